"""The target's caches of a decoder's sequences: one sequence's own, or several's batched
(`target/sequences.py`, `target/ragged.py`)."""

from typing import List

from ..target.ragged import add_to, batch_of


class Caches:
    """The target's caches of a decoder's sequences, per layer: one sequence's own (the target's
    kinds, on which it decodes as a request alone does), or for several a batch's
    (`SequenceKV`s or `RaggedKVCache`s, batched `ArraysCache`s of recurrent states)."""

    def __init__(self, split: bool = False):
        self.layers: list = []
        self.batched = False
        self.split = split  # a batch holds each sequence's K/V apart (`target.sequences`)

    def add(self, tcache: list) -> None:
        """One sequence's caches join: the first keeps its own; a later one's are held beside the
        others' (`SequenceKV`), or its rows copied into the batch's (`RaggedKVCache`)."""
        if not self.layers:
            self.layers, self.batched = list(tcache), False
            return
        self._batch()
        for batch, c in zip(self.layers, tcache):
            add_to(batch, c)

    def join(self, batched: list) -> None:
        """Several sequences' batch caches join (a padded prefill's)."""
        if not self.layers:
            self.layers, self.batched = batched, True
            return
        self._batch()
        for batch, c in zip(self.layers, batched):
            batch.join(c)

    def of(self, b: int) -> list:
        """Sequence b's caches: its own (a batch that holds them apart hands them over), or a copy of
        its rows from a padded batch's."""
        return [c.extract(b) for c in self.layers] if self.batched else self.layers

    def keep_only(self, keep: List[int], count: int) -> None:
        """Of `count` sequences, those at indices `keep` stay; one left alone decodes on caches of its
        own again (`fit`)."""
        if not keep:
            self.layers, self.batched = [], False
        elif len(keep) < count:
            for c in self.layers:
                c.filter(keep)
        self.fit(len(keep))

    def fit(self, count: int) -> None:
        """`count` sequences hold the caches: one alone gets caches of its own again (the target's
        kinds, trees where they run): the ones it brought, or its rows copied once from a padded batch."""
        if self.batched and count == 1:
            self.layers, self.batched = [c.extract(0) for c in self.layers], False

    def _batch(self) -> None:
        """A sequence alone's caches made the first of a batch's (held, or its rows copied once into a
        padded batch)."""
        if not self.batched:
            self.layers, self.batched = [batch_of(c, self.split) for c in self.layers], True
