"""One sequence's place in its grammar: the masks of a block's positions, the tokens the grammar
forces next, and its advance over committed tokens.

A drafted block [last, d_0 .. d_k-1] is verified on rows 0..k; row i's mask is the grammar's
after the committed tokens and d_0..d_i-1. Drafts past the first one the grammar forbids are
never accepted (no allowed pick equals a forbidden draft), so their rows need no mask.

Where the engine gives up on a sequence (one of its work limits reached while decoding), the
constraint records why (`error`) and from then on allows only an end-of-sequence token: the
sequence ends at its next pick, and the decoder ends it with finish reason "error". The other
sequences of its batch go on.
"""

import re
import time
from dataclasses import dataclass
from typing import List, Optional, Sequence

import numpy as np
from llguidance.numpy import fill_next_token_bitmask


@dataclass
class Masks:
    """A block's masks and how many of its drafts the grammar allows."""

    bits: np.ndarray  # [k + 1, words] int32: row i after the first i drafts (rows past `valid` allow all)
    valid: int  # the leading drafts the grammar allows


class Constraint:
    """A sequence's grammar matcher (llguidance's `LLMatcher`), at its committed tokens."""

    def __init__(self, matcher, vocab_size: int, eos: Sequence[int]):
        """`vocab_size`: the tokens the engine's masks cover; `eos`: the end-of-sequence tokens."""
        self.matcher = matcher
        self.words = (vocab_size + 31) // 32
        self.eos = set(eos)
        self.seconds = 0.0  # host time in masks and forced tokens, not yet taken (`take_seconds`)
        self.error: Optional[str] = None  # why the engine gave up on this sequence, once it has
        self._forced: Optional[List[int]] = None  # the forced tokens after the committed ones, once asked

    def _failed(self) -> bool:
        """Whether the engine has given up (its error is then recorded in `error`)."""
        if self.error is None and self.matcher.is_error():
            reason = " ".join(self.matcher.get_error().replace("<non-verbose/>", "").split())
            reason = re.sub(r";[^()]*\)", ")", reason).split("; ")[0]  # the engine's advice is for its developers
            self.error = f"the grammar engine gave up on this answer ({reason or 'unknown error'})"
        return self.error is not None

    def _end_only(self, rows: int) -> np.ndarray:
        """Masks allowing only an end-of-sequence token (all tokens where there is none)."""
        if not self.eos:
            return np.full((rows, self.words), -1, dtype=np.int32)
        bits = np.zeros((rows, self.words * 32), dtype=np.uint8)
        bits[:, sorted(t for t in self.eos if t < self.words * 32)] = 1
        return np.packbits(bits, axis=1, bitorder="little").view(np.int32)

    def allows(self, drafts: Sequence[int]) -> int:
        """How many of the leading drafts the grammar allows after the committed tokens."""
        if self._failed():
            return 0
        tic = time.perf_counter()
        valid = self.matcher.validate_tokens(list(drafts)) if len(drafts) else 0
        self.seconds += time.perf_counter() - tic
        return 0 if self._failed() else valid

    def masks(self, drafts: Sequence[int] = (), valid: Optional[int] = None) -> Masks:
        """The masks of a block's rows after the committed tokens, each draft in turn (the
        matcher is left where it was); `valid`: what `allows(drafts)` said, if it was asked."""
        drafts = list(drafts)
        valid = self.allows(drafts) if valid is None else valid
        if self._failed():
            return Masks(self._end_only(len(drafts) + 1), 0)
        tic = time.perf_counter()
        m = self.matcher
        # An end-of-sequence draft the grammar allows ends the text: no row after it needs a mask,
        # and the matcher never consumes it (it could not be rolled back past its stop).
        ends = next((i for i, t in enumerate(drafts[:valid]) if t in self.eos), valid)
        bits = np.full((len(drafts) + 1, self.words), -1, dtype=np.int32)
        for i in range(ends + 1):
            fill_next_token_bitmask(m, bits, i)
            if i < ends:
                m.consume_token(drafts[i])
        if ends and not m.is_error():
            m.rollback(ends)
        self.seconds += time.perf_counter() - tic
        if self._failed():
            return Masks(self._end_only(len(drafts) + 1), 0)
        return Masks(bits, valid)

    def forced(self, limit: int) -> List[int]:
        """Up to `limit` tokens the grammar allows no alternative to, next."""
        if limit <= 0 or self.matcher.is_stopped() or self._failed():
            return []
        if self._forced is None:  # asked by the batch's policy and by the cycle: computed once
            tic = time.perf_counter()
            self._forced = self.matcher.compute_ff_tokens()
            self.seconds += time.perf_counter() - tic
        return [] if self._failed() else self._forced[:limit]

    def take_seconds(self) -> float:
        """The host seconds spent since the last call."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds

    def commit(self, tokens: Sequence[int]) -> None:
        """The sequence committed `tokens` (its masks allowed them, unless the engine has given up)."""
        self._forced = None
        if tokens and not self._failed() and not self.matcher.consume_tokens(list(tokens)) and not self._failed():
            self.error = "the grammar engine refused a token its own mask allowed"

    @property
    def done(self) -> bool:
        """The grammar takes nothing more (only an end-of-sequence token)."""
        return self.matcher.is_stopped()

    @property
    def accepting(self) -> bool:
        """What is committed so far is a complete output of the grammar."""
        return self.matcher.is_accepting()
