"""Verify-and-accept: accepted draft length and next token from verify logits.

Greedy: argmax of every block row, then the longest prefix where the draft
equals it. Sampling: exact speculative sampling (accept draft token x with
probability min(1, p(x)/q(x)); at the first rejection draw from
normalise(max(0, p - q)); after full acceptance draw from p), with p the
target's distribution after mlx-lm's filters (top-p, min-p, top-k on
temperature-1 log probabilities, then temperature).

The kernel (Metal, and its CUDA twin from the same body) gives each block row
one threadgroup and reads the row's vocabulary once per reduction, with the
filters applied as thresholds found by bisection over float bit patterns (no
sort). Draws use inverse CDF sampling
from uniforms drawn outside the kernel, so the reference and the kernel
consume the same random numbers. Ties at a top-k boundary keep every tied
token (mlx-lm keeps an arbitrary k of them); continuous logits do not tie.
"""

from typing import Optional, Tuple

import mlx.core as mx

from ..sampling import SamplingParams, greedy_log_probs, log_probs
from .common import PRELUDE, REDUCTIONS, ROW_PROLOGUE
from .guard import GuardedKernel, register

THREADS = 1024

GREEDY_BODY = """
  int nw = (tgs + 31) / 32;
  SHARED float red[32];
  SHARED float red2[32];
  SHARED float best_v[32];
  SHARED int best_i[32];

  const DEV T* x = logits + (size_t)row * V;

  // mlx-lm's greedy pick is the argmax of logits - logsumexp(logits), both in
  // the logits' dtype T. The log-sum-exp follows MLX's own LogSumExp kernel
  // for this backend step for step (same element-to-thread mapping, reads per
  // thread, reduction structure and exp), accumulated in float and rounded
  // to T; threads MLX would not launch only ever add exact zeros.
  constexpr int R = LSE_READS(T);
  float m = -FINITE_MAX;
  float s = 0.0f;
  if (V <= LSE_BLOCK_LIMIT) {
    // MLX's block kernel (one pass, tgs * R >= V): the max first, then the sum.
    float v[R];
    for (int j = 0; j < R; ++j) {
      int i = tid * R + j;
      v[j] = i < V ? static_cast<float>(x[i]) : -INFINITY;
    }
    for (int j = 0; j < R; ++j) { m = m < v[j] ? v[j] : m; }
    m = block_max(m, red, lane, wid, nw);
    for (int j = 0; j < R; ++j) { s += FAST_EXP(v[j] - m); }
    s = block_sum(s, red2, lane, wid, nw);
  } else {
    // MLX's looped kernel: a running max and a rescaled running sum.
    int passes = (V + tgs * R - 1) / (tgs * R);
    for (int r = 0; r < passes; ++r) {
      int off = r * tgs * R + tid * R;
      float v[R];
      for (int j = 0; j < R; ++j) { v[j] = off + j < V ? static_cast<float>(x[off + j]) : -INFINITY; }
      float pm = m;
      for (int j = 0; j < R; ++j) { m = m < v[j] ? v[j] : m; }
      s *= FAST_EXP(pm - m);
      for (int j = 0; j < R; ++j) { s += FAST_EXP(v[j] - m); }
    }
    float pm = m;
    m = WARP_MAX(m);
    s *= FAST_EXP(pm - m);
    s = WARP_SUM(s);
    pm = m;
    if (lane == 0) { red[wid] = m; }
    BARRIER();
    m = WARP_MAX(lane < nw ? red[lane] : -FINITE_MAX);
    s *= FAST_EXP(pm - m);
    if (lane == 0) { red2[wid] = s; }
    BARRIER();
    s = WARP_SUM(lane < nw ? red2[lane] : 0.0f);
  }
  float lse = static_cast<float>(static_cast<T>(ISINF(m) ? m : LOG(s) + m));

  float best = -INFINITY;
  int bi = V;
  for (int i = tid; i < V; i += tgs) {
    float v = static_cast<float>(static_cast<T>(static_cast<float>(x[i]) - lse));
    if (v > best || bi == V) { best = v; bi = i; }
  }
  // Reduce (value, index): larger value wins, ties go to the lower index.
  for (int off = 16; off > 0; off /= 2) {
    float ov = SHFL_DOWN(best, off);
    int oi = SHFL_DOWN(bi, off);
    if (ov > best || (ov == best && oi < bi)) { best = ov; bi = oi; }
  }
  if (lane == 0) { best_v[wid] = best; best_i[wid] = bi; }
  BARRIER();
  if (wid == 0) {
    best = lane < nw ? best_v[lane] : -INFINITY;
    bi = lane < nw ? best_i[lane] : V;
    for (int off = 16; off > 0; off /= 2) {
      float ov = SHFL_DOWN(best, off);
      int oi = SHFL_DOWN(bi, off);
      if (ov > best || (ov == best && oi < bi)) { best = ov; bi = oi; }
    }
    if (lane == 0) { posterior[row] = bi; }
  }
"""

