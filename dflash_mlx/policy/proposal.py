"""How flat the drafter's sampled drafts are: a learned scale per draft position.

Speculative sampling is exact whatever distribution q the drafts are drawn
from; only how often they are accepted depends on it: a draft at a position
is accepted with probability sum_x min(p(x), q(x)). A drafter trained to
match the target's greedy choices is often surer than the target is at the
requested temperature, and then a flatter q is accepted more often: on the
demo pair at temperature 1 (block 16), drafting at 1.7 times the temperature
took tokens per cycle from 1.31 to 1.41.

The drafter's filtered log probabilities are divided by a scale s (q_s is
q^(1/s), normalised; s = 1 is the plain q z-lab's loop draws from). After
each verify, p and q are both known at every position the verify reached,
so the acceptance every candidate scale would have had there is computed
exactly (`acceptance_by_scale`), not guessed from the one that was drawn.
`ProposalScales` keeps aged means of it per position and drafts each
position at its best scale. Position choices are independent: in a
DFlash drafter each position is drawn on its own, and the expected accepted
length is a sum of products of per-position rates, each largest at its own
best scale.
"""

from typing import List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..sampling import SamplingParams, log_probs

SCALES = (0.7, 1.0, 1.4, 2.0, 2.8, 4.0)
# Every drafted cycle teaches the scales until this many have, then one in LEARN_EVERY: the
# sums are exact expectations, and few settle them (on MLX's CPU backend the exps they take
# cost about a twentieth of a demo pair cycle).
LEARN_ALWAYS = 64
LEARN_EVERY = 4


def rescale(lp: mx.array, scale: float) -> mx.array:
    """Log probabilities `lp` [..., V] flattened (scale > 1) or sharpened (< 1), normalised."""
    return lp if scale == 1.0 else nn.log_softmax(lp * (1.0 / scale), axis=-1)


def rescale_rows(lp: mx.array, scales: Optional[Sequence[float]]) -> mx.array:
    """`rescale` of each row of `lp` [n, V] at its own scale (None: all 1)."""
    if scales is None or all(s == 1.0 for s in scales):
        return lp
    return nn.log_softmax(lp * mx.array([1.0 / s for s in scales], dtype=lp.dtype)[:, None], axis=-1)


def acceptance_by_scale(p_lp: mx.array, q_lp: mx.array, used: Sequence[float],
                        scales: Sequence[float] = SCALES) -> mx.array:
    """[m, len(scales)]: sum_x min(p(x), q_s(x)) at each of m positions, for each scale s.

    `p_lp` [m, V]: the target's log probabilities there; `q_lp` [m, V]: those
    the drafts were drawn from, at the scales `used` [m] (so q_lp * used is
    the drafter's own, up to a constant per row).
    """
    base = q_lp * mx.array(used, dtype=q_lp.dtype)[:, None]
    q = mx.softmax(base[:, None] * mx.array([1.0 / s for s in scales], dtype=q_lp.dtype)[:, None], axis=-1)
    return mx.minimum(mx.exp(p_lp)[:, None], q).sum(axis=-1)


def reached_gains(logits: mx.array, q_lp: mx.array, copied: int, accepted: int, scales: Sequence[float],
                  params: SamplingParams) -> Tuple[int, mx.array]:
    """(first draft position, `acceptance_by_scale` [n, scales]) at the drafter's positions a
    verify reached (`logits`: its rows [n + 1, V] of [last, n drafts] drawn from `q_lp` [n, V]):
    from the first after the `copied` ones through the first rejected one."""
    stop = min(accepted, q_lp.shape[0] - 1) + 1
    rows = slice(copied, stop)
    p_lp = log_probs(logits[rows], params)
    return copied, acceptance_by_scale(p_lp, q_lp[rows], scales[copied:stop])


class ProposalScales:
    """Aged mean acceptance per draft position and scale; each position drafts at its best.

    A position with little evidence of its own borrows the mean over all
    positions (`prior_weight` cycles' worth); with none at all, scale 1.
    """

    def __init__(self, positions: int, scales: Sequence[float] = SCALES, decay: float = 0.99,
                 prior_weight: float = 4.0):
        self.scales = tuple(scales)
        self.decay, self.prior_weight = decay, prior_weight
        self.sums = np.zeros((positions, len(self.scales)))
        self.weight = np.zeros(positions)
        self.cycles = 0  # drafted cycles asked `learning`

    def learning(self) -> bool:
        """Whether the next drafted cycle should be learned from (`reached_gains`)."""
        self.cycles += 1
        return self.cycles <= LEARN_ALWAYS or self.cycles % LEARN_EVERY == 0

    def means(self) -> np.ndarray:
        """[positions, scales]: the acceptance each scale is expected to have at each position."""
        total = self.weight.sum()
        if total == 0:
            return np.zeros_like(self.sums)
        pooled = self.sums.sum(axis=0) / total
        w = self.prior_weight
        return (self.sums + w * pooled) / (self.weight + w)[:, None]

    def choose(self, n: int, start: int = 0) -> List[float]:
        """The scales for draft positions start .. start + n - 1 (0: the first after `last`)."""
        if self.weight.sum() == 0:
            return [1.0] * n
        best = self.means().argmax(axis=1)
        last = len(best) - 1
        return [self.scales[best[min(i, last)]] for i in range(start, start + n)]

    def update(self, start: int, gains: Sequence[Sequence[float]]) -> None:
        """`gains[j]`: `acceptance_by_scale` at draft position start + j, for the positions the verify reached."""
        if not len(gains):
            return
        self.sums *= self.decay
        self.weight *= self.decay
        g = np.asarray(gains, dtype=np.float64)
        end = min(start + len(g), len(self.weight))
        self.sums[start:end] += g[: end - start]
        self.weight[start:end] += 1.0

    def describe(self) -> Optional[str]:
        if self.weight.sum() == 0:
            return None
        return "proposal scales per position: " + " ".join(f"{s:g}" for s in self.choose(len(self.weight)))


class FixedScale:
    """Every position drafted at one scale (1: the drafter's own q); nothing learned."""

    def __init__(self, scale: float):
        self.scale = float(scale)

    def choose(self, n: int, start: int = 0) -> List[float]:
        return [self.scale] * n

    def learning(self) -> bool:
        return False

    def update(self, start: int, gains) -> None:
        pass

    def describe(self) -> Optional[str]:
        return None
