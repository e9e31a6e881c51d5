"""A thinking model's reasoning split from its answer, as the text streams.

Thinking models (Qwen3, Qwen3.5/3.6, Gemma 4) write their reasoning between markers mlx-lm finds
for the tokenizer (`think_start` / `think_end`: `<think>` and `</think>`, Gemma 4's thought
channel). The reasoning goes to each API's own field (OpenAI chat `reasoning` and
`reasoning_content`, Anthropic `thinking` blocks, Responses `reasoning` items) and the answer,
where tool calls are read, is what follows it. A template that opens the reasoning in the prompt
(the generation prompt ends with the start marker) starts the answer inside it.
"""

from typing import List, Optional, Sequence, Tuple

from .tools import held_back, splitter


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


def thinking(tokenizer, prompt: Sequence[int]) -> Optional[Tuple[str, str, bool]]:
    """A thinking model's (start, end) markers and whether the prompt leaves the answer inside the
    reasoning; None for a model that does not think."""
    if not getattr(tokenizer, "has_thinking", False):
        return None
    opened, closed = tokenizer.rfind_think_start(list(prompt)), tokenizer.rfind_think_end(list(prompt))
    return tokenizer.think_start, tokenizer.think_end, opened > closed


class AnswerParts:
    """An answer's text as it streams, in its parts: reasoning, the answer's text, and the tool
    calls read from that text (never from the reasoning)."""

    def __init__(self, tokenizer, job):
        """`job.thinking`: the model's markers (`thinking`); `job.tools`: the tools whose calls are read."""
        self.thinking = ReasoningSplitter(*job.thinking) if job.thinking is not None else None
        self.calls = splitter(tokenizer, job.tools)

    @property
    def called(self) -> int:
        """Calls read so far."""
        return self.calls.calls if self.calls is not None else 0

    def feed(self, text: str, final: bool = False, cut: bool = False) -> Tuple[str, str, List[dict]]:
        """(reasoning, text, calls) of the new `text`; `final`: the answer ends, `cut`: by its budget."""
        reasoning, text = self.thinking.feed(text, final) if self.thinking is not None else ("", text)
        text, calls = self.calls.feed(text, final, cut) if self.calls is not None else (text, [])
        return reasoning, text, calls
