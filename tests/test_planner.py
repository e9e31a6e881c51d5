"""The planner (`policy/planner.py`): every sequence's plan for a cycle, forced tokens before a
lookup's offer, a batch's width chosen a cycle ahead and capped while a prompt joins."""

from dataclasses import dataclass, field
from typing import List, Optional

import pytest

from dflash_mlx.policy.batch import FixedBatchWidth
from dflash_mlx.policy.plan import PLAIN, Plan
from dflash_mlx.policy.planner import FORCED_RUN, Planner


class Offers(list):
    order = 3


class Source:
    block_size = 8

    def __init__(self, offer=()):
        self._offer = Offers(offer)
        self.asked = []

    def offer(self, state, limit):
        self.asked.append(limit)
        return Offers(self._offer[:limit])

    def may_offer(self, state):
        return bool(self._offer)


class Grammar:
    def __init__(self, forced):
        self._forced = list(forced)

    def forced(self, limit):
        return self._forced[:limit]


class Run:
    learns_branches = False

    def __init__(self, plan=Plan(4)):
        self.plan, self.asked = plan, []

    def choose(self, context, offer=(), unseen=0, left=0):
        self.asked.append((context, list(offer), left))
        return self.plan

    def lookup_pays(self, context):
        return False


class Sizer:
    max_width = 8

    def copies(self, offer, width):
        return min(len(offer), 2)

    def alphas(self):
        return [0.5] * 7

    def lookup_alphas(self, order):
        return [0.9] * 7

    def best_copies(self, offered, order, width, alphas, look):
        rates = (look or alphas)[: width - 1]
        expected, p = 0.0, 1.0
        for a in rates:
            p *= a
            expected += p
        return min(offered, width - 1), expected


@dataclass
class Seq:
    source: Source = field(default_factory=Source)
    dstate: object = None
    constraint: Optional[Grammar] = None
    run: Run = field(default_factory=Run)
    sizer: Optional[Sizer] = None
    lookup: bool = True
    tapped: bool = True
    branches: int = 0
    unseen: int = 0
    chosen: Optional[Plan] = None
    history: List[int] = field(default_factory=lambda: [1, 2, 3])
    max_tokens: int = 100
    generated: int = 0


def test_forced_tokens_come_before_the_lookups_offer_and_stop_at_forced_run():
    planner = Planner(8)
    free = Seq(source=Source([7, 8, 9]))
    assert planner.offer(free, 5) == ([7, 8, 9], 0)
    bound = Seq(source=Source([7, 8, 9]), constraint=Grammar(range(100, 200)))
    offer = planner.offer(bound, 1000)
    assert offer.forced == FORCED_RUN and list(offer.tokens) == list(range(100, 100 + FORCED_RUN))
    assert bound.source.asked == []  # the lookup is not asked where the grammar forces
    assert Planner(8, forced_run=0).offer(bound, 10) == ([7, 8, 9], 0)
    assert planner.offer(Seq(source=Source([7]), lookup=False), 5) == ([], 0)


def test_a_sequence_alone_runs_its_forced_tokens_as_a_cycle_of_their_own():
    planner = Planner(8)
    seq = Seq(constraint=Grammar([5, 6, 7]), max_tokens=10, generated=7)
    plan = planner.alone(seq)
    assert plan.plans == [Plan(3, 2)] and plan.copies == [[5, 6]] and plan.forced == [2]  # its budget: 3 left
    assert seq.run.asked == []  # the policy is not asked


def test_a_sequence_alone_asks_its_policy_with_its_offer_fitted_to_its_budget():
    planner = Planner(8)
    seq = Seq(source=Source([7, 8, 9]), run=Run(Plan(8, 2)), max_tokens=10, generated=5)
    plan = planner.alone(seq)
    assert seq.run.asked == [(3, [7, 8, 9], 5)]
    assert plan.plans == [Plan(5, 2)] and plan.copies == [[7, 8]] and plan.forced == [0]
    seq.chosen = PLAIN  # chosen while a plain step was in flight: no offer is asked for
    assert planner.alone(seq).plans == [PLAIN] and seq.source.asked == [7] and seq.chosen is None


