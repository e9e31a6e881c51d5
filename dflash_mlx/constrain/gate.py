"""A grammar that applies from the end of a thinking model's reasoning: the model thinks freely,
then answers in the schema.

While the model reasons, every row allows every token; the grammar starts with the token after
the reasoning's end marker (one token or several: Gemma 4's thought channel, harmony's
`<|channel|>final<|message|>`). A block whose drafts cross the marker is masked row by row: rows
up to the marker free, the rows after it by the grammar after the drafts that follow the marker,
so speculation stays exact across the boundary. Where the model may open its reasoning itself
(the prompt did not), the first row also allows the start marker's first token; the rest of the
marker (Gemma 4's `<|channel>thought`) then follows as forced tokens. A thinking budget ends the
reasoning: past it, the rows allow only the next token of its close (the end marker, or for
harmony the analysis's end and the final answer's start), a run of forced tokens.
"""

from dataclasses import dataclass, replace
from typing import List, Optional, Sequence, Tuple

import numpy as np

from .matcher import Constraint, Masks


@dataclass(frozen=True)
class Reasoning:
    """Where a sequence's reasoning ends, as token ids."""

    end: Tuple[int, ...]  # the end marker's tokens
    start: Tuple[int, ...] = ()  # the start marker's tokens (none: the model cannot open the reasoning)
    inside: bool = False  # the prompt opened the reasoning: the answer starts inside it
    budget: Optional[int] = None  # reasoning tokens before the end marker is forced (None: no bound)
    close: Tuple[int, ...] = ()  # what a spent budget forces, ending with `end` (default: `end` alone)


@dataclass(frozen=True)
class Walk:
    """Where a sequence stands outside the grammar."""

    state: str  # "maybe": the next token may open the reasoning; "opening": in its start marker;
    # "reasoning": inside it; "answer": the grammar's
    matched: int = 0  # tokens of the end marker matched so far (of the start marker, while opening)
    closing: int = 0  # tokens of the close matched so far
    thought: int = 0  # reasoning tokens


def _match(marker: Sequence[int], matched: int, token: int) -> int:
    return matched + 1 if matched < len(marker) and token == marker[matched] else int(token == marker[0])


