"""Every sequence's plan for the decoder's next cycle, made in one place.

A sequence alone runs its own policy's plans (`plan.Run`: the adaptive sizer's width,
lookup copies and tree branches), fitted to its budget. Several run one cycle at the width
the batch's policy chooses (`batch.BatchPolicy`, a cycle ahead), each copying what its own
sizer run expects to pay of its lookup's offer. Either way the tokens a sequence's grammar
forces come first: they are certain, so they are copied as drafts before any lookup offer
(`Planner.offer`), and alone they make a cycle of their own.

The planner reads sequences through `Planned` and never imports the decoder, which
carries its plans out (`decode/decoder.py`).
"""

from dataclasses import dataclass
from typing import Any, Callable, Dict, Hashable, List, NamedTuple, Optional, Protocol, Sequence, Tuple

from .batch import BatchPolicy, FixedBatchWidth
from .plan import PLAIN, Plan

# The most forced tokens one cycle verifies: a schema's boilerplate goes through the target in one
# pass whatever the policy's width, up to this many rows (beyond, a pass costs like a prefill chunk
# and the rest is forced again next cycle).
FORCED_RUN = 64


class Planned(Protocol):
    """What the planner reads of a sequence (`decode.running.Running`)."""

    source: Any  # its draft source: `offer` / `may_offer` of its lookup
    dstate: Any
    constraint: Any  # its grammar (`forced`), or None
    run: Any  # its run of its policy (`plan.Run`)
    sizer: Any  # its run of the pair's sizer in a batch's cycles, or None
    lookup: bool
    tapped: bool
    branches: int
    unseen: int
    chosen: Optional[Plan]
    history: List[int]
    max_tokens: int
    generated: int


class Offer(NamedTuple):
    """What a sequence's next drafts may copy: the tokens its grammar forces (`forced` of them,
    then all), else its lookup's offer (which may say its n-gram `order`)."""

    tokens: Sequence[int]
    forced: int = 0


@dataclass
class CyclePlan:
    """One cycle for every sequence: each one's plan (one width for all) and the tokens its first
    draft positions copy (the first `forced[b]` of sequence b's forced by its grammar)."""

    plans: List[Plan]
    copies: List[List[int]]
    forced: List[int]
    then: Optional[int] = None  # the next cycle's width, where chosen: a plain step launches it ahead if plain
    alternatives: bool = False  # fetch the drafter's 2nd and 3rd choices (`plan.Run.learns_branches`)
    columns: int = 0  # the K/V rows the batch's attention reads per block row, where the batch's policy chose it

    @property
    def width(self) -> int:
        return max(p.width for p in self.plans)

    @property
    def branches(self) -> int:
        return max(p.branches for p in self.plans)


def narrow(seq: Planned, width: int, column_share: float = 0.0) -> int:
    """The rows a sequence held apart verifies in a batch's cycle of `width`: all of them, or its
    last token alone (1) where the attention its draft rows read at its length would take longer
    than decoding the tokens they are expected to add plainly, alone at its length. What the draft
    rows' attention costs is the cost curve's growth with context of a cycle of `width` beyond a
    plain step's; a curve timed at one context only shows none, and then a row reading a column
    costs what reading its K/V does, `column_share` (K/V bytes of a token over the weights' bytes)
    of a plain step. A long prompt then steps plainly in a batch whose short sequences draft.
    Sequences under a grammar, and those without a sizer run's statistics, verify every row."""
    run = seq.sizer
    if run is None or seq.constraint is not None or width < 2:
        return width
    curve, n = run.curve, len(seq.history)
    low = curve.contexts[0]
    if n <= low:
        return width
    if len(curve.contexts) > 1:
        rows = (curve.cost(width, n) - curve.cost(1, n)) - (curve.cost(width, low) - curve.cost(1, low))
    else:
        rows = (width - 1) * (n - low) * column_share * curve.cost(1, low)
    return 1 if rows > (run.expected_tokens(width) - 1) * curve.cost(1, n) else width


def plain(batch: int, then: Optional[int] = None) -> CyclePlan:
    """A plain step of `batch` sequences."""
    return CyclePlan([PLAIN] * batch, [[] for _ in range(batch)], [0] * batch, then)