SAMPLED_BODY = """
  int nw = (tgs + 31) / 32;
  SHARED float red[32];
  SHARED float part[1024];

  const DEV T* x = logits + (size_t)row * V;
  const DEV float* ql = q_lp + (size_t)(row < n_draft ? row : 0) * V;
  float temp = params[0];
  float top_p = params[1];
  float min_p = params[2];
  int top_k = (int)params[3];

  // Temperature-1 log probabilities: lp_i = x_i - lse.
  float m = -INFINITY;
  for (int i = tid; i < V; i += tgs) { m = FMAX(m, static_cast<float>(x[i])); }
  m = block_max(m, red, lane, wid, nw);
  float s = 0.0f;
  for (int i = tid; i < V; i += tgs) { s += EXP(static_cast<float>(x[i]) - m); }
  s = block_sum(s, red, lane, wid, nw);
  float lse = m + LOG(s);
  float lp_max = m - lse;

  // Filters as one threshold: a token is kept when lp_i >= thr.
  float thr = -INFINITY;
  if (top_p < 1.0f) {
    float total = 0.0f;
    for (int i = tid; i < V; i += tgs) { total += EXP(static_cast<float>(x[i]) - lse); }
    total = block_sum(total, red, lane, wid, nw);
    // Smallest t with mass(lp > t) < top_p * total.
    unsigned int lo = fkey(-INFINITY), hi = fkey(lp_max);
    while (hi - lo > 1) {
      unsigned int mid = lo + (hi - lo) / 2;
      float t = funkey(mid);
      float mass = 0.0f;
      for (int i = tid; i < V; i += tgs) {
        float lp = static_cast<float>(x[i]) - lse;
        mass += lp > t ? EXP(lp) : 0.0f;
      }
      mass = block_sum(mass, red, lane, wid, nw);
      if (mass < top_p * total) { hi = mid; } else { lo = mid; }
    }
    thr = FMAX(thr, funkey(hi));
  }
  if (min_p > 0.0f) {
    thr = FMAX(thr, lp_max + LOG(min_p));
  }
  if (top_k > 0 && top_k < V) {
    // Smallest t with count(lp >= t) <= top_k.
    unsigned int lo = fkey(-INFINITY), hi = fkey(lp_max);
    while (hi - lo > 1) {
      unsigned int mid = lo + (hi - lo) / 2;
      float t = funkey(mid);
      float count = 0.0f;
      for (int i = tid; i < V; i += tgs) {
        count += (static_cast<float>(x[i]) - lse) >= t ? 1.0f : 0.0f;
      }
      count = block_sum(count, red, lane, wid, nw);
      if (count <= (float)top_k) { hi = mid; } else { lo = mid; }
    }
    thr = FMAX(thr, funkey(hi));
  }

  // p_i = exp(lp_i / temp - z_max) / z over kept tokens.
  float inv_t = 1.0f / temp;
  float z_max = lp_max * inv_t;
  float z = 0.0f;
  for (int i = tid; i < V; i += tgs) {
    float lp = static_cast<float>(x[i]) - lse;
    z += lp >= thr ? EXP(lp * inv_t - z_max) : 0.0f;
  }
  z = block_sum(z, red, lane, wid, nw);

  bool draft_row = row < n_draft;
  if (draft_row && tid == 0) {
    int d = draft[row];
    float lp_d = static_cast<float>(x[d]) - lse;
    float p_d = lp_d >= thr ? EXP(lp_d * inv_t - z_max) / z : 0.0f;
    float q_d = EXP(ql[d]);
    flags[row] = u[2 * row] * q_d < p_d ? 1 : 0;
  }

  // Inverse CDF draw from the residual max(0, p - q) (or p itself on the
  // last row, or when p == q leaves no residual), over contiguous chunks.
  int chunk = (V + tgs - 1) / tgs;
  int begin = IMIN(tid * chunk, V);
  int end = IMIN(begin + chunk, V);
  bool use_p = !draft_row;
  float local = 0.0f;
  for (int i = begin; i < end; ++i) {
    float lp = static_cast<float>(x[i]) - lse;
    float p = lp >= thr ? EXP(lp * inv_t - z_max) / z : 0.0f;
    local += use_p ? p : FMAX(p - EXP(ql[i]), 0.0f);
  }
  float mass = block_sum(local, red, lane, wid, nw);
  if (!use_p && mass <= 0.0f) {
    use_p = true;
    local = 0.0f;
    for (int i = begin; i < end; ++i) {
      float lp = static_cast<float>(x[i]) - lse;
      local += lp >= thr ? EXP(lp * inv_t - z_max) / z : 0.0f;
    }
    mass = block_sum(local, red, lane, wid, nw);
  }
  part[tid] = local;
  BARRIER();
  if (tid == 0) {
    float acc = 0.0f;
    for (int j = 0; j < tgs; ++j) { float v = part[j]; part[j] = acc; acc += v; }
  }
  BARRIER();
  float target = u[2 * row + 1] * mass;
  float pre = part[tid];
  if (local > 0.0f && pre <= target && (target < pre + local || tid == tgs - 1)) {
    float c = pre;
    int pick = -1;
    int last = -1;
    for (int i = begin; i < end; ++i) {
      float lp = static_cast<float>(x[i]) - lse;
      float p = lp >= thr ? EXP(lp * inv_t - z_max) / z : 0.0f;
      float r = use_p ? p : FMAX(p - EXP(ql[i]), 0.0f);
      if (r > 0.0f) { last = i; }
      c += r;
      if (c > target && r > 0.0f) { pick = i; break; }
    }
    tokens[row] = pick >= 0 ? pick : last;
  }
"""