class AfterReasoning:
    """A `Constraint` that applies after the reasoning (same interface)."""

    def __init__(self, inner: Constraint, reasoning: Reasoning):
        self.inner, self.r = inner, reasoning
        self.words, self.eos = inner.words, inner.eos
        end, close = tuple(reasoning.end), tuple(reasoning.close)
        self.close = close if close[len(close) - len(end):] == end else end
        self.start = tuple(reasoning.start)
        self.at = Walk("reasoning" if reasoning.inside else "maybe" if self.start else "answer")

    @property
    def error(self) -> Optional[str]:
        return self.inner.error

    @property
    def done(self) -> bool:
        return self.at.state == "answer" and self.inner.done

    @property
    def accepting(self) -> bool:
        return self.at.state == "answer" and self.inner.accepting

    def take_seconds(self) -> float:
        return self.inner.take_seconds()

    def _walk(self, tokens: Sequence[int], at: Optional[Walk] = None) -> Tuple[Walk, int]:
        """Where the sequence stands after the leading `tokens` that stay outside the grammar (through
        the end marker, if it comes), and how many they are; from `at` (default: the committed walk)."""
        at = at or self.at
        for i, t in enumerate(tokens):
            if at.state == "answer":
                return at, i
            if at.state in ("maybe", "opening"):
                if at.state == "maybe" and t != self.start[0]:
                    return replace(at, state="answer"), i
                opened = at.matched + 1 if at.state == "opening" else 1
                at = Walk("opening", opened) if opened < len(self.start) else Walk("reasoning")
                continue
            matched = _match(self.r.end, at.matched, t)
            if matched == len(self.r.end):
                at = Walk("answer", thought=at.thought + 1)
            else:
                at = Walk("reasoning", matched, _match(self.close, at.closing, t), at.thought + 1)
        return at, len(tokens)

    def _spent(self, at: Walk) -> bool:
        return at.state == "reasoning" and self.r.budget is not None and at.thought >= self.r.budget

    def _closing(self, at: Walk) -> Tuple[int, ...]:
        """What a spent budget forces from `at`: the rest of the end marker once begun, else of the close."""
        return tuple(self.r.end[at.matched:]) if at.matched else self.close[at.closing:] or tuple(self.r.end)

    def _free_row(self, at: Walk) -> np.ndarray:
        """The mask of a row outside the grammar: all tokens while reasoning (past the budget, the
        close's next token alone); at the answer's start, the grammar's first row and the start
        marker."""
        if at.state == "reasoning":
            if self._spent(at):
                return self._only(self._closing(at)[0])
            return np.full((self.words,), -1, dtype=np.int32)
        if at.state == "opening":
            return self._only(self.start[at.matched])
        return self._only(self.start[0])  # "maybe": joined with the grammar's row by the caller

    def _only(self, token: int) -> np.ndarray:
        bits = np.zeros((self.words * 32,), dtype=np.uint8)
        bits[token] = 1
        return np.packbits(bits, bitorder="little").view(np.int32)

    def allows(self, drafts: Sequence[int]) -> int:
        drafts = list(drafts)
        at, i = self.at, 0
        while i < len(drafts) and at.state != "answer":
            row = self._free_row(at)
            if at.state == "maybe" and drafts[i] != self.start[0]:
                break  # the grammar's first token: the inner matcher decides
            if not (row[drafts[i] // 32] >> (drafts[i] % 32)) & 1:
                return i
            at, _ = self._walk([drafts[i]], at)
            i += 1
        return i + self.inner.allows(drafts[i:]) if at.state != "reasoning" else i

    def masks(self, drafts: Sequence[int] = (), valid: Optional[int] = None) -> Masks:
        drafts = list(drafts)
        valid = self.allows(drafts) if valid is None else valid
        rows: List[np.ndarray] = []
        at, i = self.at, 0
        while at.state != "answer" and i <= len(drafts):
            if at.state == "maybe":  # the grammar's first row, or the reasoning's start
                if i < len(drafts) and drafts[i] == self.start[0]:
                    rows.append(self.inner.masks().bits[0] | self._only(self.start[0]))
                    at, _ = self._walk([drafts[i]], at)
                    i += 1
                    continue
                first = self.inner.masks(drafts[i:], max(valid - i, 0))
                first.bits[0] |= self._only(self.start[0])
                return Masks(np.concatenate([np.stack(rows)] + [first.bits]) if rows else first.bits, valid)
            rows.append(self._free_row(at))
            if i == len(drafts):
                return Masks(np.stack(rows), valid)
            at, _ = self._walk([drafts[i]], at)
            i += 1
        rest = self.inner.masks(drafts[i:], max(valid - i, 0))
        return Masks(np.concatenate([np.stack(rows), rest.bits]) if rows else rest.bits, valid)

    def forced(self, limit: int) -> List[int]:
        if self.at.state == "answer":
            return self.inner.forced(limit)
        if self.at.state == "opening":  # the rest of the start marker
            return list(self.start[self.at.matched:])[:limit]
        if self._spent(self.at):
            return list(self._closing(self.at))[:limit]  # the budget is spent: the close, as certain drafts
        return []

    def commit(self, tokens: Sequence[int]) -> None:
        tokens = list(tokens)
        self.at, i = self._walk(tokens)
        if i < len(tokens):
            self.inner.commit(tokens[i:])


class Free:
    """No grammar after the reasoning (a thinking budget alone): every row allows every token."""

    error = None
    done = False
    accepting = True

    def __init__(self, vocab_size: int, eos: Sequence[int]):
        self.words, self.eos = (vocab_size + 31) // 32, set(eos)

    def allows(self, drafts: Sequence[int]) -> int:
        return len(drafts)

    def masks(self, drafts: Sequence[int] = (), valid: Optional[int] = None) -> Masks:
        return Masks(np.full((len(drafts) + 1, self.words), -1, dtype=np.int32), len(drafts))

    def forced(self, limit: int) -> List[int]:
        return []

    def commit(self, tokens: Sequence[int]) -> None:
        pass

    def take_seconds(self) -> float:
        return 0.0
