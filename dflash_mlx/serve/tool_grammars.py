"""Tool calls as grammars, in the model's own tool-call format: for `tool_choice` "required" or a
named function, and for strict tools under "auto".

Three formats, found by asking the model's tool parser (mlx-lm's, picked for its family) to read
a call written each way:

- JSON `{"name": ..., "arguments": {...}}` between the markers (mlx-lm's `json_tools`: Qwen3,
  Hermes and the like): the arguments are the function's parameters' JSON schema.
- XML parameters (`qwen3_coder`: Qwen3-Coder, Qwen3.5): `<function=NAME>`, then per parameter
  `<parameter=P>`, its value on lines of its own, `</parameter>`. A string's value is the raw
  text (never `</parameter>`, never `null`, which the parser reads as None), within its
  `enum`, `const` and length bounds; a number, boolean, object or array is JSON kept to its
  schema. The parameters come in the schema's order, the required ones always (under `strict`,
  all of them, as OpenAI's strict mode has it).
- Gemma 4's `call:NAME{key:value,...}` (`gemma4`): JSON with bare keys, strings between `<|"|>`
  markers and no spaces, written from the parameters' schema by `GemmaArguments`.

A keyword a format cannot enforce is refused (400) for a strict function and left unchecked for
the others.
"""

import json
import re
from typing import Callable, Dict, List, Optional, Union

from ..constrain.grammar import JSON_OPTIONS, MAX_GRAMMAR_BYTES, Grammar
from .tools import ToolError

# The string keywords the XML format's raw-text values can be kept to; a strict function whose
# string parameter has another (`pattern`, `format`) is refused rather than left unchecked.
XML_STRING_KEYWORDS = {"type", "enum", "const", "minLength", "maxLength", "description", "title", "default",
                       "examples"}
# Scalar types the qwen3_coder parser converts by name (its `_convert_param_value`).
XML_JSON_TYPES = {"integer", "number", "object", "array"}


def call_grammar(tokenizer, special, tools: list, name: Union[None, bool, str], parallel: bool) -> Grammar:
    """A grammar whose text is a call (or with `parallel`, calls on lines of their own) of the
    tools (the one named `name`, unless it is True) in the model's tool-call format, each call's
    arguments kept to its function's parameters' schema (a non-strict function's leniently: keywords
    the engine cannot enforce are left unchecked, where a strict one's are refused).
    With `name` None (`tool_choice` "auto" with strict tools) the text is free, and each call in
    it, from its start marker on, is kept so. `special(id)`: whether a token is special (its
    marker is then that token, not text)."""
    body = call_format(getattr(tokenizer, "tool_parser", None))
    if body is None:
        raise ToolError("Constraining tool calls (tool_choice \"required\" or a named function, or strict tools) "
                        "needs a model whose calls are JSON between markers, XML parameters or Gemma 4's "
                        "call:NAME{...} (mlx-lm's json_tools, qwen3_coder and gemma4 parsers); this model's are "
                        "none of them. Use tool_choice \"auto\" with tools that are not strict.", "tool_choice")
    chosen = [t["function"] for t in tools if name in (None, True) or t["function"]["name"] == name]
    for f in chosen:  # each schema checked alone, so that an error names its tool
        Grammar.json_schema(f.get("parameters") or {"type": "object"}, lenient=not f.get("strict"),
                            what=f"The schema of tool '{f['name']}'")
    marker = lambda text: _marker(tokenizer, special, text)  # noqa: E731
    rules = body(chosen, marker)
    start, end = marker(tokenizer.tool_call_start), marker(tokenizer.tool_call_end)
    rules += f"tail: {end}\n"
    if name is not None:
        more = ' ("\\n" call)*' if parallel else ""
        return _calls(f"start: call{more}\ncall: {start} body tail\n{rules}")
    # Free text, and a call from each start marker on: a special marker is a token free text
    # never holds; a textual one is found in the text by a lazy lexeme (the text up to it).
    head = (f"call: TEXT {start} body tail\n" if start.startswith("<[") else
            f"call_start[lazy]: TEXT {start}\ncall: call_start body tail\n")
    return _calls(f"start: (call){'*' if parallel else '?'} TEXT\nTEXT: /(.|\\n)*/\n{head}{rules}")


def _calls(text: str) -> Grammar:
    """The calls' grammar, named in errors by what the client sent: its tools."""
    if len(text.encode()) > MAX_GRAMMAR_BYTES:
        raise ToolError(f"The tools' schemas come to {len(text.encode()):,} bytes of grammar together; at most "
                        f"{MAX_GRAMMAR_BYTES:,} are taken. Send fewer or smaller tools.", "tools")
    return Grammar("lark", text, label="The tools' call grammar")


