"""K/V caches of several sequences of different lengths, for one target pass over all of them.

mlx-lm's `BatchKVCache` keeps its sequences right-aligned: every sequence writes
its new rows at one shared column, and a shorter one is padded on the left. A
speculative cycle leaves each sequence with its own number of accepted rows, so
after a crop their ends differ again; realigning them (mlx-lm's `finalize` roll)
copies every cached row of every sequence, every cycle.

`RaggedKVCache` keeps sequence b in columns [0, ends[b]) instead and writes each
sequence's new rows at its own end (one scatter per layer). Cropping a sequence
moves its end back and copies nothing; the attention mask hides each sequence's
columns past its own end. The positions RoPE sees (`offset`) are the ends.

A sliding-window layer is held the same way, every row from position 0, and
its mask also hides what the window does: crops stay free where a ring buffer
would have to keep slack, at the memory of full attention while batched.
"""

from typing import List, Optional, Sequence

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache

from .caches import WindowCache
from .sequences import SequenceKV

STEP = 256  # columns the buffer grows by, as mlx-lm's KVCache: few reallocations, little waste


class RaggedKVCache:
    """One layer's keys and values for B sequences, sequence b in columns [0, ends[b])."""

    def __init__(self, ends: Sequence[int] = (), keys: Optional[mx.array] = None, values: Optional[mx.array] = None,
                 window: Optional[int] = None, slack: int = 0):
        """`window` (and the slack its single-sequence `WindowCache` keeps): a sliding-window layer."""
        self.keys, self.values = keys, values
        self.ends: List[int] = list(ends)
        self.window, self.slack = window, slack
        self._offset: Optional[mx.array] = None  # `ends` on the device, made once per change

    @classmethod
    def merge(cls, caches: Sequence[KVCache]) -> "RaggedKVCache":
        """The batch of single-sequence caches (one layer's), in order."""
        out = cls()
        out.extend(caches)
        return out

    @property
    def offset(self) -> mx.array:
        if self._offset is None:
            self._offset = mx.array(self.ends)
        return self._offset

    def _moved(self) -> None:
        self._offset = None

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def _reserve(self, columns: int, like: mx.array, like_values: mx.array) -> None:
        if columns <= self.capacity:
            return
        B, H, _, D = like.shape
        grown = -(-columns // STEP) * STEP
        k = mx.zeros((B, H, grown - self.capacity, D), like.dtype)
        v = mx.zeros((B, H, grown - self.capacity, like_values.shape[3]), like_values.dtype)
        if self.keys is None:
            self.keys, self.values = k, v
        else:
            self.keys = mx.concatenate([self.keys, k], axis=2)
            self.values = mx.concatenate([self.values, v], axis=2)

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None, **kwargs):
        """[B, 1, N, top] bool: new row j of sequence b sees its columns up to ends[b] + j (the
        last `window_size` of them in a sliding-window layer)."""
        top = max(self.ends) + N
        limit = self.offset[:, None, None, None] + mx.arange(N)[None, None, :, None]
        columns = mx.arange(top)[None, None, None, :]
        seen = columns <= limit
        if window_size is not None:
            seen = seen & (limit - columns < window_size)
        return seen

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        B, _, N, _ = keys.shape
        top = max(self.ends) + N
        self._reserve(top, keys, values)
        if min(self.ends) == max(self.ends):  # aligned: one slice for all
            e = self.ends[0]
            self.keys[..., e : e + N, :] = keys
            self.values[..., e : e + N, :] = values
        else:
            rows = (self.offset[:, None] + mx.arange(N)[None])[:, None, :, None]
            self.keys = mx.put_along_axis(self.keys, rows, keys, axis=2)
            self.values = mx.put_along_axis(self.values, rows, values, axis=2)
        self.ends = [e + N for e in self.ends]
        if self._offset is not None:  # every end moved alike: no new array from the host
            self._offset = self._offset + N
        return self.keys[..., :top, :], self.values[..., :top, :]

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Drop the last n rows of every sequence."""
        n = min(n, min(self.ends, default=0))
        self.ends = [e - n for e in self.ends]
        self._moved()
        return n

    def crop(self, drops: Sequence[int]) -> None:
        """Drop the last drops[b] rows of sequence b (no copy: the ends move back)."""
        self.ends = [e - min(d, e) for e, d in zip(self.ends, drops, strict=True)]
        self._moved()

    def keep_rows(self, rows: Sequence[Sequence[int]], width: int) -> None:
        """After a pass of `width` rows (a tree's nodes), sequence b keeps rows `rows[b]` of it
        (ascending) as the pass's first and drops the others: one gather and one scatter of the
        kept rows, for every sequence at once."""
        bases = [e - width for e in self.ends]
        K = max(len(r) for r in rows)
        if any(list(r) != list(range(len(r))) for r in rows):
            # Sequence b's row j comes from column bases[b] + rows[b][j]; past its own rows, from where it goes.
            src = mx.array([[b + i for i in r] + [b + j for j in range(len(r), K)] for b, r in zip(bases, rows)])
            dst = (mx.array(bases)[:, None] + mx.arange(K)[None])[:, None, :, None]
            src = src[:, None, :, None]
            self.keys = mx.put_along_axis(self.keys, dst, mx.take_along_axis(self.keys, src, axis=2), axis=2)
            self.values = mx.put_along_axis(self.values, dst, mx.take_along_axis(self.values, src, axis=2), axis=2)
        self.ends = [b + len(r) for b, r in zip(bases, rows)]
        self._moved()

    def filter(self, keep: Sequence[int]) -> None:
        """Keep sequences `keep` (indices, in that order); the buffer shrinks to what they use."""
        self.ends = [self.ends[i] for i in keep]
        self._moved()
        if self.keys is None:
            return
        if not keep:
            self.keys = self.values = None
            return
        columns = -(-max(max(self.ends), 1) // STEP) * STEP
        idx = mx.array(list(keep))
        self.keys = self.keys[idx, :, : min(columns, self.capacity)]
        self.values = self.values[idx, :, : min(columns, self.capacity)]

    def extend(self, caches: Sequence[KVCache]) -> None:
        """Append single-sequence caches (one layer's) as new sequences. One new buffer holds
        every sequence: the rows held already and the new ones are each copied into it once."""
        lengths = [c.offset if c.keys is not None else 0 for c in caches]
        ref = self if self.keys is not None else next((c for c in caches if c.keys is not None), None)
        if ref is None:  # no rows anywhere yet
            self.ends += lengths
            self._moved()
            return
        held = max(self.ends, default=0) if self.keys is not None else 0  # columns of rows held already
        columns = max(self.capacity, -(-max(lengths + [1]) // STEP) * STEP)
        B, H, D, M = len(self.ends) + len(caches), ref.keys.shape[1], ref.keys.shape[3], ref.values.shape[3]
        k = mx.zeros((B, H, columns, D), ref.keys.dtype)
        v = mx.zeros((B, H, columns, M), ref.values.dtype)
        if held:
            k[: len(self.ends), :, :held] = self.keys[..., :held, :]
            v[: len(self.ends), :, :held] = self.values[..., :held, :]
        for i, (c, n) in enumerate(zip(caches, lengths), start=len(self.ends)):
            if n:
                k[i : i + 1, :, :n] = c.keys[..., :n, :]
                v[i : i + 1, :, :n] = c.values[..., :n, :]
        self.keys, self.values = k, v
        self.ends += lengths
        self._moved()

    def join(self, other: "RaggedKVCache") -> None:
        """Append `other`'s sequences (every sequence holds rows: a prompt's at least)."""
        if self.keys is None:
            self.keys, self.values = other.keys, other.values
        else:
            columns = max(self.capacity, other.capacity)
            self._reserve(columns, self.keys, self.values)
            other._reserve(columns, other.keys, other.values)
            self.keys = mx.concatenate([self.keys, other.keys], axis=0)
            self.values = mx.concatenate([self.values, other.values], axis=0)
        self.ends = self.ends + other.ends
        self._moved()

    def extract(self, b: int):
        """Sequence b's rows as a single-sequence cache (a copy): a `KVCache`, or for a
        sliding-window layer a `WindowCache` holding the rows its window and slack keep."""
        n = self.ends[b]
        if self.window is not None:
            start = max(0, n - self.window - self.slack)
            return WindowCache.holding(mx.contiguous(self.keys[b : b + 1, :, start:n]),
                                       mx.contiguous(self.values[b : b + 1, :, start:n]), start,
                                       self.window, self.slack)
        c = KVCache()
        if n and self.keys is not None:
            c.keys = mx.contiguous(self.keys[b : b + 1, :, :n])
            c.values = mx.contiguous(self.values[b : b + 1, :, :n])
            c.offset = n
        return c

    @property
    def state(self):
        return self.keys, self.values

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes


def _from_zero(cache):
    """A single-sequence K/V cache as rows from position 0 (what `RaggedKVCache.extend` copies)."""
    if not isinstance(cache, WindowCache) or cache.keys is None:
        return cache
    out = KVCache()
    out.keys, out.values = cache.rows_from_zero()
    out.offset = cache.offset
    return out


def ragged_like(cache, ends: Sequence[int] = ()) -> RaggedKVCache:
    """An empty batch layer for sequences whose single-sequence cache is like `cache`."""
    if isinstance(cache, WindowCache):
        return RaggedKVCache(ends, window=cache.window, slack=cache.slack)
    return RaggedKVCache(ends)


def batch_of(cache, split: bool = False) -> object:
    """One sequence's cache (one layer's) as the first of a batch: with `split` (a target whose
    attention runs per sequence, `TargetAdapter.splits`) a `SequenceKV` holding it, else a
    `RaggedKVCache` for K/V (a sliding window's too); mlx-lm's `ArraysCache` (its own `merge`,
    `extend`, `filter`, `extract`) for a recurrent state."""
    if isinstance(cache, ArraysCache):
        return ArraysCache.merge([cache])
    if split:
        return SequenceKV([cache])
    out = ragged_like(cache)
    out.extend([_from_zero(cache)])
    return out


def add_to(batch, *caches) -> None:
    """Append sequences' caches (one layer's each) to the batch's: a padded batch is copied once for all."""
    if isinstance(batch, SequenceKV):
        batch.extend(caches)
    elif isinstance(batch, RaggedKVCache):
        batch.extend([_from_zero(c) for c in caches])
    else:
        batch.extend(ArraysCache.merge(list(caches)))
