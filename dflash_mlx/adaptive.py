"""Adaptive block size.

The cost of a cycle at block size b is the drafter's pass, the target's
verify pass over b tokens and the loop's fixed work (acceptance, the host
synchronisation, cropping), all growing with context length; the gain is the
expected number of committed tokens, 1 + sum_k prod_{j<=k} alpha_j, where
alpha_j is the running rate at which draft position j is accepted once
positions before it were. Each cycle picks the b that maximises gain / cost.

The cost curve times whole cycles, widths interleaved round by round and each
round normalised by its own mean, so that a machine whose speed wanders
(other processes, clocks) still yields a steady shape; it is measured once per
(model, drafter, quantization, backend, MLX version, BLAS) and cached as JSON.
Only relative costs decide the width, so the curve is not corrected online:
earlier versions did, per width, and the noise of single cycles made the
choice wander between widths that were in truth no better.
"""

import copy
import hashlib
import json
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import List, Optional

import mlx.core as mx

CONTEXTS = (64, 1024)
CURVE_VERSION = 3  # bump when what a curve measures changes


@dataclass
class CostCurve:
    contexts: List[int]
    verify: List[List[float]]  # [context][width - 1] seconds
    draft: List[List[float]]  # [context][width - 1] seconds (0 for width 1)
    cycle: Optional[List[List[float]]] = None  # [context][width - 1] whole cycle, seconds

    @property
    def max_width(self) -> int:
        return len(self.verify[0])

    def costs(self, context: int) -> List[float]:
        """Seconds per cycle for widths 1..max_width, interpolated linearly in context length."""
        cs = self.contexts
        i = 0 if context <= cs[0] else min(len(cs) - 2, next((j for j in range(len(cs) - 1) if context <= cs[j + 1]), len(cs) - 2))
        j = min(i + 1, len(cs) - 1)
        t = 0.0 if cs[j] == cs[i] else max(0.0, (context - cs[i]) / (cs[j] - cs[i]))
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

    def start(self) -> "BlockSizer":
        """A sizer for a new request: this curve, the shared statistics as its prior."""
        run = copy.copy(self)  # shares the curve and the shared statistics
        run.stats = self.shared.capped(self.carry)
        run.current = 0
        return run

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


def curve_key(pair) -> str:
    q = getattr(pair.target.args, "quantization", None) or {}
    parts = [str(CURVE_VERSION), str(pair.target_path), str(pair.draft_path), json.dumps(q, sort_keys=True),
             str(mx.default_device()), mx.__version__, blas_name(), str(pair.target.embed_tokens.weight.dtype)]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:20]


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


def measure_cost_curve(pair, max_width: int, contexts=CONTEXTS, repeats: int = 8, max_repeats: int = 40,
                       tolerance: float = 0.01, progress=lambda done, total: None) -> CostCurve:
    """Seconds of the drafter pass, the verify pass and a whole cycle per width.

    Widths are interleaved within each round, in alternating order, and rounds
    are normalised before their median is taken (`profile`): only relative
    costs decide the width, and those stay put while the machine's overall
    speed wanders. After `repeats` rounds, more whole-cycle rounds are added
    until each width's relative cost is known to `tolerance` (a quiet GPU
    settles at once; a shared CPU takes more) or `max_repeats` is reached.
    """
    from .decode import draft, verify
    from .sampling import SamplingParams

    target, source = pair.target, pair.draft_source
    greedy = SamplingParams()
    verify_rows, draft_rows, cycle_rows = [], [], []
    max_repeats = max(repeats, max_repeats)
    total, done = len(contexts) * (max_repeats + 1), 0
    for ctx in contexts:
        prompt = mx.random.randint(0, target.vocab_size, (ctx,))
        tcache = target.make_cache()
        dstate = source.new_state()
        _, hidden = target(prompt[None], tcache)
        source.add_context(dstate, hidden)
        mx.eval([c.state for c in tcache], source.arrays(dstate))
        last = prompt[-1:]

        def run_draft(w):
            return draft(source, dstate, last, None, w, greedy)[0] if w > 1 else mx.array([], dtype=last.dtype)

        def run_verify(w, tokens):
            n_acc, nxt, _ = verify(target, tcache, last, tokens, None, greedy)
            out = mx.concatenate([n_acc.reshape(1).astype(tokens.dtype), tokens, nxt.reshape(1).astype(tokens.dtype)])
            out.tolist()
            target.crop(tcache, 0, w)

        parts, cycles = [], []  # per round: (verify, draft) and whole-cycle seconds per width
        r = -1  # round -1 warms up
        while r < repeats or (r < max_repeats and not settled(cycles, tolerance)):
            split = r < repeats
            times = [[0.0] * max_width for _ in range(3)]
            order = range(1, max_width + 1) if r % 2 else range(max_width, 0, -1)
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
                run_verify(w, run_draft(w))  # one host synchronisation, as in the loop
                times[2][w - 1] = time.perf_counter() - tic
            if r >= 0:
                cycles.append(times[2])
                if split:
                    parts.append(times[:2])
            r += 1
            done += 1
            progress(done, total)
        done += max_repeats - r  # rounds this context did not need
        progress(done, total)
        means = [sum(c) / len(c) for c in cycles[: len(parts)]]  # parts are normalised by their round's cycles
        verify_rows.append(profile([p[0] for p in parts], means))
        draft_rows.append(profile([p[1] for p in parts], means))
        cycle_rows.append(profile(cycles))
    return CostCurve(list(contexts), verify_rows, draft_rows, cycle_rows)


def load_or_measure(pair, max_width: int, cache_dir: Path, progress=lambda d, t: None) -> CostCurve:
    path = Path(cache_dir) / "costs" / f"{curve_key(pair)}-w{max_width}.json"
    if path.exists():
        try:
            return CostCurve(**json.loads(path.read_text()))
        except (json.JSONDecodeError, TypeError):
            pass
    curve = measure_cost_curve(pair, max_width, progress=progress)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(curve)))
    tmp.replace(path)
    return curve
