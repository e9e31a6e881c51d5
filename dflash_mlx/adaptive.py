"""Adaptive block size.

The cost of a cycle at block size b is the drafter's pass, the target's
verify pass over b tokens and the loop's fixed work (acceptance, the host
synchronisation, cropping), all growing with context length; the gain is the
expected number of committed tokens, 1 + sum_k prod_{j<=k} alpha_j, where
alpha_j is the running rate at which draft position j is accepted once
positions before it were. Each cycle picks the b that maximises gain / cost,
with the alphas drawn from their posteriors (Thompson sampling), so that
what is not tried is still learnt.

The cost curve times whole cycles, widths interleaved round by round and each
round normalised by its own mean, so that a machine whose speed wanders
(other processes, clocks) still yields a steady shape. It is kept per (model,
drafter, quantization, dtype, backend, MLX version, BLAS) as JSON: the first
run measures for about ten seconds, and later runs add a few seconds of
rounds (and any context that fits) until every width is settled.
Only relative costs decide the width, so the curve is not corrected online:
earlier versions did, per width, and the noise of single cycles made the
choice wander between widths that were in truth no better.
"""

import copy
import hashlib
import json
import math
import platform
import random
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import mlx.core as mx

from . import kept_files
from . import tree as trees

# Context lengths the cost curve times cycles at (those that fit the model's window).
# Beyond the last, costs grow at the slope between the last two: at 64 and 1,024 tokens
# a step's fixed work hides how attention grows with context, so 4,096 is timed too
# (the curve from 64 and 1,024 alone put a drafted cycle at twice its measured cost
# relative to a plain step at 16k tokens; benchmarks/README.md).
CONTEXTS = (64, 1024, 4096)
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
CURVE_VERSION = 11  # bump when what a curve measures, or how it is kept, changes
CURVE_KIND = "dflash_mlx.cost_curve"
# A kept timing above this (seconds for one cycle) is not a measurement: the file is damaged.
MAX_SECONDS = 3600.0
# Trees of up to this many branches are timed with the curve (`tree_shapes`), and so
# weighed by `auto` unless a request says otherwise.
TREE_BRANCHES = 2
# A kept acceptance count is refused above this when its statistics never forget
# (decay 1): a request's checks of one position are far fewer.
MAX_KEPT_COUNT = 1e9


def tree_rows(width: int, branches: int) -> int:
    """Rows a tree of this width and branch count verifies (`tree.shape`, a large vocabulary)."""
    b, length = trees.shape(width, branches, 1 << 30)
    return width + b * length


def tree_shapes(max_width: int, branches: int = TREE_BRANCHES) -> List[Tuple[int, int]]:
    """The (width, branches) trees a curve times: per branch count, the narrowest and the
    widest tree whose rows fit the measured widths (costs between are interpolated)."""
    out = []
    for b in range(1, branches + 1):
        fit = [w for w in range(3, max_width + 1) if tree_rows(w, b) <= max_width]
        out += sorted({(fit[0], b), (fit[-1], b)}) if fit else []
    return out