# The draft count arrives as a scalar on Metal and as a one-element array on CUDA.
N_DRAFT = {"metal": "  int n_draft = n;\n", "cuda": "  int n_draft = n[0];\n"}


def sources(be: str):
    """(header, greedy source, sampled source) for a backend."""
    header = PRELUDE[be] + REDUCTIONS
    return header, ROW_PROLOGUE[be] + GREEDY_BODY, ROW_PROLOGUE[be] + N_DRAFT[be] + SAMPLED_BODY


def _combine(draft: mx.array, flags: mx.array, tokens: mx.array) -> Tuple[mx.array, mx.array]:
    n = draft.shape[0]
    accepted = mx.cumprod(flags[:n].astype(mx.int32)).sum()
    return accepted, tokens[accepted]


def greedy_reference(draft: mx.array, logits: mx.array) -> Tuple[mx.array, mx.array]:
    """draft: [n] tokens; logits: [n + 1, V] verify logits of [last, draft].

    Each row's pick is mlx-lm's: the argmax of the log probabilities computed
    in the logits' dtype (`sampling.greedy_log_probs`), not of the raw logits.
    """
    posterior = mx.argmax(greedy_log_probs(logits), axis=-1)
    return _combine(draft, draft == posterior[: draft.shape[0]], posterior)


def inverse_cdf(rows: mx.array, u: mx.array) -> mx.array:
    """Index i of each row with cumsum[i-1] <= u * total < cumsum[i] (rows need not be normalised)."""
    c = mx.cumsum(rows, axis=-1)
    target = u * c[..., -1:]
    return mx.minimum((c <= target).sum(axis=-1), rows.shape[-1] - 1).astype(mx.int32)


def sampled_reference(draft: mx.array, logits: mx.array, q_lp: mx.array, u: mx.array,
                      params: SamplingParams) -> Tuple[mx.array, mx.array]:
    """draft: [n]; logits: [n + 1, V]; q_lp: [n, V] drafter log probs; u: [n + 1, 2] uniforms."""
    n = draft.shape[0]
    p = mx.exp(log_probs(logits, params))
    q = mx.exp(q_lp)
    idx = draft[:, None]
    p_d = mx.take_along_axis(p[:n], idx, axis=-1)[:, 0]
    q_d = mx.take_along_axis(q, idx, axis=-1)[:, 0]
    accepted = mx.cumprod((u[:n, 0] * q_d < p_d).astype(mx.int32)).sum()
    # Only the row at the first rejection (or the bonus row) is drawn from.
    p_row = p[accepted]
    q_row = mx.concatenate([q, mx.zeros_like(q[:1])], axis=0)[accepted]
    residual = mx.maximum(p_row - q_row, 0.0)
    residual = mx.where((accepted < n) & (residual.sum() > 0), residual, p_row)
    token = inverse_cdf(residual[None], u[accepted, 1:][None])[0]
    return accepted, token


