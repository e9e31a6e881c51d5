"""The target's caches of a decoder's sequences: one sequence's own, or several's batched
(`target/sequences.py`, `target/ragged.py`)."""

from typing import List, Optional, Sequence

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

from ..target.ragged import RaggedKVCache, add_to, batch_of
from ..target.sequences import SequenceKV, grouped

# What one part of a batch costs beside the rows it attends, in rows of K/V: a part runs the
# model's attention code once (a few small operations per layer), a padded row is attended for
# nothing. On the CPU a part of the widened pair costs about as much as 120 columns of a plain
# step (2 ms against 18 us a column, OpenBLAS, float32); on a GPU columns are cheaper and launches
# dearer. A 16k-token prompt beside 512-token ones is a part of its own at any such value; prompts
# within about a thousand tokens of each other share one padded array.
PART_ROWS = 1024
# A batch is laid out again (its parts' sequences regrouped, each sequence whose part changes copied
# once) once its layout costs this many rows more than the best one. Short of that, only sequences
# held apart are grouped among themselves (each copies its own rows once, nobody else's): a few
# groups of similar lengths are cheaper than copying a group that holds many.
REGROUP_ROWS = 2 * PART_ROWS


def kv_bytes_per_token(layers: list) -> int:
    """Bytes of keys and values a token beyond a sliding window adds to what attention reads, over one
    sequence's caches (`layers`, per layer): its full-attention layers' (a sliding-window layer reads
    its window whatever the length)."""
    total = 0
    for c in layers:
        k, v = getattr(c, "keys", None), getattr(c, "values", None)
        if getattr(c, "window", None) is None and isinstance(k, mx.array) and isinstance(v, mx.array):
            total += k.shape[1] * k.shape[3] * k.dtype.size + v.shape[1] * v.shape[3] * v.dtype.size
    return total


def waste(lengths: List[int]) -> float:
    """Rows one array padded to the longest sequence holds, over the rows the sequences hold."""
    return len(lengths) * max(lengths) / max(1, sum(lengths))


def cost(groups: Sequence[Sequence[int]], lengths: Sequence[int]) -> int:
    """A layout's cost in rows: each group padded to its longest sequence, `PART_ROWS` a part."""
    return sum(len(g) * max(lengths[b] for b in g) + PART_ROWS for g in groups)


def best_groups(lengths: Sequence[int], among: Optional[Sequence[int]] = None) -> List[List[int]]:
    """The sequences (indices; `among` these, default all) in the groups of least `cost`: runs of
    similar lengths (the best layout groups neighbours in length order, so a search over those
    runs finds it)."""
    order = sorted(range(len(lengths)) if among is None else among, key=lambda b: lengths[b])
    best, cut = [0] + [None] * len(order), [0] * (len(order) + 1)
    for i in range(1, len(order) + 1):
        longest = lengths[order[i - 1]]
        for j in range(i):
            c = best[j] + (i - j) * longest + PART_ROWS
            if best[i] is None or c < best[i]:
                best[i], cut[i] = c, j
    groups, i = [], len(order)
    while i:
        groups.append(sorted(order[cut[i] : i]))
        i = cut[i]
    return sorted(groups)


def one_part(lengths: Sequence[int]) -> bool:
    """Whether sequences of `lengths` are best held in one part (`best_groups`): one padded array."""
    return len(best_groups(lengths)) == 1


