"""What a request constrains its output to: a JSON Schema, any JSON object, a regular expression
or a Lark grammar (llguidance's syntax, which also reads GBNF), as one hashable value."""

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Union

from ..errors import DFlashError

KINDS = ("json_schema", "json_object", "regex", "lark")

# A schema or grammar larger than this is refused before it is compiled: the engine's own
# limits bound the work of what it compiles, this bounds what it is handed.
MAX_GRAMMAR_BYTES = 256 << 10

# JSON is written on one line with `json.dumps`' separators, so that a schema's keys and the
# punctuation between them are forced tokens (drafts no model need make). A schema's own
# "x-guidance" options override these.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Grammar:
    kind: str  # one of KINDS
    text: str  # the schema as compact JSON, the regex, or the Lark grammar
    lenient: bool = False  # a schema's keywords the engine cannot enforce are ignored, not refused

    def __post_init__(self):
        if self.kind not in KINDS:
            raise DFlashError(f"Unknown grammar kind '{self.kind}'; use one of {', '.join(KINDS)}.")
        if len(self.text.encode()) > MAX_GRAMMAR_BYTES:
            raise DFlashError(f"The {self.kind.replace('_', ' ')} is {len(self.text.encode())} bytes; at most "
                              f"{MAX_GRAMMAR_BYTES} are taken. Shorten it.")

    @classmethod
    def json_schema(cls, schema: Union[str, dict], lenient: bool = False) -> "Grammar":
        """From a schema (an object, or its JSON text). `lenient`: keywords the engine cannot
        enforce (e.g. `uniqueItems`) are ignored (OpenAI's non-strict schemas); else refused."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise DFlashError(f"The JSON schema is not valid JSON ({e.msg} at line {e.lineno} column "
                                  f"{e.colno}); fix it.") from None
        if not isinstance(schema, (dict, bool)):
            raise DFlashError(f"A JSON schema is an object (got {type(schema).__name__}).")
        return cls("json_schema", json.dumps(schema, separators=(",", ":")), lenient)  # its key order is the output's

    @classmethod
    def json_object(cls) -> "Grammar":
        """Any JSON object (OpenAI's `json_object` response format)."""
        return cls("json_object", "")

    @classmethod
    def regex(cls, pattern: str) -> "Grammar":
        return cls("regex", pattern)

    @classmethod
    def lark(cls, grammar: str) -> "Grammar":
        return cls("lark", grammar)

    @property
    def key(self) -> str:
        """The grammar's hash: compiled grammars are cached by it."""
        return hashlib.sha256(f"{self.kind}\0{self.lenient:d}\0{self.text}".encode()).hexdigest()

    def schema(self) -> Any:
        """The JSON Schema its output validates against (None for a regex or a grammar)."""
        if self.kind == "json_schema":
            return json.loads(self.text)
        return {"type": "object"} if self.kind == "json_object" else None
