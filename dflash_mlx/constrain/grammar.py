"""What a request constrains its output to: a JSON Schema, any JSON object, a regular expression
or a Lark grammar (llguidance's syntax, which also reads GBNF), as one hashable value."""

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Union

from ..errors import DFlashError
from . import schema as schemas

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
    label: str = field(default="", compare=False)  # how errors name it (e.g. "The schema of tool 'search'")

    def __post_init__(self):
        if self.kind not in KINDS:
            raise DFlashError(f"Unknown grammar kind '{self.kind}'; use one of {', '.join(KINDS)}.")
        check_size(len(self.text.encode()), f"The {describe(self.kind)}")

    @classmethod
    def json_schema(cls, schema: Union[str, dict, bool], lenient: bool = False,
                    what: str = "The JSON schema") -> "Grammar":
        """From a schema (an object, or its JSON text). `lenient`: keywords the engine cannot
        enforce (e.g. `uniqueItems`) are ignored (OpenAI's non-strict schemas); else refused.
        `what` names the schema in errors (e.g. "The parameters of tool 'search'"). A schema is
        checked before the engine sees it (`constrain.schema`): its size, nesting, references and
        whether any finite answer satisfies it."""
        if isinstance(schema, str):
            check_size(len(schema.encode()), what)
            schema = schemas.parse(schema, what)
        if schema is True:
            schema = {}
        schemas.check(schema, what)
        text = json.dumps(schema, separators=(",", ":"))  # its key order is the output's
        check_size(len(text.encode()), what)
        return cls("json_schema", text, lenient, "" if what == "The JSON schema" else what)

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
    def name(self) -> str:
        """How errors name it: its label, or its kind ("The JSON schema")."""
        return self.label or f"The {describe(self.kind)}"

    @property
    def key(self) -> str:
        """The grammar's hash: compiled grammars are cached by it."""
        return hashlib.sha256(f"{self.kind}\0{self.lenient:d}\0{self.text}".encode()).hexdigest()

    def schema(self) -> Any:
        """The JSON Schema its output validates against (None for a regex or a grammar)."""
        if self.kind == "json_schema":
            return json.loads(self.text)
        return {"type": "object"} if self.kind == "json_object" else None


def describe(kind: str) -> str:
    """A grammar kind in words."""
    return {"json_schema": "JSON schema", "json_object": "JSON object format", "regex": "regex",
            "lark": "grammar"}[kind]


def check_size(n: int, what: str) -> None:
    """Refuse `n` bytes of a schema or grammar over `MAX_GRAMMAR_BYTES`, in the user's own units."""
    if n > MAX_GRAMMAR_BYTES:
        raise DFlashError(f"{what} is {n:,} bytes; at most {MAX_GRAMMAR_BYTES:,} are taken. Shorten it.")
