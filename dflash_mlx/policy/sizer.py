"""The adaptive block size (`--block-size auto`).

Each cycle's gain is the expected number of committed tokens,
1 + sum_k prod_{j<=k} alpha_j, where alpha_j is the running rate at which
draft position j is accepted once positions before it were; its cost comes
from the measured cost curve (`costs.py`) at the current context. Each cycle
picks the plan that maximises gain / cost, with the alphas drawn from their
posteriors (Thompson sampling), so that what is not tried is still learnt.
"""

import random
from typing import Dict, List, Optional, Sequence, Tuple

from ..draft import tree as trees
from ..machine import blas_name
from .costs import CostCurve
from .plan import PLAIN, Outcome, Plan

COST_STEP = 32  # tokens of context growth before a sizer interpolates its costs again
# After choosing plain decoding, the sizer holds it for this many steps without asking
# again (unless a lookup offer comes): its per-step Python work, and the probes its
# draws make where drafting does not pay, are paid once per run of steps. Each further
# plain choice in a row doubles the hold, up to PLAIN_HOLD_MAX; a probe starts it again.
# A draw probes the drafter with the probability that drafting is best, so asking at
# every other step of a long plain run buys a probe every few dozen tokens where the
# evidence says it does not pay. That holds on thin evidence too: where probes are rare
# (temperature 1 on the demo pair), the evidence ages as fast as they add to it and stays
# thin for good, and a hold kept short for it made a draw every other step (1-7% of the speed there).
PLAIN_HOLD = 2
PLAIN_HOLD_MAX = 8
# The drafter's one-time catch-up on the context it has not seen (a long prompt's)
# is spread over the tokens left, but over at most this many: a request rarely
# runs its whole budget.
CATCH_UP_SPREAD = 512
# The sizer's defaults. A trained drafter's first positions are accepted most of the
# time: the drafter's prior is a rate of 0.8, worth WEIGHT cycles, so a request's own
# few cycles outweigh it quickly. A lookup offer is a coin toss until its n-gram order
# has a record (0.5), and the drafter's 2nd/3rd choice is rarely right where its best
# was not (0.2).
DRAFTER_PRIOR = 0.8
LOOKUP_PRIOR = 0.5
BRANCH_PRIOR = 0.2
WEIGHT = 4.0
# Per position, each new check of it counts for 1 and older ones by DECAY each:
# the rates follow the text within a few dozen cycles.
DECAY = 0.98
# Every statistic loses half its weight per HALF_LIFE committed tokens, so evidence
# that drafting does not pay becomes uncertain again and the drafter is retried.
HALF_LIFE = 1024.0
# A request starts from the shared statistics worth at most CARRY cycles per position:
# enough to start well, little enough that its own outcomes take over within a few cycles.
CARRY = 8.0
# A width is kept unless another promises 3% more tokens per second: the curve's
# noise alone must not make the choice wander between equally good widths.
STICK = 1.03
# A kept acceptance count is refused above this when its statistics never forget
# (decay 1): a request's checks of one position are far fewer.
MAX_KEPT_COUNT = 1e9


class Clock:
    """Tokens committed so far: the statistics that read one age by what was committed since they last looked."""

    __slots__ = ("tokens",)

    def __init__(self):
        self.tokens = 0