def test_a_batch_copies_what_each_sizer_expects_to_pay_forced_tokens_whole():
    planner = Planner(8)
    seqs = [Seq(source=Source([7, 8, 9]), sizer=Sizer()), Seq(constraint=Grammar([1, 2, 3, 4]), sizer=Sizer()),
            Seq(source=Source([7, 8, 9]))]
    plan = planner.fixed(seqs, 6)
    assert plan.copies == [[7, 8], [1, 2, 3, 4], []] and plan.forced == [0, 4, 0]
    assert plan.plans == [Plan(6, 2), Plan(6, 4), Plan(6, 0)]
    # one that keeps no drafter's context verifies its last token alone, the others draft
    assert planner.fixed(seqs + [Seq(tapped=False)], 6).plans == [Plan(6, 2), Plan(6, 4), Plan(6, 0), PLAIN]
    assert planner.fixed([Seq(tapped=False)] * 2, 6).plans == [PLAIN] * 2
    # it still verifies what its grammar forces (no drafter is needed for those), and the block is no wider
    assert planner.fixed([Seq(tapped=False, constraint=Grammar([1, 2])), Seq(tapped=False)], 6).plans == [
        Plan(3, 2), PLAIN]
    mixed = planner.fixed([Seq(tapped=False, constraint=Grammar([1, 2, 3])), Seq()], 6)
    assert mixed.plans == [Plan(4, 3), Plan(6, 0)] and mixed.copies == [[1, 2, 3], []] and mixed.forced == [3, 0]
    assert planner.fixed(seqs, 16).width == 8
    trees = [Seq(branches=2), Seq(branches=3)]
    assert planner.fixed(trees, 4, branches=3).plans == [Plan(4, 0, 2)] * 2
    assert planner.fixed(trees + [Seq(tapped=False)], 4, branches=3).plans == [Plan(4), Plan(4), PLAIN]  # linear


def test_forced_tokens_count_as_certain_in_what_a_batch_expects():
    planner = Planner(8)
    free, bound = Seq(sizer=Sizer(), lookup=False), Seq(sizer=Sizer(), constraint=Grammar(range(10)))
    gains, alone = planner.gains([free, bound], [1, 4, 8]), planner.gains([free], [1, 4, 8])
    for w in (1, 4, 8):
        assert gains[w] == pytest.approx(alone[w] + w)
    assert planner.gains([free, Seq()], [1, 4]) is None  # a sequence without a sizer run
    untapped = planner.gains([free, Seq(sizer=Sizer(), tapped=False)], [1, 4, 8])
    assert untapped == {w: pytest.approx(alone[w] + 1) for w in (1, 4, 8)}  # no drafts: its own token alone
    untapped = planner.gains([free, Seq(sizer=Sizer(), tapped=False, constraint=Grammar(range(10)))], [1, 4, 8])
    assert untapped == {w: pytest.approx(alone[w] + w) for w in (1, 4, 8)}  # but its forced tokens


class Script(FixedBatchWidth):
    widths = (1, 2, 4, 8)

    def __init__(self, choices):
        super().__init__(8)
        self.choices = iter(choices)
        self.updates = []

    def choose(self, batch, gains=None, columns=0):
        return next(self.choices)

    def update(self, batch, width, seconds, tokens, branches=0, columns=0):
        self.updates.append((batch, width, tokens, branches))


def test_a_batchs_width_is_chosen_a_cycle_ahead_and_capped_while_a_prompt_joins():
    policy = Script([4, 1, 8, 8, 8, 8])
    planner = Planner(8, policy)
    two, three = [Seq(), Seq()], [Seq(), Seq(), Seq()]
    shapes = [(p.width, p.then) for p in (planner.batch(two), planner.batch(two), planner.batch(two))]
    assert shapes == [(4, 4), (4, 1), (1, 8)]  # nothing chosen before: what is chosen now; then a cycle ahead
    assert planner.batch(three).width == 8  # the batch changed: what is chosen now
    fits = lambda shape: shape[1] <= 2  # noqa: E731
    capped = planner.batch(three, joining=True, fits=fits)
    assert (capped.width, capped.then) == (8, 2)  # the width chosen a cycle ahead runs; the next is capped
    assert planner.batch(three, joining=True, fits=fits).width == 2
    planner.update(capped, 0.1, 12, tree=False)
    assert policy.updates == [(3, 8, 12, 0)]


