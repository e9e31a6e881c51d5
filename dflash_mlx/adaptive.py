"""Adaptive block size.

The cost of a cycle at block size b is the drafter's pass, the target's
verify pass over b tokens and the loop's fixed work (acceptance, the host
synchronisation, cropping), all growing with context length; the gain is the
expected number of committed tokens, 1 + sum_k prod_{j<=k} alpha_j, where
alpha_j is the running rate at which draft position j is accepted once
positions before it were. Each cycle picks the b that maximises gain / cost.

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
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, List, Optional, Tuple

import mlx.core as mx

CONTEXTS = (64, 1024)
CURVE_VERSION = 4  # bump when what a curve measures changes


@dataclass
class CostCurve:
    contexts: List[int]
    verify: List[List[float]]  # [context][width - 1] seconds
    draft: List[List[float]]  # [context][width - 1] seconds (0 for width 1)
    cycle: Optional[List[List[float]]] = None  # [context][width - 1] whole cycle, seconds

    @property
    def max_width(self) -> int:
        return len((self.cycle or self.verify)[0])

    def costs(self, context: int) -> List[float]:
        """Seconds per cycle for widths 1..max_width, interpolated linearly in context length.

        Beyond the measured contexts the nearest measurement is used: a linear
        extrapolation can make a width look free and win every cycle.
        """
        cs = self.contexts
        i = 0 if context <= cs[0] else min(len(cs) - 2, next((j for j in range(len(cs) - 1) if context <= cs[j + 1]), len(cs) - 2))
        j = min(i + 1, len(cs) - 1)
        t = 0.0 if cs[j] == cs[i] else min(1.0, max(0.0, (context - cs[i]) / (cs[j] - cs[i])))
        rows = [self.cycle] if self.cycle is not None else [self.verify, self.draft]
        out = [0.0] * self.max_width
        for r in rows:
            a, b = r[i], r[j]
            for w in range(self.max_width):
                out[w] += a[w] + t * (b[w] - a[w])
        return [max(1e-9, c) for c in out]

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
        verify, draft = [], []
        for i in n:
            parts = samples.parts[i]
            if parts:
                means = [sum(c) / len(c) for c in samples.cycle[i][: len(parts)]]  # parts share their round's scale
                verify.append(profile([p[0] for p in parts], means))
                draft.append(profile([p[1] for p in parts], means))
        cycle = [profile(samples.cycle[i]) for i in n]
        return cls([samples.contexts[i] for i in n], verify, draft, cycle)


@dataclass
class CostSamples:
    """The raw rounds a cost curve is made from, kept so later runs can add to them."""

    contexts: List[int]
    max_width: int
    cycle: List[List[List[float]]] = field(default_factory=list)  # [context][round][width - 1] seconds
    parts: List[List[List[List[float]]]] = field(default_factory=list)  # [context][round][verify, draft][width - 1]
    setup_per_token: float = 0.0  # seconds to set a context up (its prefill), per token

    def __post_init__(self):
        self.cycle = self.cycle or [[] for _ in self.contexts]
        self.parts = self.parts or [[] for _ in self.contexts]

    def done(self, min_rounds: int, max_rounds: int, tolerance: float) -> bool:
        return all(finished(r, min_rounds, max_rounds, tolerance) for r in self.cycle)


class AcceptanceStats:
    """Per-position acceptance counts, forgetting old outcomes as new ones arrive."""

    def __init__(self, n: int, decay: float):
        self.decay = decay
        self.tried = [0.0] * n  # times draft position k (index k, 1-based) was checked
        self.accepted = [0.0] * n

    def add(self, width: int, accepted: int) -> None:
        # Only positions actually checked forget, so a run of narrow cycles
        # does not erase what was known about deeper positions.
        for k in range(1, min(accepted + 2, width)):
            self.tried[k] = self.tried[k] * self.decay + 1
            self.accepted[k] = self.accepted[k] * self.decay + (k <= accepted)

    def capped(self, weight: float) -> "AcceptanceStats":
        """The same rates, each worth at most `weight` observations."""
        out = AcceptanceStats(len(self.tried), self.decay)
        for k, t in enumerate(self.tried):
            if t > 0:
                out.tried[k] = min(t, weight)
                out.accepted[k] = out.tried[k] * self.accepted[k] / t
        return out


class FixedWidth:
    """The block-size policy of a fixed --block-size."""

    def __init__(self, width: int):
        self.width = width

    def start(self, seeded: bool = False) -> "FixedWidth":
        return self

    def choose(self, context: int) -> int:
        return self.width

    def update(self, width: int, accepted: int) -> None:
        pass


class BlockSizer:
    """Chooses each cycle's block size from acceptance statistics and the cost curve.

    Statistics are kept across requests (the drafter's usual form) and per
    request: a request starts from the shared rates, worth `carry`
    observations per position, so that its own outcomes take over within a few
    cycles (a drafter that copies well on one prompt may guess poorly on the
    next).
    """

    def __init__(self, curve: CostCurve, max_width: int, prior: float = 0.8, weight: float = 2.0,
                 decay: float = 0.98, carry: float = 8.0, stick: float = 1.03):
        self.curve = curve
        self.max_width = min(max_width, curve.max_width)
        self.prior, self.weight, self.carry, self.stick = prior, weight, carry, stick
        self.shared = AcceptanceStats(self.max_width, decay)
        self.stats = self.shared  # a request's own, once start() made one
        self.current = 0  # the width chosen last
        self._context, self._costs = None, []

    def start(self, seeded: bool = False) -> "BlockSizer":
        """A sizer for a new request: this curve, the shared statistics as its prior.

        A seeded request starts from the prior alone, so that its widths, and
        with them the order its random numbers are drawn in, are the same
        whatever earlier requests taught the shared statistics.
        """
        run = copy.copy(self)  # shares the curve and the shared statistics
        run.stats = AcceptanceStats(self.max_width, self.shared.decay) if seeded else self.shared.capped(self.carry)
        run.current = 0
        return run

    def explain(self, context: int) -> Optional[str]:
        """Why a request at `context` tokens would start with plain decoding; None if it drafts."""
        if self.start().choose(context) > 1:
            return None
        w = self.max_width
        ratio = self.curve.cost(w, context) / self.curve.cost(1, context)
        return (
            f"drafting does not pay here: a {w}-token verify cycle costs {ratio:.1f}x one token "
            f"on this machine (BLAS: {blas_name()}), more than the {self.expected_tokens(w):.1f} tokens "
            f"a cycle is expected to commit; decoding plainly. --block-size {w} shows the drafter."
        )

    def alphas(self) -> List[float]:
        """alpha_k for k = 1..max_width-1; untested depths borrow the previous estimate."""
        st, out, prev = self.stats, [], self.prior
        for k in range(1, self.max_width):
            mean = (st.accepted[k] + self.weight * prev) / (st.tried[k] + self.weight)
            out.append(mean)
            prev = mean
        return out

    def expected_tokens(self, width: int, alphas: Optional[List[float]] = None) -> float:
        alphas = self.alphas() if alphas is None else alphas
        total, run = 1.0, 1.0
        for k in range(width - 1):
            run *= alphas[k]
            total += run
        return total

    def cost(self, width: int, context: int) -> float:
        if self._context != context:
            self._context, self._costs = context, self.curve.costs(context)
        return self._costs[width - 1]

    def rates(self, context: int) -> List[float]:
        """Expected committed tokens per second for widths 1..max_width (one pass: runs every cycle)."""
        alphas = self.alphas()
        out, tokens, run = [], 1.0, 1.0
        for w in range(1, self.max_width + 1):
            if w > 1:
                run *= alphas[w - 2]
                tokens += run
            out.append(tokens / self.cost(w, context))
        return out

    def choose(self, context: int) -> int:
        rates = self.rates(context)
        best = max(range(self.max_width), key=rates.__getitem__) + 1
        # Keep the previous choice unless another is clearly better: the
        # estimates are noisy and each change of width costs a little.
        if not self.current or rates[best - 1] >= self.stick * rates[self.current - 1]:
            self.current = best
        return self.current

    def update(self, width: int, accepted: int) -> None:
        """Record a cycle: `accepted` of its `width - 1` draft tokens were kept."""
        self.stats.add(width, accepted)
        if self.stats is not self.shared:
            self.shared.add(width, accepted)


def blas_name() -> str:
    """Which BLAS this process runs on (Linux: read from the loaded libraries)."""
    if platform.system() != "Linux":
        return "Accelerate" if platform.system() == "Darwin" else "unknown"
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "unknown"
    # Only libraries MLX can resolve BLAS symbols from count: numpy's own
    # bundled OpenBLAS (numpy.libs/, scipy_openblas) is private to numpy.
    libs = {line.split()[-1] for line in maps.splitlines() if "/" in line}
    libs = [l.lower() for l in libs if "numpy" not in l.lower() and "scipy_openblas" not in l.lower()]
    for name in ("openblas", "mkl", "blis"):
        if any(name in l for l in libs):
            return name
    return "reference (stock mlx[cpu])"


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


# (draft(width) -> tokens, verify(width, tokens) -> None) for a context of n tokens
CycleParts = Tuple[Callable[[int], mx.array], Callable[[int, mx.array], None]]


def measure_cost_curve(make_cycle: Callable[[int], CycleParts], max_width: int, contexts=CONTEXTS,
                       budget: float = 10.0, min_rounds: int = 3, max_rounds: int = 40, tolerance: float = 0.02,
                       split_rounds: int = 0, samples: Optional[CostSamples] = None,
                       progress: Callable[[float, float], None] = lambda done, total: None) -> CostSamples:
    """Time whole cycles at each width and context, within about `budget` seconds.

    `make_cycle(n)` sets up a context of n tokens and returns its two halves:
    `draft(w)` (lazy draft tokens) and `verify(w, tokens)` (the verify pass,
    the cycle's one host synchronisation and the crop back). Widths are
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
    began. The first `split_rounds` rounds of a context also time the draft and
    verify halves apart (for reports).
    """
    samples = samples or CostSamples(list(contexts), max_width)
    start = time.perf_counter()
    spent = lambda: time.perf_counter() - start  # noqa: E731
    runners = {}
    first_ever = not any(samples.cycle)

    def expected(i: int) -> float:
        """Seconds the next round at context i should take, its set-up (a prefill) included if new."""
        own = [sum(r) for r in samples.cycle[i]]
        before = [sum(r) for rounds in samples.cycle[:i] for r in rounds]
        seconds = max(own) if own else 1.5 * max(before, default=0.0)  # longer contexts cost more
        seconds *= 1 + (len(samples.parts[i]) < split_rounds)
        return seconds + (i not in runners) * samples.setup_per_token * samples.contexts[i]

    def one_round(i: int) -> None:
        if i not in runners:
            tic = time.perf_counter()
            runners[i] = make_cycle(samples.contexts[i])
            samples.setup_per_token = max(samples.setup_per_token,
                                          (time.perf_counter() - tic) / samples.contexts[i])
            if not runners.keys() - {i} and not samples.cycle[i]:
                one_round_timed(i, record=False)  # a fresh measurement warms up once
        one_round_timed(i, record=True)
        progress(min(spent(), budget), budget)

    def one_round_timed(i: int, record: bool) -> None:
        run_draft, run_verify = runners[i]
        rounds, parts = samples.cycle[i], samples.parts[i]
        split = record and len(parts) < split_rounds
        times = [[0.0] * max_width for _ in range(3)]
        order = range(1, max_width + 1) if len(rounds) % 2 else range(max_width, 0, -1)
        for w in order:
            if split:
                tic = time.perf_counter()
                tokens = run_draft(w)
                mx.eval(tokens)
                mid = time.perf_counter()
                run_verify(w, tokens)
                times[0][w - 1] = time.perf_counter() - mid
                times[1][w - 1] = mid - tic if w > 1 else 0.0
            tic = time.perf_counter()
            run_verify(w, run_draft(w))
            times[2][w - 1] = time.perf_counter() - tic
        if record:
            rounds.append(times[2])
            if split:
                parts.append(times[:2])

    def wanted(i: int) -> bool:
        return not finished(samples.cycle[i], min_rounds, max_rounds, tolerance)

    def fits(i: int) -> bool:
        return spent() + expected(i) <= budget

    progress(0.0, budget)
    for i in range(len(samples.contexts)):
        while len(samples.cycle[i]) < min_rounds and ((first_ever and i == 0) or fits(i)):
            one_round(i)
    while True:
        todo = [i for i in range(len(samples.contexts))
                if len(samples.cycle[i]) >= min_rounds and wanted(i) and fits(i)]
        if not todo:
            break
        for i in todo:
            one_round(i)
    progress(budget, budget)
    return samples


def curve_key(pair) -> str:
    """What a cost curve depends on: models (with their quantization and dtype), backend, MLX, BLAS."""
    parts = [str(CURVE_VERSION), str(pair.target_path), str(pair.draft_path),
             json.dumps(pair.target.quantization, sort_keys=True),
             json.dumps(pair.drafter.args.quantization, sort_keys=True),
             str(mx.default_device()), mx.__version__, blas_name(), str(pair.target.dtype)]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:20]


def load_or_measure(key: str, make_cycle: Callable[[int], CycleParts], max_width: int, cache_dir: Path,
                    budget: float = 10.0, refine: float = 3.0, min_rounds: int = 3, max_rounds: int = 12,
                    tolerance: float = 0.02, progress: Callable[[float, float], None] = lambda d, t: None
                    ) -> CostCurve:
    """The cached cost curve for `key`: measured within about `budget` seconds
    the first time, then refined by about `refine` seconds a run until every
    width is settled (or has `max_rounds`)."""
    path = Path(cache_dir) / "costs" / f"{key}-w{max_width}.json"
    samples = None
    if path.exists():
        try:
            samples = CostSamples(**json.loads(path.read_text()))
        except (json.JSONDecodeError, TypeError):
            samples = None
    if samples is None or not samples.done(min_rounds, max_rounds, tolerance):
        first = samples is None  # refining takes a moment: no progress shown
        samples = measure_cost_curve(make_cycle, max_width, budget=budget if first else refine,
                                     min_rounds=min_rounds, max_rounds=max_rounds, tolerance=tolerance,
                                     samples=samples, progress=progress if first else lambda d, t: None)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(samples)))
        tmp.replace(path)
    return CostCurve.from_samples(samples, min_rounds)
