"""One sequence's place in its grammar: the masks of a block's positions, the tokens the grammar
forces next, and its advance over committed tokens.

A drafted block [last, d_0 .. d_k-1] is verified on rows 0..k; row i's mask is the grammar's
after the committed tokens and d_0..d_i-1. Drafts past the first one the grammar forbids are
never accepted (no allowed pick equals a forbidden draft), so their rows need no mask.
"""

from dataclasses import dataclass
from typing import List, Sequence

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

    def masks(self, drafts: Sequence[int] = ()) -> Masks:
        """The masks of a block's rows after the committed tokens, each draft in turn (the
        matcher is left where it was)."""
        drafts = list(drafts)
        m = self.matcher
        valid = m.validate_tokens(drafts) if drafts else 0
        # An end-of-sequence draft the grammar allows ends the text: no row after it needs a mask,
        # and the matcher never consumes it (it could not be rolled back past its stop).
        ends = next((i for i, t in enumerate(drafts[:valid]) if t in self.eos), valid)
        bits = np.full((len(drafts) + 1, self.words), -1, dtype=np.int32)
        for i in range(ends + 1):
            fill_next_token_bitmask(m, bits, i)
            if i < ends:
                m.consume_token(drafts[i])
        if ends:
            m.rollback(ends)
        return Masks(bits, valid)

    def forced(self, limit: int) -> List[int]:
        """Up to `limit` tokens the grammar allows no alternative to, next."""
        if limit <= 0 or self.matcher.is_stopped():
            return []
        return self.matcher.compute_ff_tokens()[:limit]

    def commit(self, tokens: Sequence[int]) -> None:
        """The sequence committed `tokens` (its masks allowed them)."""
        if tokens and not self.matcher.consume_tokens(list(tokens)):
            raise RuntimeError(f"a committed token broke the grammar: {self.matcher.get_error()}")

    @property
    def done(self) -> bool:
        """The grammar takes nothing more (only an end-of-sequence token)."""
        return self.matcher.is_stopped()

    @property
    def accepting(self) -> bool:
        """What is committed so far is a complete output of the grammar."""
        return self.matcher.is_accepting()
