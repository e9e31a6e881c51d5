"""The Anthropic Messages API (`POST /v1/messages`) on top of the OpenAI chat path.

A request is translated into the equivalent chat completion request (system
prompt, text and tool blocks, tools, stop sequences); the answer's text and
tool calls become content blocks, as one message or as Anthropic's stream of
events.
"""

import hashlib
import json
import uuid
from typing import Any, Dict, Iterator, List, Optional, Tuple


class BadRequest(ValueError):
    def __init__(self, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.param = param


# What an image becomes in the prompt of a model that reads text only: agents send screenshots
# (a tool's result) as a matter of course, and a refusal would end their loop.
IMAGE_NOTE = "[an image was here; this model reads text only]"
MEDIA = ("image", "document")
# Claude Code's first system block, `x-anthropic-billing-header: cc_version=<version>.<3 hex>; cc_entrypoint=...;`,
# changes from one session to the next. At the start of the prompt it would leave no prefix for the prompt
# cache to share between sessions; it is metadata, not instructions, so it is left out (as vLLM does).
BILLING_HEADER = "x-anthropic-billing-header:"


def _text(content, where: str) -> str:
    """A string, or text (and image) blocks, as text; an image becomes `IMAGE_NOTE`."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(b, dict) and b.get("type") in ("text", *MEDIA) for b in content):
        return "".join(str(b.get("text", "")) if b["type"] == "text" else IMAGE_NOTE for b in content)
    raise BadRequest(f"{where} must be a string or a list of text or image blocks.", "messages")


def _billing(block) -> bool:
    """Whether a system block is Claude Code's billing line: one text line that starts with `BILLING_HEADER`."""
    text = block.get("text") if isinstance(block, dict) and block.get("type") == "text" else None
    return isinstance(text, str) and text.startswith(BILLING_HEADER) and "\n" not in text.strip()


def _message(m) -> List[dict]:
    """One Anthropic message -> chat messages (tool results become `tool` messages, thinking the
    assistant's `reasoning_content`, images a note)."""
    if not isinstance(m, dict) or m.get("role") not in ("user", "assistant", "system"):
        raise BadRequest("Each message needs 'role' \"user\", \"assistant\" or \"system\" and 'content'.", "messages")
    content = m.get("content")
    if m["role"] == "system":
        return [{"role": "system", "content": _text(content, "A system message's 'content'")}]
    if isinstance(content, str):
        return [{"role": m["role"], "content": content}]
    if not isinstance(content, list):
        raise BadRequest("A message's 'content' must be a string or a list of content blocks.", "messages")
    text, calls, results, thinking = [], [], [], []
    for b in content:
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text":
            text.append(str(b.get("text", "")))
        elif kind in MEDIA and m["role"] == "user":
            text.append(IMAGE_NOTE)
        elif kind == "tool_use" and m["role"] == "assistant":
            calls.append({"id": b.get("id"), "type": "function",
                          "function": {"name": b.get("name"), "arguments": b.get("input", {})}})
        elif kind == "tool_result" and m["role"] == "user":
            result = _text(b.get("content", ""), "A tool_result's content")
            if b.get("is_error"):  # templates have no field for it: the text says so
                result = f"Error: {result}"
            results.append({"role": "tool", "tool_call_id": b.get("tool_use_id"), "content": result})
        elif kind in ("thinking", "redacted_thinking") and m["role"] == "assistant":
            thinking.append(str(b.get("thinking", "")))  # taken back as it was given, its signature unchecked
        else:
            raise BadRequest(f"Content blocks of type {kind!r} are not supported in a {m['role']} message "
                             "(text and images; tool_use and thinking from the assistant; tool_result from the "
                             "user).", "messages")
    out = results
    if text or calls or not results:
        msg = {"role": m["role"], "content": "".join(text)}
        if calls:
            msg["tool_calls"] = calls
        if "".join(thinking):
            msg["reasoning_content"] = "".join(thinking)
        out = out + [msg]
    return out


def _in_place(chat: List[dict]) -> List[dict]:
    """System entries among the messages (Claude Code sends reminders so) folded into a user turn
    next to them: chat templates take one system message, at the start."""
    out: List[dict] = []
    held: List[str] = []
    for m in chat:
        if m["role"] == "system" and out:
            if len(out) == 1 and out[0]["role"] == "system":  # the system prompt, in two parts
                out[0] = dict(out[0], content=f"{out[0]['content']}\n\n{m['content']}")
            elif out[-1]["role"] == "user":
                out[-1] = dict(out[-1], content=f"{out[-1]['content']}\n\n{m['content']}")
            else:
                held.append(m["content"])
            continue
        if m["role"] == "user" and held:
            m = dict(m, content="\n\n".join(held + [m["content"]]))
            held = []
        out.append(m)
    if held:
        out.append({"role": "user", "content": "\n\n".join(held)})
    return out


def to_chat(body: Any) -> Dict[str, Any]:
    """The chat completion request equivalent to a Messages API request."""
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object.")
    if not isinstance(body.get("max_tokens"), int) or isinstance(body.get("max_tokens"), bool):
        raise BadRequest("'max_tokens' is required: a positive integer.", "max_tokens")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list.", "messages")
    chat = [m for msg in messages for m in _message(msg)]
    system = body.get("system")
    if isinstance(system, list):
        system = [b for b in system if not _billing(b)] or None
    if system is not None:
        chat.insert(0, {"role": "system", "content": _text(system, "'system'")})
    chat = _in_place(chat)
    out = {k: body[k] for k in ("model", "max_tokens", "temperature", "top_p", "top_k", "stream") if k in body}
    thinking = body.get("thinking") if isinstance(body.get("thinking"), dict) else {}
    if thinking.get("type") == "enabled" and thinking.get("budget_tokens") is not None:
        out["thinking_budget"] = thinking["budget_tokens"]
    elif thinking.get("type") == "disabled":
        out["enable_thinking"] = False
    effort = (body.get("output_config") or {}).get("effort") if isinstance(body.get("output_config"), dict) else None
    if effort is not None and "thinking_budget" not in out and thinking.get("type") != "disabled":
        out["reasoning_effort"] = effort
    out["messages"] = chat
    if body.get("stop_sequences") is not None:
        stops = body["stop_sequences"]
        if not (isinstance(stops, list) and all(isinstance(s, str) for s in stops)):
            raise BadRequest("'stop_sequences' must be a list of strings.", "stop_sequences")
        out["stop"] = stops
    tools = body.get("tools")
    if tools:
        if not (isinstance(tools, list) and all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                                for t in tools)):
            raise BadRequest("'tools' must be a list of {\"name\", \"description\", \"input_schema\"} objects.",
                             "tools")
        out["tools"] = [{"type": "function", "function": {
            "name": t["name"], "description": t.get("description", ""),
            "parameters": t.get("input_schema", {"type": "object"}), "strict": t.get("strict", False)}} for t in tools]
    choice = body.get("tool_choice")
    if choice is not None:
        kind = choice.get("type") if isinstance(choice, dict) else None
        if kind not in ("auto", "none", "any", "tool") or (kind == "tool" and not isinstance(choice.get("name"), str)):
            raise BadRequest("'tool_choice' must be {\"type\": \"auto\"}, {\"type\": \"none\"}, {\"type\": \"any\"} or "
                             "{\"type\": \"tool\", \"name\": ...}.", "tool_choice")
        out["tool_choice"] = ({"type": "function", "function": {"name": choice["name"]}} if kind == "tool"
                              else "required" if kind == "any" else kind)
        if choice.get("disable_parallel_tool_use"):
            out["parallel_tool_calls"] = False
    fmt = body.get("output_format")
    if fmt is not None:  # structured outputs: the text is JSON that validates against the schema
        if not (isinstance(fmt, dict) and fmt.get("type") == "json_schema" and isinstance(fmt.get("schema"), dict)):
            raise BadRequest("'output_format' must be {\"type\": \"json_schema\", \"schema\": {...}}.", "output_format")
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"],
                                                                         "strict": True}}
    return out