def call_format(parser) -> Optional[Callable[[List[dict], Callable[[str], str]], str]]:
    """What writes the Lark rules of a call's `body` (between the markers) in the format `parser`
    reads, given the functions and how a marker's text is written in a rule (`_marker`)."""
    if _reads(parser, json.dumps({"name": "f", "arguments": {"a": [1, "b"]}}), {"name": "f", "arguments": {"a": [1, "b"]}}):
        return json_body
    xml = "\n<function=f>\n<parameter=a>\n12\n</parameter>\n<parameter=b>\nx <y>\n</parameter>\n</function>\n"
    if _reads(parser, xml, {"name": "f", "arguments": {"a": 12, "b": "x <y>"}}, _PROBE_TOOLS):
        return xml_body
    gemma = 'call:f{a:12,b:<|"|>x, {y}<|"|>,c:[true,null]}'
    if _reads(parser, gemma, {"name": "f", "arguments": {"a": 12, "b": "x, {y}", "c": [True, None]}}):
        return gemma_body
    return None


_PROBE_TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}}}}]


def _reads(parser, text: str, call: dict, tools: Optional[list] = None) -> bool:
    try:
        return parser is not None and parser(text, tools) == call
    except Exception:  # another format's parser
        return False


def json_body(functions: List[dict], marker=None) -> str:
    """JSON {"name", "arguments"}, the arguments kept to the function's parameters' schema."""
    calls = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                               "arguments": f.get("parameters") or {"type": "object"}},
              "required": ["name", "arguments"], "additionalProperties": False,
              "x-guidance": dict(JSON_OPTIONS, lenient=not f.get("strict"))} for f in functions]
    # One JSON grammar per function (each strict or not): the engine merges their lexers, so the
    # alternatives read as one `anyOf`.
    return f'body: "\\n"? ({" | ".join(f"%json {json.dumps(c)}" for c in calls)}) "\\n"?\n'


def xml_body(functions: List[dict], marker=None) -> str:
    """`<function=NAME>` and a `<parameter=P>` block per parameter (qwen3_coder's format)."""
    rules = [f"body: \"\\n\" ({' | '.join(f'f{i}' for i in range(len(functions)))})"]
    for i, f in enumerate(functions):
        params = f.get("parameters") or {}
        strict = bool(f.get("strict"))
        defs = {k: params[k] for k in ("$defs", "definitions") if k in params}
        required = set(params.get("required") or ())
        parts = []
        for j, (p, schema) in enumerate((params.get("properties") or {}).items()):
            if not p or any(c.isspace() or c in "<>" for c in p):
                raise ToolError(f"The parameter name {p!r} of '{f['name']}' cannot be written in this model's "
                                "tool-call format (no spaces or angle brackets).", "tools")
            schema = schema if isinstance(schema, dict) else {}
            if "$ref" in schema:  # a parameter that is one of the schema's $defs
                schema = _resolve(schema["$ref"], params, f["name"])
            rules += _xml_value(f"f{i}v{j}", f["name"], p, schema, defs, strict)
            parts.append(f'("<parameter={p}>\\n" f{i}v{j})' + ("" if strict or p in required else "?"))
        rules.append(f'f{i}: {json.dumps("<function=" + f["name"] + ">")} "\\n" {" ".join(parts)} "</function>\\n"')
    return "\n".join(rules) + "\n"


def _xml_value(rule: str, fn: str, param: str, schema: dict, defs: dict, strict: bool) -> List[str]:
    """The Lark rules of one parameter's value, through its closing `</parameter>` line."""
    close = '"\\n</parameter>\\n"'
    kind = schema.get("type") if isinstance(schema.get("type"), str) else None  # a list of types: none of them
    options = schema["enum"] if "enum" in schema else [schema["const"]] if "const" in schema else None
    if kind == "string" or (kind is None and options and all(isinstance(v, str) for v in options)):
        if strict and set(schema) - XML_STRING_KEYWORDS:
            raise ToolError(f"The parameter '{param}' of '{fn}' uses {sorted(set(schema) - XML_STRING_KEYWORDS)}, "
                            "which this model's tool-call format cannot enforce on a string; drop \"strict\" "
                            "to leave them unchecked.", "tools")
        if options is not None:
            return [f"{rule}: ({' | '.join(json.dumps(v) for v in options if isinstance(v, str))}) {close}"]
        return _text(rule, schema, close)
    if kind == "boolean":  # the parser reads any case; chat templates write Python's True and False
        return [f'{rule}: ("true" | "false" | "True" | "False") {close}']
    if kind in XML_JSON_TYPES:
        value = dict(schema, **defs, **{"x-guidance": dict(JSON_OPTIONS, lenient=not strict)})
        return [f"{rule}: %json {json.dumps(value)} {close}"]
    if strict:
        raise ToolError(f"The parameter '{param}' of '{fn}' needs one \"type\" (string, integer, number, boolean, "
                        "object or array) to be enforced in this model's tool-call format; drop \"strict\" to take "
                        "its value as text.", "tools")
    return _text(rule, {}, close)


