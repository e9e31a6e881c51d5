"""Greedy and exact speculative acceptance, computed on the device.

Filters are mlx-lm's own (top-p, min-p, top-k on temperature-1 log
probabilities, then temperature), applied identically to the target's p and
the drafter's q, so DFlash samples from exactly the distribution mlx-lm's
sampler would.
"""

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from .errors import DFlashError


@dataclass(frozen=True)
class SamplingParams:
    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None

    def __post_init__(self):
        if self.temp < 0:
            raise DFlashError(f"--temp must be >= 0 (got {self.temp}).")
        if not 0 < self.top_p <= 1:
            raise DFlashError(f"--top-p must be in (0, 1] (got {self.top_p}).")
        if self.top_k < 0:
            raise DFlashError(f"--top-k must be >= 0 (got {self.top_k}); 0 disables it.")
        if not 0 <= self.min_p <= 1:
            raise DFlashError(f"--min-p must be in [0, 1] (got {self.min_p}).")

    @property
    def greedy(self) -> bool:
        return self.temp == 0


def log_probs(logits: mx.array, params: SamplingParams) -> mx.array:
    """Normalised log probabilities of the distribution tokens are drawn from."""
    lp = logits.astype(mx.float32)
    lp = lp - mx.logsumexp(lp, axis=-1, keepdims=True)
    if 0 < params.top_p < 1:
        lp = apply_top_p(lp, params.top_p)
    if params.min_p > 0:
        lp = apply_min_p(lp, params.min_p)
    if 0 < params.top_k < lp.shape[-1]:
        lp = apply_top_k(lp, params.top_k)
    lp = lp * (1.0 / params.temp)
    return lp - mx.logsumexp(lp, axis=-1, keepdims=True)


def pick(logits: mx.array, params: SamplingParams) -> mx.array:
    """One token per row: argmax, or a draw from the filtered distribution."""
    if params.greedy:
        return mx.argmax(logits, axis=-1)
    return mx.random.categorical(log_probs(logits, params))


def accept_greedy(draft: mx.array, target_logits: mx.array):
    """Accepted draft count and the target's next token.

    draft: [n] tokens; target_logits: [n + 1, V] verify logits of [last, draft].
    """
    posterior = mx.argmax(target_logits, axis=-1)
    n = draft.shape[0]
    accepted = mx.cumprod((draft == posterior[:n]).astype(mx.int32)).sum()
    return accepted, posterior[accepted]


def accept_speculative(draft: mx.array, q_lp: mx.array, p_lp: mx.array):
    """Exact speculative sampling.

    Accept draft token i with probability min(1, p_i/q_i); at the first
    rejection draw from normalise(max(0, p - q)); after full acceptance draw
    from p at the last position. q_lp: [n, V], p_lp: [n + 1, V].
    """
    n = draft.shape[0]
    idx = draft[:, None]
    p_d = mx.exp(mx.take_along_axis(p_lp[:n], idx, axis=-1)[:, 0])
    q_d = mx.exp(mx.take_along_axis(q_lp, idx, axis=-1)[:, 0])
    u = mx.random.uniform(shape=(n,))
    accepted = mx.cumprod((u * q_d < p_d).astype(mx.int32)).sum()
    p = mx.exp(p_lp)
    residual = mx.maximum(p[:n] - mx.exp(q_lp), 0.0)
    rows = mx.concatenate([residual, p[n:]], axis=0)
    row = rows[accepted]
    total = row.sum()
    # p == q exactly leaves no residual mass; p itself is then the right law.
    row = mx.where(total > 0, row / mx.maximum(total, 1e-30), p[accepted])
    token = mx.random.categorical(mx.log(row))
    return accepted, token
