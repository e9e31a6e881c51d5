"""A batch's drafts: each sequence's block for a drafted cycle, from one drafter pass over the
pooled contexts of sequences that share the pair's poolable drafter (`draft.pool.DraftBatch`), or
else from each sequence's own source; a lookup's copies in the first positions; and what the
unseeded sampled sequences' proposal scales learn from the verify."""

from typing import List, Optional, Sequence

import mlx.core as mx

from ..draft import tree as trees
from ..draft.lookup import point_masses
from ..draft.pool import DraftBatch
from ..policy.proposal import reached_gains
from .cycle import Block, LinearCycle
from .passes import Draft, caught_up, draft, joined, pick_drafts
from .running import Proposal, Running


class Drafting:
    """Drafts for the decoder's sequences (`seqs`, in the caches' order)."""

    def __init__(self, poolable):
        """`poolable`: the pair's drafter as a source several sequences can draft with in one pass
        (`DraftSource.pooled`), or None: each sequence drafts on its own."""
        self.poolable = poolable
        # The drafter's contexts of the first len(pool) sequences, drafted in one pass; a sequence
        # joins it at its first drafted cycle beside others. None: each drafts on its own.
        self.pool: Optional[DraftBatch] = None

    def propose(self, seqs: List[Running], width: int, copies: List[List[int]],
                alternatives: bool = False, widths: Optional[List[int]] = None) -> Proposal:
        """Every sequence's block for a cycle of `width`: its last token, then its drafts (its
        `copies` first); with `alternatives`, a sequence alone's drafter's 2nd and 3rd choices.
        A sequence whose `widths` entry is 1 verifies its last token alone, and one that keeps no
        drafter's context its copies alone: neither is drafted (padding fills its block after its
        copies, and a drafter's context waits for its next drafted cycle)."""
        lasts = mx.concatenate([s.last for s in seqs])
        noises = [s.noise(width) for s in seqs]
        scales = [None if s.scaler is None else s.scaler.choose(width - 1) for s in seqs]
        skip = set() if widths is None else {b for b, w in enumerate(widths) if w == 1 or not seqs[b].tapped}
        if self._pooling(seqs):
            drawn = self._pooled(seqs, lasts, width, noises, copies, scales, skip)
        else:
            drawn = [None if b in skip else self._own(s, width, n, c, sc, alternatives)
                     for b, (s, n, c, sc) in enumerate(zip(seqs, noises, copies, scales))]
        drawn = [_copies_alone(s, width, c) if b in skip else d for b, (s, d, c) in enumerate(zip(seqs, drawn, copies))]
        alts = drawn[0].alternatives if len(drawn) == 1 else None
        return Proposal(Block(lasts, mx.stack([d.tokens for d in drawn]), [d.q_lp for d in drawn], noises, alts),
                        scales, copies)

    def tree(self, seqs: List[Running], width: int, branches: int) -> trees.Tree:
        """Every sequence's tree for a cycle of `width` with `branches` branches (greedy), from
        one drafter pass where they are pooled."""
        lasts = mx.concatenate([s.last for s in seqs])
        if self._pooling(seqs):
            logits = self.pool.propose(lasts, [joined(s.take_taps()) if s.taps else None for s in seqs], width)
        else:
            logits = mx.stack([s.source.propose(s.dstate, s.last, _caught_up(s), width) for s in seqs])
        return trees.build(lasts, logits, branches)

    @staticmethod
    def learn(seqs: List[Running], p: Proposal, cycle: LinearCycle, accepted: List[int]) -> None:
        """Unseeded sampled sequences' proposal scales learn from the last cycle's lessons (read at
        this cycle's synchronisation); this cycle's are left lazy, to be read at the next one's."""
        for b, s in enumerate(seqs):
            if s.lesson is not None:
                s.scaler.update(*s.lesson)
                s.lesson = None
            copied, rows = len(p.copies[b]), cycle.processed[b]
            width = p.block.width if p.block.widths is None else p.block.widths[b]
            drafted = copied < width - 1  # the drafter filled positions it verified: its scales were used
            # A grammar's masks are not the drafter's: what they reject teaches the scales nothing.
            if rows is not None and drafted and s.constraint is None and s.scaler.learning() and accepted[b] >= copied:
                s.lesson = reached_gains(rows, p.block.q_lps[b], copied, accepted[b], p.scales[b], s.params)

    def read_held(self, seqs: List[Running], b: int) -> None:
        """Sequence b holds `HELD_TAPS` taps (a long plain run): its drafter reads them in one pass
        (with the pool's other sequences', where it is pooled)."""
        if self.pool is not None and b < len(self.pool):
            pooled = seqs[: len(self.pool)]
            self.pool.add_context([joined(s.take_taps()) if s.taps else None for s in pooled])
        else:
            seq = seqs[b]
            seq.source.add_context(seq.dstate, joined(seq.take_taps()))

    def unpool(self, b: int, seq: Running) -> None:
        """Sequence b's drafter context, if the pool holds it, back into its own state."""
        if self.pool is not None and b < len(self.pool):
            seq.source.context(seq.dstate)[:] = self.pool.extract(b)

    def keep_only(self, keep: List[int]) -> None:
        """The sequences at indices `keep` stay (the pool's others are dropped)."""
        if not keep:
            self.pool = None
        elif self.pool is not None:
            self.pool.filter([b for b in keep if b < len(self.pool)])

    def _pooling(self, seqs: List[Running]) -> bool:
        """Whether this cycle drafts every sequence in one pass: several sequences, each drafting
        with the pair's poolable source. Sequences not pooled yet join the pool (their held taps
        read into their own context first, which the pool then holds); where they cannot, the
        pool's contexts go back to their sequences."""
        if self.poolable is None or len(seqs) == 1 or any(s.source.pooled() is not self.poolable for s in seqs):
            if self.pool is not None:
                for b, s in enumerate(seqs[: len(self.pool)]):
                    self.unpool(b, s)
                self.pool = None
            return False
        if self.pool is None:
            self.pool = DraftBatch(self.poolable)
        joining = seqs[len(self.pool) :]
        for s in joining:
            if s.taps:
                s.source.add_context(s.dstate, joined(caught_up(s.source, s.dstate, s.take_taps())))
        if joining:
            self.pool.join([s.source.context(s.dstate) for s in joining])
        return True

    def _pooled(self, seqs: List[Running], lasts: mx.array, width: int, noises: list, copies: List[List[int]],
                scales: list, skip=frozenset()) -> List[Draft]:
        """Every sequence's drafts from one drafter pass (but those in `skip`: None), each
        sequence's `copies` in its first positions (point masses, for rejection sampling)."""
        which = [b for b in range(len(seqs)) if b not in skip]
        if not which:
            return [None] * len(seqs)
        hiddens = [joined(seqs[b].take_taps()) if seqs[b].taps else None for b in which]
        some = lasts if not skip else mx.take(lasts, mx.array(which), axis=0)
        logits = self.pool.propose(some, hiddens, width, None if not skip else which)
        drawn: List[Optional[Draft]] = [None] * len(seqs)
        if all(seqs[b].params.greedy and not seqs[b].proc for b in which):
            tokens = mx.argmax(logits, axis=-1).astype(mx.uint32)
            for i, b in enumerate(which):
                drawn[b] = Draft(tokens[i], None, None)
        else:
            for i, b in enumerate(which):
                s, n = seqs[b], noises[b]
                drawn[b] = pick_drafts(logits[i], s.params, s.proc or None, None if n is None else n[:-1], scales[b])
        return [d if d is None or not c else _copied(d, c) for d, c in zip(drawn, copies)]

    @staticmethod
    def _own(seq: Running, width: int, noise: Optional[mx.array], copies: Sequence[int] = (),
             scales: Optional[List[float]] = None, alternatives: bool = False) -> Draft:
        """A sequence's drafts from its own source (the lookup's `copies` first)."""
        if len(copies) == width - 1:  # no drafter pass: its taps wait for the next one
            tokens = mx.array(copies, dtype=mx.uint32)
            return Draft(tokens, point_masses(tokens, seq.source.vocab_size) if seq.rejection else None, None)
        return draft(seq.source, seq.dstate, seq.last, _caught_up(seq), width, seq.params, copies,
                     proc=seq.proc or None, alternatives=alternatives, scales=scales,
                     noise=None if noise is None else noise[:-1])


