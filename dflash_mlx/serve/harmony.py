"""gpt-oss's harmony format: its answer read into reasoning, text and tool calls.

A harmony answer is a run of messages, each a header, `<|message|>`, a body and an end marker:
`<|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>...<|return|>`
(the generation prompt ends with `<|start|>assistant`, so the answer starts in a header). The
analysis channel is reasoning; the final channel, and commentary without a recipient (preambles),
the answer's text. A message to `functions.NAME` (written after the channel or before it, in the
header) is a call of NAME whose body is its arguments as JSON, ended by `<|call|>`; a message to
one of the model's built-in tools (`browser.search`, `python`) is reasoning.
"""

import json
import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from ..constrain.gate import Reasoning
from .tools import held_back, openai_call

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
ENDS = ("<|end|>", "<|return|>", "<|call|>")  # a message's end
OPENS = (START, CHANNEL)  # the next message's header, where the model left out the end marker
FINAL = "<|channel|>final<|message|>"  # the final answer's start
CLOSE = "<|end|><|start|>assistant" + FINAL  # from the analysis to the final answer: what a spent budget forces
RECIPIENT = re.compile(r"to=([^\s<]+)")
CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"([^\s<]+)")


def is_harmony(tokenizer) -> bool:
    """Whether the model writes harmony: its chat template names the channels and its vocabulary
    has the format's markers as tokens."""
    template = getattr(tokenizer, "chat_template", None)
    return (isinstance(template, str) and CHANNEL in template
            and all(len(tokenizer.encode(m, add_special_tokens=False)) == 1 for m in (START, CHANNEL, MESSAGE)))


def harmony_gate(tokenizer, budget: Optional[int]) -> Reasoning:
    """The final channel's start as the end of the reasoning, in token ids: a grammar applies to the
    final answer, and a spent budget closes the analysis and opens the final answer."""
    def ids(text):
        return tuple(tokenizer.encode(text, add_special_tokens=False))

    return Reasoning(end=ids(FINAL), close=ids(CLOSE), inside=True, budget=budget)


@dataclass(frozen=True)
class Route:
    """Where a message's body goes: "reasoning", "text" or "call" (of the function `name`)."""

    kind: str
    name: str = ""


def route(header: str, tools: Optional[list]) -> Route:
    """The route of a message by its header (from its `<|start|>`, if the header has one)."""
    header = header[header.rfind(START) + len(START):] if START in header else header
    recipient = RECIPIENT.search(header)
    to = recipient.group(1) if recipient else ""
    channel = CHANNEL_NAME.findall(header)
    if to.startswith("functions."):
        return Route("call", to[len("functions."):]) if tools else Route("text")
    if to or channel[-1:] == ["analysis"]:
        return Route("reasoning")
    return Route("text")


class HarmonySplitter:
    """Splits streamed harmony text into (reasoning, text, calls).

    A marker's start is held back until it is known; a call is read when its end marker arrives
    or the text ends (the engine may stop on `<|call|>` without writing it). Text cut by the token
    budget (`cut`) drops a call it cut short, a header and a marker's start: no markup reaches a
    client. A call whose body is not JSON stays text; without the request's tools calls are not
    read: their bodies are text. Messages of one kind are joined by a blank line."""

    def __init__(self, tools: Optional[list]):
        self.tools = tools
        self.buffer = ""
        self.route: Optional[Route] = None  # the message being read; None: in a header
        self.fresh = False  # no text of the message out yet
        self.written: Dict[str, bool] = {"reasoning": False, "text": False}
        self.calls = 0

    def feed(self, text: str, final: bool = False, cut: bool = False) -> Tuple[str, str, List[dict]]:
        """(reasoning, text, calls) of the new `text`; `final`: the text ends, `cut`: by its budget."""
        self.buffer += text
        out = {"reasoning": [], "text": [], "call": []}
        while self._message(out):
            pass
        if self.route is None:
            if final and not cut and self.buffer.strip() and "<|" not in self.buffer:
                self._put(out, Route("text"), self.buffer)  # no harmony at all: the model's text stands
        elif self.route.kind == "call":
            if final and not cut:
                self._put(out, self.route, self.buffer)
        else:
            keep = 0 if final and not cut else max(held_back(self.buffer, m) for m in ENDS + OPENS)
            self._put(out, self.route, self.buffer[: len(self.buffer) - keep])
            self.buffer = self.buffer[len(self.buffer) - keep:]
        if final:
            self.buffer, self.route = "", None
        self.calls += len(out["call"])
        return "".join(out["reasoning"]), "".join(out["text"]), out["call"]

    def _message(self, out: Dict[str, list]) -> bool:
        """Reads a header or a body whose end is in the buffer; False where none is."""
        if self.route is None:
            i = self.buffer.find(MESSAGE)
            if i < 0:
                return False
            self.route, self.buffer = route(self.buffer[:i], self.tools), self.buffer[i + len(MESSAGE):]
            self.fresh = True
            return True
        ends = [(i, len(m)) for m in ENDS for i in [self.buffer.find(m)] if i >= 0]
        ends += [(i, 0) for m in OPENS for i in [self.buffer.find(m)] if i >= 0]  # kept for the next header
        if not ends:
            return False
        i, n = min(ends)
        self._put(out, self.route, self.buffer[:i])
        self.buffer, self.route = self.buffer[i + n:], None
        return True

    def _put(self, out: Dict[str, list], where: Route, body: str) -> None:
        if where.kind == "call":
            try:
                args = json.loads(body)
            except ValueError:
                where = Route("text")  # not a call after all: the model's text stands
            else:
                out["call"].append(openai_call({"name": where.name, "arguments": args}))
                return
        if not body:
            return
        if self.fresh and self.written[where.kind]:
            body = "\n\n" + body
        self.fresh, self.written[where.kind] = False, True
        out[where.kind].append(body)