class Planner:
    """The decoder's plans: a sequence alone's from its own run, a batch's from `policy`."""

    def __init__(self, width: int, policy: Optional[BatchPolicy] = None, forced_run: int = FORCED_RUN):
        """`width`: the widest cycle of several sequences; `policy` chooses each such cycle's
        (default: always `width`, linear); `forced_run`: the most forced tokens one cycle copies (0: a
        grammar's forced tokens are decoded as any others)."""
        self.width = width
        self.policy: BatchPolicy = policy or FixedBatchWidth(width, trees=False)
        self.forced_run = forced_run
        self._then: Optional[Tuple[int, int]] = None  # (batch size, width) chosen for the next cycle
        self.column_share = 0.0  # K/V bytes of a token over the target's weight bytes (`narrow`), once known

    def offer(self, seq: Planned, room: int, lookup: Optional[int] = None) -> Offer:
        """At most `room` tokens `seq`'s grammar forces next; where it forces none, at most
        `lookup` (default `room`) of its lookup's offer (none where it keeps no lookup)."""
        certain = [] if seq.constraint is None else seq.constraint.forced(max(0, min(room, self.forced_run)))
        if certain:
            return Offer(certain, len(certain))
        lookup = room if lookup is None else lookup
        return Offer(seq.source.offer(seq.dstate, lookup) if seq.lookup and lookup > 0 else [])

    def alone(self, seq: Planned) -> CyclePlan:
        """A sequence alone's next cycle: its forced tokens where its grammar forces some (its policy
        is not asked: they are certain, and a drafter after them would draft blind to them), else its
        policy's plan (chosen while a plain step was in flight, or now with its lookup's offer),
        fitted to its budget."""
        self._then = None
        plan, seq.chosen = seq.chosen, None
        left = seq.max_tokens - seq.generated
        offer = self.offer(seq, left - 1, lookup=0 if plan is not None else seq.source.block_size - 1)
        if offer.forced:
            n = offer.forced
            return CyclePlan([Plan(n + 1, n)], [list(offer.tokens)], [n])
        if plan is None:
            plan = seq.run.choose(len(seq.history), offer.tokens, unseen=seq.unseen, left=left)
        width = min(plan.width, left)
        copied = min(plan.copied, width - 1, len(offer.tokens))
        plan = Plan(width, copied, min(plan.branches, seq.branches) if width > 1 and not copied else 0)
        return CyclePlan([plan], [list(offer.tokens[:copied])], [0], alternatives=seq.run.learns_branches)

    @staticmethod
    def plain_next(seq: Planned) -> bool:
        """While a sequence alone's plain step is in flight, whether its next is plain too (chosen
        now, so that it launches before the host reads this one), unless a lookup offer may be
        worth waiting for or its grammar needs this step's token."""
        left = seq.max_tokens - seq.generated
        seq.chosen = None  # a plan chosen for this step is spent: the next is chosen now or when it comes
        if seq.constraint is not None:  # its next mask needs this step's token, and may force drafts
            return False
        if left > 1 and not (seq.lookup and seq.source.may_offer(seq.dstate)
                             and seq.run.lookup_pays(len(seq.history) + 1)):
            seq.chosen = seq.run.choose(len(seq.history) + 1, unseen=seq.unseen + 1, left=left - 1)
            return seq.chosen == PLAIN
        return False

    def batch(self, seqs: Sequence[Planned], joining: bool = False,
              fits: Optional[Callable[[Hashable], bool]] = None, columns: int = 0,
              apart: Optional[Sequence[bool]] = None) -> CyclePlan:
        """A cycle of several sequences, as the batch's policy chooses it. Widths are chosen a cycle
        ahead, so that a plain step launches the next one only where it will run; where the batch
        has changed, this cycle runs what is chosen now. While a prompt joins (`joining`), a policy
        weighing widths runs cycles cheap enough (`fits`: a cycle's shape, (batch, width) or
        (batch, width, branches)) to leave the prompt's chunks, and its first cycle, their share
        (a fixed one runs what it was given). `columns`: the K/V rows the batch's attention reads per
        block row (`decode.caches.Caches.columns`): the policy's figures are kept per such span.
        `apart`: per sequence, whether its K/V is a part of its own (`fixed` may narrow it)."""
        B, widths = len(seqs), self.policy.widths
        then = self.policy.choose(B, self.gains(seqs, widths), columns)
        capped = joining and bool(widths) and fits is not None
        if capped:
            then = max((w for w in widths if w <= then and fits((B, w))), default=min(widths))
        width = self._then[1] if self._then is not None and self._then[0] == B else then
        self._then = (B, then)
        branches = self.policy.branches(B, width, min(s.branches for s in seqs), columns)
        if capped and branches and not fits((B, width, branches)):
            branches = 0
        plan = self.fixed(seqs, width, then, branches, apart)
        plan.columns = columns
        return plan

    def fixed(self, seqs: Sequence[Planned], width: int, then: Optional[int] = None, branches: int = 0,
              apart: Optional[Sequence[bool]] = None) -> CyclePlan:
        """A cycle of `width` (at most the planner's) for every sequence: a tree of `branches` where
        every sequence allows that many and keeps a drafter's context; else a linear cycle, each
        sequence's forced tokens copied first, else what its sizer run expects to pay of its
        lookup's offer. A sequence held `apart` verifies its last token alone where drafting it
        does not pay at its length (`narrow`); one that keeps no drafter's context (its policy
        found no drafted cycle could pay at its length) verifies its copies alone, no drafts
        after them. Plain where no sequence verifies more than its last token."""
        B = len(seqs)
        w = max(1, min(width, self.width))
        if w == 1 or not any(s.tapped or s.constraint is not None or s.lookup for s in seqs):
            return plain(B, then)
        branches = min([branches] + [s.branches for s in seqs])
        if branches and all(s.tapped for s in seqs):  # a tree drafts every sequence
            return CyclePlan([Plan(w, 0, branches)] * B, [[] for _ in seqs], [0] * B, then)
        widths = [narrow(s, w, self.column_share) if apart is not None and apart[b] and s.tapped else w
                  for b, s in enumerate(seqs)]
        offers = [self.offer(s, x - 1, lookup=x - 1 if s.sizer is not None else 0) for s, x in zip(seqs, widths)]
        copies = [list(o.tokens) if o.forced else list(o.tokens[: s.sizer.copies(o.tokens, x)]) if o.tokens else []
                  for s, o, x in zip(seqs, offers, widths)]
        widths = [x if s.tapped else 1 + len(c) for s, x, c in zip(seqs, widths, copies)]
        top = max(widths)
        if top == 1:
            return plain(B, then)
        if top < w:  # no sequence verifies the block's last rows
            widths = [min(x, top) for x in widths]
            copies = [c[: x - 1] for c, x in zip(copies, widths)]
        return CyclePlan([Plan(x, len(c)) for x, c in zip(widths, copies)], copies,
                         [min(o.forced, len(c)) for o, c in zip(offers, copies)], then)

    def gains(self, seqs: Sequence[Planned], widths: Sequence[int]) -> Optional[Dict[int, float]]:
        """The tokens the sequences expect a cycle of each width to commit, in all, from their sizer
        runs' acceptance statistics and their offers (`offer`: forced tokens certain), copied as
        `fixed` would (None unless every sequence has a sizer run)."""
        if not widths or not seqs or any(s.sizer is None for s in seqs):
            return None
        gains = dict.fromkeys(widths, 0.0)
        for s in seqs:
            offer = self.offer(s, max(widths) - 1)
            order = getattr(offer.tokens, "order", 0)
            alphas = s.sizer.alphas() if s.tapped else [0.0] * (max(widths) - 1)  # no drafts after its copies
            look = [1.0] * len(alphas) if offer.forced else s.sizer.lookup_alphas(order) if offer.tokens else None
            for w in widths:
                gains[w] += 1 + s.sizer.best_copies(len(offer.tokens), order, min(w, s.sizer.max_width), alphas, look)[1]
        return gains

    def update(self, plan: CyclePlan, seconds: float, tokens: int, tree: bool) -> None:
        """A batch's cycle run as `plan` (as a tree where `tree`) took `seconds` and committed `tokens` in all."""
        self.policy.update(len(plan.plans), plan.width, seconds, tokens, plan.branches if tree else 0, plan.columns)