def test_a_batchs_figures_are_kept_apart_beside_a_long_prompt_and_found_again_after_it():
    """Widths are measured per span of the K/V rows a batch's attention reads: beside a long prompt
    the batch tries its widths afresh (drafting costs more there), and once the prompt has left it
    chooses from its own figures again, without trying anything."""
    from dflash_mlx.policy.batch import COLUMN_SPAN, TRIES, BatchWidths, bucket

    assert bucket(8, 4000) == bucket(8, COLUMN_SPAN) != bucket(8, COLUMN_SPAN + 1) == bucket(8, 2 * COLUMN_SPAN)
    assert bucket(8, 2 * COLUMN_SPAN + 1) != bucket(8, 2 * COLUMN_SPAN)
    policy, short, long = BatchWidths(8), 7 * 600, 7 * 600 + 16384
    costs = {short: {1: 0.1, 2: 0.11, 4: 0.12, 8: 0.2}, long: {1: 0.3, 2: 0.5, 4: 0.9, 8: 1.7}}
    tokens = {1: 8, 2: 12, 4: 16, 8: 18}

    def run(columns, cycles):
        chosen = []
        for _ in range(cycles):
            w = policy.choose(8, columns=columns)
            policy.update(8, w, costs[columns][w], tokens[w], columns=columns)
            chosen.append(w)
        return chosen

    first = run(short, 4 * TRIES)
    assert first[: 3 * TRIES] == [1] * TRIES + [2] * TRIES + [4] * TRIES and policy.choose(8, columns=short) == 4
    assert run(long, 2 * TRIES)[:TRIES] == [1] * TRIES  # tried afresh beside the long prompt
    assert policy.choose(8, columns=long) == 1  # drafting does not pay there
    assert run(short, 3) == [4, 4, 4]  # its own figures again


def test_a_long_sequence_held_apart_verifies_its_last_token_alone_where_drafting_it_does_not_pay():
    """`narrow`: the attention a sequence's draft rows read at its length, against the tokens they are
    expected to add decoded plainly: a 16k-token sequence steps plainly in a cycle whose short
    sequences draft, and a batch whose sequences all step plainly runs a plain step."""
    from dflash_mlx.policy.planner import narrow

    class Curve:
        contexts = [64, 1024, 4096]

        def cost(self, w, n):
            return 1 + 0.1 * w + 1e-4 * w * n  # each block row attends every column

    class Run(Sizer):
        curve = Curve()

        def expected_tokens(self, w):
            return 2.0

    long, short = Seq(sizer=Run(), history=[1] * 16384), Seq(sizer=Run(), history=[1] * 512)
    assert narrow(long, 8) == 1 and narrow(short, 8) == 8
    assert narrow(Seq(sizer=None, history=[1] * 16384), 8) == 8  # no statistics to weigh
    assert narrow(Seq(sizer=Run(), history=[1] * 16384, constraint=Grammar([])), 8) == 8
    planner = Planner(8)
    plan = planner.fixed([long, short], 8, apart=[True, True])
    assert [p.width for p in plan.plans] == [1, 8] and plan.width == 8
    assert planner.fixed([long, short], 8, apart=[True, False]).plans[1].width == 8
    assert planner.fixed([long, Seq(sizer=Run(), history=[1] * 9000)], 8, apart=[True, True]).plans == [PLAIN] * 2


def test_a_curve_timed_at_one_context_weighs_a_columns_bytes_against_the_weights():
    """A cost curve that timed one context shows no growth with it: a draft row reading a column of
    K/V then costs `column_share` of a plain step, the bytes it reads against the weights'."""
    from dflash_mlx.policy.planner import narrow

    class Flat:
        contexts = [64]

        def cost(self, w, n):
            return 1 + 0.1 * w

    class Run(Sizer):
        curve = Flat()

        def expected_tokens(self, w):
            return 2.0

    long = Seq(sizer=Run(), history=[1] * 16384)
    assert narrow(long, 8) == 8  # nothing known of a column's cost
    assert narrow(long, 8, column_share=1e-4) == 1  # 7 rows x 16k columns x 1e-4 of a step: 12 steps' worth
    assert narrow(Seq(sizer=Run(), history=[1] * 512), 8, column_share=1e-4) == 8
