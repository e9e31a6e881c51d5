"""Adaptive block size.

The cost of a cycle at block size b is the drafter's pass, the target's
verify pass over b tokens and the loop's fixed work (acceptance, the host
synchronisation, cropping), all growing with context length; the gain is the
expected number of committed tokens, 1 + sum_k prod_{j<=k} alpha_j, where
alpha_j is the running rate at which draft position j is accepted once
positions before it were. Each cycle picks the b that maximises gain / cost.

The cost curve times whole cycles, widths interleaved round by round so that
machine noise falls on all widths alike; it is measured once per (model,
drafter, quantization, backend, MLX version, BLAS) and cached as JSON. While
decoding, the sizer also times the real cycles and corrects the curve per
width, and now and then tries another width whose predicted rate is close, so
a curve that is off (other processes, a longer context, a thermal state) is
mended online where it matters.
"""

import hashlib
import json
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List, Optional

import mlx.core as mx

CONTEXTS = (64, 1024)
CURVE_VERSION = 2  # bump when what a curve measures changes


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


class BlockSizer:
    """Chooses each cycle's block size from acceptance statistics and costs."""

    def __init__(self, curve: CostCurve, max_width: int, prior: float = 0.8, weight: float = 2.0,
                 decay: float = 0.98, probe_every: int = 16, probe_margin: float = 0.9, window: int = 9,
                 stick: float = 1.03):
        self.curve = curve
        self.max_width = min(max_width, curve.max_width)
        self.prior, self.weight, self.decay = prior, weight, decay
        self.probe_every, self.probe_margin, self.window, self.stick = probe_every, probe_margin, window, stick
        n = self.max_width
        self.tried = [0.0] * n  # times draft position k (1-based index k) was checked
        self.accepted = [0.0] * n
        # Measured / curve cost per width: the median of its last few timed
        # cycles (robust to the odd stalled cycle, which would otherwise keep a
        # rarely tried width looking slow); widths seen little lean on
        # global_ratio, the lowest of those medians (optimistic).
        self.samples: List[List[float]] = [[] for _ in range(n)]
        self.ratio = [1.0] * n
        self.seen = [0] * n
        self.global_ratio = 1.0
        self.cycles = 0
        self.current = 0  # the width chosen last (probes aside)
        self._context, self._curve_costs = None, []

    def alphas(self) -> List[float]:
        """alpha_k for k = 1..max_width-1; untested depths borrow the previous estimate."""
        out, prev = [], self.prior
        for k in range(1, self.max_width):
            mean = (self.accepted[k] + self.weight * prev) / (self.tried[k] + self.weight)
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

    def _costs(self, context: int) -> List[float]:
        if self._context != context:
            self._context, self._curve_costs = context, self.curve.costs(context)
        return self._curve_costs

    def _ratio(self, width: int) -> float:
        n = self.seen[width - 1]
        return (n * self.ratio[width - 1] + self.weight * self.global_ratio) / (n + self.weight)

    def cost(self, width: int, context: int) -> float:
        """Expected seconds of a cycle: the curve, corrected by the cycles timed so far."""
        return self._costs(context)[width - 1] * self._ratio(width)

    def rates(self, context: int) -> List[float]:
        """Expected committed tokens per second for widths 1..max_width (one pass: runs every cycle)."""
        alphas, costs = self.alphas(), self._costs(context)
        out, tokens, run = [], 1.0, 1.0
        for w in range(1, self.max_width + 1):
            if w > 1:
                run *= alphas[w - 2]
                tokens += run
            out.append(tokens / (costs[w - 1] * self._ratio(w)))
        return out

    def choose(self, context: int) -> int:
        rates = self.rates(context)
        best = max(range(self.max_width), key=rates.__getitem__) + 1
        # Keep the previous choice unless another is clearly better: estimates are noisy.
        if not self.current or rates[best - 1] >= self.stick * rates[self.current - 1]:
            self.current = best
        self.cycles += 1
        # Now and then try another width whose predicted rate is close, the
        # least timed first, so every contender's real cost gets measured.
        if self.probe_every and self.cycles % self.probe_every == 0:
            floor = self.probe_margin * rates[self.current - 1]
            close = [w for w in range(1, self.max_width + 1) if w != self.current and rates[w - 1] >= floor]
            if close:
                return min(close, key=lambda w: (self.seen[w - 1], -rates[w - 1]))
        return self.current

    def update(self, width: int, accepted: int, seconds: Optional[float] = None, context: int = 0) -> None:
        """Record a cycle: its accepted draft tokens and, when timed, its wall time."""
        # Each position forgets old outcomes only as new ones arrive, so a run
        # of narrow cycles does not erase what was known about deeper positions.
        for k in range(1, min(accepted + 2, width)):
            self.tried[k] = self.tried[k] * self.decay + 1
            self.accepted[k] = self.accepted[k] * self.decay + (k <= accepted)
        if seconds is None or seconds <= 0:
            return
        i = width - 1
        window = self.samples[i]
        window.append(seconds / self._costs(context)[i])
        if len(window) > self.window:
            window.pop(0)
        self.ratio[i] = sorted(window)[len(window) // 2]
        self.seen[i] = len(window)
        self.global_ratio = min(self.ratio[j] for j in range(self.max_width) if self.seen[j])


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


def measure_cost_curve(pair, max_width: int, contexts=CONTEXTS, repeats: int = 5,
                       progress=lambda done, total: None) -> CostCurve:
    """Median seconds of the drafter pass, the verify pass and a whole cycle per width.

    Widths are interleaved within each round, so slow spells of a shared
    machine spread over all widths instead of biasing a few.
    """
    from .decode import draft, verify
    from .sampling import SamplingParams

    target, source = pair.target, pair.draft_source
    greedy = SamplingParams()
    verify_rows, draft_rows, cycle_rows = [], [], []
    total, done = len(contexts) * (repeats + 1), 0
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
            n_acc, nxt, h = verify(target, tcache, last, tokens, None, greedy)
            out = mx.concatenate([n_acc.reshape(1).astype(tokens.dtype), tokens, nxt.reshape(1).astype(tokens.dtype)])
            out.tolist()
            target.crop(tcache, 0, w)
            return h

        samples = {w: ([], [], []) for w in range(1, max_width + 1)}
        for r in range(repeats + 1):  # round 0 warms up
            for w in range(1, max_width + 1):
                tic = time.perf_counter()
                tokens = run_draft(w)
                mx.eval(tokens)
                mid = time.perf_counter()
                run_verify(w, tokens)
                toc = time.perf_counter()
                tic2 = time.perf_counter()
                run_verify(w, run_draft(w))  # one host synchronisation, as in the loop
                toc2 = time.perf_counter()
                if r:
                    samples[w][0].append(toc - mid)
                    samples[w][1].append(mid - tic if w > 1 else 0.0)
                    samples[w][2].append(toc2 - tic2)
            done += 1
            progress(done, total)
        med = lambda xs: sorted(xs)[len(xs) // 2]
        verify_rows.append([med(samples[w][0]) for w in range(1, max_width + 1)])
        draft_rows.append([med(samples[w][1]) for w in range(1, max_width + 1)])
        cycle_rows.append([med(samples[w][2]) for w in range(1, max_width + 1)])
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