class AcceptanceStats:
    """Per-position acceptance counts: a check forgets a little of what earlier
    checks of that position said (`decay`), and everything ages slowly with
    committed tokens (`half_life`, by the tokens its `clock` counts).

    Ageing by tokens means a source that is not tried drifts back towards the
    prior (depth k towards depth k - 1's rate, depth 1 towards the sizer's
    prior): old evidence becomes uncertain again, so a sizer that samples
    its rates (`BlockSizer.choose`) tries the source again now and then.
    """

    def __init__(self, n: int, decay: float = DECAY, half_life: float = HALF_LIFE, clock: Optional[Clock] = None):
        self.decay, self.half_life = decay, half_life
        self._tried = [0.0] * n  # times draft position k (index k, 1-based) was checked
        self._accepted = [0.0] * n
        self.clock = clock or Clock()  # shared by a sizer's statistics: a plain step ages them all in O(1)
        self._seen = self.clock.tokens  # the clock when the counts were last aged

    @property
    def tried(self) -> List[float]:
        self._age_now()
        return self._tried

    @property
    def accepted(self) -> List[float]:
        self._age_now()
        return self._accepted

    def add(self, checked: range, accepted: int) -> None:
        """Positions in `checked` were checked; those up to `accepted` were accepted."""
        tried, acc = self.tried, self.accepted
        for k in checked:
            tried[k] = tried[k] * self.decay + 1
            acc[k] = acc[k] * self.decay + (k <= accepted)

    def _age_now(self) -> None:
        unaged = self.clock.tokens - self._seen
        if unaged and self.half_life:
            f = 0.5 ** (unaged / self.half_life)
            self._tried = [t * f for t in self._tried]
            self._accepted = [a * f for a in self._accepted]
        self._seen = self.clock.tokens

    def state(self) -> dict:
        """The aged counts, for a later process (`load`)."""
        return {"tried": list(self.tried), "accepted": list(self.accepted)}

    def load(self, state: dict) -> None:
        """Counts an earlier process kept (`state`); ValueError if they do not fit."""
        tried, accepted = [float(t) for t in state["tried"]], [float(a) for a in state["accepted"]]
        # `add` forgets a share 1 - decay of each count per check, so no count it kept exceeds this
        # (a huge or infinite one would stall the Beta sampler).
        most = 1 / (1 - self.decay) + 1e-6 if self.decay < 1 else MAX_KEPT_COUNT
        if len(tried) != len(self._tried) or len(accepted) != len(tried) or \
                any(not 0 <= a <= t + 1e-6 <= most for a, t in zip(accepted, tried)):
            raise ValueError("acceptance counts of another shape or out of range")
        self._tried, self._accepted, self._seen = tried, accepted, self.clock.tokens

    def capped(self, weight: float, clock: Optional[Clock] = None) -> "AcceptanceStats":
        """The same rates, each worth at most `weight` observations (ageing by `clock`)."""
        out = AcceptanceStats(len(self._tried), self.decay, self.half_life, clock)
        for k, (t, a) in enumerate(zip(self.tried, self.accepted)):
            if t > 0:
                out._tried[k] = min(t, weight)
                out._accepted[k] = out._tried[k] * a / t
        return out

    def posteriors(self, prior: float, weight: float) -> List[Tuple[float, float]]:
        """Beta(a, b) of alpha_k for k = 1..n-1: the counts plus `weight` observations
        at a prior mean, which is the previous depth's mean (depth 1's is `prior`)."""
        out, prev, tried, accepted = [], prior, self.tried, self.accepted
        for k in range(1, len(tried)):
            a = accepted[k] + weight * prev
            b = max(0.0, tried[k] - accepted[k]) + weight * (1 - prev)
            out.append((a, b))
            prev = a / (a + b)
        return out

    def rates(self, prior: float, weight: float) -> List[float]:
        """alpha_k for k = 1..n-1 (posterior means); depths with little evidence borrow the previous depth's rate."""
        return [a / (a + b) for a, b in self.posteriors(prior, weight)]

    def sample(self, prior: float, weight: float, rng: random.Random) -> List[float]:
        """alpha_k for k = 1..n-1 drawn from their posteriors (Thompson sampling).

        Python's own Beta draws, not numpy's: next to MLX's CPU backend at work,
        numpy's vectorised draw took ~160 us against ~55 us for these (both ~15 us idle)."""
        return [rng.betavariate(max(a, 1e-6), max(b, 1e-6)) for a, b in self.posteriors(prior, weight)]


