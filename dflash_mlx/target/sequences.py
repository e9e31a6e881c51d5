"""K/V caches of several sequences in parts, for one target pass over all of them.

A part is one sequence's own cache (mlx-lm's `KVCache`, a `WindowCache` for a sliding-window
layer), the cache it decodes on alone, or a group of sequences of similar lengths held in one
padded array (`ragged.RaggedKVCache`). A batch so holds about what its sequences hold: a long
prompt is a part of its own, and short ones beside it are not padded to its length. A sequence
that joins brings its cache as a part of its own, and one held apart that leaves takes it:
neither copies another's rows. A crop moves ends back (no copy). The target's attention runs
per part over its own cache, while its projections and MLPs see every sequence's rows at once
(`adapter.GroupedAttention`). `decode.caches` decides which sequences share a part.
"""

from typing import List, Optional, Sequence, Tuple

import mlx.core as mx

from ..errors import DFlashError
from .caches import WindowCache


def grouped(part) -> bool:
    """Whether a part holds several sequences in one padded array (`ragged.RaggedKVCache`)."""
    return isinstance(getattr(part, "ends", None), list)


def _ends(part) -> List[int]:
    return part.ends if grouped(part) else [part.offset]


class PartMasks(tuple):
    """Each part's mask, and how the model asked for them (a part that attends fewer rows makes its own)."""

    def __new__(cls, masks, kwargs: dict):
        out = super().__new__(cls, masks)
        out.kwargs = kwargs
        return out


class SequenceKV:
    """One layer's caches of B sequences in parts: `parts[p]` holds the sequences `members[p]`
    (indices into the batch, in the part's own order)."""

    def __init__(self, parts: Sequence = (), members: Optional[Sequence[Sequence[int]]] = None):
        self.parts: List = list(parts)
        if members is None:
            members, start = [], 0
            for part in self.parts:
                n = len(_ends(part))
                members.append(list(range(start, start + n)))
                start += n
        self.members: List[List[int]] = [list(m) for m in members]

    def __len__(self) -> int:
        return sum(len(m) for m in self.members)

    def where(self, b: int) -> Tuple[int, int]:
        """(part, index within it) of sequence b."""
        return next((p, m.index(b)) for p, m in enumerate(self.members) if b in m)

    @property
    def ends(self) -> List[int]:
        out = [0] * len(self)
        for part, m in zip(self.parts, self.members):
            for b, e in zip(m, _ends(part)):
                out[b] = e
        return out

    @property
    def offset(self) -> mx.array:
        """Each sequence's length: the position its next row is at."""
        return mx.array(self.ends)

    @property
    def window(self) -> Optional[int]:
        """The sliding window of the layer (None: full attention)."""
        c = self.parts[0] if self.parts else None
        return c.window if isinstance(c, WindowCache) or grouped(c) else None

    def make_mask(self, N: int, **kwargs) -> "PartMasks":
        """Each part's own mask for N new rows, as its cache makes it."""
        return PartMasks((c.make_mask(N, **kwargs) for c in self.parts), kwargs)

    def update_and_fetch(self, keys, values):
        raise DFlashError("A batch held in parts needs the target's attention run per part; "
                          "this layer's attention was not wrapped by the adapter.")

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Drop the last n rows of every sequence."""
        n = min(n, min(self.ends, default=0))
        for c in self.parts:
            c.trim(n)
        return n

    def crop(self, drops: Sequence[int]) -> None:
        """Drop the last drops[b] rows of sequence b (no copy: its end moves back)."""
        if len(drops) != len(self):
            raise ValueError(f"{len(drops)} drops for {len(self)} sequences")
        for c, m in zip(self.parts, self.members):
            if grouped(c):
                if any(drops[b] for b in m):
                    c.crop([drops[b] for b in m])
            elif drops[m[0]]:
                c.trim(min(drops[m[0]], c.offset))

    def keep_rows_each(self, layers: Sequence["SequenceKV"], rows: Sequence[Sequence[int]], width: int,
                       keep_rows) -> None:
        """After a tree pass over `width` tokens, sequence b keeps rows `rows[b]` of it, in every
        layer of `layers` (this one's parts, each laid out alike): a group's rows moved in its
        array, a sequence's own by `keep_rows` (`caches.keep_rows`)."""
        for p, m in enumerate(self.members):
            if grouped(self.parts[p]):
                for layer in layers:
                    layer.parts[p].keep_rows([rows[b] for b in m], width)
            else:
                keep_rows([layer.parts[p] for layer in layers], list(rows[m[0]]), width)

    def taken(self, widths: Sequence[int]) -> List[int]:
        """Per sequence, the rows of a pass's block its K/V took, where sequence b verified the first
        widths[b]: a sequence in a part of its own its own (the pass narrows it: `adapter.GroupedAttention`),
        one in a group every row of the block."""
        out = [max(widths)] * len(self)
        for m in self.members:
            if len(m) == 1:
                out[m[0]] = widths[m[0]]
        return out

    def filter(self, keep: Sequence[int]) -> None:
        """Keep sequences `keep` (indices, in that order): a part held apart is let go or kept as it
        is; a group that loses sequences is copied once (its own rows only)."""
        new = {b: i for i, b in enumerate(keep)}
        parts, members = [], []
        for c, m in zip(self.parts, self.members):
            kept = sorted((j for j, b in enumerate(m) if b in new), key=lambda j: new[m[j]])
            if not kept:
                continue
            if grouped(c) and kept != list(range(len(m))):
                c.filter(kept)
            parts.append(c)
            members.append([new[m[j]] for j in kept])
        self.parts, self.members = parts, members

    def extend(self, caches: Sequence) -> None:
        """Append single-sequence caches (one layer's) as new sequences, each a part of its own:
        they are held, not copied."""
        B = len(self)
        self.parts += list(caches)
        self.members += [[B + i] for i in range(len(caches))]

    def join(self, other: "SequenceKV") -> None:
        """Append `other`'s sequences, in its parts."""
        B = len(self)
        self.parts += other.parts
        self.members += [[B + b for b in m] for m in other.members]

    def extract(self, b: int):
        """Sequence b's own cache: held apart, the batch's (not a copy: it is handed on as the
        sequence leaves); in a group, a copy of its rows."""
        p, j = self.where(b)
        c = self.parts[p]
        return c.extract(j) if grouped(c) else c

    @property
    def state(self) -> list:
        """The arrays the parts hold (for `mx.eval`)."""
        return [(c.keys, c.values) for c in self.parts if c.keys is not None]

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.parts)
