"""A grammar as an mlx-lm logits processor (`processor(tokens, logits)`): plain constrained
decoding with `mlx_lm.generate`, whose output constrained DFlash equals."""

import mlx.core as mx

from .mask import allowed, upload
from .matcher import Constraint


class GrammarProcessor:
    """Masks each step's logits [1, V] with the grammar's mask after the tokens generated so far
    (`tokens`: the prompt of `prompt_tokens` tokens, then those generated, as mlx-lm passes them).
    Reading the newest token is a host synchronisation per step, as any grammar engine's."""

    def __init__(self, constraint: Constraint, prompt_tokens: int):
        self.constraint = constraint
        self.seen = prompt_tokens

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        new = tokens[self.seen :].tolist()
        self.seen = tokens.shape[0]
        if not self.constraint.done:  # mlx-lm computes a step past the end-of-sequence token
            self.constraint.commit(new)
        return allowed(logits, upload(self.constraint.masks().bits))
