"""A grammar that applies from the end of a thinking model's reasoning: the model thinks freely,
then answers in the schema.

While the model reasons, every row allows every token; the grammar starts with the token after
the reasoning's end marker. A block whose drafts cross the marker is masked row by row: rows up
to the marker free, the rows after it by the grammar after the drafts that follow the marker, so
speculation stays exact across the boundary. Where the model may open its reasoning itself (the
prompt did not), the first row also allows the start marker. A thinking budget ends the
reasoning: past it, the rows allow only the end marker's next token, a run of forced tokens.
"""

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import numpy as np

from .matcher import Constraint, Masks


@dataclass(frozen=True)
class Reasoning:
    """Where a sequence's reasoning ends, as token ids."""

    end: Tuple[int, ...]  # the end marker's tokens
    start: Optional[int] = None  # the start marker's token, where it is one token
    inside: bool = False  # the prompt opened the reasoning: the answer starts inside it
    budget: Optional[int] = None  # reasoning tokens before the end marker is forced (None: no bound)


class AfterReasoning:
    """A `Constraint` that applies after the reasoning (same interface)."""

    def __init__(self, inner: Constraint, reasoning: Reasoning):
        self.inner, self.r = inner, reasoning
        self.words, self.eos = inner.words, inner.eos
        # "maybe": the next token may open the reasoning; "reasoning": inside it; "answer": the grammar's
        self.state = "reasoning" if reasoning.inside else "maybe" if reasoning.start is not None else "answer"
        self.matched = 0  # tokens of the end marker matched so far
        self.thought = 0  # reasoning tokens committed

    @property
    def error(self) -> Optional[str]:
        return self.inner.error

    @property
    def done(self) -> bool:
        return self.state == "answer" and self.inner.done

    @property
    def accepting(self) -> bool:
        return self.state == "answer" and self.inner.accepting

    def take_seconds(self) -> float:
        return self.inner.take_seconds()

    def _walk(self, tokens: Sequence[int],
              at: Optional[Tuple[str, int, int]] = None) -> Tuple[str, int, int, int]:
        """(state, matched, thought, i) after the leading tokens that stay outside the grammar:
        `i` of them (through the end marker, if it comes); the state after them. `at`: the
        (state, matched, thought) to walk from (default: the committed one)."""
        state, matched, thought = at or (self.state, self.matched, self.thought)
        for i, t in enumerate(tokens):
            if state == "answer":
                return state, matched, thought, i
            if state == "maybe":
                if t != self.r.start:
                    return "answer", matched, thought, i
                state = "reasoning"
                continue
            thought += 1
            matched = matched + 1 if t == self.r.end[matched] else int(t == self.r.end[0])
            if matched == len(self.r.end):
                state, matched = "answer", 0
        return state, matched, thought, len(tokens)

    def _free_row(self, state: str, matched: int, thought: int) -> np.ndarray:
        """The mask of a row outside the grammar: all tokens while reasoning (past the budget, the
        end marker's next token alone); at the answer's start, the grammar's first row and the
        start marker."""
        if state == "reasoning":
            if self.r.budget is not None and thought >= self.r.budget:
                return self._only(self.r.end[matched])
            return np.full((self.words,), -1, dtype=np.int32)
        return self._only(self.r.start)  # "maybe": joined with the grammar's row by the caller

    def _only(self, token: int) -> np.ndarray:
        bits = np.zeros((self.words * 32,), dtype=np.uint8)
        bits[token] = 1
        return np.packbits(bits, bitorder="little").view(np.int32)

    def allows(self, drafts: Sequence[int]) -> int:
        drafts = list(drafts)
        state, matched, thought, i = self.state, self.matched, self.thought, 0
        while i < len(drafts) and state != "answer":
            row = self._free_row(state, matched, thought)
            if state == "maybe" and drafts[i] != self.r.start:
                break  # the grammar's first token: the inner matcher decides
            if not (row[drafts[i] // 32] >> (drafts[i] % 32)) & 1:
                return i
            state, matched, thought, _ = self._walk([drafts[i]], (state, matched, thought))
            i += 1
        return i + self.inner.allows(drafts[i:]) if state != "reasoning" else i

    def masks(self, drafts: Sequence[int] = (), valid: Optional[int] = None) -> Masks:
        drafts = list(drafts)
        valid = self.allows(drafts) if valid is None else valid
        rows: List[np.ndarray] = []
        state, matched, thought, i = self.state, self.matched, self.thought, 0
        while state != "answer" and i <= len(drafts):
            if state == "maybe":  # the grammar's first row, or the reasoning's start
                if i < len(drafts) and drafts[i] == self.r.start:
                    rows.append(self.inner.masks().bits[0] | self._only(self.r.start))
                    state = "reasoning"
                    i += 1
                    continue
                first = self.inner.masks(drafts[i:], max(valid - i, 0))
                first.bits[0] |= self._only(self.r.start)
                return Masks(np.concatenate([np.stack(rows)] + [first.bits]) if rows else first.bits, valid)
            rows.append(self._free_row(state, matched, thought))
            if i == len(drafts):
                return Masks(np.stack(rows), valid)
            state, matched, thought, _ = self._walk([drafts[i]], (state, matched, thought))
            i += 1
        rest = self.inner.masks(drafts[i:], max(valid - i, 0))
        return Masks(np.concatenate([np.stack(rows), rest.bits]) if rows else rest.bits, valid)

    def forced(self, limit: int) -> List[int]:
        if self.state == "answer":
            return self.inner.forced(limit)
        if self.state == "reasoning" and self.r.budget is not None and self.thought >= self.r.budget:
            return list(self.r.end[self.matched:])[:limit]  # the budget is spent: the marker, as certain drafts
        return []

    def commit(self, tokens: Sequence[int]) -> None:
        tokens = list(tokens)
        self.state, self.matched, self.thought, i = self._walk(tokens)
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