class BlockSizer:
    """Chooses each cycle's width and draft source for the most committed tokens per second.

    Candidates: plain decoding, the drafter at width 2..max, and when the
    source offers lookup tokens, the lookup alone (its first m tokens, no
    drafter pass: it costs a bare verify) or the lookup's tokens followed by
    the drafter's. Expected tokens come from per-position acceptance rates of
    each source, costs from the measured curve at the current context.

    The drafter's rates are learnt only from the cycles that check its
    drafts, so a sizer that picked plain decoding on its means would never
    learn that it was wrong (two unlucky rejections at the start of a
    request would end drafting for good). `choose` therefore draws the
    drafter's rates from their Beta posteriors (Thompson sampling): where
    the evidence is thin or old, a draw that makes drafting pay is likely
    and the drafter is tried; as evidence that it does not pay builds up,
    such draws, and so the probes, become rare. Where drafting cannot pay
    even if every draft were accepted, no draw makes it pay, and it is never
    tried. The lookup's rates are learnt from every offer, used or not (an
    offer is compared with the tokens then committed, which is what
    verifying it would have accepted), so they need no exploring: their
    means are used. Both age with committed tokens (`AcceptanceStats`).

    Statistics are kept across requests (the drafter's usual form), here,
    and per request, in the `SizerRun` that `start` makes and that makes the
    choices: a request starts from the shared rates, worth `carry`
    observations per position, so that its own outcomes take over within a
    few cycles; what it learns goes into both.

    Where the request allows tree verification (`start(branches=n)`: greedy,
    a target with plain KV caches), a cycle may also verify the best path
    with up to n branches, each the drafter's 2nd or 3rd choice at one depth
    followed by the best path's tokens (`draft/tree.py`). Its gain comes from how
    often the 2nd and the 3rd choice are the target's token where the best
    guess was not, learnt per depth from every drafted cycle (the drafter's
    top 3 are fetched with the cycle's tokens), so, like the lookup's, they
    need no exploring and their means are used; its cost is the drafted cycle at
    the path's width plus the extra rows of a bare verify (a tree pass costs
    what a linear pass of as many rows does), within the measured widths only.
    Whether to draft at all is decided on linear plans, so allowing trees
    does not make the sizer draft (or probe) more often; a tree only refines
    a cycle that drafts.
    """

    def __init__(self, curve: CostCurve, max_width: int, prior: float = DRAFTER_PRIOR,
                 lookup_prior: float = LOOKUP_PRIOR, weight: float = WEIGHT, decay: float = DECAY,
                 half_life: float = HALF_LIFE, carry: float = CARRY, stick: float = STICK, explore: bool = True,
                 branch_prior: float = BRANCH_PRIOR):
        self.curve = curve
        self.explore = explore  # False: choose on the posterior means (no exploring)
        self.rng = random.Random(0)  # seeds each run's own generator
        self.max_width = min(max_width, curve.max_width)
        self.prior, self.lookup_prior, self.weight, self.carry, self.stick = prior, lookup_prior, weight, carry, stick
        self.branch_prior, self.decay, self.half_life = branch_prior, decay, half_life
        self.shared_clock = Clock()  # tokens committed by every request: the shared statistics age by it
        self.shared = self.empty()
        # The lookup's, per n-gram order of the match (0: offers that name none): a long match is surer.
        self.shared_lookup: Dict[int, AcceptanceStats] = {}
        # Per depth: how often the drafter's 2nd and 3rd choices are the target's token where its best is not.
        self.shared_alt = [self.empty() for _ in range(2)]

    def fresh(self) -> "BlockSizer":
        """A sizer with this one's curve and settings and none of its statistics."""
        return BlockSizer(self.curve, self.max_width, self.prior, self.lookup_prior, self.weight, self.decay,
                          self.half_life, self.carry, self.stick, self.explore, self.branch_prior)

    def empty(self, clock: Optional[Clock] = None) -> AcceptanceStats:
        """Statistics with nothing in them, ageing by `clock` (default: every request's tokens)."""
        return AcceptanceStats(self.max_width, self.decay, self.half_life, clock or self.shared_clock)

    def start(self, branches: int = 0) -> "SizerRun":
        """A run for a new request (`SizerRun`), whose cycles may verify trees of up to
        `branches` branches."""
        return SizerRun(self, branches)

    @property
    def default_branches(self) -> int:
        """The tree branches a request weighs unless it says otherwise: as many as the curve
        timed (`TREE_BRANCHES` where the target can verify trees), so trees are used where
        this machine's timings say they pay; none where the curve timed no trees."""
        return self.curve.tree_branches

    def shared_state(self) -> dict:
        """What requests taught the shared statistics (drafter, lookups per n-gram order,
        the drafter's alternatives), to keep across processes (`load_shared`)."""
        return {"drafter": self.shared.state(), "alt": [st.state() for st in self.shared_alt],
                "lookup": {str(n): st.state() for n, st in self.shared_lookup.items()}}

    def load_shared(self, state: dict) -> None:
        """Shared statistics an earlier process kept (`shared_state`), loaded in place;
        ValueError (or KeyError, TypeError) if they do not fit, and then nothing changes."""
        drafter, alt = self.empty(), [self.empty() for _ in self.shared_alt]
        drafter.load(state["drafter"])
        for st, kept in zip(alt, state["alt"], strict=True):
            st.load(kept)
        lookup = {}
        for n, kept in state["lookup"].items():
            lookup[int(n)] = self.empty()
            lookup[int(n)].load(kept)
        for own, kept in zip([self.shared, *self.shared_alt], [state["drafter"], *state["alt"]]):
            own.load(kept)  # checked above: it fits
        self.shared_lookup.clear()
        self.shared_lookup.update(lookup)

    def explain(self, context: int) -> Optional[str]:
        """The curve's prediction where a request at `context` tokens would start with plain
        decoding (None where it drafts): a prediction, since the request goes on learning
        (it probes the drafter, and drafts from the lookup where the text repeats)."""
        run = self.start()
        if run.best(context)[0] != PLAIN:
            return None
        w = self.max_width
        ratio = self.curve.cost(w, context) / self.curve.cost(1, context)
        lookup = ", drafting from the n-gram lookup where the text repeats" if run.lookup_pays(context) else ""
        return (
            f"the cost curve predicts the drafter does not pay here: a {w}-token verify cycle costs {ratio:.1f}x "
            f"one token on this machine (BLAS: {blas_name()}), more than the {run.expected_tokens(w):.1f} tokens "
            f"a cycle is expected to commit; the default starts by decoding plainly{lookup}. "
            f"--block-size {w} shows the drafter."
        )


