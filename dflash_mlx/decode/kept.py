"""What finished sequences computed, held until their answers are out and then kept in the
prompt cache (`cache/`); and what a sequence's sizer learnt, written when it ends."""

from typing import List

import mlx.core as mx

from .passes import caught_up, joined
from .running import Running


class Kept:
    """A decoder's finished sequences, for its prompt cache (None: nothing is kept)."""

    def __init__(self, pair, prompt_cache=None):
        self.pair, self.prompt_cache = pair, prompt_cache
        self.finished: List[tuple] = []  # (sequence, its caches, tokens they hold)

    def ended(self, seq: Running, tcache: list, rows: int) -> None:
        """A sequence ended: with a prompt cache, its caches (holding `rows` tokens of its history)
        are held for `keep`; what the pair's sizer learnt from it is written."""
        if self.prompt_cache is not None:
            self.finished.append((seq, tcache, rows))
        if seq.keeps_rates:
            self.pair.keep_rates()  # what the pair's sizers learnt outlives the process, as its cost curve does

    def keep(self) -> None:
        """Hand what finished sequences computed to the prompt cache: the caches hold every
        committed token but the last, and the drafter reads the taps it had not."""
        for seq, tcache, rows in self.finished:
            store(self.prompt_cache, self.pair.target, seq, tcache, rows)
        self.finished = []


def store(prompt_cache, target, seq: Running, tcache: list, rows: int) -> None:
    """A finished sequence's caches (holding `rows` tokens of its history) and its drafter's
    context (given the taps it has not read) kept in the prompt cache."""
    if seq.taps:
        seq.source.add_context(seq.dstate, joined(caught_up(seq.source, seq.dstate, seq.take_taps())))
    mx.eval([c.state for c in tcache], seq.source.arrays(seq.dstate))
    prompt_cache.store(target, seq.source, seq.dstate, seq.history[:rows], tcache, seq.at_prompt)
