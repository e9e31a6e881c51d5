"""The drafter's blocks for every sequence of a batch in one pass.

Each sequence's committed drafter context lives side by side with the others'
in a `RaggedKVCache` per drafter layer (sequence b in columns [0, ends[b])).
A cycle commits each sequence's new context rows (right-padded to the longest,
the padding cropped after) and runs every block [B, L] through the drafter
once; a block's rows are scratch, written at its sequence's end and cropped
after, and each block sees its own sequence's columns only. One pass reads the
drafter's weights once for the whole batch, where a pass per sequence reads
them B times.

Column c of a sequence holds its context position c, so causal and windowed
layers mask by position as they do alone; rows a window has left behind stay
(masked) until the sequence leaves. A drafter whose context is bounded to its
first and last rows (`DFlashDrafter.batchable`) drafts per sequence.
"""

from typing import List, Optional, Sequence

import mlx.core as mx

from ..target.ragged import RaggedKVCache
from .drafter import DraftCache, visible


class RaggedDraftCache:
    """One drafter layer's context for B sequences, with the `DraftCache` interface the
    drafter's attention uses (`DFlashDrafter.ragged` sets `counts` before each pass)."""

    def __init__(self):
        self.kv = RaggedKVCache()
        self.counts: List[int] = []  # each sequence's real rows of the padded context being committed

    @property
    def offset(self) -> mx.array:
        """Each sequence's committed context rows (its block's first position)."""
        return self.kv.offset

    def update_and_fetch(self, ctx_kv, block_kv):
        """Commit each sequence's context rows, write its block after them as scratch and
        return every column (the block's cropped again: nothing but the context is kept)."""
        (ck, cv), (bk, bv) = ctx_kv, block_kv
        if ck is not None:
            self.kv.update_and_fetch(ck, cv)
            self.kv.crop([ck.shape[2] - n for n in self.counts])
        if bk is None:
            return None
        L = bk.shape[2]
        keys, values = self.kv.update_and_fetch(bk, bv)
        self.kv.crop([L] * len(self.kv.ends))
        return keys, values

    def block_mask(self, L: int, S: int, q_start: mx.array, causal: bool, window: Optional[int]) -> mx.array:
        """[B, 1, L, S]: block row j of sequence b (at position q_start[b] + j) sees the columns of its
        own context and block that its layer's mask allows."""
        q_pos = q_start[:, None] + mx.arange(L)[None]
        k_pos = mx.arange(S)
        mask = k_pos[None, None] < (q_start + L)[:, None, None]
        seen = visible(q_pos, k_pos, causal, window)
        return (mask if seen is None else mask & seen)[:, None]


def _from_zero(c: DraftCache):
    """`c` with its rows at their positions from 0 (a window may have dropped the first `start`)."""
    if c.start == 0 or c.keys is None:
        return c
    out = DraftCache()
    B, H, _, D = c.keys.shape
    out.keys = mx.concatenate([mx.zeros((B, H, c.start, D), c.keys.dtype), c.keys[..., : c.offset, :]], axis=2)
    out.values = mx.concatenate([mx.zeros((B, H, c.start, c.values.shape[3]), c.values.dtype),
                                 c.values[..., : c.offset, :]], axis=2)
    out.offset = c.start + c.offset
    return out


class DraftBatch:
    """A DFlash draft source's drafter over many sequences: their contexts (joined from
    each one's own `DraftCache`s, handed back by `extract`) and one pass for all blocks."""

    def __init__(self, source):
        """`source`: a `draft.source.DFlashDraftSource` whose drafter is `batchable`."""
        self.source, self.drafter, self.target = source, source.drafter, source.target
        self.cache = [RaggedDraftCache() for _ in self.drafter.layers]

    def __len__(self) -> int:
        return len(self.cache[0].kv.ends)

    def join(self, contexts: Sequence[List[DraftCache]]) -> None:
        """Append sequences, each given as its drafter layers' `DraftCache`s (rows copied once;
        rows a window dropped become zeros, which the window hides)."""
        for layer, c in enumerate(self.cache):
            c.kv.extend([_from_zero(ctx[layer]) for ctx in contexts])

    def filter(self, keep: Sequence[int]) -> None:
        for c in self.cache:
            c.kv.filter(keep)

    def extract(self, b: int) -> List[DraftCache]:
        """Sequence b's context as its own `DraftCache`s (a copy)."""
        out = []
        for layer, c in zip(self.drafter.layers, self.cache):
            kv = c.kv.extract(b)
            d = DraftCache(layer.self_attn.window, self.drafter.context_bound)
            d.keys, d.values, d.offset = kv.keys, kv.values, kv.offset
            out.append(d)
        return out

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

    def propose(self, lasts: mx.array, hiddens: Sequence[Optional[mx.array]], width: int) -> mx.array:
        """Draft logits [B, width - 1, V]: each sequence's new context rows committed, then its
        block [last, MASK, ...] of the source's `block_rows(width)` rows."""
        hidden, counts = self._padded(hiddens)
        n = self.source.block_rows(width)
        block = mx.concatenate([lasts[:, None], mx.full((lasts.shape[0], n - 1), self.source.mask_token_id,
                                                          lasts.dtype)], axis=1)
        emb = self.target.embed(block)
        if self.source.scale != 1.0:
            emb = emb * self.source.scale
        h = self.drafter.ragged(emb, hidden, counts, self.cache)[:, 1:width]
        return self.drafter.finish_logits(self.target.head(h))