def stop_reason(finish: Optional[str], stop_sequence: Optional[str], calls: bool) -> str:
    if finish == "length":  # the budget ended it, even after a whole call
        return "max_tokens"
    if calls:
        return "tool_use"
    return "stop_sequence" if stop_sequence is not None else "end_turn"


def tool_use(call: dict) -> dict:
    """An OpenAI tool call (from the splitter) as a tool_use block."""
    args = call["function"]["arguments"]
    return {"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"), "name": call["function"]["name"],
            "input": json.loads(args) if isinstance(args, str) else args}


def usage(stats, output_tokens: Optional[int] = None) -> Dict[str, int]:
    cached = stats.cached_tokens if stats is not None else 0
    prompt = stats.prompt_tokens if stats is not None else 0
    return {"input_tokens": prompt - cached, "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0,
            "output_tokens": output_tokens if output_tokens is not None else
            (stats.generation_tokens if stats is not None else 0)}


def signature(thinking: str) -> str:
    """A thinking block's `signature`: clients echo it back with the block, and this server takes
    it back unchecked, so it only names the text (its hash)."""
    return "dflash-" + hashlib.sha256(thinking.encode()).hexdigest()


def message(model: str, text: str, calls: List[dict], finish, stop_seq, stats, thinking: str = "") -> Dict[str, Any]:
    content = ([{"type": "thinking", "thinking": thinking, "signature": signature(thinking)}] if thinking else [])
    content += ([{"type": "text", "text": text}] if text.strip() else []) + [tool_use(c) for c in calls]
    return {"id": "msg_" + uuid.uuid4().hex[:24], "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": stop_reason(finish, stop_seq, bool(calls)),
            "stop_sequence": stop_seq, "usage": usage(stats)}


