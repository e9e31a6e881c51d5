"""K/V caches of several sequences, each sequence in a buffer of its own, for one target pass over
all of them.

Each sequence keeps the cache it decodes on alone (mlx-lm's `KVCache`, a `WindowCache` for a
sliding-window layer), so a batch holds what its sequences hold. A sequence that joins brings its
cache and one that leaves takes it: neither copies another's rows. A crop trims one sequence's
cache (no copy). The target's attention runs per sequence over its own cache, while its
projections and MLPs see every sequence's rows at once (`adapter.GroupedAttention`).

`ragged.RaggedKVCache` keeps a batch in one array padded to its longest sequence instead; it
stays for targets whose attention the adapter cannot run per sequence (layers sharing caches).
"""

from typing import List, Optional, Sequence

import mlx.core as mx

from ..errors import DFlashError
from .caches import WindowCache


class SequenceKV:
    """One layer's caches of B sequences, sequence b's in `caches[b]`."""

    def __init__(self, caches: Sequence = ()):
        self.caches: List = list(caches)

    @property
    def ends(self) -> List[int]:
        return [c.offset for c in self.caches]

    @property
    def offset(self) -> mx.array:
        """Each sequence's length: the position its next row is at."""
        return mx.array(self.ends)

    @property
    def window(self) -> Optional[int]:
        """The sliding window of the layer (None: full attention)."""
        c = self.caches[0] if self.caches else None
        return c.window if isinstance(c, WindowCache) else None

    def make_mask(self, N: int, **kwargs) -> tuple:
        """Each sequence's own mask for N new rows, as its cache makes it."""
        return tuple(c.make_mask(N, **kwargs) for c in self.caches)

    def update_and_fetch(self, keys, values):
        raise DFlashError("A batch held per sequence needs the target's attention run per sequence; "
                          "this layer's attention was not wrapped by the adapter.")

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Drop the last n rows of every sequence."""
        n = min(n, min(self.ends, default=0))
        for c in self.caches:
            c.trim(n)
        return n

    def crop(self, drops: Sequence[int]) -> None:
        """Drop the last drops[b] rows of sequence b (no copy: its cache's end moves back)."""
        for c, d in zip(self.caches, drops, strict=True):
            if d:
                c.trim(min(d, c.offset))

    def filter(self, keep: Sequence[int]) -> None:
        """Keep sequences `keep` (indices, in that order); the others' caches are let go."""
        self.caches = [self.caches[i] for i in keep]

    def extend(self, caches: Sequence) -> None:
        """Append single-sequence caches (one layer's) as new sequences: they are held, not copied."""
        self.caches += list(caches)

    def join(self, other: "SequenceKV") -> None:
        """Append `other`'s sequences."""
        self.extend(other.caches)

    def extract(self, b: int):
        """Sequence b's own cache (the batch's, not a copy: it is handed on as the sequence leaves)."""
        return self.caches[b]

    @property
    def state(self) -> list:
        """The arrays the sequences' caches hold (for `mx.eval`)."""
        return [(c.keys, c.values) for c in self.caches if c.keys is not None]

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.caches)