@dataclass
class CostCurve:
    contexts: List[int]
    verify: List[List[float]]  # [context][width - 1] seconds
    draft: List[List[float]]  # [context][width - 1] seconds (0 for width 1)
    cycle: Optional[List[List[float]]] = None  # [context][width - 1] whole cycle, seconds
    copy: Optional[List[List[float]]] = None  # [context][width - 1] a cycle without a drafter pass (a lookup's)
    catch_up: Optional[List[float]] = None  # [context] seconds per row the drafter catches up on (0: not measured)
    tree: Optional[List[List[float]]] = None  # [context][shape] a tree cycle of each of `tree_shapes`
    tree_shapes: Optional[List[Tuple[int, int]]] = None  # (width, branches) of the timed trees

    @property
    def max_width(self) -> int:
        return len((self.cycle or self.verify)[0])

    @property
    def tree_branches(self) -> int:
        """The most branches of a timed tree (0: trees were not timed on this curve)."""
        return max((b for _, b in self.tree_shapes or ()), default=0) if self.tree else 0

    def _interpolate(self, rows: List[List[List[float]]], context: int, floor: Optional[float] = None) -> List[float]:
        """Sum of `rows` at `context`, interpolated linearly in context length.

        Below the first measured context the first measurement is used. Beyond the
        last, each column grows on at its slope between the last two measurements,
        never slower than `floor` (seconds per context token) nor below zero: a
        long context's attention (the target's and the drafter's) keeps adding to
        every cycle, and a width whose cost grew slower than a plain step's would
        look cheaper the longer the context, which no backend does.
        """
        cs = self.contexts
        i = 0 if context <= cs[0] else min(len(cs) - 2, next((j for j in range(len(cs) - 1) if context <= cs[j + 1]), len(cs) - 2))
        j = min(i + 1, len(cs) - 1)
        t = 0.0 if cs[j] == cs[i] else min(1.0, max(0.0, (context - cs[i]) / (cs[j] - cs[i])))
        out = [0.0] * len(rows[0][0])
        for r in rows:
            a, b = r[i], r[j]
            for w in range(len(out)):
                out[w] += a[w] + t * (b[w] - a[w])
        beyond = context - cs[-1]
        if beyond > 0 and len(cs) > 1:
            slopes = self._slopes(rows)
            out = [c + beyond * max(g, floor or 0.0, 0.0) for c, g in zip(out, slopes)]
        return [max(1e-9, c) for c in out]

    def _slopes(self, rows: List[List[List[float]]]) -> List[float]:
        """Seconds per context token each column of `rows` grew by between the last two measured contexts."""
        cs = self.contexts
        span = cs[-1] - cs[-2]
        return [sum(r[-1][w] - r[-2][w] for r in rows) / span for w in range(len(rows[0][0]))]

    def _cycle_rows(self) -> List[List[List[float]]]:
        return [self.cycle] if self.cycle is not None else [self.verify, self.draft]

    def _plain_slope(self) -> float:
        """How fast a plain step's cost grows with context beyond the measured ones."""
        return max(0.0, self._slopes(self._cycle_rows())[0]) if len(self.contexts) > 1 else 0.0

    def costs(self, context: int) -> List[float]:
        """Seconds per drafted cycle for widths 1..max_width at `context`."""
        return self._interpolate(self._cycle_rows(), context, self._plain_slope())

    def copy_costs(self, context: int) -> List[float]:
        """Seconds per cycle that verifies copied tokens (no drafter pass) for widths 1..max_width."""
        if self.copy is not None:
            return self._interpolate([self.copy], context, self._plain_slope())
        if self.verify:
            return self._interpolate([self.verify], context, self._plain_slope())
        return self.costs(context)  # unknown: no cheaper than a drafted cycle

    def catch_up_seconds(self, context: int, rows: int) -> float:
        """Seconds the drafter takes to catch up on the last `rows` rows of a `context`-token
        context (the taps' own work, e.g. a tapped last layer, and its projection).

        A row's cost is interpolated linearly in context between the contexts where
        it was measured (held below the first); beyond the last it grows at the
        slope between the last two, and at least as a plain step's cost does (both
        are a token's work through layers whose attention reads the whole context)."""
        measured = [(c, r) for c, r in zip(self.contexts, self.catch_up or ()) if r > 0]
        if not measured or rows <= 0:
            return 0.0
        c, per_row = measured[-1]
        if context > c:
            slope = (per_row - measured[-2][1]) / (c - measured[-2][0]) if len(measured) > 1 else 0.0
            per_row = max(per_row * self.cost(1, context) / self.cost(1, c), per_row + slope * (context - c))
        else:
            (c0, r0), (c1, r1) = next(((a, b) for a, b in zip(measured, measured[1:]) if context <= b[0]),
                                      (measured[0], measured[0]))
            per_row = r0 if c1 == c0 or context <= c0 else r0 + (r1 - r0) * (context - c0) / (c1 - c0)
        return per_row * rows

    def tree_costs(self, context: int, branches: int) -> Dict[Tuple[int, int], float]:
        """Seconds per tree cycle for every (width, branch count <= `branches`) whose rows fit the
        measured widths: a drafted cycle at the path's width plus the extra rows of a bare
        verify, plus what the timed trees cost beyond that (the tree's own work: ranking the
        drafter's choices, the mask, moving the accepted rows), interpolated in width
        between the timed shapes of each branch count. A curve that timed no trees
        has none of that extra; where it timed some, branch counts it did not time are left out."""
        costs, copies = self.costs(context), self.copy_costs(context)
        W = self.max_width

        def model(w, b, costs=costs, copies=copies):
            return costs[w - 1] + copies[tree_rows(w, b) - 1] - copies[w - 1]

        extra: Dict[int, List[Tuple[int, float]]] = {}
        if self.tree:
            # A tree's own work beyond the model, as timed: held beyond the measured contexts.
            held = min(context, self.contexts[-1])
            at = self.costs(held), self.copy_costs(held)
            for (w, b), t in zip(self.tree_shapes, self._interpolate([self.tree], held)):
                extra.setdefault(b, []).append((w, t - model(w, b, *at)))
            branches = min(branches, max(extra))
        out = {}
        for b in range(1, branches + 1):
            if self.tree and b not in extra:
                continue
            for w in range(3, W + 1):
                if tree_rows(w, b) > W:
                    break
                out[(w, b)] = max(1e-9, model(w, b) + _between(extra.get(b, [(w, 0.0)]), w))
        return out

    def cost(self, width: int, context: int) -> float:
        return self.costs(context)[width - 1]

    def relative(self, context: int = 64) -> List[float]:
        base = self.cost(1, context)
        return [self.cost(w, context) / base for w in range(1, self.max_width + 1)]

    @classmethod
    def from_samples(cls, samples: "CostSamples", min_rounds: int = 3) -> "CostCurve":
        """The curve over the first context and any other measured `min_rounds` times so far.

        `verify` and `draft` (reports only) hold the contexts whose halves were timed apart.
        """
        n = [i for i, rounds in enumerate(samples.cycle) if rounds and (i == 0 or len(rounds) >= min_rounds)]
        verify, draft, cycle, copies, timed = [], [], [], [], []
        W = samples.max_width
        for i in n:
            parts = samples.parts[i]
            if parts:
                means = [sum(c) / len(c) for c in samples.cycle[i][: len(parts)]]  # parts share their round's scale
                verify.append(profile([p[0] for p in parts], means))
                draft.append(profile([p[1] for p in parts], means))
            both = profile(samples.rounds(i))  # drafted, copied and tree cycles share each round's scale
            cycle.append(both[:W])
            copies.append(both[:1] + both[W : 2 * W - 1] if len(both) > W else None)
            timed.append(both[2 * W - 1 :] if len(both) > 2 * W - 1 else None)
        copies = None if any(c is None for c in copies) else copies
        timed = None if not samples.tree_shapes or any(t is None for t in timed) else timed
        shapes = [tuple(t) for t in samples.tree_shapes] if timed else None
        catch_up = [samples.catch_up[i] for i in n]
        return cls([samples.contexts[i] for i in n], verify, draft, cycle, copies, catch_up, timed, shapes)


