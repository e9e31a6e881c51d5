"""The OpenAI Responses API (`POST /v1/responses`) on top of the chat path, as Codex CLI and the
OpenAI Agents SDK use it.

A request becomes the equivalent chat completion request: `instructions` and `system` or
`developer` messages the system prompt, `input` (a string, or items: messages with text parts,
`function_call`, `function_call_output`, `reasoning`) the conversation, function tools (also those
inside a `namespace`) the chat tools, `text.format` the response format and `max_output_tokens`
the budget. Tools of other kinds (`web_search`, `file_search`, `local_shell`, ...) run on the
client's side or not at all here: they are left out of the prompt. Nothing is stored
(`store: false` is what the clients send); `previous_response_id` is refused, since each
request carries its whole history.

The answer is a `response` object whose `output` holds a `message` item (its text) and a
`function_call` item per call, whole or as the stream of events the clients parse
(`ResponseEvents`): `response.created`, `response.output_item.added` / `.done`,
`response.output_text.delta`, `response.function_call_arguments.delta` / `.done`, and a last
`response.completed` (its response's status `incomplete` where the budget ran out) or
`response.failed`.
"""

import json
import time
import uuid
from typing import Any, Dict, Iterator, List, Optional, Tuple

from .api_errors import APIError
from .messages_api import IMAGE_NOTE

# Fields of a request echoed in its response object, as OpenAI's API does.
ECHOED = ("instructions", "max_output_tokens", "metadata", "parallel_tool_calls", "previous_response_id",
          "reasoning", "temperature", "text", "tool_choice", "tools", "top_p", "truncation", "user")
TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text", "refusal")
MEDIA_PARTS = ("input_image", "input_file", "input_audio")


def _bad(message: str, param: Optional[str] = None) -> APIError:
    return APIError(400, message, param=param)


