"""The target's caches of a decoder's sequences: one sequence's own, or several's batched
(`target/ragged.py`)."""

from typing import List

from ..target.ragged import add_to, batch_of


class Caches:
    """The target's caches of a decoder's sequences, per layer: one sequence's own (the target's
    kinds, on which it decodes as a request alone does), or for several a batch's
    (`RaggedKVCache`s, batched `ArraysCache`s of recurrent states)."""

    def __init__(self):
        self.layers: list = []
        self.batched = False

    def add(self, tcache: list) -> None:
        """One sequence's caches join: the first keeps its own, a later one's rows are copied in."""
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
        """Sequence b's caches (a copy of its rows where they are a batch's)."""
        return [c.extract(b) for c in self.layers] if self.batched else self.layers

    def keep_only(self, keep: List[int], count: int) -> None:
        """Of `count` sequences, those at indices `keep` stay; one left alone gets caches of its own
        again (its rows copied once), the target's kinds, trees where they run."""
        if not keep:
            self.layers, self.batched = [], False
        elif len(keep) < count:
            for c in self.layers:
                c.filter(keep)
        self.fit(len(keep))

    def fit(self, count: int) -> None:
        """`count` sequences hold the caches: one alone gets caches of its own again (its rows
        copied once), the target's kinds, trees where they run."""
        if self.batched and count == 1:
            self.layers, self.batched = [c.extract(0) for c in self.layers], False

    def _batch(self) -> None:
        """A sequence alone's caches made the first of a batch's (its rows copied once)."""
        if not self.batched:
            self.layers, self.batched = [batch_of(c) for c in self.layers], True
