"""Gated DeltaNet verify pass that records an update tape.

Same recurrence as mlx-lm's gated delta rule (state [B, Hv, Dv, Dk]):

    S <- S * g_t;  delta_t = (v_t - S k_t) * beta_t;  S <- S + delta_t k_t^T;  y_t = S q_t

and also returns every delta_t [B, T, Hv, Dv]. With g, k and the deltas, the
state after any accepted prefix is rebuilt by `gdn_replay` without the two
reductions per step, and without storing a state per step.
"""

from functools import partial
from typing import Tuple

import mlx.core as mx

from .common import PRELUDE
from .guard import GuardedKernel, register

# Thread layout shared with gdn_replay: grid (32, Dv, B * Hv), threadgroup
# (32, 4, 1); a simdgroup (warp) of 32 lanes splits Dk for one value row.
PROLOGUE = {
    "metal": """
  int n = thread_position_in_grid.z;
  int dk_idx = thread_position_in_threadgroup.x;
  int dv_idx = thread_position_in_grid.y;
""",
    "cuda": """
  int n = blockIdx.z;
  int dk_idx = threadIdx.x;
  int dv_idx = blockIdx.y * blockDim.y + threadIdx.y;
""",
}
SCALAR = {"metal": "{name}", "cuda": "{name}[0]"}  # how a scalar input reads

HEAD_SETUP = """
  if (dv_idx >= Dv) { return; }
  int b_idx = n / Hv;
  int hv_idx = n % Hv;
  int hk_idx = hv_idx / (Hv / Hk);
  constexpr int n_per_t = Dk / 32;
  // state_in, state_out: [B, Hv, Dv, Dk]
  auto i_state = state_in + (n * Dv + dv_idx) * Dk;
  auto o_state = state_out + (n * Dv + dv_idx) * Dk;
  float state[n_per_t];
  for (int i = 0; i < n_per_t; ++i) {
    state[i] = static_cast<float>(i_state[n_per_t * dk_idx + i]);
  }
"""

BODY = """
  // q, k: [B, T, Hk, Dk]; v, y, delta: [B, T, Hv, Dv]; g, beta: [B, T, Hv]
  auto q_ = q + b_idx * steps * Hk * Dk + hk_idx * Dk;
  auto k_ = k + b_idx * steps * Hk * Dk + hk_idx * Dk;
  auto v_ = v + b_idx * steps * Hv * Dv + hv_idx * Dv;
  auto y_ = y + b_idx * steps * Hv * Dv + hv_idx * Dv;
  auto d_ = delta + b_idx * steps * Hv * Dv + hv_idx * Dv;
  auto g_ = g + b_idx * steps * Hv;
  auto beta_ = beta + b_idx * steps * Hv;

  for (int t = 0; t < steps; ++t) {
    float kv_mem = 0.0f;
    for (int i = 0; i < n_per_t; ++i) {
      int s_idx = n_per_t * dk_idx + i;
      state[i] = state[i] * g_[hv_idx];
      kv_mem += state[i] * static_cast<float>(k_[s_idx]);
    }
    kv_mem = WARP_SUM(kv_mem);
    float dlt = (static_cast<float>(v_[dv_idx]) - kv_mem) * beta_[hv_idx];
    float out = 0.0f;
    for (int i = 0; i < n_per_t; ++i) {
      int s_idx = n_per_t * dk_idx + i;
      state[i] = state[i] + static_cast<float>(k_[s_idx]) * dlt;
      out += state[i] * static_cast<float>(q_[s_idx]);
    }
    out = WARP_SUM(out);
    if (dk_idx == 0) {
      y_[dv_idx] = static_cast<InT>(out);
      d_[dv_idx] = dlt;
    }
    q_ += Hk * Dk;
    k_ += Hk * Dk;
    v_ += Hv * Dv;
    y_ += Hv * Dv;
    d_ += Hv * Dv;
    g_ += Hv;
    beta_ += Hv;
  }
  for (int i = 0; i < n_per_t; ++i) {
    o_state[n_per_t * dk_idx + i] = static_cast<StT>(state[i]);
  }
"""


def source(be: str) -> str:
    steps = "  int steps = " + SCALAR[be].format(name="T") + ";\n"
    return PROLOGUE[be] + steps + HEAD_SETUP + BODY


