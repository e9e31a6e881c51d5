"""Rebuild a Gated DeltaNet state for an accepted prefix from the verify tape.

    S <- S * g_t;  S <- S + delta_t k_t^T      for t < keep

These are the verify pass's own state updates in the same order, so the state
is the one step-by-step decoding of the accepted tokens reaches. No reduction
is needed: the deltas were recorded by `gdn_verify`.
"""

from functools import partial
from typing import Sequence

import mlx.core as mx

from .common import PRELUDE
from .gdn_verify import HEAD_SETUP, PROLOGUE, SCALAR, gdn_verify_reference, random_inputs, repeat_heads
from .guard import GuardedKernel, register

BODY = """
  // k: [B, T, Hk, Dk]; delta: [B, T, Hv, Dv]; g: [B, T, Hv]
  auto k_ = k + b_idx * steps * Hk * Dk + hk_idx * Dk;
  auto d_ = delta + b_idx * steps * Hv * Dv + hv_idx * Dv;
  auto g_ = g + b_idx * steps * Hv;
  for (int t = 0; t < kept; ++t) {
    float dlt = d_[dv_idx];
    for (int i = 0; i < n_per_t; ++i) {
      state[i] = state[i] * g_[hv_idx];
    }
    for (int i = 0; i < n_per_t; ++i) {
      state[i] = state[i] + k_[n_per_t * dk_idx + i] * dlt;
    }
    k_ += Hk * Dk;
    d_ += Hv * Dv;
    g_ += Hv;
  }
  for (int i = 0; i < n_per_t; ++i) {
    o_state[n_per_t * dk_idx + i] = static_cast<StT>(state[i]);
  }
"""


def source(be: str) -> str:
    scalars = "".join(f"  int {var} = " + SCALAR[be].format(name=name) + ";\n"
                      for var, name in (("steps", "T"), ("kept", "keep")))
    return PROLOGUE[be] + scalars + HEAD_SETUP + BODY


@partial(mx.compile, shapeless=False)
def _step(state, k, g, delta):
    state = state * g[..., None, None]
    return state + k[..., None, :] * delta[..., None]


def gdn_replay_reference(state, k, g, delta, keep: int) -> mx.array:
    """state: [B, Hv, Dv, Dk]; k: [B, T, Hk, Dk]; g: [B, T, Hv]; delta: [B, T, Hv, Dv]."""
    k = repeat_heads(k, delta.shape[2])
    for t in range(keep):
        state = _step(state, k[:, t], g[:, t], delta[:, t])
    return state


def _build(be: str):
    if be not in PRELUDE:
        raise RuntimeError(f"no {be} build")
    make = mx.fast.metal_kernel if be == "metal" else mx.fast.cuda_kernel
    kernel = make(
        name="dflash_gdn_replay", input_names=["state_in", "k", "g", "delta", "T", "keep"],
        output_names=["state_out"], source=source(be), header=PRELUDE[be],
    )

    def run(state, k, g, delta, keep):
        B, T, Hk, Dk = k.shape
        Hv, Dv = delta.shape[2:]
        (out,) = kernel(
            inputs=[state, k.astype(mx.float32), g.astype(mx.float32), delta, T, keep],
            template=[("StT", state.dtype), ("Dk", Dk), ("Dv", Dv), ("Hk", Hk), ("Hv", Hv)],
            grid=(32, Dv, B * Hv), threadgroup=(32, 4, 1),
            output_shapes=[state.shape], output_dtypes=[state.dtype],
        )
        return out

    return run


def _check(run) -> None:
    for B, T in ((1, 6), (2, 16)):
        q, k, v, g, beta, state = random_inputs(mx.random.key(T), B=B, T=T)
        _, _, delta = gdn_verify_reference(q, k, v, g, beta, state)
        for keep in (1, T // 2, T - 1):
            want = gdn_verify_reference(q[:, :keep], k[:, :keep], v[:, :keep], g[:, :keep], beta[:, :keep], state)[1]
            got = run(state, k, g, delta, keep)
            assert mx.allclose(got, want, atol=1e-5, rtol=1e-5).item(), f"keep={keep}"


KERNEL = register(GuardedKernel("gdn_replay", "Gated DeltaNet state rebuilt for the accepted prefix", _build, _check))


def gdn_replay(state, k, g, delta, keep: int) -> mx.array:
    """The state after the first `keep` steps of a taped verify block."""
    run = KERNEL.kernel() if k.shape[-1] % 32 == 0 else None
    if run is None:
        return gdn_replay_reference(state, k, g, delta, keep)
    return run(state, k, g, delta, keep)


def gdn_replay_each(state, k, g, delta, keeps: Sequence[int]) -> mx.array:
    """`gdn_replay` with its own `keeps[b]` per sequence of a batched block: the steps
    past a sequence's keep become identities (gate 1, delta 0), which leave its state
    exactly as it was, so one replay to the longest keep serves every sequence."""
    T = g.shape[1]
    live = mx.arange(T)[None] < mx.array(keeps)[:, None]  # [B, T]
    g = mx.where(live[..., None], g, mx.array(1, g.dtype))
    delta = mx.where(live[..., None, None], delta, mx.array(0, delta.dtype))
    return gdn_replay(state, k, g, delta, max(keeps)) if max(keeps) else state