class EventStream:
    """Anthropic's streaming events for one message, from text deltas and tool calls."""

    def __init__(self, model: str):
        self.model = model
        self.index = -1
        self.open: Optional[str] = None  # the kind of the block being streamed
        self.calls = 0
        self.blank = ""  # whitespace held back: sent before more text, dropped before a call or the end
        self.thought = ""  # the thinking block being streamed

    def start(self, stats) -> Iterator[Tuple[str, dict]]:
        """The first event, once the prompt is read (`stats` of the first event): its usage counts the
        prompt's tokens, as clients that track their context read it here."""
        yield "message_start", {"type": "message_start", "message": {
            "id": "msg_" + uuid.uuid4().hex[:24], "type": "message", "role": "assistant", "model": self.model,
            "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage(stats, 0)}}

    def _close(self):
        if self.open == "thinking":
            yield "content_block_delta", {"type": "content_block_delta", "index": self.index,
                                          "delta": {"type": "signature_delta", "signature": signature(self.thought)}}
        if self.open is not None:
            yield "content_block_stop", {"type": "content_block_stop", "index": self.index}
            self.open = None

    def thinking(self, text: str):
        """Reasoning, in a thinking block of its own (its signature sent as it closes)."""
        if not text:
            return
        if self.open != "thinking":
            yield from self._close()
            self.index, self.open, self.thought = self.index + 1, "thinking", ""
            yield "content_block_start", {"type": "content_block_start", "index": self.index,
                                          "content_block": {"type": "thinking", "thinking": "", "signature": ""}}
        self.thought += text
        yield "content_block_delta", {"type": "content_block_delta", "index": self.index,
                                      "delta": {"type": "thinking_delta", "thinking": text}}

    def text(self, text: str):
        if not text.strip():  # no block of its own, and none between calls
            self.blank += text
            return
        text, self.blank = self.blank + text, ""
        if self.open != "text":
            yield from self._close()
            self.index, self.open = self.index + 1, "text"
            yield "content_block_start", {"type": "content_block_start", "index": self.index,
                                          "content_block": {"type": "text", "text": ""}}
        yield "content_block_delta", {"type": "content_block_delta", "index": self.index,
                                      "delta": {"type": "text_delta", "text": text}}

    def call(self, call: dict):
        self.blank = ""
        yield from self._close()
        block = tool_use(call)
        self.index, self.calls = self.index + 1, self.calls + 1
        yield "content_block_start", {"type": "content_block_start", "index": self.index,
                                      "content_block": dict(block, input={})}
        yield "content_block_delta", {"type": "content_block_delta", "index": self.index,
                                      "delta": {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}}
        yield "content_block_stop", {"type": "content_block_stop", "index": self.index}

    def end(self, finish, stop_seq, stats):
        yield from self._close()
        yield "message_delta", {"type": "message_delta",
                                "delta": {"stop_reason": stop_reason(finish, stop_seq, self.calls > 0),
                                          "stop_sequence": stop_seq},
                                "usage": usage(stats)}
        yield "message_stop", {"type": "message_stop"}