def _text(content: Any, where: str) -> str:
    """A string, or a list of text (and image, file) parts, as text; media become a note."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        out = []
        for p in content:
            if p.get("type") in TEXT_PARTS:
                out.append(str(p.get("text", "")))
            elif p.get("type") in MEDIA_PARTS:
                out.append(IMAGE_NOTE)
            else:
                raise _bad(f"{where} holds a part of type {p.get('type')!r}; text, image and file parts are "
                           "taken.", "input")
        return "".join(out)
    raise _bad(f"{where} must be a string or a list of content parts.", "input")


def _messages(body: dict) -> List[dict]:
    """`instructions` and `input` as chat messages."""
    system = [body["instructions"]] if isinstance(body.get("instructions"), str) and body["instructions"] else []
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise _bad("'input' must be a string or a non-empty list of items.", "input")
    chat: List[dict] = []
    reasoning: List[str] = []
    for item in items:
        if not isinstance(item, dict):
            raise _bad("Each item of 'input' must be an object.", "input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise _bad("A message item needs 'role' user, assistant, system or developer.", "input")
            text = _text(item.get("content", ""), "A message's 'content'")
            if role in ("system", "developer"):
                if not chat:  # the system prompt: instructions, then the leading system items
                    system.append(text)
                    continue
                role = "user"  # later in the conversation, templates take it as the user's
            if role == "assistant" and chat and chat[-1]["role"] == "assistant" and not chat[-1].get("content"):
                chat[-1]["content"] = text
            else:
                chat.append({"role": role, "content": text})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": _arguments(item.get("arguments"))}}
            if chat and chat[-1]["role"] == "assistant":
                chat[-1].setdefault("tool_calls", []).append(call)
            else:
                chat.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output", "")
            chat.append({"role": "tool", "tool_call_id": item.get("call_id"),
                         "content": output if isinstance(output, str) else _text(output, "A function_call_output")})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            reasoning.append(_text(parts, "A reasoning item"))
            continue
        else:
            continue  # a hosted tool's call or result (web search, ...): nothing the model reads back
        if reasoning and chat[-1]["role"] == "assistant":
            chat[-1]["reasoning_content"] = "\n".join(reasoning)
            reasoning = []
    if system:
        chat.insert(0, {"role": "system", "content": "\n\n".join(system)})
    return chat


def _arguments(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value if value is not None else {}


def functions(tools: Any) -> List[dict]:
    """The request's function tools as chat tools: a namespace's functions each in their own
    right; tools of other kinds left out."""
    if tools is None:
        return []
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise _bad("'tools' must be a list of tool objects.", "tools")
    out = []
    for t in tools:
        if t.get("type") == "namespace":
            out += functions(t.get("tools") or [])
        elif t.get("type") == "function":
            if not isinstance(t.get("name"), str):
                raise _bad("A function tool needs a 'name'.", "tools")
            out.append({"type": "function", "function": {
                "name": t["name"], "description": t.get("description") or "",
                "parameters": t.get("parameters") or {"type": "object", "properties": {}},
                "strict": bool(t.get("strict"))}})
    return out


def namespaces(tools: Any) -> Dict[str, str]:
    """Function name -> the namespace it was listed in."""
    return {f["name"]: t.get("name") for t in tools or [] if isinstance(t, dict) and t.get("type") == "namespace"
            for f in t.get("tools") or [] if isinstance(f, dict) and isinstance(f.get("name"), str)}


def to_chat(body: Any) -> Dict[str, Any]:
    """The chat completion request equivalent to a Responses API request."""
    if not isinstance(body, dict):
        raise _bad("The request body must be a JSON object.")
    if body.get("previous_response_id") is not None:
        raise _bad("'previous_response_id' is not supported: this server stores no responses. Send the whole "
                   "conversation in 'input' (as with \"store\": false).", "previous_response_id")
    chat = {k: body[k] for k in ("model", "temperature", "top_p", "stream", "parallel_tool_calls") if k in body}
    chat["messages"] = _messages(body)
    effort = body["reasoning"].get("effort") if isinstance(body.get("reasoning"), dict) else None
    if effort is not None:
        chat["reasoning_effort"] = effort
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    tools = functions(body.get("tools"))
    if tools:
        chat["tools"] = tools
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function":
        chat["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
    elif choice in ("auto", "none", "required"):
        chat["tool_choice"] = choice if tools or choice != "required" else "auto"
    elif choice is not None and not isinstance(choice, dict):  # a hosted tool's choice is the client's
        raise _bad("'tool_choice' must be \"auto\", \"none\", \"required\" or {\"type\": \"function\", "
                   "\"name\": ...}.", "tool_choice")
    if "tools" not in chat:
        chat.pop("tool_choice", None)
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind == "json_schema":
            chat["response_format"] = {"type": "json_schema", "json_schema": {
                "name": fmt.get("name", "output"), "schema": fmt.get("schema"), "strict": bool(fmt.get("strict"))}}
        elif kind == "json_object":
            chat["response_format"] = {"type": "json_object"}
        elif kind != "text":
            raise _bad("'text.format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                       "{\"type\": \"json_schema\", \"name\": ..., \"schema\": {...}}.", "text")
    return chat


def _usage(stats) -> Dict[str, Any]:
    prompt = stats.prompt_tokens if stats is not None else 0
    out = stats.generation_tokens if stats is not None else 0
    cached = stats.cached_tokens if stats is not None else 0
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": out, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": prompt + out}


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


class ResponseEvents:
    """One response: its object (`response`), and its stream of events as text and calls arrive."""

    def __init__(self, model: str, body: dict):
        self.id, self.created = _id("resp"), int(time.time())
        self.model, self.namespaces = model, namespaces(body.get("tools"))
        self.echo = {k: body.get(k) for k in ECHOED}
        self.echo["tools"] = body.get("tools") or []
        self.echo["tool_choice"] = body.get("tool_choice", "auto")
        self.echo["parallel_tool_calls"] = body.get("parallel_tool_calls", True)
        self.echo["text"] = body.get("text") or {"format": {"type": "text"}}
        self.output: List[dict] = []  # the items so far
        self.text: Optional[dict] = None  # the message item being written
        self.thought: Optional[dict] = None  # the reasoning item being written
        self.sequence = 0

    def response(self, status: str, stats=None, finish: Optional[str] = None, error=None) -> dict:
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "model": self.model, "output": self.output, "output_text": "".join(
                    p["text"] for i in self.output if i["type"] == "message" for p in i["content"]),
                "error": error, "incomplete_details": {"reason": "max_output_tokens"} if finish == "length" else None,
                "usage": _usage(stats) if stats is not None else None, **self.echo}

    def _event(self, kind: str, **fields) -> Tuple[str, dict]:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return kind, event

    def start(self) -> Iterator[Tuple[str, dict]]:
        yield self._event("response.created", response=self.response("in_progress"))
        yield self._event("response.in_progress", response=self.response("in_progress"))

    def add_reasoning(self, text: str) -> Iterator[Tuple[str, dict]]:
        """A thinking model's reasoning, in a `reasoning` item of its own."""
        if not text:
            return
        if self.thought is None:
            yield from self._close_text()
            self.thought = {"type": "reasoning", "id": _id("rs"), "status": "in_progress", "summary": [],
                            "content": [{"type": "reasoning_text", "text": ""}]}
            self.output.append(self.thought)
            yield self._event("response.output_item.added", output_index=len(self.output) - 1,
                              item=dict(self.thought, content=[]))
        self.thought["content"][0]["text"] += text
        yield self._event("response.reasoning_text.delta", item_id=self.thought["id"],
                          output_index=self.output.index(self.thought), content_index=0, delta=text)

    def _close_reasoning(self) -> Iterator[Tuple[str, dict]]:
        if self.thought is None:
            return
        item, self.thought = self.thought, None
        index = self.output.index(item)
        item["status"] = "completed"
        yield self._event("response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0,
                          text=item["content"][0]["text"])
        yield self._event("response.output_item.done", output_index=index, item=item)

    def add_text(self, text: str) -> Iterator[Tuple[str, dict]]:
        if not text:
            return
        yield from self._close_reasoning()
        if self.text is None:
            if not text.strip():
                return  # no message of its own for whitespace before a call
            self.text = {"type": "message", "id": _id("msg"), "status": "in_progress", "role": "assistant",
                         "content": []}
            self.output.append(self.text)
            index = len(self.output) - 1
            yield self._event("response.output_item.added", output_index=index, item=dict(self.text, content=[]))
            part = {"type": "output_text", "text": "", "annotations": []}
            self.text["content"].append(part)
            yield self._event("response.content_part.added", item_id=self.text["id"], output_index=index,
                              content_index=0, part=dict(part))
        self.text["content"][0]["text"] += text
        yield self._event("response.output_text.delta", item_id=self.text["id"],
                          output_index=self.output.index(self.text), content_index=0, delta=text, logprobs=[])

    def _close_text(self) -> Iterator[Tuple[str, dict]]:
        if self.text is None:
            return
        item, self.text = self.text, None
        index, part = self.output.index(item), item["content"][0]
        item["status"] = "completed"
        yield self._event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                          text=part["text"], logprobs=[])
        yield self._event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                          part=part)
        yield self._event("response.output_item.done", output_index=index, item=item)

    def add_call(self, call: dict) -> Iterator[Tuple[str, dict]]:
        yield from self._close_reasoning()
        yield from self._close_text()
        name = call["function"]["name"]
        item = {"type": "function_call", "id": _id("fc"), "call_id": call["id"], "name": name, "arguments": "",
                "status": "in_progress"}
        if name in self.namespaces:
            item["namespace"] = self.namespaces[name]
        self.output.append(item)
        index = len(self.output) - 1
        yield self._event("response.output_item.added", output_index=index, item=dict(item))
        item["arguments"] = call["function"]["arguments"]
        yield self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                          delta=item["arguments"])
        yield self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                          arguments=item["arguments"])
        item["status"] = "completed"
        yield self._event("response.output_item.done", output_index=index, item=item)

    def end(self, finish: Optional[str], stats) -> Iterator[Tuple[str, dict]]:
        """The last event: `response.completed`, whose response says `incomplete` where the budget ran
        out (clients such as Codex and the openai SDK's stream helper finish a turn on this event
        alone)."""
        yield from self._close_reasoning()
        yield from self._close_text()
        status = "incomplete" if finish == "length" else "completed"
        yield self._event("response.completed", response=self.response(status, stats, finish))

    def failed(self, error: APIError) -> Iterator[Tuple[str, dict]]:
        yield from self._close_reasoning()
        yield from self._close_text()
        yield self._event("response.failed", response=self.response(
            "failed", error={"code": error.code or error.kind, "message": error.message}))

    def whole(self, text: str, calls: List[dict], finish: Optional[str], stats, reasoning: str = "") -> dict:
        """The response object of an answer that is not streamed."""
        for _ in self.add_reasoning(reasoning):
            pass
        for _ in self.add_text(text):
            pass
        for call in calls:
            for _ in self.add_call(call):
                pass
        for _ in self._close_reasoning():
            pass
        for _ in self._close_text():
            pass
        return self.response("incomplete" if finish == "length" else "completed", stats, finish)