@dataclass
class CostSamples:
    """The raw rounds a cost curve is made from, kept so later runs can add to them."""

    contexts: List[int]
    max_width: int
    cycle: List[List[List[float]]] = field(default_factory=list)  # [context][round][width - 1] seconds
    copy: List[List[List[float]]] = field(default_factory=list)  # [context][round][width - 2]: copied widths 2..
    parts: List[List[List[List[float]]]] = field(default_factory=list)  # [context][round][verify, draft][width - 1]
    setup_per_token: float = 0.0  # seconds to set the longest timed context up (its prefill), per token
    catch_up: List[float] = field(default_factory=list)  # [context] seconds per row of the drafter's catch-up
    tree_shapes: List[List[int]] = field(default_factory=list)  # (width, branches) of the trees timed
    tree: List[List[List[float]]] = field(default_factory=list)  # [context][round][shape] seconds

    def __post_init__(self):
        self.cycle = self.cycle or [[] for _ in self.contexts]
        self.catch_up = self.catch_up or [0.0 for _ in self.contexts]
        self.copy = self.copy or [[] for _ in self.contexts]
        self.parts = self.parts or [[] for _ in self.contexts]
        self.tree = self.tree or [[] for _ in self.contexts]

    def rounds(self, i: int) -> List[List[float]]:
        """Context i's rounds: drafted widths 1..W, then copied widths 2..W and the
        timed trees (where timed) in each."""
        copy, tree = self.copy[i], self.tree[i]
        if len(copy) != len(self.cycle[i]):
            return self.cycle[i]
        if not self.tree_shapes or len(tree) != len(copy):
            return [c + k for c, k in zip(self.cycle[i], copy)]
        return [c + k + t for c, k, t in zip(self.cycle[i], copy, tree)]

    def done(self, min_rounds: int, max_rounds: int, tolerance: float) -> bool:
        return all(finished(self.rounds(i), min_rounds, max_rounds, tolerance) for i in range(len(self.contexts)))

    @classmethod
    def parse(cls, data, contexts: Sequence[int], max_width: int) -> "CostSamples":
        """Samples kept by an earlier process for these contexts and widths; ValueError
        (saying what is wrong) unless every field has the shape and range a measurement gives."""
        if not isinstance(data, dict) or set(data) - {f.name for f in fields(cls)}:
            raise ValueError("not cost samples")
        if data.get("contexts") != list(contexts) or data.get("max_width") != max_width:
            raise ValueError(f"contexts or widths other than {list(contexts)} and {max_width}")
        n, W = len(contexts), max_width

        def seconds(x, zero_ok=False):
            if not isinstance(x, (int, float)) or isinstance(x, bool) or not math.isfinite(x) or x < 0 \
                    or (x == 0 and not zero_ok) or x > MAX_SECONDS:
                raise ValueError(f"a timing of {str(x)[:20]}")
            return float(x)

        def rounds(value, width, zero_ok=False):
            if not isinstance(value, list) or len(value) != n:
                raise ValueError("rounds for other contexts")
            for per_context in value:
                if not isinstance(per_context, list):
                    raise ValueError("rounds of another shape")
                for r in per_context:
                    if not isinstance(r, list) or len(r) != width:
                        raise ValueError("a round of another width")
                    for x in r:
                        seconds(x, zero_ok)
            return value

        shapes = data.get("tree_shapes", [])
        if not isinstance(shapes, list) or any(
                not isinstance(t, list) or len(t) != 2 or tuple(t) not in tree_shapes(W) for t in shapes):
            raise ValueError("trees the curve does not time")
        out = cls(list(contexts), W,
                  cycle=rounds(data.get("cycle", [[]] * n), W),
                  copy=rounds(data.get("copy", [[]] * n), W - 1),
                  tree=rounds(data.get("tree", [[]] * n), len(shapes)), tree_shapes=shapes)
        parts = data.get("parts", [[]] * n)
        if not isinstance(parts, list) or len(parts) != n:
            raise ValueError("parts for other contexts")
        for per_context in parts:  # rounds of [verify, draft] halves, each over widths 1..W
            if not isinstance(per_context, list):
                raise ValueError("parts of another shape")
            for r in per_context:
                if not isinstance(r, list) or len(r) != 2 or any(not isinstance(h, list) or len(h) != W for h in r):
                    raise ValueError("parts of another shape")
                for half in r:
                    for x in half:
                        seconds(x, zero_ok=True)
        out.parts = parts
        catch_up = data.get("catch_up", [0.0] * n)
        if not isinstance(catch_up, list) or len(catch_up) != n:
            raise ValueError("catch-up for other contexts")
        out.catch_up = [seconds(x, zero_ok=True) for x in catch_up]
        out.setup_per_token = seconds(data.get("setup_per_token", 0.0), zero_ok=True)
        return out