class Caches:
    """The target's caches of a decoder's sequences, per layer: one sequence's own (the target's
    kinds, on which it decodes as a request alone does), or for several a batch's: K/V in parts
    (`SequenceKV`: sequences of similar lengths in one padded array, a long one apart), or in one
    padded array (`RaggedKVCache`: targets whose attention cannot run per part, and batches whose
    lengths are alike), and batched `ArraysCache`s of recurrent states."""

    def __init__(self, split: bool = False):
        self.layers: list = []
        self.batched = False
        self.split = split  # the target can hold a batch's K/V in parts (`TargetAdapter.splits`)

    @property
    def apart(self) -> bool:
        """Whether the batch holds its K/V in several parts now."""
        return self.batched and any(isinstance(c, SequenceKV) for c in self.layers)

    def groups(self) -> List[List[int]]:
        """The sequences each part of the batch holds (one group where its K/V is one array)."""
        kv = self._kv()
        if kv is None or not self.batched:
            return [[0]] if self.layers else []
        return [list(m) for m in kv.members] if isinstance(kv, SequenceKV) else [list(range(len(kv.ends)))]

    def kv_bytes_per_token(self) -> int:
        """Bytes of keys and values a long sequence's token adds to what attention reads (its
        full-attention layers')."""
        return kv_bytes_per_token([c.parts[0] if isinstance(c, SequenceKV) else c for c in self.layers])

    def columns(self) -> int:
        """The K/V rows the batch's attention reads for each row of a block: every sequence's, in
        its part (padded to its group's longest)."""
        lengths = self.lengths()
        return sum(len(g) * max(lengths[b] for b in g) for g in self.groups()) if lengths else 0

    def alone(self) -> List[bool]:
        """Per sequence, whether its K/V is a part of its own in a batch held in parts."""
        out = [False] * len(self.lengths())
        for g in self.groups() if self.apart else []:
            if len(g) == 1:
                out[g[0]] = True
        return out

    def lengths(self) -> List[int]:
        """Each sequence's rows (none where no layer holds K/V)."""
        kv = self._kv()
        if kv is None:
            return []
        return kv.ends if self.batched else [kv.offset]

    def add(self, *tcaches: list) -> None:
        """Sequences' caches join: a first one alone keeps its own; later ones' are held as parts of
        their own (`SequenceKV`), or their rows copied into the batch's (`RaggedKVCache`, once for all)."""
        if not self.layers:
            self.layers, self.batched = list(tcaches[0]), False
            tcaches = tcaches[1:]
        if not tcaches:
            return
        if not self.batched:
            self.layers, self.batched = [batch_of(c, self.split) for c in self.layers], True
        if self.split:
            self.layers = [_as_parts(c) for c in self.layers]
        for i, batch in enumerate(self.layers):
            add_to(batch, *(t[i] for t in tcaches))
        self._regroup()

    def join(self, batched: list) -> None:
        """Several sequences' batch caches join (a prefill of several prompts')."""
        apart = next((c for c in batched if isinstance(c, SequenceKV)), None)
        if apart is not None:  # each sequence's own caches, held in the layout the lengths call for
            self.add(*([c.extract(b) for c in batched] for b in range(len(apart))))
            return
        held = len(self.lengths())
        fresh = range(held, held + len(self._kv(batched).ends)) if self.layers else ()
        if not self.layers:
            self.layers, self.batched = batched, True
        else:
            if not self.batched:
                self.layers, self.batched = [batch_of(c, self.split) for c in self.layers], True
            for i, c in enumerate(batched):
                if self.split and not isinstance(c, ArraysCache):
                    self.layers[i] = _as_parts(self.layers[i])
                    self.layers[i].join(SequenceKV([c]))
                else:
                    self.layers[i].join(c)
        self._regroup(fresh)

    def of(self, b: int) -> list:
        """Sequence b's caches: its own (a part of its own is handed over), or a copy of its rows
        from a padded group's."""
        return [c.extract(b) for c in self.layers] if self.batched else self.layers

    def keep_only(self, keep: List[int], count: int) -> None:
        """Of `count` sequences, those at indices `keep` stay; one left alone decodes on caches of its
        own again (`fit`), several in the layout their lengths call for."""
        if not keep:
            self.layers, self.batched = [], False
        elif len(keep) < count or keep != list(range(count)):
            for c in self.layers:
                c.filter(keep)
            if len(keep) > 1:
                self._regroup()
        self.fit(len(keep))

    def fit(self, count: int) -> None:
        """`count` sequences hold the caches: one alone gets caches of its own again (the target's
        kinds, trees where they run): the ones it brought, or its rows copied once from a padded batch."""
        if self.batched and count == 1:
            self.layers, self.batched = [c.extract(0) for c in self.layers], False

    def _regroup(self, fresh: Sequence[int] = ()) -> None:
        """Where the batch's K/V is held in parts, lay it out again in `best_groups` once its layout
        costs `REGROUP_ROWS` more (the parts whose sequences stay together are kept as they are, the
        others' sequences copied once); else group the sequences held apart, and those of a group
        that has just joined (`fresh`: its array was made for the join), among themselves where that
        costs less. A layout of one group is one padded array."""
        if not (self.split and self.batched):
            return
        lengths, now = self.lengths(), self.groups()
        if not lengths:
            return
        best = best_groups(lengths)
        fresh = set(fresh)
        fixed = [g for g in now if len(g) > 1 and not set(g) <= fresh]
        loose = [b for g in now if len(g) == 1 or set(g) <= fresh for b in g]
        light = sorted(fixed + best_groups(lengths, loose))
        if cost(now, lengths) > cost(best, lengths) + REGROUP_ROWS:
            want = best
        elif cost(light, lengths) < cost(now, lengths):
            want = light
        else:
            want = None
        if want is not None:
            self.layers = [_regrouped(c, want) if isinstance(c, SequenceKV) else c for c in self.layers]
        self.layers = [_unwrapped(c) for c in self.layers]

    def _kv(self, layers: Optional[list] = None):
        """The first layer holding K/V (of `layers`, else of the decoder's), or None."""
        return next((c for c in (self.layers if layers is None else layers) if not isinstance(c, ArraysCache)), None)


def _as_parts(layer):
    """A batch layer's K/V as parts (one padded array becomes one part; nothing is copied)."""
    return SequenceKV([layer]) if isinstance(layer, RaggedKVCache) else layer


def _unwrapped(layer):
    """A layer held in one padded part as that array, in the batch's order."""
    if isinstance(layer, SequenceKV) and len(layer.parts) == 1 and grouped(layer.parts[0]):
        if layer.members[0] == list(range(len(layer))):
            return layer.parts[0]
    return layer


def _regrouped(layer: SequenceKV, groups: List[List[int]]) -> SequenceKV:
    """`layer` in parts holding `groups`: a part that holds a group already is kept; each other
    group's sequences are copied once into an array of their own (one alone keeps, or gets, its own cache)."""
    held = {tuple(sorted(m)): (p, m) for p, m in zip(layer.parts, layer.members)}
    parts, members = [], []
    for g in groups:
        if tuple(g) in held:
            p, m = held[tuple(g)]
        else:
            own = [layer.extract(b) for b in g]
            p, m = own[0], g
            if len(g) > 1:
                p = batch_of(own[0], False)
                add_to(p, *own[1:])
        parts.append(p)
        members.append(list(m))
    return SequenceKV(parts, members)