class SizerRun:
    """One request's side of a `BlockSizer` (`policy.plan.Run`): its own statistics,
    which start from the shared ones and feed them, its random draws, the width it
    keeps, the lookup offer it is scoring and the plain steps it holds.
    (Its widths never change a request's text: greedy picks and a seed's draws,
    `sampling.Draws`, do not depend on them.)
    """

    def __init__(self, sizer: BlockSizer, branches: int = 0):
        self.curve, self.max_width, self.explore = sizer.curve, sizer.max_width, sizer.explore
        self.prior, self.lookup_prior, self.branch_prior = sizer.prior, sizer.lookup_prior, sizer.branch_prior
        self.weight, self.stick = sizer.weight, sizer.stick
        self.sizer = sizer  # what every request learns goes to its statistics too
        self.rng = random.Random(sizer.rng.getrandbits(63))
        self.branches = min(branches, self.curve.tree_branches) if self.curve.tree else branches
        self.clock = Clock()  # tokens this request committed: its own statistics age by it
        self.stats = sizer.shared.capped(sizer.carry, self.clock)
        self.lookup = {n: st.capped(sizer.carry, self.clock) for n, st in sizer.shared_lookup.items()}
        self.alt = [st.capped(sizer.carry, self.clock) for st in sizer.shared_alt]
        self.current = 0  # the drafter width chosen last
        self.pending: List[int] = []  # a lookup offer not yet compared with what was committed
        self.pending_order = 0
        self.matched = 0  # how many of its tokens were committed so far
        self._context, self._costs, self._copy, self._drafts, self._tree = None, [], [], True, {}
        self.held = 0  # plain steps still to run without asking again (`PLAIN_HOLD`)
        self.plain_streak = 0  # plain choices in a row (each doubles the hold)
        self._lookup_pays: Optional[bool] = None
        self._lookup_key: Optional[tuple] = None  # (cost context, statistics version) it was weighed at
        self._version = 0  # bumped whenever this run's acceptance statistics take a check

    def _fresh(self) -> AcceptanceStats:
        """Empty statistics, ageing with this request's tokens."""
        return self.sizer.empty(self.clock)

    def alphas(self) -> List[float]:
        """The drafter's alpha_k for k = 1..max_width-1 (posterior means)."""
        return self.stats.rates(self.prior, self.weight)

    def sampled_alphas(self) -> List[float]:
        """The drafter's alpha_k drawn from their posteriors."""
        return self.stats.sample(self.prior, self.weight, self.rng)

    def _lookup_stats(self, order: int) -> List[AcceptanceStats]:
        """The request's and the shared statistics of lookups matched at n-gram `order` (made on first use)."""
        own = self.lookup.setdefault(order, self._fresh())
        return [own, self.sizer.shared_lookup.setdefault(order, self.sizer.empty())]

    def lookup_alphas(self, order: int = 0) -> List[float]:
        st = self.lookup.get(order)
        return (st or self._fresh()).rates(self.lookup_prior, self.weight)

    def expected_tokens(self, width: int, alphas: Optional[List[float]] = None) -> float:
        alphas = self.alphas() if alphas is None else alphas
        total, run = 1.0, 1.0
        for k in range(width - 1):
            run *= alphas[k]
            total += run
        return total

    def cost(self, width: int, context: int) -> float:
        self._at(context)
        return self._costs[width - 1]

    def _at(self, context: int) -> None:
        # Costs change slowly with context: interpolate again every COST_STEP tokens, not every token.
        if self._context is None or abs(context - self._context) >= COST_STEP:
            self._context, self._costs, self._copy = context, self.curve.costs(context), self.curve.copy_costs(context)
            self._drafts = self._could_pay(self._costs)
            self._tree = self.curve.tree_costs(context, self.branches) if self.branches else {}

    def _could_pay(self, costs: List[float]) -> bool:
        """Whether a cycle that runs the drafter could beat plain steps at these costs even
        if every draft were accepted. If not, no draw ever chooses one: rates are at most
        1, and a cycle of width w commits at most w tokens, trees included."""
        return any(w / costs[w - 1] > 1 / costs[0] for w in range(2, self.max_width + 1))

    def rates(self, context: int, alphas: Optional[List[float]] = None, owed: float = 0.0) -> List[float]:
        """Expected committed tokens per second of the drafter at widths 1..max_width; a
        drafted cycle also pays `owed` seconds per token it commits (a catch-up spread)."""
        self._at(context)
        alphas = self.alphas() if alphas is None else alphas
        out, tokens, run = [], 1.0, 1.0
        for w, a in zip(range(1, self.max_width + 1), [1.0] + alphas):
            if w > 1:
                run *= a
                tokens += run
            out.append(tokens / (self._costs[w - 1] + (owed * tokens if w > 1 else 0.0)))
        return out

    @property
    def learns_branches(self) -> bool:
        """Whether this request's `update` wants `missed` (trees are allowed)."""
        return self.branches > 0

    def alt_rates(self) -> List[List[float]]:
        """Per depth 1..max_width-1, P(the drafter's 2nd / 3rd choice is the target's token | its best is not)."""
        return [st.rates(self.branch_prior, self.weight) for st in self.alt]

    def branch_gain(self, width: int, branches: int, alphas: List[float], alt: List[List[float]]) -> float:
        """Expected tokens `branches` branches add to a best path of `width`: each
        (depth d, choice c) pays where the path holds to d, fails at d and choice c
        is right there, plus the best path's tokens it goes on with (`draft/tree.py`)."""
        return sum(self._forks(alphas, alt)(width)[:branches])

    @staticmethod
    def _forks(alphas: List[float], alt: List[List[float]]):
        """width -> what each (depth, choice) fork adds to a best path of that width
        (`branch_gain`), best first; the work shared by all widths done once."""
        L = trees.BRANCH_LENGTH
        fails, after, reach = [], [], 1.0  # per depth d: P(held to d, fails at d); after[d][m]: m nodes on
        for d in range(1, len(alphas) + 1):
            fails.append(reach * (1 - alphas[d - 1]))
            reach *= alphas[d - 1]
            row, run = [0.0, 1.0], 1.0
            for k in range(d + 1, min(d + L, len(alphas) + 1)):
                run *= alphas[k - 1]
                row.append(row[-1] + run)
            after.append(row)

        def values(width: int) -> List[float]:
            length = min(L, width - 1)
            out = []
            for d in range(1, width):
                pays = fails[d - 1] * after[d - 1][min(length, width - d)]
                out += [pays * rates[d - 1] for rates in alt]
            return sorted(out, reverse=True)

        return values

    def best_tree(self, alphas: List[float], alt: List[List[float]], owed: float = 0.0) -> Tuple[Plan, float]:
        """The best tree plan (width and branches) and its rate at the curve's tree costs
        (`CostCurve.tree_costs`); (PLAIN, 0) if no tree fits the measured widths."""
        plan, rate = PLAIN, 0.0
        if not self._tree:
            return plan, rate
        path, run, forks, values = [1.0], 1.0, {}, self._forks(alphas, alt)
        for a in alphas:  # path[w - 1]: the best path's expected tokens at width w
            run *= a
            path.append(path[-1] + run)
        for (w, b), cost in self._tree.items():
            if w not in forks:
                forks[w] = values(w)
            tokens = path[w - 1] + sum(forks[w][:b])
            r = tokens / (cost + owed * tokens)
            if r > rate:
                plan, rate = Plan(w, 0, b), r
        return plan, rate

    def best(self, context: int, offered: int = 0, alphas: Optional[List[float]] = None,
             order: int = 0, alt: Optional[List[List[float]]] = None, owed: float = 0.0) -> Tuple[Plan, float]:
        """The best plan and its rate, given a lookup offer of `offered` tokens (matched
        at n-gram `order`), the drafter's `alphas` and its alternatives' hit rates `alt`
        (default: their means); plans that run the drafter also pay `owed` seconds per
        token they commit. Pure: changes nothing."""
        alphas = self.alphas() if alphas is None else alphas
        rates = self.rates(context, alphas, owed)
        w = max(range(self.max_width), key=rates.__getitem__) + 1
        if self.current and rates[self.current - 1] * self.stick >= rates[w - 1]:
            w = self.current  # keep the previous width unless another is clearly better: estimates are noisy
        plan, rate = Plan(w), rates[w - 1]
        if self.branches and w > 1:  # a tree refines a drafted cycle; it is no reason to draft
            tree, r = self.best_tree(alphas, self.alt_rates() if alt is None else alt, owed)
            if r > rate * self.stick:
                plan, rate = tree, r
        m = min(offered, self.max_width - 1)
        if m == 0:
            return plan, rate
        look, head, run = self.lookup_alphas(order), 1.0, 1.0
        for k in range(1, m + 1):  # the lookup's first k tokens alone: a bare verify of k + 1 rows
            run *= look[k - 1]
            head += run
            if head / self._copy[k] > rate:
                plan, rate = Plan(k + 1, k), head / self._copy[k]
        tail, drun = 0.0, 1.0
        for w in range(m + 2, self.max_width + 1):  # all of it, then the drafter's guesses
            drun *= alphas[w - 2]
            tail += drun
            r = (head + run * tail) / (self._costs[w - 1] + owed * (head + run * tail))
            if r > rate:
                plan, rate = Plan(w, m), r
        return plan, rate

    def choose(self, context: int, offer: Sequence[int] = (), unseen: int = 0, left: int = 0) -> Plan:
        """The plan of the next cycle, given the source's lookup `offer` (its `order`, if
        it has one, is the n-gram order of the match), the `unseen` context rows the
        drafter would first catch up on and the `left` tokens of the budget.

        The catch-up (a long prompt's, before the first drafted cycle) is paid once,
        so it is spread over the tokens left (at most `CATCH_UP_SPREAD`): drafting must
        pay for it over the rest of the request, not within one cycle.
        """
        order = getattr(offer, "order", 0)
        if offer and not self.pending:
            self.pending, self.pending_order = list(offer[: self.max_width - 1]), order
        if self.held and not offer:
            self.held -= 1
            return PLAIN
        self._at(context)
        if not offer and not self._drafts:  # nothing to draw: only a lookup could beat a plain step here
            plan = PLAIN
        else:
            explore = self.explore
            spread = min(left, CATCH_UP_SPREAD)
            owed = self.curve.catch_up_seconds(context, unseen) / spread if unseen and spread > 0 else 0.0
            plan, _ = self.best(context, len(offer), self.sampled_alphas() if explore else None, order,
                                owed=owed)
        if plan.copied == 0 and not plan.branches:
            self.current = plan.width
        self.plain_streak = self.plain_streak + 1 if plan == PLAIN and self.max_width > 1 else 0
        hold = min(PLAIN_HOLD << max(self.plain_streak - 1, 0), PLAIN_HOLD_MAX) if plan == PLAIN else 0
        self.held = max(hold - 1, 0)
        return plan

    def copies(self, offer: Sequence[int], width: int) -> int:
        """How many of a lookup `offer` (its `order`, if it has one, the n-gram order of the
        match) a cycle of `width` set by others (a batch's) copies before the drafter's
        guesses: the count with the most expected accepted drafts. The offer is scored
        against the tokens committed next (`record`), as `choose`'s are."""
        order = getattr(offer, "order", 0)
        if offer and not self.pending:
            self.pending, self.pending_order = list(offer[: self.max_width - 1]), order
        if min(len(offer), width - 1) == 0:
            return 0
        return self.best_copies(len(offer), order, width)[0]

    def best_copies(self, offered: int, order: int, width: int, alphas: Optional[List[float]] = None,
                    look: Optional[List[float]] = None) -> Tuple[int, float]:
        """Of a lookup offer of `offered` tokens (n-gram `order`), how many a cycle of `width`
        copies before the drafter's guesses, and the accepted drafts it then expects (the count
        with the most). `alphas`, `look`: this run's drafter and lookup rates, if already read."""
        alphas = self.alphas() if alphas is None else alphas
        look = self.lookup_alphas(order) if look is None and offered else look

        def expected(k: int) -> float:
            run, total = 1.0, 0.0
            for i in range(min(width - 1, len(alphas))):
                run *= look[i] if i < k else alphas[i]
                total += run
            return total

        best = max(range(min(offered, width - 1) + 1), key=expected)
        return best, expected(best)

    def drafter_pays(self, first: int, last: int) -> bool:
        """Whether a cycle that runs the drafter could beat plain decoding anywhere from
        context `first` to `last` even if every draft were accepted (`_could_pay`); if
        not, the request needs no drafter context at all."""
        return any(self._could_pay(self.curve.costs(c))
                   for c in [first, last] + [c for c in self.curve.contexts if first < c < last])

    def lookup_pays(self, context: int) -> bool:
        """Whether a full lookup offer (of any order) would be used now (else plain steps may run
        ahead without asking). Asked at most once per plain step, it is weighed again only
        when the costs move on (every `COST_STEP` tokens) or a check changed the statistics."""
        self._at(context)
        key = (self._context, self._version)
        if key != self._lookup_key:
            self._lookup_pays = any(self.best(context, self.max_width - 1, order=n)[0].copied > 0
                                    for n in set(self.lookup) | {0})
            self._lookup_key = key
        return self._lookup_pays

    def update(self, plan: Plan, outcome: Outcome) -> None:
        self.record(plan, outcome.accepted, outcome.tokens, outcome.missed)

    def record(self, plan: Plan, accepted: int, tokens: Sequence[int] = (),
               missed: Optional[Tuple[int, int]] = None) -> None:
        """Record a cycle: `accepted` of its `width - 1` draft tokens were kept; `tokens` were committed.

        `missed` (asked for where `learns_branches`): the first draft depth d at
        which the drafter's best guess was not the target's token, and which of
        the drafter's alternatives was (2 or 3; 0 for neither), or None when
        every best guess held. For a tree it also says how far the best path held.
        """
        self.clock.tokens += len(tokens)
        self.sizer.shared_clock.tokens += len(tokens)
        if plan.branches:  # the drafter's rates see the best path alone
            accepted = plan.width - 1 if missed is None else missed[0] - 1
        if plan.drafts and accepted >= plan.copied:  # the drafter's positions were reached
            checked = range(plan.copied + 1, min(accepted + 2, plan.width))
            for st in (self.stats, self.sizer.shared):
                st.add(checked, accepted)
            self._version += 1
        if missed is not None and missed[0] < self.max_width:
            d, choice = missed
            for c, (own, shared) in enumerate(zip(self.alt, self.sizer.shared_alt), start=2):
                for st in (own, shared):
                    st.add(range(d, d + 1), d if choice == c else d - 1)
        if self.pending and tokens:
            self._compare(tokens)

    def _compare(self, tokens: Sequence[int]) -> None:
        """Score the pending lookup offer against committed tokens (it may take several cycles to settle)."""
        offer, done = self.pending, self.matched
        for t in tokens:
            if offer[done] != t or done + 1 == len(offer):
                hit = done + (offer[done] == t)
                for st in self._lookup_stats(self.pending_order):
                    st.add(range(1, min(hit + 2, len(offer) + 1)), hit)
                self._version += 1
                self.pending, self.matched = [], 0
                return
            done += 1
        self.matched = done
