"""Tool calls as grammars, in the model's own tool-call format: for `tool_choice` "required" or a
named function, and for strict tools under "auto".

Two formats, found by asking the model's tool parser (mlx-lm's, picked for its family) to read a
call written each way:

- JSON `{"name": ..., "arguments": {...}}` between the markers (mlx-lm's `json_tools`: Qwen3,
  Hermes and the like): the arguments are the function's parameters' JSON schema.
- XML parameters (`qwen3_coder`: Qwen3-Coder, Qwen3.5): `<function=NAME>`, then per parameter
  `<parameter=P>`, its value on lines of its own, `</parameter>`. A string's value is the raw
  text (never `</parameter>`, never `null`, which the parser reads as None), within its
  `enum`, `const` and length bounds; a number, boolean, object or array is JSON kept to its
  schema. The parameters come in the schema's order, the required ones always (under `strict`,
  all of them, as OpenAI's strict mode has it).
"""

import json
from typing import Callable, List, Optional, Union

from ..constrain.grammar import JSON_OPTIONS, Grammar
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
                        "needs a model whose calls are JSON between markers (mlx-lm's json_tools parser) or XML "
                        "parameters (its qwen3_coder parser); this model's are neither. Use tool_choice \"auto\" "
                        "with tools that are not strict.", "tool_choice")
    chosen = [t["function"] for t in tools if name in (None, True) or t["function"]["name"] == name]
    rules = body(chosen)
    start, end = (_marker(tokenizer, special, m) for m in (tokenizer.tool_call_start, tokenizer.tool_call_end))
    rules += f"tail: {end}\n"
    if name is not None:
        more = ' ("\\n" call)*' if parallel else ""
        return Grammar.lark(f"start: call{more}\ncall: {start} body tail\n{rules}")
    # Free text, and a call from each start marker on: a special marker is a token free text
    # never holds; a textual one is found in the text by a lazy lexeme (the text up to it).
    head = (f"call: TEXT {start} body tail\n" if start.startswith("<[") else
            f"call_start[lazy]: TEXT {start}\ncall: call_start body tail\n")
    return Grammar.lark(f"start: (call){'*' if parallel else '?'} TEXT\nTEXT: /(.|\\n)*/\n{head}{rules}")


def call_format(parser) -> Optional[Callable[[List[dict]], str]]:
    """The Lark rules of a call's `body` (between the markers) in the format `parser` reads."""
    if _reads(parser, json.dumps({"name": "f", "arguments": {"a": [1, "b"]}}), {"name": "f", "arguments": {"a": [1, "b"]}}):
        return json_body
    xml = "\n<function=f>\n<parameter=a>\n12\n</parameter>\n<parameter=b>\nx <y>\n</parameter>\n</function>\n"
    if _reads(parser, xml, {"name": "f", "arguments": {"a": 12, "b": "x <y>"}}, _PROBE_TOOLS):
        return xml_body
    return None


_PROBE_TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}}}}]


def _reads(parser, text: str, call: dict, tools: Optional[list] = None) -> bool:
    try:
        return parser is not None and parser(text, tools) == call
    except Exception:  # another format's parser
        return False


def json_body(functions: List[dict]) -> str:
    """JSON {"name", "arguments"}, the arguments kept to the function's parameters' schema."""
    calls = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                               "arguments": f.get("parameters") or {"type": "object"}},
              "required": ["name", "arguments"], "additionalProperties": False,
              "x-guidance": dict(JSON_OPTIONS, lenient=not f.get("strict"))} for f in functions]
    # One JSON grammar per function (each strict or not): the engine merges their lexers, so the
    # alternatives read as one `anyOf`.
    return f'body: "\\n"? ({" | ".join(f"%json {json.dumps(c)}" for c in calls)}) "\\n"?\n'


def xml_body(functions: List[dict]) -> str:
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
            rules += _xml_value(f"f{i}v{j}", f["name"], p, schema if isinstance(schema, dict) else {}, defs, strict)
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
    low, high = schema.get("minLength", 0), schema.get("maxLength")
    length = f"{{{int(low)},{'' if high is None else int(high)}}}"
    text = (f"{rule.upper()}: /(?s:.){length}/ & ~/(?s:.*)<\\/parameter>(?s:.*)/ & ~/[nN][uU][lL][lL]/\n"
            f"{rule}[lazy]: {rule.upper()} {close}")
    return [text]


def _marker(tokenizer, special, text: str) -> str:
    """A tool-call marker in a Lark rule: its special token, or its text."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return f"<[{ids[0]}]>" if len(ids) == 1 and special(ids[0]) else json.dumps(text)
