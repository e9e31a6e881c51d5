"""A thinking model's reasoning split from its answer, as the text streams.

Thinking models (Qwen3, Qwen3.5/3.6, Gemma 4) write their reasoning between markers mlx-lm finds
for the tokenizer (`think_start` / `think_end`: `<think>` and `</think>`, Gemma 4's thought
channel); the answer, where tool calls are read, is what follows it. A template that opens the
reasoning in the prompt (the generation prompt ends with the start marker) starts the answer
inside it. gpt-oss writes harmony (`harmony`): its analysis channel is the reasoning, its final
channel and preambles the answer's text, and its messages to functions the tool calls. The
reasoning goes to each API's own field (OpenAI chat `reasoning` and `reasoning_content`,
Anthropic `thinking` blocks, Responses `reasoning` items).
"""

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from ..constrain.gate import Reasoning
from .api_errors import APIError
from .harmony import FINAL, HarmonySplitter, harmony_gate, is_harmony
from .tools import held_back, splitter

# Reasoning tokens a request's effort allows before the end marker is forced (OpenAI's
# `reasoning_effort` and `reasoning.effort`); Anthropic's `thinking.budget_tokens` gives the number.
# "none" turns thinking off where the chat template can.
EFFORT_BUDGETS = {"minimal": 256, "low": 1024, "medium": 4096, "high": 16384, "xhigh": 32768}


class ReasoningSplitter:
    """Splits streamed text into (reasoning, answer). A marker's start is held back until it is
    known; the answer's first line breaks after the end marker are dropped, as templates write
    them."""

    def __init__(self, start: str, end: str, inside: bool = False):
        self.start, self.end = start, end
        self.inside = inside  # in the reasoning now
        self.buffer = ""
        self.after_end = False  # just past the end marker: leading line breaks are the template's

    def feed(self, text: str, final: bool = False) -> Tuple[str, str]:
        self.buffer += text
        reasoning, answer = [], []
        while True:
            marker = self.end if self.inside else self.start
            i = self.buffer.find(marker)
            if i < 0:
                keep = 0 if final else held_back(self.buffer, marker)
                piece, self.buffer = self.buffer[: len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
                (reasoning if self.inside else answer).append(self._answer(piece) if not self.inside else piece)
                break
            piece = self.buffer[:i]
            (reasoning if self.inside else answer).append(self._answer(piece) if not self.inside else piece)
            self.buffer = self.buffer[i + len(marker):]
            self.after_end, self.inside = self.inside, not self.inside
        return "".join(reasoning), "".join(answer)

    def _answer(self, text: str) -> str:
        if self.after_end:
            text = text.lstrip("\n")
            self.after_end = not text
        return text


@dataclass(frozen=True)
class Markers:
    """Where a model's reasoning is in its text."""

    start: str  # the reasoning's start marker
    end: str  # its end marker: the answer follows it
    inside: bool  # the prompt opened the reasoning: the answer starts inside it
    harmony: bool = False  # gpt-oss's harmony channels (`harmony`), read by their own splitter


def thinking(tokenizer, prompt: Sequence[int]) -> Optional[Markers]:
    """A thinking model's markers; None for a model that does not think."""
    if is_harmony(tokenizer):
        return Markers("<|channel|>analysis<|message|>", FINAL, inside=True, harmony=True)
    if not getattr(tokenizer, "has_thinking", False):
        return None
    opened, closed = tokenizer.rfind_think_start(list(prompt)), tokenizer.rfind_think_end(list(prompt))
    return Markers(tokenizer.think_start, tokenizer.think_end, opened > closed)


class AnswerParts:
    """An answer's text as it streams, in its parts: reasoning, the answer's text, and the tool
    calls read from that text (never from the reasoning)."""

    def __init__(self, tokenizer, job):
        """`job.thinking`: the model's `Markers`; `job.tools`: the tools whose calls are read."""
        markers = job.thinking
        self.harmony = HarmonySplitter(job.tools) if markers is not None and markers.harmony else None
        self.thinking = (ReasoningSplitter(markers.start, markers.end, markers.inside)
                         if markers is not None and self.harmony is None else None)
        self.calls = splitter(tokenizer, job.tools) if self.harmony is None else None

    @property
    def called(self) -> int:
        """Calls read so far."""
        reader = self.harmony if self.harmony is not None else self.calls
        return reader.calls if reader is not None else 0

    def feed(self, text: str, final: bool = False, cut: bool = False) -> Tuple[str, str, List[dict]]:
        """(reasoning, text, calls) of the new `text`; `final`: the answer ends, `cut`: by its budget."""
        if self.harmony is not None:
            return self.harmony.feed(text, final, cut)
        reasoning, text = self.thinking.feed(text, final) if self.thinking is not None else ("", text)
        text, calls = self.calls.feed(text, final, cut) if self.calls is not None else (text, [])
        return reasoning, text, calls


def budget(body: dict) -> Optional[int]:
    """The request's thinking budget in tokens: `thinking_budget` (Anthropic's `budget_tokens`, as
    the Messages API passes it on) or `reasoning_effort` (`EFFORT_BUDGETS`); None: unbounded."""
    tokens = body.get("thinking_budget")
    if tokens is not None:
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
            raise APIError(400, "'thinking.budget_tokens' must be a positive integer.", param="thinking")
        return tokens
    effort = body.get("reasoning_effort")
    if effort is None or effort == "none":
        return None
    if effort not in EFFORT_BUDGETS:
        raise APIError(400, f"'reasoning_effort' must be one of none, {', '.join(EFFORT_BUDGETS)}.",
                       param="reasoning_effort")
    return EFFORT_BUDGETS[effort]


def gate(tokenizer, markers: Markers, tokens: Optional[int]) -> Reasoning:
    """Where a thinking model's reasoning ends, in token ids, for a grammar that follows it or a
    budget that ends it."""
    if markers.harmony:
        return harmony_gate(tokenizer, tokens)
    return Reasoning(end=tuple(tokenizer.think_end_tokens), start=tuple(tokenizer.think_start_tokens),
                     inside=markers.inside, budget=tokens)