class Plan(NamedTuple):
    """One cycle: its verify width, how many of its draft positions are copied from a lookup offer
    (the rest the drafter fills; with `copied == width - 1` no drafter pass runs), and how many
    branches are verified beside the drafter's best path in a tree (`tree.py`; none copied then)."""

    width: int
    copied: int = 0
    branches: int = 0

    @property
    def drafts(self) -> bool:
        return self.width > self.copied + 1


PLAIN = Plan(1)


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

    def __init__(self, n: int, decay: float = 0.98, half_life: float = 1024.0, clock: Optional[Clock] = None):
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


class FixedWidth:
    """The block-size policy of a fixed --block-size: the drafter at that width, every cycle
    (verified as a tree with `branches` where the loop can)."""

    def __init__(self, width: int, branches: int = 0):
        self.plan = Plan(width, 0, branches if width > 1 else 0)

    def start(self, seeded: bool = False, branches: int = 0) -> "FixedWidth":
        return self

    def choose(self, context: int, offer: Sequence[int] = (), unseen: int = 0, left: int = 0) -> Plan:
        return self.plan

    def update(self, plan: Plan, accepted: int, tokens: Sequence[int] = (), missed=None) -> None:
        pass

    def lookup_pays(self, context: int) -> bool:
        return False

    def drafter_pays(self, first: int, last: int) -> bool:
        return self.plan.width > 1


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

    Statistics are kept across requests (the drafter's usual form) and per
    request: a request starts from the shared rates, worth `carry`
    observations per position, so that its own outcomes take over within a
    few cycles.

    Where the request allows tree verification (`start(branches=n)`: greedy,
    a target with plain KV caches), a cycle may also verify the best path
    with up to n branches, each the drafter's 2nd or 3rd choice at one depth
    followed by the best path's tokens (`tree.py`). Its gain comes from how
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

    def __init__(self, curve: CostCurve, max_width: int, prior: float = 0.8, lookup_prior: float = 0.5,
                 weight: float = 4.0, decay: float = 0.98, half_life: float = 1024.0, carry: float = 8.0,
                 stick: float = 1.03, explore: bool = True, branch_prior: float = 0.2):
        self.curve = curve
        self.explore = explore  # False: choose on the posterior means (no exploring)
        self.rng = random.Random(0)
        self.max_width = min(max_width, curve.max_width)
        self.prior, self.lookup_prior, self.weight, self.carry, self.stick = prior, lookup_prior, weight, carry, stick
        # Tokens committed: by every request (the shared statistics age by it), and by this request.
        self.shared_clock = self.clock = Clock()
        self.shared = AcceptanceStats(self.max_width, decay, half_life, self.shared_clock)
        # The lookup's, per n-gram order of the match (0: offers that name none): a long match is surer.
        self.shared_lookup: Dict[int, AcceptanceStats] = {}
        self.stats, self.lookup = self.shared, self.shared_lookup  # a request's own, once start() made them
        # Per depth: how often the drafter's 2nd and 3rd choices are the target's token where its best is not.
        self.branch_prior = branch_prior
        self.shared_alt = [AcceptanceStats(self.max_width, decay, half_life, self.shared_clock) for _ in range(2)]
        self.alt = self.shared_alt
        self.branches = 0  # tree branches a cycle of this request may verify (0: linear only)
        self.current = 0  # the drafter width chosen last
        self.pending: List[int] = []  # a lookup offer not yet compared with what was committed
        self.pending_order = 0
        self.matched = 0  # how many of its tokens were committed so far
        self._context, self._costs, self._copy, self._drafts, self._tree = None, [], [], True, {}
        self.held = 0  # plain steps still to run without asking again (`PLAIN_HOLD`)
        self.plain_streak = 0  # plain choices in a row (each doubles the hold)
        self._lookup_pays: Optional[bool] = None
        self._lookup_key: Optional[tuple] = None  # (cost context, statistics version) it was weighed at
        self._version = 0  # bumped whenever this sizer's acceptance statistics take a check

    def fresh(self) -> "BlockSizer":
        """A sizer with this one's curve and settings and none of its statistics."""
        return BlockSizer(self.curve, self.max_width, self.prior, self.lookup_prior, self.weight, self.shared.decay,
                          self.shared.half_life, self.carry, self.stick, self.explore, self.branch_prior)

    def start(self, seeded: bool = False, branches: int = 0) -> "BlockSizer":
        """A sizer for a new request: this curve, the shared statistics as its prior;
        cycles may verify trees of up to `branches` branches (at most as many as the curve
        timed, where it timed trees: `default_branches`).

        A seeded request starts from the prior alone, and draws its rates from
        a fixed seed (Python's generator, not MLX's), so that its widths, and with them
        the order its random numbers are drawn in, are the same whatever
        earlier requests taught the shared statistics.
        """
        run = copy.copy(self)  # shares the curve and the shared statistics
        run.rng = random.Random(0 if seeded else self.rng.getrandbits(63))
        run.branches = min(branches, self.curve.tree_branches) if self.curve.tree else branches
        run._context = None  # its tree costs are those of its branches
        run.clock = Clock()
        if seeded:
            run.stats, run.lookup, run.alt = run._fresh(), {}, [run._fresh(), run._fresh()]
        else:
            run.stats = self.shared.capped(self.carry, run.clock)
            run.lookup = {n: st.capped(self.carry, run.clock) for n, st in self.shared_lookup.items()}
            run.alt = [st.capped(self.carry, run.clock) for st in self.shared_alt]
        run.current, run.pending, run.matched, run.pending_order = 0, [], 0, 0
        run.held, run.plain_streak, run._lookup_pays, run._lookup_key, run._version = 0, 0, None, None, 0
        return run

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
        drafter, alt = self._fresh(shared=True), [self._fresh(shared=True) for _ in self.shared_alt]
        drafter.load(state["drafter"])
        for st, kept in zip(alt, state["alt"], strict=True):
            st.load(kept)
        lookup = {}
        for n, kept in state["lookup"].items():
            lookup[int(n)] = self._fresh(shared=True)
            lookup[int(n)].load(kept)
        for own, kept in zip([self.shared, *self.shared_alt], [drafter, *alt]):
            own._tried, own._accepted, own._seen = kept._tried, kept._accepted, own.clock.tokens
        self.shared_lookup.clear()
        self.shared_lookup.update(lookup)

    def explain(self, context: int) -> Optional[str]:
        """Why a request at `context` tokens would start with plain decoding; None if it drafts."""
        run = self.start()
        if run.best(context)[0] != PLAIN:
            return None
        w = self.max_width
        ratio = self.curve.cost(w, context) / self.curve.cost(1, context)
        plainly = "decoding plainly, with lookup drafts where the text repeats" if run.lookup_pays(context) \
            else "decoding plainly"
        return (
            f"drafting does not pay here: a {w}-token verify cycle costs {ratio:.1f}x one token "
            f"on this machine (BLAS: {blas_name()}), more than the {self.expected_tokens(w):.1f} tokens "
            f"a cycle is expected to commit; {plainly}. --block-size {w} shows the drafter."
        )

    def alphas(self) -> List[float]:
        """The drafter's alpha_k for k = 1..max_width-1 (posterior means)."""
        return self.stats.rates(self.prior, self.weight)

    def sampled_alphas(self) -> List[float]:
        """The drafter's alpha_k drawn from their posteriors."""
        return self.stats.sample(self.prior, self.weight, self.rng)

    def _fresh(self, shared: bool = False) -> AcceptanceStats:
        """Empty statistics, ageing with this request's tokens (or, `shared`, with every request's)."""
        return AcceptanceStats(self.max_width, self.shared.decay, self.shared.half_life,
                               self.shared_clock if shared else self.clock)

    def _lookup_stats(self, order: int) -> List[AcceptanceStats]:
        """The request's and the shared statistics of lookups matched at n-gram `order` (made on first use)."""
        own = self.lookup.setdefault(order, self._fresh())
        if self.lookup is self.shared_lookup:
            return [own]
        return [own, self.shared_lookup.setdefault(order, self._fresh(shared=True))]

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
        is right there, plus the best path's tokens it goes on with (`tree.py`)."""
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

    def update(self, plan: Plan, accepted: int, tokens: Sequence[int] = (),
               missed: Optional[Tuple[int, int]] = None) -> None:
        """Record a cycle: `accepted` of its `width - 1` draft tokens were kept; `tokens` were committed.

        `missed` (asked for where `learns_branches`): the first draft depth d at
        which the drafter's best guess was not the target's token, and which of
        the drafter's alternatives was (2 or 3; 0 for neither), or None when
        every best guess held. For a tree it also says how far the best path held.
        """
        self.clock.tokens += len(tokens)
        if self.clock is not self.shared_clock:
            self.shared_clock.tokens += len(tokens)
        if plan.branches:  # the drafter's rates see the best path alone
            accepted = plan.width - 1 if missed is None else missed[0] - 1
        if plan.drafts and accepted >= plan.copied:  # the drafter's positions were reached
            checked = range(plan.copied + 1, min(accepted + 2, plan.width))
            for st in self._both(self.stats, self.shared):
                st.add(checked, accepted)
            self._version += 1
        if missed is not None and missed[0] < self.max_width:
            d, choice = missed
            for c, (own, shared) in enumerate(zip(self.alt, self.shared_alt), start=2):
                for st in self._both(own, shared):
                    st.add(range(d, d + 1), d if choice == c else d - 1)
        if self.pending and tokens:
            self._compare(tokens)

    @staticmethod
    def _both(own: AcceptanceStats, shared: AcceptanceStats) -> List[AcceptanceStats]:
        """A request's statistics and the shared ones, once each (the root sizer records into the shared directly)."""
        return [own] if own is shared else [own, shared]

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


def blas_name() -> str:
    """Which BLAS this process runs on (Linux: read from the loaded libraries)."""
    if platform.system() != "Linux":
        return "Accelerate" if platform.system() == "Darwin" else "unknown"
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "unknown"
    return _blas_of(line.split()[-1] for line in maps.splitlines() if "/" in line)


def _blas_of(paths) -> str:
    """The BLAS among loaded library `paths`. Only libraries MLX can resolve BLAS
    symbols from count (numpy's bundled OpenBLAS is private to numpy), and only
    by the library's own name or folder: MLX's JIT-compiled kernels are loaded
    too, and their names spell out ops ("...MinimumKL..." holds "mkl")."""
    found = set()
    for path in paths:
        p = Path(path.lower())
        if not p.name.startswith("lib") or ".so" not in p.name or "numpy" in path.lower():
            continue
        if "openblas" in p.name or "openblas" in p.parent.name:  # Debian's: openblas-pthread/libblas.so.3
            found.add("openblas")
        elif p.name.startswith("libmkl"):
            found.add("mkl")
        elif p.name.startswith("libblis"):
            found.add("blis")
    for name in ("openblas", "mkl", "blis"):
        if name in found:
            return name
    return "reference (stock mlx[cpu])"


def _between(points: List[Tuple[int, float]], x: int) -> float:
    """y at x, linearly between the (x, y) `points` and held beyond the first and the last."""
    points = sorted(points)
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return points[-1][1]


def _median(xs: List[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def normalised(rounds: List[List[float]], means: Optional[List[float]] = None) -> List[List[float]]:
    """Per width, its timings divided by their round's mean (or by `means`, one per round)."""
    means = means or [sum(r) / len(r) for r in rounds]
    return [[r[w] / m for r, m in zip(rounds, means)] for w in range(len(rounds[0]))]


def profile(rounds: List[List[float]], means: Optional[List[float]] = None) -> List[float]:
    """A robust per-width cost from rounds of timings (rows: rounds, columns: widths).

    Each round is divided by its own mean first, so that a machine that speeds
    up or slows down between rounds (other processes, clocks) does not bend
    the shape; the median shape is then scaled by the median round mean.
    """
    means = means or [sum(r) / len(r) for r in rounds]
    return [_median(col) * _median(means) for col in normalised(rounds, means)]


def settled(rounds: List[List[float]], tolerance: float) -> bool:
    """Whether every width's median shape is known to within `tolerance` (relative standard error)."""
    n = len(rounds)
    if n < 3:
        return False
    for col in normalised(rounds):
        mean = sum(col) / n
        sd = (sum((x - mean) ** 2 for x in col) / (n - 1)) ** 0.5
        if 1.25 * sd / n ** 0.5 > tolerance * _median(col):  # standard error of a median
            return False
    return True


def finished(rounds: List[List[float]], min_rounds: int, max_rounds: int, tolerance: float) -> bool:
    """Whether a context needs no more rounds: `max_rounds` of them, or settled after `min_rounds`."""
    return len(rounds) >= max_rounds or (len(rounds) >= min_rounds and settled(rounds, tolerance))


# (draft(width) -> tokens, verify(width, tokens) -> how many cycles it ran: None for one) for a context
# of n tokens, optionally with the seconds per row the drafter took to catch up on that context
CycleParts = Tuple[Callable[[int], mx.array], Callable[[int, mx.array], None]]


def measure_cost_curve(make_cycle: Callable[[int], CycleParts], max_width: int, contexts=CONTEXTS,
                       budget: float = 10.0, min_rounds: int = 3, max_rounds: int = 40, tolerance: float = 0.02,
                       split_rounds: int = 0, samples: Optional[CostSamples] = None, at_least: int = 0,
                       progress: Callable[[float, float], None] = lambda done, total: None,
                       trees: Sequence[Tuple[int, int]] = ()) -> CostSamples:
    """Time whole cycles at each width and context, within about `budget` seconds.

    `make_cycle(n)` sets up a context of n tokens and returns its two halves:
    `draft(w)` (lazy draft tokens) and `verify(w, tokens)` (the verify pass,
    the cycle's one host synchronisation and the crop back), and optionally
    the seconds per row the drafter took to catch up on the context (kept as
    the curve's `catch_up`). Widths are
    interleaved within each round in alternating order, and rounds are
    normalised before their median is taken (`profile`), so drift of the
    machine's overall speed does not bend the shape.

    Rounds go first to contexts with fewer than `min_rounds` (the very first
    context gets them at once, whatever the budget), then to contexts whose
    widths are not yet known to `tolerance`, up to `max_rounds`; a round
    starts only where it is expected to fit the budget, set-up included (so
    on a slow machine a long context may never be measured: costs there are
    held at the longest measured context). Passing earlier
    `samples` adds to them: later runs refine what a time-capped first run
    began, at least `at_least` rounds each time while some context is unsettled
    (a large model's round can take longer than a refining run's budget). The
    first `split_rounds` rounds of a context also time the draft and verify
    halves apart (for reports). Each round also times tree cycles of the
    (width, branches) `trees` (`tree_shapes`; `draft(w, branches)` drafts a
    tree), each next to the linear cycle of its width; earlier `samples` keep
    the shapes they were begun with.
    """
    samples = samples or CostSamples(list(contexts), max_width, tree_shapes=[list(t) for t in trees])
    shapes = [tuple(t) for t in samples.tree_shapes]
    start = time.perf_counter()
    spent = lambda: time.perf_counter() - start  # noqa: E731
    runners = {}
    first_ever = not any(samples.cycle)

    def expected(i: int) -> float:
        """Seconds the next round at context i should take, its set-up (a prefill) included if new."""
        own = [sum(r) for r in samples.rounds(i)]
        before = [sum(r) for j in range(i) for r in samples.rounds(j)]
        seconds = max(own) if own else 1.5 * max(before, default=0.0)  # longer contexts cost more
        seconds *= 1 + (len(samples.parts[i]) < split_rounds)
        return seconds + (i not in runners) * samples.setup_per_token * samples.contexts[i]

    def one_round(i: int) -> None:
        if i not in runners:
            tic = time.perf_counter()
            parts = make_cycle(samples.contexts[i])
            runners[i] = parts[:2]
            if len(parts) > 2:
                samples.catch_up[i] = parts[2]
            # The longest timed context's: a short one's fixed work, spread over its few
            # tokens, would price a long context's set-up far above what it costs.
            if all(samples.contexts[i] >= c for c, r in zip(samples.contexts, samples.cycle) if r):
                samples.setup_per_token = (time.perf_counter() - tic) / samples.contexts[i]
            if not runners.keys() - {i} and not samples.cycle[i]:
                one_round_timed(i, record=False)  # a fresh measurement warms up once
            elif len(runners) == 1:  # a refining run: warm up on the widest cycle only (it sets the allocations)
                run_draft, run_verify = runners[i]  # and on each tree once
                run_verify(max_width, run_draft(max_width))
                for w, b in shapes:
                    run_verify(w, run_draft(w, b))
        one_round_timed(i, record=True)
        progress(min(spent(), budget), budget)

    def one_round_timed(i: int, record: bool) -> None:
        run_draft, run_verify = runners[i]
        rounds, parts = samples.cycle[i], samples.parts[i]
        split = record and len(parts) < split_rounds
        times = [[0.0] * max_width for _ in range(3)]
        copied = [0.0] * (max_width - 1)
        tree = [0.0] * len(shapes)
        order = range(1, max_width + 1) if len(rounds) % 2 else range(max_width, 0, -1)
        for w in order:
            if w > 1:  # a cycle of copied (lookup) tokens: the bare verify
                tokens = mx.zeros((w - 1,), mx.int32)
                tic = time.perf_counter()
                run_verify(w, tokens)
                copied[w - 2] = time.perf_counter() - tic
            if split:
                tic = time.perf_counter()
                tokens = run_draft(w)
                mx.eval(tokens)
                mid = time.perf_counter()
                steps = run_verify(w, tokens) or 1
                times[0][w - 1] = (time.perf_counter() - mid) / steps
                times[1][w - 1] = mid - tic if w > 1 else 0.0
            tic = time.perf_counter()
            steps = run_verify(w, run_draft(w)) or 1
            times[2][w - 1] = (time.perf_counter() - tic) / steps
            for j in (j for j, (tw, _) in enumerate(shapes) if tw == w):
                tic = time.perf_counter()
                run_verify(w, run_draft(w, shapes[j][1]))
                tree[j] = time.perf_counter() - tic
        if record:
            rounds.append(times[2])
            samples.copy[i].append(copied)
            if shapes:
                samples.tree[i].append(tree)
            if split:
                parts.append(times[:2])

    def wanted(i: int) -> bool:
        return not finished(samples.rounds(i), min_rounds, max_rounds, tolerance)

    def fits(i: int) -> bool:
        return spent() + expected(i) <= budget

    progress(0.0, budget)
    for i in range(len(samples.contexts)):
        while len(samples.cycle[i]) < min_rounds and ((first_ever and i == 0) or fits(i)):
            one_round(i)
    added = 0
    while True:
        unsettled = [i for i in range(len(samples.contexts)) if len(samples.cycle[i]) >= min_rounds and wanted(i)]
        todo = [i for i in unsettled if fits(i)]
        if not todo and added < at_least:  # a round a run while unsettled, a context short of rounds included
            todo = (unsettled or [i for i in range(len(samples.contexts)) if len(samples.cycle[i]) < min_rounds])[:1]
        if not todo:
            break
        for i in todo:
            one_round(i)
            added += 1
    progress(budget, budget)
    return samples


def curve_key(pair) -> str:
    """What a cost curve depends on: models (with their quantization and dtype), the drafter's
    context bound, backend, MLX, BLAS."""
    parts = [str(CURVE_VERSION), str(pair.target_path), str(pair.draft_path),
             json.dumps(pair.target.quantization, sort_keys=True),
             json.dumps(pair.drafter.args.quantization, sort_keys=True),
             str(mx.default_device()), mx.__version__, blas_name(), str(pair.target.dtype)]
    if pair.drafter.context_bound is not None:  # a bounded drafter's cycles cost less on long contexts
        parts.append(f"draft context {pair.drafter.context_bound}")
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:20]


def load_or_measure(key: str, make_cycle: Callable[[int], CycleParts], max_width: int, cache_dir: Path,
                    budget: float = 10.0, refine: float = 3.0, min_rounds: int = 3, max_rounds: int = 12,
                    tolerance: float = 0.02, progress: Callable[[float, float], None] = lambda d, t: None,
                    trees: Callable[[], Sequence[Tuple[int, int]]] = tuple,
                    contexts: Sequence[int] = CONTEXTS) -> CostCurve:
    """The cached cost curve for `key`: measured within about `budget` seconds
    the first time, then refined by about `refine` seconds a run until every
    width is settled (or has `max_rounds`). A first measurement also times the
    trees `trees()` returns (asked then only: the shapes stay with the samples)."""
    path = Path(cache_dir) / "costs" / f"{key}-w{max_width}.json"
    samples, what = None, "cost curve"
    data = kept_files.read(path, CURVE_KIND, CURVE_VERSION, what)
    if data is not None:
        try:
            samples = CostSamples.parse(data, contexts, max_width)
        except ValueError as e:
            kept_files.set_aside(path, what, str(e))
    if samples is None or not samples.done(min_rounds, max_rounds, tolerance):
        first = samples is None  # refining takes a moment: no progress shown
        samples = measure_cost_curve(make_cycle, max_width, contexts, budget=budget if first else refine,
                                     min_rounds=min_rounds, max_rounds=max_rounds, tolerance=tolerance,
                                     samples=samples, at_least=0 if first else 1,
                                     progress=progress if first else lambda d, t: None,
                                     trees=trees() if first else ())
        kept_files.write(path, CURVE_KIND, CURVE_VERSION, asdict(samples))
    return CostCurve.from_samples(samples, min_rounds)
