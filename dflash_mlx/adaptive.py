"""Adaptive block size.

The cost of a cycle at block size b is the target's verify pass over b tokens
plus the drafter's pass, both growing with context length; the gain is the
expected number of committed tokens, 1 + sum_k prod_{j<=k} alpha_j, where
alpha_j is the running rate at which draft position j is accepted once
positions before it were. Each cycle picks the b that maximises gain / cost.

The cost curve is measured once per (model, drafter, quantization, backend,
MLX version, BLAS) and cached as JSON.
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


@dataclass
class CostCurve:
    contexts: List[int]
    verify: List[List[float]]  # [context][width - 1] seconds
    draft: List[List[float]]  # [context][width - 1] seconds (0 for width 1)

    @property
    def max_width(self) -> int:
        return len(self.verify[0])

    def cost(self, width: int, context: int) -> float:
        """Seconds per cycle at `width`, interpolated linearly in context length."""
        cs = self.contexts
        i = 0 if context <= cs[0] else min(len(cs) - 2, next((j for j in range(len(cs) - 1) if context <= cs[j + 1]), len(cs) - 2))
        c0, c1 = cs[i], cs[min(i + 1, len(cs) - 1)]
        t = 0.0 if c1 == c0 else (context - c0) / (c1 - c0)
        t = max(0.0, t)
        def at(rows):
            return rows[i][width - 1] + t * (rows[min(i + 1, len(cs) - 1)][width - 1] - rows[i][width - 1])
        return max(1e-9, at(self.verify) + at(self.draft))

    def relative(self, context: int = 64) -> List[float]:
        base = self.cost(1, context)
        return [self.cost(w, context) / base for w in range(1, self.max_width + 1)]


class BlockSizer:
    """Chooses each cycle's block size from acceptance statistics and costs."""

    def __init__(self, curve: CostCurve, max_width: int, prior: float = 0.8, weight: float = 2.0,
                 decay: float = 0.995):
        self.curve = curve
        self.max_width = min(max_width, curve.max_width)
        self.prior, self.weight, self.decay = prior, weight, decay
        n = self.max_width
        self.tried = [0.0] * n  # times draft position k (1-based index k) was checked
        self.accepted = [0.0] * n

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

    def choose(self, context: int) -> int:
        alphas = self.alphas()
        best, best_rate = 1, 0.0
        for w in range(1, self.max_width + 1):
            rate = self.expected_tokens(w, alphas) / self.curve.cost(w, context)
            if rate > best_rate:
                best, best_rate = w, rate
        return best

    def update(self, width: int, accepted: int) -> None:
        self.tried = [t * self.decay for t in self.tried]
        self.accepted = [a * self.decay for a in self.accepted]
        for k in range(1, min(accepted + 2, width)):
            self.tried[k] += 1
            self.accepted[k] += k <= accepted


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
    parts = [str(pair.target_path), str(pair.draft_path), json.dumps(q, sort_keys=True),
             str(mx.default_device()), mx.__version__, blas_name(), str(pair.target.embed_tokens.weight.dtype)]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:20]


def _timed(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        tic = time.perf_counter()
        fn()
        times.append(time.perf_counter() - tic)
    times.sort()
    return times[len(times) // 2]


def measure_cost_curve(pair, max_width: int, contexts=CONTEXTS, repeats: int = 5,
                       progress=lambda done, total: None) -> CostCurve:
    target, source = pair.target, pair.draft_source
    verify, draft = [], []
    total, done = len(contexts) * max_width, 0
    for ctx in contexts:
        prompt = mx.random.randint(0, target.vocab_size, (ctx,))
        tcache = target.make_cache()
        dstate = source.new_state()
        target(prompt[None], tcache)
        _, hidden = target(prompt[None], target.make_cache())
        source.add_context(dstate, hidden)
        mx.eval([c.state for c in tcache], source.arrays(dstate))
        v_row, d_row = [], []
        for w in range(1, max_width + 1):
            block = prompt[:w][None]

            def run_verify():
                logits, h = target(block, tcache, record=True)
                mx.eval(logits, h)
                target.crop(tcache, 0, w)

            v_row.append(_timed(run_verify, repeats))
            if w > 1:
                last = prompt[:1]

                def run_draft():
                    mx.eval(source.propose(dstate, last, None, w))

                d_row.append(_timed(run_draft, repeats))
            else:
                d_row.append(0.0)
            done += 1
            progress(done, total)
        verify.append(v_row)
        draft.append(d_row)
    return CostCurve(list(contexts), verify, draft)


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
