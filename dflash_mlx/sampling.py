"""Sampling settings, the filtered distributions tokens are drawn from, and
the draws of a seeded request.

Filters are mlx-lm's own (top-p, min-p, top-k on temperature-1 log
probabilities, then temperature), applied identically to the target's p and
the drafter's q, so DFlash samples from exactly the distribution mlx-lm's
sampler would. Rejection sampling lives in `kernels/verify_accept.py`;
`Draws` is the other exact scheme, whose text a seed fixes at any width.
"""

import functools
import hashlib
import secrets
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_logits_processors, make_sampler

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

    @property
    def key(self) -> tuple:
        """The settings the drawn distribution depends on (what is learnt about acceptance is kept per key)."""
        return (0.0, 1.0, 0, 0.0) if self.greedy else (self.temp, self.top_p, self.top_k, self.min_p)


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


def greedy_log_probs(logits: mx.array) -> mx.array:
    """mlx-lm's greedy log probabilities: `logits - logsumexp(logits)` in the logits' dtype.

    mlx-lm's `generate_step` takes the argmax of exactly these. In bfloat16 (or
    float16) the log-sum-exp is rounded to the dtype and so is each
    difference, so two logits one ulp apart can tie (the lower index wins)
    where the raw logits would not: greedy picks must come from this, never
    from the raw logits. MLX's LogSumExp accumulates in float32 and rounds its
    result to the input dtype; each row is reduced on its own.
    """
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


@functools.lru_cache(maxsize=32)
def _sampler(temp: float, top_p: float, min_p: float, top_k: int):
    return make_sampler(temp, top_p, min_p, top_k=top_k)


def pick(logits: mx.array, params: SamplingParams) -> mx.array:
    """One token per row of `logits` [1, V], as mlx-lm's `generate_step` picks
    it: its own sampler on `greedy_log_probs(logits)`. A seeded plain step so
    draws what mlx-lm would (the draws depend on the shape: [1, V] as mlx-lm's)."""
    return _sampler(params.temp, params.top_p, params.min_p, params.top_k)(greedy_log_probs(logits))


class Processed:
    """mlx-lm logits processors (penalties, logit bias: `make_logits_processors`)
    applied at every block position with the tokens before that position.

    mlx-lm calls each processor as `processor(tokens, logits [1, V])` with the
    prompt and every token fed so far; a verify block row i (after the block's
    first i drafts) sees the committed tokens and those drafts, so each row gets
    exactly the logits plain decoding would have given its position.
    """

    def __init__(self, processors, prompt):
        self.processors = list(processors)
        self.seen = mx.array(list(prompt)) if self.processors else None  # the prompt and every committed token

    def __bool__(self):
        return bool(self.processors)

    def commit(self, tokens: mx.array) -> None:
        if self.processors:
            self.seen = mx.concatenate([self.seen, tokens.astype(self.seen.dtype)])

    def row(self, logits: mx.array, before: Optional[mx.array] = None) -> mx.array:
        """One row [1, V] after the committed tokens and then `before`."""
        tokens = self.seen if before is None or before.size == 0 else mx.concatenate(
            [self.seen, before.astype(self.seen.dtype)])
        for p in self.processors:
            logits = p(tokens, logits)
        return logits

    def __call__(self, logits: mx.array, drafts: mx.array) -> mx.array:
        """Rows [n, V] of a block [last, drafts]: row i after the first i drafts."""
        if not self.processors:
            return logits
        return mx.concatenate([self.row(logits[i : i + 1], drafts[:i]) for i in range(logits.shape[0])])


@functools.lru_cache(maxsize=8)
def _gumbel_rows(V: int):
    return mx.vmap(lambda key: mx.random.gumbel((V,), key=key))


def gumbel_rows(keys: mx.array, V: int) -> mx.array:
    """A Gumbel row [V] per key of `keys` [n, 2] (`Draws.key`s; several requests' in one call)."""
    return _gumbel_rows(V)(keys)


class Draws:
    """A request's random draws, fixed by its seed and each token's position.

    The token at position t is `argmax(log_probs(logits_t) + G_t)`, with G_t
    Gumbel noise [V] from the key (seed word, t): the Gumbel-max trick, an
    exact draw from the filtered, tempered distribution, and independent from
    position to position. A draft at t is chosen with the same G_t from the
    drafter's distribution, and verifying it is the greedy rule on the
    perturbed rows (accepted where it equals the target's choice, the target's
    choice after the first disagreement). So the text is a function of the
    prompt, the settings and the seed alone: the same at every block width,
    with or without drafts, alone or in any batch. (Rejection sampling, used
    without a seed on a request's own, accepts a little more: its coupling of
    draft and target is the best possible, but its draws follow the widths.)
    Without a seed the word is random.
    """

    def __init__(self, seed: Optional[int], at: int, vocab_size: int):
        """`at`: the position (prompt tokens before it) of the next token drawn."""
        self.vocab_size = vocab_size
        if seed is None:
            self.word = secrets.randbits(32)
        else:
            digest = hashlib.blake2b(str(int(seed)).encode(), digest_size=4).digest()
            self.word = int.from_bytes(digest, "little")
        self.at = at

    def key(self, i: int) -> list:
        """The key of the position `i` after the next one."""
        return [self.word, (self.at + i) & 0xFFFFFFFF]

    def keys(self, n: int) -> mx.array:
        """The keys [n, 2] of the next n positions."""
        return mx.array([self.key(i) for i in range(n)], dtype=mx.uint32)

    def noise(self, n: int) -> mx.array:
        """Gumbel rows [n, V] for the next n positions (lazy)."""
        return gumbel_rows(self.keys(n), self.vocab_size)

    def advance(self, n: int) -> None:
        """n tokens were committed."""
        self.at += n


def choose(logits: mx.array, params: SamplingParams, noise: Optional[mx.array] = None) -> mx.array:
    """Each row's token: the greedy pick (mlx-lm's), or with `noise` (`Draws.noise`) a
    draw from the filtered, tempered distribution of that row."""
    if params.greedy:
        return mx.argmax(greedy_log_probs(logits), axis=-1).astype(mx.uint32)
    return mx.argmax(log_probs(logits, params) + noise, axis=-1).astype(mx.uint32)


def agreeing(drafts: mx.array, picks: mx.array) -> mx.array:
    """How many leading drafts [..., n] equal the picks [..., n + 1] after them (the accepted count)."""
    return mx.cumprod(drafts == picks[..., :-1], axis=-1).sum(axis=-1)


def make_processors(args: Optional[dict]) -> list:
    """mlx-lm's logits processors from their arguments (JSON-safe: logit_bias keys may be strings)."""
    if not args:
        return []
    args = dict(args)
    if args.get("logit_bias"):
        args["logit_bias"] = {int(k): float(v) for k, v in args["logit_bias"].items()}
    return make_logits_processors(**args)