def _params_array(params: SamplingParams) -> mx.array:
    return mx.array([params.temp, params.top_p, params.min_p, float(params.top_k)], dtype=mx.float32)


def _build(be: str):
    if be not in PRELUDE:
        raise RuntimeError(f"no {be} build")
    make = mx.fast.metal_kernel if be == "metal" else mx.fast.cuda_kernel
    header, greedy_src, sampled_src = sources(be)
    greedy_k = make(name="dflash_verify_accept_greedy", input_names=["logits"], output_names=["posterior"],
                    source=greedy_src, header=header)
    sampled_k = make(name="dflash_verify_accept_sampled", input_names=["logits", "q_lp", "draft", "u", "params", "n"],
                     output_names=["flags", "tokens"], source=sampled_src, header=header)

    def run(draft, logits, q_lp=None, u=None, params=None):
        R, V = logits.shape
        grid, group = (R * THREADS, 1, 1), (THREADS, 1, 1)
        if q_lp is None:
            (posterior,) = greedy_k(inputs=[logits], template=[("T", logits.dtype), ("V", V)], grid=grid,
                                    threadgroup=group, output_shapes=[(R,)], output_dtypes=[mx.int32])
            return _combine(draft, draft == posterior[: draft.shape[0]], posterior)
        n = draft.shape[0]
        flags, tokens = sampled_k(
            inputs=[logits, q_lp.astype(mx.float32), draft.astype(mx.int32), u, _params_array(params), n],
            template=[("T", logits.dtype), ("V", V)], grid=grid, threadgroup=group,
            output_shapes=[(R,), (R,)], output_dtypes=[mx.int32, mx.int32], init_value=0,
        )
        return _combine(draft, flags, tokens)

    return run


def _check(run) -> None:
    key = mx.random.key(7)
    for n, V, dtype in ((4, 1000, mx.float32), (7, 4099, mx.float16), (0, 513, mx.float32)):
        k1, k2, k3, k4, key = mx.random.split(key, 5)
        logits = (3 * mx.random.normal((n + 1, V), key=k1)).astype(dtype)
        # Drafts that agree with the target for a while, then disagree.
        draft = mx.argmax(logits[:n], axis=-1).astype(mx.int32) if n else mx.zeros((0,), mx.int32)
        if n > 2:
            draft = mx.concatenate([draft[:2], mx.random.randint(0, V, (n - 2,), key=k2).astype(mx.int32)])
        got, want = run(draft, logits), greedy_reference(draft, logits)
        if n == 0:
            continue
        assert got[0].item() == want[0].item() and got[1].item() == want[1].item(), f"greedy {got} != {want}"
        q_lp = log_probs(3 * mx.random.normal((n, V), key=k3), SamplingParams(temp=1.0))
        for params in (SamplingParams(temp=1.0), SamplingParams(temp=0.7, top_p=0.9),
                       SamplingParams(temp=1.3, top_k=40, min_p=0.02)):
            for trial in range(4):
                u = mx.random.uniform(shape=(n + 1, 2), key=mx.random.split(k4, 4)[trial])
                got = run(draft, logits, q_lp, u, params)
                want = sampled_reference(draft, logits, q_lp, u, params)
                assert (got[0].item(), got[1].item()) == (want[0].item(), want[1].item()), (
                    f"sampled {params} {got} != {want}")


KERNEL = register(GuardedKernel(
    "verify_accept", "greedy and speculative-sampling acceptance, one pass per block row", _build, _check))


def verify_accept(draft: mx.array, logits: mx.array, params: SamplingParams,
                  q_lp: Optional[mx.array] = None) -> Tuple[mx.array, mx.array]:
    """(accepted draft count, next token) from verify logits [n + 1, V] of [last, draft]."""
    run = KERNEL.kernel()
    if params.greedy:
        return greedy_reference(draft, logits) if run is None else run(draft, logits)
    u = mx.random.uniform(shape=(draft.shape[0] + 1, 2))
    if run is None:
        return sampled_reference(draft, logits, q_lp, u, params)
    return run(draft, logits, q_lp, u, params)