def _text(rule: str, schema: dict, close: str) -> List[str]:
    """A string's raw text up to its closing line: never `</parameter>` (the parser would end the
    value there) and never `null` in any case (the parser would read None)."""
    text = text_terminal(rule.upper(), schema, "<\\/parameter>") + " & ~/[nN][uU][lL][lL]/"
    return [f"{text}\n{rule}[lazy]: {rule.upper()} {close}"]


def text_terminal(name: str, schema: dict, end: str) -> str:
    """A Lark terminal of raw text within the string schema's length bounds that never holds `end`
    (a regex), which would end it early."""
    low, high = schema.get("minLength", 0), schema.get("maxLength")
    return f"{name}: /(?s:.){{{int(low)},{'' if high is None else int(high)}}}/ & ~/(?s:.*){end}(?s:.*)/"


def gemma_body(functions: List[dict], marker) -> str:
    """Gemma 4's `call:NAME{key:value,...}`: JSON with bare keys, strings between `<|"|>` markers
    and no spaces (`GemmaArguments`)."""
    notation = GemmaArguments(marker('<|"|>'))
    calls = []
    for f in functions:
        if not _WORD.fullmatch(f["name"].replace("-", "_")):
            raise ToolError(f"The function name '{f['name']}' cannot be written in this model's tool-call format "
                            "(letters, digits, '_' and '-' only).", "tools")
        args = notation.value(f.get("parameters") or {"type": "object"}, f["name"], bool(f.get("strict")),
                              root=f.get("parameters") or {})
        calls.append(f'{json.dumps("call:" + f["name"])} {args}')
    return f"body: {' | '.join(calls)}\n" + "\n".join(notation.rules) + "\n"


_WORD = re.compile(r"\w+")
# JSON Schema keywords Gemma's notation enforces, per kind of value (numbers, booleans and null are
# written as JSON, and kept by the engine's JSON schemas with every keyword it has).
GEMMA_KEYWORDS = {
    "object": {"type", "properties", "required", "additionalProperties"},
    "array": {"type", "items", "minItems", "maxItems"},
    "string": {"type", "enum", "const", "minLength", "maxLength"},
    "any": {"enum", "const", "anyOf", "$ref", "$defs", "definitions"},
}
ANNOTATIONS = {"description", "title", "default", "examples", "$comment"}


