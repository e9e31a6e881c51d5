"""The drafter's blocks for every sequence of a batch in one pass.

Each sequence keeps the drafter context it drafts on alone (a `DraftCache` per drafter layer), and
the batch holds those caches side by side (`DraftCaches`): a sequence that joins or leaves copies
nothing of the others', and a window or a context bound drops rows as it does alone. A cycle
commits each sequence's new context rows (right-padded to the longest in the projections, each
sequence's own rows committed) and runs every block [B, L] through the drafter once: the
projections and MLPs read the drafter's weights once for the whole batch, and each block attends
over its own sequence's context only. A drafter whose context is bounded to its first and last
rows (`DFlashDrafter.batchable`) drafts per sequence.
"""

from typing import List, Optional, Sequence

import mlx.core as mx

from .drafter import DraftCache, DraftCaches


class DraftBatch:
    """A DFlash draft source's drafter over many sequences: their contexts (each one's own
    `DraftCache`s, held side by side and handed back by `extract`) and one pass for all blocks."""

    def __init__(self, source):
        """`source`: a `draft.source.DFlashDraftSource` whose drafter is `batchable`."""
        self.source, self.drafter, self.target = source, source.drafter, source.target
        self.cache = [DraftCaches() for _ in self.drafter.layers]

    def __len__(self) -> int:
        return len(self.cache[0].caches)

    def join(self, contexts: Sequence[List[DraftCache]]) -> None:
        """Append sequences, each given as its drafter layers' `DraftCache`s (held, not copied)."""
        for layer, c in enumerate(self.cache):
            c.caches += [ctx[layer] for ctx in contexts]

    def filter(self, keep: Sequence[int]) -> None:
        for c in self.cache:
            c.caches = [c.caches[b] for b in keep]

    def extract(self, b: int) -> List[DraftCache]:
        """Sequence b's context: its own `DraftCache`s."""
        return [c.caches[b] for c in self.cache]

    def _padded(self, hiddens: Sequence[Optional[mx.array]]):
        """New context rows per sequence ([1, r, D] or None) as one right-padded [B, R, D], and each r."""
        counts = [0 if h is None else h.shape[1] for h in hiddens]
        R = max(counts)
        if R == 0:
            return None, counts
        like = next(h for h in hiddens if h is not None)
        rows = [mx.zeros((1, R, like.shape[2]), like.dtype) if h is None else
                h if h.shape[1] == R else mx.concatenate([h, mx.zeros((1, R - h.shape[1], h.shape[2]), h.dtype)], 1)
                for h in hiddens]
        return mx.concatenate(rows), counts

    def add_context(self, hiddens: Sequence[Optional[mx.array]]) -> None:
        """Commit each sequence's new context rows without drafting."""
        hidden, counts = self._padded(hiddens)
        if hidden is not None:
            self.drafter.ragged(None, hidden, counts, self.cache)

    def propose(self, lasts: mx.array, hiddens: Sequence[Optional[mx.array]], width: int,
                which: Optional[Sequence[int]] = None) -> mx.array:
        """Draft logits [B, width - 1, V]: each sequence's new context rows committed, then its
        block [last, MASK, ...] of the source's `block_rows(width)` rows. With `which`, only
        those sequences (their `lasts` and `hiddens`, in that order): the others' contexts wait."""
        hidden, counts = self._padded(hiddens)
        if which is not None:
            cache = [DraftCaches([c.caches[b] for b in which]) for c in self.cache]
            return self._propose(lasts, hidden, counts, width, cache)
        return self._propose(lasts, hidden, counts, width, self.cache)

    def _propose(self, lasts, hidden, counts, width: int, cache) -> mx.array:
        n = self.source.block_rows(width)
        block = mx.concatenate([lasts[:, None], mx.full((lasts.shape[0], n - 1), self.source.mask_token_id,
                                                          lasts.dtype)], axis=1)
        emb = self.target.embed(block)
        if self.source.scale != 1.0:
            emb = emb * self.source.scale
        h = self.drafter.ragged(emb, hidden, counts, cache)[:, 1:width]
        return self.drafter.finish_logits(self.target.head(h))
