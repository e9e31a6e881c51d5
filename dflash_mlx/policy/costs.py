"""The cost curve: what a cycle of each width costs on this machine, relative to a plain step.

The cost of a cycle at block size b is the drafter's pass, the target's
verify pass over b tokens and the loop's fixed work (acceptance, the host
synchronisation, cropping), all growing with context length. The curve times
whole cycles (`decode.timing.cycle_parts`), widths interleaved round by round
and each round normalised by its own mean, so that a machine whose speed
wanders (other processes, clocks) still yields a steady shape. It is kept per
(model, drafter, quantization, dtype, backend, MLX version, BLAS) as JSON:
the first run measures for about ten seconds, and later runs add a few
seconds of rounds (and any context that fits) until every width is settled.
Only relative costs decide the width, so the curve is not corrected online
(the noise of single cycles would make the choice wander between widths that
are in truth no better).
"""

import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx

from .. import kept_files
from ..draft import tree as trees
from ..machine import blas_name

# Context lengths the cost curve times cycles at (those that fit the model's window).
# Beyond the last, costs grow at the slope between the last two: at 64 and 1,024 tokens
# a step's fixed work hides how attention grows with context, so 4,096 is timed too
# (the curve from 64 and 1,024 alone put a drafted cycle at twice its measured cost
# relative to a plain step at 16k tokens; benchmarks/README.md).
CONTEXTS = (64, 1024, 4096)
CURVE_VERSION = 11  # bump when what a curve measures, or how it is kept, changes
CURVE_KIND = "dflash_mlx.cost_curve"
# A kept timing above this (seconds for one cycle) is not a measurement: the file is damaged.
MAX_SECONDS = 3600.0
# A context not timed yet is expected to take this much longer than the longest timed
# one (it is longer): a guess that keeps a run from starting a round it cannot finish.
NEW_CONTEXT_GROWTH = 1.5
# Trees of up to this many branches are timed with the curve (`tree_shapes`), and so
# weighed by `auto` unless a request says otherwise.
TREE_BRANCHES = 2


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
    m = _Measurement(make_cycle, samples, max_width, budget, progress, split_rounds)
    first_ever = not any(samples.cycle)

    def wanted(i: int) -> bool:
        return not finished(samples.rounds(i), min_rounds, max_rounds, tolerance)

    progress(0.0, budget)
    for i in range(len(samples.contexts)):
        while len(samples.cycle[i]) < min_rounds and ((first_ever and i == 0) or m.fits(i)):
            m.one_round(i)
    added = 0
    while True:
        unsettled = [i for i in range(len(samples.contexts)) if len(samples.cycle[i]) >= min_rounds and wanted(i)]
        todo = [i for i in unsettled if m.fits(i)]
        if not todo and added < at_least:  # a round a run while unsettled, a context short of rounds included
            todo = (unsettled or [i for i in range(len(samples.contexts)) if len(samples.cycle[i]) < min_rounds])[:1]
        if not todo:
            break
        for i in todo:
            m.one_round(i)
            added += 1
    progress(budget, budget)
    return samples


class _Measurement:
    """One `measure_cost_curve` run: the contexts set up so far, the clock against the
    budget, and the timing of one round (every width, interleaved) at a context."""

    def __init__(self, make_cycle: Callable[[int], CycleParts], samples: CostSamples, max_width: int,
                 budget: float, progress: Callable[[float, float], None], split_rounds: int):
        self.make_cycle, self.samples, self.budget, self.progress = make_cycle, samples, budget, progress
        self.max_width = max_width
        self.split_rounds = split_rounds
        self.shapes = [tuple(t) for t in samples.tree_shapes]
        self.start = time.perf_counter()
        self.runners: Dict[int, CycleParts] = {}

    def spent(self) -> float:
        return time.perf_counter() - self.start

    def expected(self, i: int) -> float:
        """Seconds the next round at context i should take, its set-up (a prefill) included if new."""
        samples = self.samples
        own = [sum(r) for r in samples.rounds(i)]
        before = [sum(r) for j in range(i) for r in samples.rounds(j)]
        seconds = max(own) if own else NEW_CONTEXT_GROWTH * max(before, default=0.0)
        seconds *= 1 + (len(samples.parts[i]) < self.split_rounds)
        return seconds + (i not in self.runners) * samples.setup_per_token * samples.contexts[i]

    def fits(self, i: int) -> bool:
        return self.spent() + self.expected(i) <= self.budget

    def one_round(self, i: int) -> None:
        if i not in self.runners:
            self.set_up(i)
        self.timed_round(i, record=True)
        self.progress(min(self.spent(), self.budget), self.budget)

    def set_up(self, i: int) -> None:
        """Make context i's cycle, note its set-up cost per token, and warm it up."""
        samples = self.samples
        tic = time.perf_counter()
        parts = self.make_cycle(samples.contexts[i])
        self.runners[i] = parts[:2]
        if len(parts) > 2:
            samples.catch_up[i] = parts[2]
        # The longest timed context's: a short one's fixed work, spread over its few
        # tokens, would price a long context's set-up far above what it costs.
        if all(samples.contexts[i] >= c for c, r in zip(samples.contexts, samples.cycle) if r):
            samples.setup_per_token = (time.perf_counter() - tic) / samples.contexts[i]
        if not self.runners.keys() - {i} and not samples.cycle[i]:
            self.timed_round(i, record=False)  # a fresh measurement warms up once
        elif len(self.runners) == 1:  # a refining run: warm up on the widest cycle only (it sets the allocations)
            run_draft, run_verify = self.runners[i]  # and on each tree once
            run_verify(self.max_width, run_draft(self.max_width))
            for w, b in self.shapes:
                run_verify(w, run_draft(w, b))

    def timed_round(self, i: int, record: bool) -> None:
        """Every width once at context i, in alternating order: the whole cycle, the bare verify
        of copied tokens, the trees of that width and (the first `split_rounds`) the halves apart."""
        samples, shapes, max_width = self.samples, self.shapes, self.max_width
        run_draft, run_verify = self.runners[i]
        rounds, parts = samples.cycle[i], samples.parts[i]
        split = record and len(parts) < self.split_rounds
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
