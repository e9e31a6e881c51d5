"""Tool calling for the server: OpenAI messages in, tool calls out.

The tools reach the model through its own chat template; calls are found in
the generated text between the tokenizer's tool-call markers and parsed by the
tool parser mlx-lm picked for the model's family (`TokenizerWrapper`'s
`tool_call_start`, `tool_call_end`, `tool_parser`).
"""

import json
import uuid
from typing import Any, Dict, List, Optional, Tuple, Union



class ToolError(ValueError):
    """A request whose tools or messages cannot be used (the message says why)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def check_tools(tools: Any) -> List[dict]:
    if not isinstance(tools, list) or not all(
            isinstance(t, dict) and t.get("type", "function") == "function" and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str) for t in tools):
        raise ToolError("'tools' must be a list of {\"type\": \"function\", \"function\": {\"name\": ...}} objects.",
                        "tools")
    return tools


def template_messages(messages: Any) -> List[dict]:
    """OpenAI chat messages as chat templates read them.

    Content may be a string, null (an assistant turn that only calls tools)
    or a list of text parts; assistant tool calls carry their arguments as
    JSON text, which templates expect parsed; `tool` messages answer a call.
    """
    out = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ToolError("Each message needs a string 'role'.", "messages")
        m = dict(m)
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise ToolError("Only text content parts ({\"type\": \"text\", \"text\": ...}) are supported.",
                                "messages")
            m["content"] = "".join(p["text"] for p in content)
        elif content is None and (m["role"] == "assistant" and m.get("tool_calls")):
            m["content"] = ""
        elif not isinstance(content, str):
            raise ToolError("Each message needs a string 'content' (or text parts; null only for an assistant "
                            "message with tool_calls).", "messages")
        if m.get("tool_calls") is not None:
            m["tool_calls"] = [_template_call(c) for c in _list(m["tool_calls"])]
        out.append(m)
    return out


def _list(v):
    if not isinstance(v, list):
        raise ToolError("'tool_calls' must be a list.", "messages")
    return v


def _template_call(call) -> dict:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ToolError("Each tool call needs a 'function' with a 'name'.", "messages")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            raise ToolError(f"Tool call arguments of '{fn['name']}' are not valid JSON ({e.msg}).", "messages")
    return dict(call, function=dict(fn, arguments=args))


def openai_call(parsed: dict) -> dict:
    """A parsed call ({"name", "arguments"}) as OpenAI's `tool_calls` entry."""
    args = parsed.get("arguments", {})
    return {"id": parsed.get("id") or "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": parsed["name"],
                         "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)}}


class ToolCallSplitter:
    """Splits streamed model text into plain content and tool calls.

    Text that may be the start of a call marker is held back until it is
    known; a call is parsed when its end marker arrives (or when the text
    ends, for a call whose end marker the model left out); one that does not
    parse stays content. Text cut by the token budget (`cut`) drops a call it
    cut short, and a marker's start held back: no partial markup reaches a
    client.
    """

    def __init__(self, start: str, end: str, parser, tools: Optional[list]):
        self.start, self.end, self.parser, self.tools = start, end, parser, tools
        self.buffer = ""
        self.inside = False
        self.calls = 0

    def feed(self, text: str, final: bool = False, cut: bool = False) -> Tuple[str, List[dict]]:
        """(content, calls) of the text so far; `final`: the text ends here, `cut`: by the budget."""
        self.buffer += text
        content, calls = [], []
        while True:
            if not self.inside:
                i = self.buffer.find(self.start)
                if i < 0:
                    keep = held_back(self.buffer, self.start) if not final or cut else 0
                    content.append(self.buffer[: len(self.buffer) - keep])
                    self.buffer = "" if final else self.buffer[len(self.buffer) - keep:]
                    break
                content.append(self.buffer[:i])
                self.buffer, self.inside = self.buffer[i + len(self.start):], True
            else:
                j = self.buffer.find(self.end)
                if j < 0:
                    if final and not cut:
                        calls += self._parse(self.buffer, content)
                    if final:
                        self.buffer = ""
                    break
                calls += self._parse(self.buffer[:j], content)
                self.buffer, self.inside = self.buffer[j + len(self.end):], False
        self.calls += len(calls)
        return "".join(content), calls

    def _parse(self, text: str, content: List[str]) -> List[dict]:
        try:
            parsed = self.parser(text, self.tools)
        except (ValueError, KeyError, TypeError):
            content.append(self.start + text)  # not a call after all: the model's text stands
            return []
        parsed = parsed if isinstance(parsed, list) else [parsed]
        return [openai_call(p) for p in parsed]


def held_back(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def splitter(tokenizer, tools: Optional[list]) -> Optional[ToolCallSplitter]:
    if not tools or not getattr(tokenizer, "has_tool_calling", False):
        return None
    return ToolCallSplitter(tokenizer.tool_call_start, tokenizer.tool_call_end, tokenizer.tool_parser, tools)


def tool_choice(value: Any, tools: Optional[list]) -> Dict[str, Any]:
    """The template arguments for `tool_choice`: the tools are shown unless it is "none"."""
    forced_tool(value, tools)  # a bad value is refused
    if value == "none":
        return {}
    return {"tools": tools} if tools else {}


def strict_tools(value: Any, tools: Optional[list]) -> bool:
    """Whether calls the model may make of its own accord (`tool_choice` "auto") must keep to
    their functions' schemas: a tool says `"strict": true`."""
    return value in (None, "auto") and any(t["function"].get("strict") for t in tools or ())


def forced_tool(value: Any, tools: Optional[list]) -> Union[None, bool, str]:
    """What `tool_choice` forces: a call of any tool ("required": True), of the named one (its
    name: {"type": "function", "function": {"name": ...}}), or nothing ("auto", "none": None)."""
    if value in (None, "auto", "none"):
        return None
    if value == "required":
        name = True
    elif (isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("function"), dict)
          and isinstance(value["function"].get("name"), str)):
        name = value["function"]["name"]
    else:
        raise ToolError("'tool_choice' must be \"auto\", \"none\", \"required\" or {\"type\": \"function\", "
                        "\"function\": {\"name\": ...}}.", "tool_choice")
    if not tools:
        raise ToolError("'tool_choice' forces a tool call, but the request has no 'tools'.", "tool_choice")
    if name is not True and all(t["function"]["name"] != name for t in tools):
        raise ToolError(f"'tool_choice' names the function '{name}', which is not in 'tools'.", "tool_choice")
    return name