class GemmaArguments:
    """A JSON schema as Lark rules of Gemma 4's argument notation (mlx-lm's `gemma4` parser turns it
    back into JSON): objects `{key:value,...}` with the properties in the schema's order (the
    required ones always, every one for a strict function), arrays `[a,b]`, strings between the
    quote marker (their text never holding it), and numbers, booleans and null as JSON."""

    def __init__(self, quote: str):
        self.quote, self.rules = quote, []
        self.refs: Dict[tuple, str] = {}  # (function, `$ref`) -> its rule: a recursive schema is a recursive rule

    def _rule(self, body: str) -> str:
        name = f"g{len(self.rules)}"
        self.rules.append(f"{name}: {body}")
        return name

    def value(self, schema: dict, fn: str, strict: bool, root: dict) -> str:
        """The rule of a value kept to `schema` (`root`: the parameters' schema its `$ref`s point in)."""
        if not isinstance(schema, dict) or not schema:
            return self._any_json(fn, strict)
        kind = schema.get("type") if isinstance(schema.get("type"), str) else None  # a list of types: none of them
        known = GEMMA_KEYWORDS.get(kind or "any", set()) | ANNOTATIONS
        if strict and kind in GEMMA_KEYWORDS and set(schema) - known - {"$defs", "definitions"}:
            raise ToolError(f"A parameter of '{fn}' uses {sorted(set(schema) - known)}, which this model's tool-call "
                            "format cannot enforce; drop \"strict\" to leave them unchecked.", "tools")
        if "$ref" in schema:
            key = (fn, schema["$ref"])
            if key not in self.refs:
                self.refs[key] = name = f"r{len(self.refs)}"
                self.rules.append(f"{name}: {self.value(_resolve(schema['$ref'], root, fn), fn, strict, root)}")
            return self.refs[key]
        if "anyOf" in schema:
            return self._rule(" | ".join(self.value(s, fn, strict, root) for s in schema["anyOf"]))
        if "enum" in schema or "const" in schema:
            options = schema["enum"] if "enum" in schema else [schema["const"]]
            return self._rule(" | ".join(self._literal(v) for v in options))
        if kind == "object":
            return self._object(schema, fn, strict, root)
        if kind == "array":
            item = self.value(schema.get("items", {}), fn, strict, root)
            low, high = int(schema.get("minItems", 0)), schema.get("maxItems")
            more = f'("," {item}){{{max(low - 1, 0)},{"" if high is None else max(int(high) - 1, 0)}}}'
            inner = f"{item} {more}" if high != 0 else '""'
            return self._rule(f'"[" {inner} "]"' if low else f'"[" ({inner})? "]"')
        if kind == "string":
            text = f"G{len(self.rules)}"
            self.rules.append(text_terminal(text, schema, '<\\|"\\|>'))
            if self.quote.startswith("<["):  # a special token: the text's lexeme ends where it comes
                return self._rule(f"{self.quote} {text} {self.quote}")
            # A textual quote: the text and its closing quote are one lazy lexeme, ending at the first quote.
            closed = self._rule(f"{text} {self.quote}")
            self.rules[-1] = self.rules[-1].replace(":", "[lazy]:", 1)
            return self._rule(f"{self.quote} {closed}")
        if kind in ("integer", "number", "boolean", "null"):
            return self._rule(f"%json {json.dumps(dict(schema, **{'x-guidance': dict(JSON_OPTIONS, lenient=not strict)}))}")
        if strict:
            raise ToolError(f"A parameter of '{fn}' needs a \"type\" this model's tool-call format can enforce "
                            "(object, array, string, integer, number, boolean, null), an enum or anyOf; drop "
                            "\"strict\" to take any value.", "tools")
        return self._any_json(fn, strict)

    def _object(self, schema: dict, fn: str, strict: bool, root: dict) -> str:
        props = schema.get("properties") or {}
        required = set(schema.get("required") or ())
        items = []
        for key, sub in props.items():
            if not _WORD.fullmatch(key):
                raise ToolError(f"The property name {key!r} of '{fn}' cannot be written in this model's tool-call "
                                "format (letters, digits and '_' only).", "tools")
            items.append((f'"{key}:" {self.value(sub, fn, strict, root)}', strict or key in required))
        # Properties in order, comma-separated: from item i on, after nothing yet (head) or after one (tail).
        head, tail = '""', '""'
        for text, needed in reversed(items):
            new_tail = self._rule(f'"," {text} {tail}' + ("" if needed else f" | {tail}"))
            head = self._rule(f"{text} {tail}" + ("" if needed else f" | {head}"))
            tail = new_tail
        return self._rule(f'"{{" {head} "}}"')

    def _literal(self, v) -> str:
        if isinstance(v, str):
            return f"{self.quote} {json.dumps(v)} {self.quote}" if v else f"{self.quote} {self.quote}"
        if isinstance(v, (dict, list)):
            raise ToolError("An enum or const of objects or arrays cannot be written in this model's tool-call "
                            "format.", "tools")
        return json.dumps(json.dumps(v))  # a number, boolean or null as its JSON text

    def _any_json(self, fn: str, strict: bool) -> str:
        if strict:
            raise ToolError(f"A parameter of '{fn}' has no schema this model's tool-call format can enforce; drop "
                            "\"strict\" to take any value.", "tools")
        return self.value({"anyOf": [{"type": t} for t in ("string", "number", "boolean", "null")]}, fn, False, {})


def _resolve(ref: str, root: dict, fn: str) -> dict:
    """A local `$ref` (`#/$defs/X`, `#/definitions/X`) in the parameters' schema."""
    parts = ref.split("/")
    if len(parts) != 3 or parts[0] != "#" or parts[1] not in ("$defs", "definitions") \
            or parts[2] not in root.get(parts[1], {}):
        raise ToolError(f"The parameters of '{fn}' refer to {ref!r}, which is not one of their own $defs.", "tools")
    return root[parts[1]][parts[2]]


def _marker(tokenizer, special, text: str) -> str:
    """A tool-call marker in a Lark rule: its special token, or its text."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return f"<[{ids[0]}]>" if len(ids) == 1 and special(ids[0]) else json.dumps(text)
