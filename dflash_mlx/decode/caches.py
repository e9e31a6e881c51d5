"""The target's caches of a decoder's sequences: one sequence's own, or several's batched
(`target/sequences.py`, `target/ragged.py`)."""

from typing import List, Optional

from mlx_lm.models.cache import ArraysCache

from ..target.ragged import RaggedKVCache, add_to, batch_of
from ..target.sequences import SequenceKV

# A batch's K/V is held per sequence (`SequenceKV`) once one array padded to its longest sequence
# would hold SPLIT_WASTE times the rows its sequences hold: one 16k-token prompt beside seven
# 512-token ones holds 6.7x. Below, one padded array (`RaggedKVCache`): per-sequence attention costs
# a few small operations per sequence and layer, which a batch of similar lengths does not repay
# (on the CPU a plain step of seven 512-token sequences takes 1.5x; benchmarks/serving.md).
SPLIT_WASTE = 1.5
# A batch held per sequence goes back to one padded array below this waste (a margin, so that a
# batch near the threshold does not change layouts back and forth, each change a copy).
SPLIT_BACK = 1.2


def waste(lengths: List[int]) -> float:
    """Rows one array padded to the longest sequence holds, over the rows the sequences hold."""
    return len(lengths) * max(lengths) / max(1, sum(lengths))


class Caches:
    """The target's caches of a decoder's sequences, per layer: one sequence's own (the target's
    kinds, on which it decodes as a request alone does), or for several a batch's: `SequenceKV`s
    (each sequence's own K/V held side by side, where the target `splits` and one padded array would
    waste `SPLIT_WASTE`) or `RaggedKVCache`s (one padded array), and batched `ArraysCache`s of
    recurrent states."""

    def __init__(self, split: bool = False):
        self.layers: list = []
        self.batched = False
        self.split = split  # the target can hold a batch's K/V per sequence (`TargetAdapter.splits`)

    @property
    def apart(self) -> bool:
        """Whether the batch holds each sequence's K/V apart now."""
        return self.batched and any(isinstance(c, SequenceKV) for c in self.layers)

    def lengths(self) -> List[int]:
        """Each sequence's rows (none where no layer holds K/V)."""
        kv = self._kv()
        if kv is None:
            return []
        return kv.ends if self.batched else [kv.offset]

    def add(self, *tcaches: list) -> None:
        """Sequences' caches join: a first one alone keeps its own; later ones' are held beside the
        others' (`SequenceKV`), or their rows copied into the batch's (`RaggedKVCache`, once for all)."""
        if not self.layers:
            self.layers, self.batched = list(tcaches[0]), False
            tcaches = tcaches[1:]
        if not tcaches:
            return
        kvs = [self._kv(t) for t in tcaches]
        self._fit_layout(self.lengths() + [kv.offset for kv in kvs if kv is not None])
        for i, batch in enumerate(self.layers):
            add_to(batch, *(t[i] for t in tcaches))

    def join(self, batched: list) -> None:
        """Several sequences' batch caches join (a prefill of several prompts')."""
        apart = next((c for c in batched if isinstance(c, SequenceKV)), None)
        if apart is not None:  # each sequence's own caches, held in the layout the lengths call for
            self.add(*([c.extract(b) for c in batched] for b in range(len(apart.caches))))
            return
        if not self.layers:
            self.layers, self.batched = batched, True
            return
        self._fit_layout(self.lengths())
        for batch, c in zip(self.layers, batched):
            batch.join(c)

    def of(self, b: int) -> list:
        """Sequence b's caches: its own (a batch that holds them apart hands them over), or a copy of
        its rows from a padded batch's."""
        return [c.extract(b) for c in self.layers] if self.batched else self.layers

    def keep_only(self, keep: List[int], count: int) -> None:
        """Of `count` sequences, those at indices `keep` stay; one left alone decodes on caches of its
        own again (`fit`), several in the layout their lengths call for."""
        if not keep:
            self.layers, self.batched = [], False
        elif len(keep) < count:
            for c in self.layers:
                c.filter(keep)
            if len(keep) > 1:
                self._fit_layout(self.lengths())
        self.fit(len(keep))

    def fit(self, count: int) -> None:
        """`count` sequences hold the caches: one alone gets caches of its own again (the target's
        kinds, trees where they run): the ones it brought, or its rows copied once from a padded batch."""
        if self.batched and count == 1:
            self.layers, self.batched = [c.extract(0) for c in self.layers], False

    def _fit_layout(self, lengths: List[int]) -> None:
        """Hold the batch (made from a sequence alone's caches where there is none yet) in the layout
        sequences of these lengths call for, its rows copied once where it changes."""
        apart = self.split and bool(lengths) and waste(lengths) > (SPLIT_BACK if self.apart else SPLIT_WASTE)
        if not self.batched:
            self.layers, self.batched = [batch_of(c, apart) for c in self.layers], True
        elif apart != self.apart:
            self.layers = [_relaid(c, apart) for c in self.layers]

    def _kv(self, layers: Optional[list] = None):
        """The first layer holding K/V (of `layers`, else of the decoder's), or None."""
        return next((c for c in (self.layers if layers is None else layers) if not isinstance(c, ArraysCache)), None)


def _relaid(layer, apart: bool):
    """A batch layer in the other layout: each sequence's rows copied once (recurrent states stay)."""
    if apart and isinstance(layer, RaggedKVCache):
        return SequenceKV([layer.extract(b) for b in range(len(layer.ends))])
    if not apart and isinstance(layer, SequenceKV):
        out = batch_of(layer.caches[0], False)
        add_to(out, *layer.caches[1:])
        return out
    return layer
