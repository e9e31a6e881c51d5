"""What one sequence keeps between cycles, decoded alone or in a batch.

How its tokens are drawn (sampling settings, logits processors that have seen its history, a
seed's draws, log probabilities, proposal scales), its draft source and that source's state,
the target taps its drafter has not read yet, its last token and what it has committed, and the
grammar it keeps to. A
sequence of the decoder (`running.Running`) is one, alone or in a batch, and the cycles
(`cycle.py`) decode it either way.
"""

from dataclasses import dataclass, field
from typing import Any, List, Optional

import mlx.core as mx

from ..sampling import Draws, Processed, SamplingParams

GREEDY = SamplingParams()


@dataclass(kw_only=True)
class SequenceState:
    source: Any  # the draft source (`draft.source.DraftSource`)
    dstate: Any  # the source's state for this sequence (the drafter's context)
    params: SamplingParams = GREEDY
    proc: Processed = field(default_factory=lambda: Processed([], ()))  # fed every committed token
    draws: Optional[Draws] = None  # a seeded sampled sequence's draws (None: rejection sampling)
    top: Optional[int] = None  # with `logprobs=k`: the k most likely tokens at each position
    scaler: Any = None  # an unseeded sampled sequence's proposal scales (`policy.proposal`), where it drafts
    constraint: Any = None  # its grammar's matcher (`constrain.Constraint`): masks every position it picks
    last: Optional[mx.array] = None  # [1] the last committed token (the next block's first)
    taps: list = field(default_factory=list)  # target taps of committed tokens the drafter has not read (lazy)
    history: List[int] = field(default_factory=list)  # the prompt and the committed tokens
    max_tokens: int = 0
    generated: int = 0  # tokens committed so far

    @property
    def rejection(self) -> bool:
        """Sampled without a seed: drafted cycles are verified by rejection sampling."""
        return not self.params.greedy and self.draws is None

    def noise(self, n: int) -> Optional[mx.array]:
        """The next n positions' draws (`Draws.noise`), None without a seed."""
        return None if self.draws is None else self.draws.noise(n)

    def drawn(self, tokens: List[int]) -> None:
        """Tokens committed: the grammar and the logits processors see them, the draws move past them."""
        if self.constraint is not None:
            self.constraint.commit(tokens)
        if self.proc:
            self.proc.commit(mx.array(tokens))
        if self.draws is not None:
            self.draws.advance(len(tokens))
