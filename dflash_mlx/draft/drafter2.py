"""MLX port of z-lab's DFlash 2 drafter (`DFlash2DraftModel`).

DFlash 2 keeps DFlash's layers (attention from the block to the committed
context plus the block, `drafter.py`) and adds, around the attention and
around the MLP of every layer, a grouped dynamic causal convolution over the
block: a learned base kernel plus a per-group kernel computed from the
layer's input at each position. Taps stop at the block's first position, so
a block never reads another. The drafted tokens are then chosen by a
candidate selector: the draft head's top-k tokens per position, rescored by
how well each follows the token chosen before it (predecessor and successor
codebooks, gated by the position's hidden state), walking from the verified
anchor token.
"""

from typing import Callable, Dict, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn

from ..config import DrafterConfig
from .source import DFlashDraftSource
from .drafter import DecoderLayer, DFlashDrafter
from ..policy.proposal import rescale
from ..sampling import SamplingParams, log_probs

CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")


def published_keys(weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
    """Codebooks under their published names (PyTorch's state_dict adds `.weight`)."""
    out = dict(weights)
    for name in CODEBOOKS:
        if f"{name}.weight" in out and name not in out:
            out[name] = out.pop(f"{name}.weight")
    return out


def grouped_causal_conv(x: mx.array, dynamic: mx.array, base: mx.array, group_size: int) -> mx.array:
    """out[t] = sum_o (base[o] + dynamic[t, o, group]) * x[t - o], zero before the block starts.

    x [B, L, D]; dynamic [B, L, K, G] (one weight per output position, tap and
    channel group); base [K, D].
    """
    B, L, D = x.shape
    G = D // group_size
    xg = x.reshape(B, L, G, group_size)
    out = None
    for o in range(min(base.shape[0], L)):
        shifted = xg if o == 0 else mx.pad(xg[:, : L - o], [(0, 0), (o, 0), (0, 0), (0, 0)])
        kernel = base[o].reshape(G, group_size).astype(x.dtype) + dynamic[:, :, o, :, None]
        out = kernel * shifted if out is None else out + kernel * shifted
    return out.reshape(B, L, D)


class GroupedDynamicCausalConv(nn.Module):
    """Two convolutions around a sublayer, both with kernels computed from its input."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        self.kernel_size = kernel_size
        self.group_size = group_size
        groups = hidden_size // group_size
        self.base_kernel = mx.zeros((2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * groups, bias=False)

    def prepare(self, x: mx.array) -> Tuple[mx.array, mx.array]:
        """The convolved input, and the dynamic kernel `finish` applies to the sublayer's output."""
        B, L, D = x.shape
        dynamic = self.kernel_projection(x).reshape(B, L, 2, self.kernel_size, -1)
        return grouped_causal_conv(x, dynamic[:, :, 0], self.base_kernel[0], self.group_size), dynamic[:, :, 1]

    def finish(self, x: mx.array, dynamic: mx.array) -> mx.array:
        return grouped_causal_conv(x, dynamic, self.base_kernel[1], self.group_size)


class DFlash2DecoderLayer(DecoderLayer):
    def __init__(self, args: DrafterConfig, layer_idx: int):
        super().__init__(args, layer_idx)
        self.attention_conv = GroupedDynamicCausalConv(args.hidden_size, args.conv_kernel_size, args.conv_group_size)
        self.mlp_conv = GroupedDynamicCausalConv(args.hidden_size, args.conv_kernel_size, args.conv_group_size)

    def _run(self, x, attend):
        h, kernel = self.attention_conv.prepare(self.input_layernorm(x))
        h = x + self.attention_conv.finish(attend(h), kernel)
        m, kernel = self.mlp_conv.prepare(self.post_attention_layernorm(h))
        return h + self.mlp_conv.finish(self.mlp(m), kernel)

    def __call__(self, x, ctx_kv, cache, offset):
        return self._run(x, lambda h: self.self_attn(h, ctx_kv, cache, offset))

    def forward_blocks(self, x, ctx, anchors):
        return self._run(x, lambda h: self.self_attn.forward_blocks(h, ctx, anchors))


class CandidateSelector(nn.Module):
    def __init__(self, args: DrafterConfig):
        super().__init__()
        self.top_k = args.selector_top_k
        rank = args.selector_rank
        # Plain arrays, not embeddings: published checkpoints name them without `.weight`.
        self.predecessor_codebook = mx.zeros((args.vocab_size, rank))
        self.successor_codebook = mx.zeros((args.vocab_size, rank))
        self.hidden_projection = nn.Linear(args.hidden_size, rank, bias=False)

    def candidates(self, logits: mx.array) -> Tuple[mx.array, mx.array]:
        """The top-k token ids per position [L, k], in ascending id order (so ties
        in a score row break as an argmax over the whole vocabulary would), and
        their logits (float32)."""
        k = self.top_k
        cand = mx.sort(mx.argpartition(logits, -k, axis=-1)[..., -k:], axis=-1)
        return cand, mx.take_along_axis(logits, cand, axis=-1).astype(mx.float32)

    def scores(self, h: mx.array, cand: mx.array, unary: mx.array, prev: mx.array) -> mx.array:
        """Candidate scores after token(s) `prev`: logit + <pred[prev] * h, succ[cand]>.

        h [..., rank] projected hidden states, cand/unary [..., k], prev [...].
        """
        edge = self.predecessor_codebook[prev].astype(mx.float32) * h
        succ = self.successor_codebook[cand].astype(mx.float32)
        return unary + (succ @ edge[..., None])[..., 0]

    def project(self, hidden: mx.array) -> mx.array:
        return self.hidden_projection(hidden).astype(mx.float32)

    def walk(self, hidden: mx.array, logits: mx.array, anchor: mx.array, choose: Optional[Callable] = None):
        """The selector's path from `anchor` (the token before the first position).

        hidden [L, D] (the drafter's output), logits [L, V] (its draft logits).
        At each position `choose(cand [k], scores [k], path so far)` returns
        the index of the chosen candidate and the row it chose from (default:
        the argmax of the scores, and the scores); the choice is the next
        position's predecessor. Returns the path [L], the candidates [L, k]
        and the rows [L, k].
        """
        choose = choose or (lambda cand, s, path: (mx.argmax(s, axis=-1), s))
        cand, unary = self.candidates(logits)
        h = self.project(hidden)
        prev, path, rows = anchor.reshape(()), [], []
        for i in range(cand.shape[0]):
            index, row = choose(cand[i], self.scores(h[i], cand[i], unary[i], prev), path)
            prev = mx.take(cand[i], index)
            path.append(prev)
            rows.append(row)
        return mx.stack(path), cand, mx.stack(rows)

    def greedy_paths(self, hidden: mx.array, logits: mx.array, anchors: mx.array) -> mx.array:
        """`walk`'s greedy path for many blocks at once: hidden [N, L, D], logits [N, L, V], anchors [N] -> [N, L]."""
        cand, unary = self.candidates(logits)
        h = self.project(hidden)
        prev, path = anchors, []
        for i in range(cand.shape[1]):
            best = mx.argmax(self.scores(h[:, i], cand[:, i], unary[:, i], prev), axis=-1)
            prev = mx.take_along_axis(cand[:, i], best[:, None], axis=-1)[:, 0]
            path.append(prev)
        return mx.stack(path, axis=1)

    def loss(self, hidden: mx.array, logits: mx.array, prev: mx.array, labels: mx.array,
             weights: mx.array) -> mx.array:
        """The selector's training objective: cross-entropy of its scores over its
        candidates at every position, the true previous token as predecessor
        (teacher forcing); positions whose label is not among the candidates are
        skipped. hidden [N, L, D], logits [N, L, V], prev/labels [N, L], weights [L]."""
        cand, unary = self.candidates(logits)
        scores = self.scores(self.project(hidden), cand, unary, prev)
        hit = cand == labels[..., None]
        ce = nn.losses.cross_entropy(scores, mx.argmax(hit, axis=-1), reduction="none")
        w = weights * hit.any(axis=-1)
        return (ce * w).sum() / mx.maximum(w.sum(), 1.0)

    def init_for_training(self, scale: float = 0.02) -> None:
        """A selector that starts as the draft head's argmax (successor codebook 0)
        but can learn: a zero predecessor codebook would leave both without gradient."""
        self.predecessor_codebook = scale * mx.random.normal(self.predecessor_codebook.shape)
        self.successor_codebook = mx.zeros_like(self.successor_codebook)


class DFlash2Drafter(DFlashDrafter):
    """Weights named as in z-lab's DFlash 2 checkpoints."""

    layer_class = DFlash2DecoderLayer

    def __init__(self, args: DrafterConfig):
        super().__init__(args)
        self.candidate_selector = CandidateSelector(args)

    def init_for_training(self, scale: float = 0.01) -> None:
        """Near-identity convolutions (the current position's tap 1, small dynamic
        kernels) so a new drafter starts as a DFlash 1 one, and a selector that can learn."""
        for layer in self.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.base_kernel = mx.zeros_like(conv.base_kernel).at[:, 0].add(1.0)
                conv.kernel_projection.weight = conv.kernel_projection.weight * scale
        self.candidate_selector.init_for_training()

    def forward_blocks(self, block_embeddings, target_hidden, anchors):
        ctx = self.hidden_norm(self.fc(target_hidden))
        h = block_embeddings
        for layer in self.layers:
            h = layer.forward_blocks(h, ctx, anchors)
        return self.norm(h)


def spread(cand: mx.array, rows: mx.array, vocab_size: int) -> mx.array:
    """Rows over the candidates [L, k] as full rows [L, V], -inf elsewhere."""
    full = mx.full((cand.shape[0], vocab_size), -mx.inf, dtype=mx.float32)
    return mx.put_along_axis(full, cand, rows.astype(mx.float32), axis=-1)


class DFlash2DraftSource(DFlashDraftSource):
    """The candidate selector's path as the loop's draft.

    `propose` (the loop's contract) returns, per position, the selector's
    scores over its candidates (-inf elsewhere) along the greedy path: their
    argmax is that path, and the loop's q, `log_probs` of these rows, is the
    selector's own sampling distribution given the greedy predecessor (the
    reference's q = softmax(scores / T), after the same filters as the
    target's p). `propose_path` walks the path as the reference does when
    sampling, each position's predecessor being the token drawn before it,
    and returns the tokens with the q each was drawn from.
    """

    def pooled(self):
        return None  # the selector walks each sequence's path on its own

    def draft_logits(self, state, last: mx.array, hidden: Optional[mx.array], width: int):
        """The drafter's hidden states [width - 1, D] and draft logits [width - 1, V]."""
        h = self.draft_states(state, last, hidden, width)
        return h[0], self.drafter.finish_logits(self.target.head(h))[0]

    def propose(self, state, last, hidden, width):
        h, logits = self.draft_logits(state, last, hidden, width)
        _, cand, scores = self.drafter.candidate_selector.walk(h, logits, last)
        return spread(cand, scores, logits.shape[-1])

    def propose_path(self, state, last, hidden, width: int, params: SamplingParams,
                     prefix: Sequence[int] = (), process: Optional[Callable] = None,
                     scales: Optional[Sequence[float]] = None, noise: Optional[mx.array] = None):
        """Draft tokens [width - 1 - len(prefix)] after `prefix` (tokens already
        drafted at the first positions, e.g. a lookup's) and, when sampling,
        the log probabilities [same, V] each was drawn from (position i at
        `scales[i]`, when given; with `noise`, `sampling.Draws` rows
        [width - 1, V], position i is the draw with `noise[i]`).

        `process(row [1, V], drafts before it)` (the loop's logits processors)
        is applied to each position's row, -inf outside the candidates, before
        the choice.
        """
        h, logits = self.draft_logits(state, last, hidden, width)
        n, V = len(prefix), logits.shape[-1]
        before = [mx.array(prefix, dtype=mx.uint32)] if n else []
        anchor = before[0][-1] if n else last

        def choose(cand, scores, path):
            if process is not None:
                drafted = before + [mx.stack(path).astype(mx.uint32)] if path else before
                drafted = mx.concatenate(drafted) if drafted else None
                scores = mx.take(process(spread(cand[None], scores[None], V), drafted)[0], cand)
            if params.greedy:
                return mx.argmax(scores, axis=-1), scores
            row = log_probs(scores, params)
            if noise is not None:
                return mx.argmax(row + mx.take(noise[n + len(path)], cand), axis=-1), row
            if scales is not None:
                row = rescale(row, scales[n + len(path)])
            return mx.random.categorical(row), row

        tokens, cand, rows = self.drafter.candidate_selector.walk(h[n:], logits[n:], anchor, choose)
        tokens = tokens.astype(mx.uint32)
        return (tokens, None) if params.greedy else (tokens, spread(cand, rows, V))


def drafter_class(config: DrafterConfig):
    return DFlash2Drafter if config.is_dflash2 else DFlashDrafter


def draft_source(drafter: DFlashDrafter, target) -> DFlashDraftSource:
    """The loop's source for a drafter of either architecture."""
    return DFlash2DraftSource(drafter, target) if drafter.args.is_dflash2 else DFlashDraftSource(drafter, target)