def _padding(width: int) -> Draft:
    """Drafts that only pad a block, for a sequence that verifies its last token alone."""
    return Draft(mx.zeros((width - 1,), dtype=mx.uint32), None, None)


def _copies_alone(seq: Running, width: int, copies: List[int]) -> Draft:
    """A block of `copies` and padding after, for a sequence that verifies its copies alone (point
    masses for rejection sampling)."""
    if not copies:
        return _padding(width)
    tokens = mx.array(copies, dtype=mx.uint32)
    q_lp = point_masses(tokens, seq.source.vocab_size) if seq.rejection else None
    return Draft(mx.concatenate([tokens, mx.zeros((width - 1 - len(copies),), dtype=mx.uint32)]), q_lp, None)


def _caught_up(seq: Running) -> Optional[mx.array]:
    """The taps a sequence holds, for its own drafter to read with its next block (a long backlog
    read first, `passes.caught_up`)."""
    return joined(caught_up(seq.source, seq.dstate, seq.take_taps())) if seq.taps else None


def _copied(d: Draft, copies: List[int]) -> Draft:
    """`d` with a lookup's `copies` in its first positions."""
    k, n = len(copies), d.tokens.shape[0]
    copied = mx.array(copies, dtype=mx.uint32)
    tokens = mx.concatenate([copied, d.tokens[k:]]) if k < n else copied
    if d.q_lp is None:
        return Draft(tokens, None, None)
    masses = point_masses(copied, d.q_lp.shape[-1])
    return Draft(tokens, mx.concatenate([masses, d.q_lp[k:]]) if k < n else masses, None)