@partial(mx.compile, shapeless=False)
def _step(q, k, v, g, beta, state):
    state = state * g[..., None, None]
    kv_mem = (state * k[..., None, :]).sum(axis=-1)
    delta = (v - kv_mem) * beta[..., None]
    state = state + k[..., None, :] * delta[..., None]
    y = (state * q[..., None, :]).sum(axis=-1)
    return y.astype(q.dtype), state, delta


def repeat_heads(x: mx.array, hv: int) -> mx.array:
    r = hv // x.shape[-2]
    return mx.repeat(x, r, -2) if r > 1 else x


def gdn_verify_reference(q, k, v, g, beta, state) -> Tuple[mx.array, mx.array, mx.array]:
    """q, k: [B, T, Hk, Dk]; v: [B, T, Hv, Dv]; g, beta: [B, T, Hv]; state: [B, Hv, Dv, Dk].

    Returns y [B, T, Hv, Dv], the final state and the deltas [B, T, Hv, Dv] (float32).
    """
    Hv = v.shape[2]
    q, k = repeat_heads(q, Hv), repeat_heads(k, Hv)
    ys, deltas = [], []
    for t in range(k.shape[1]):
        y, state, delta = _step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
        ys.append(y)
        deltas.append(delta)
    return mx.stack(ys, axis=1), state, mx.stack(deltas, axis=1).astype(mx.float32)


def supported(k: mx.array, g: mx.array) -> bool:
    return k.shape[-1] % 32 == 0 and g.ndim == 3


def _build(be: str):
    if be not in PRELUDE:
        raise RuntimeError(f"no {be} build")
    make = mx.fast.metal_kernel if be == "metal" else mx.fast.cuda_kernel
    kernel = make(
        name="dflash_gdn_verify", input_names=["q", "k", "v", "g", "beta", "state_in", "T"],
        output_names=["y", "state_out", "delta"], source=source(be), header=PRELUDE[be],
    )

    def run(q, k, v, g, beta, state):
        B, T, Hk, Dk = k.shape
        Hv, Dv = v.shape[2:]
        return tuple(kernel(
            inputs=[q, k, v, g.astype(mx.float32), beta.astype(mx.float32), state, T],
            template=[("InT", q.dtype), ("StT", state.dtype), ("Dk", Dk), ("Dv", Dv), ("Hk", Hk), ("Hv", Hv)],
            grid=(32, Dv, B * Hv), threadgroup=(32, 4, 1),
            output_shapes=[(B, T, Hv, Dv), state.shape, (B, T, Hv, Dv)],
            output_dtypes=[q.dtype, state.dtype, mx.float32],
        ))

    return run


def random_inputs(key, B=1, T=5, Hk=2, Hv=4, Dk=64, Dv=32, dtype=mx.float32):
    ks = mx.random.split(key, 6)
    q = mx.random.normal((B, T, Hk, Dk), key=ks[0]).astype(dtype) * Dk**-0.5
    k = mx.random.normal((B, T, Hk, Dk), key=ks[1]).astype(dtype) * Dk**-0.5
    v = mx.random.normal((B, T, Hv, Dv), key=ks[2]).astype(dtype)
    g = mx.random.uniform(0.5, 1.0, (B, T, Hv), key=ks[3])
    beta = mx.random.uniform(0.0, 1.0, (B, T, Hv), key=ks[4])
    state = mx.random.normal((B, Hv, Dv, Dk), key=ks[5])
    return q, k, v, g, beta, state


def _check(run) -> None:
    for B, T, dtype in ((1, 5, mx.float32), (2, 16, mx.bfloat16)):
        args = random_inputs(mx.random.key(B * 100 + T), B=B, T=T, dtype=dtype)
        got, want = run(*args), gdn_verify_reference(*args)
        for name, a, b in zip(("y", "state", "delta"), got, want):
            tol = 1e-5 if dtype == mx.float32 else 2e-2
            assert mx.allclose(a.astype(mx.float32), b.astype(mx.float32), atol=tol, rtol=tol).item(), name


KERNEL = register(GuardedKernel("gdn_verify", "Gated DeltaNet verify pass recording an update tape", _build, _check))


def gdn_verify(q, k, v, g, beta, state) -> Tuple[mx.array, mx.array, mx.array]:
    """(y, final state, deltas): the gated delta rule over a verify block, with its tape."""
    run = KERNEL.kernel() if supported(k, g) else None
    if run is None:
        return gdn_verify_reference(q, k, v, g, beta, state)
    return run(q, k, v, g, beta, state)
