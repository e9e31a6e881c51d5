"""MLX port of the z-lab DFlash drafter.

Each layer attends from the block (queries) to the committed target context
plus the block itself (keys/values). Context keys/values are projected once,
when the context is committed, and kept in `DraftCache`; the block's own keys
are scratch that the next cycle overwrites.
"""

from typing import List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn

from ..target.adapter import initialize_rope
from ..config import DrafterConfig


# A bounded drafter context (`bound_context`, off unless asked for) keeps the
# first rows too: attention puts mass on the sequence's first tokens whatever
# they hold, and a block that lost them would spread it over the recent rows.
CONTEXT_SINKS = 4


class DraftCache:
    """Committed context keys/values of one drafter layer.

    Rows are written into a buffer grown in steps; the block's rows go after
    the committed ones and are not counted, so dropping them costs nothing.
    A sliding-window layer keeps only the last `window` committed rows.
    """

    step = 256

    def __init__(self, window: Optional[int] = None, bound: Optional[Tuple[int, int]] = None):
        self.window = window
        self.bound = bound  # (sinks, recent): a full-attention layer's block sees only these context rows
        self.keys = None
        self.values = None
        self.offset = 0  # committed rows in the buffer
        self.start = 0  # absolute position of buffer row 0
        self.holes = ()  # (from, to) absolute positions of skipped rows (zeros in the buffer)

    def _reserve(self, k: mx.array, v: mx.array, n: int):
        need = self.offset + n
        if self.keys is not None and need <= self.keys.shape[2]:
            return
        if self.window is not None and self.offset > self.window:
            # Drop rows no query can see any more before growing.
            drop = self.offset - self.window
            self.keys = self.keys[..., drop : self.offset, :]
            self.values = self.values[..., drop : self.offset, :]
            self.offset -= drop
            self.start += drop
            need -= drop
        B, H, _, Dk = k.shape
        size = ((need + self.step - 1) // self.step) * self.step
        new_k = mx.zeros((B, H, size, Dk), k.dtype)
        new_v = mx.zeros((B, H, size, v.shape[3]), v.dtype)
        if self.keys is not None and self.offset > 0:
            new_k[..., : self.offset, :] = self.keys[..., : self.offset, :]
            new_v[..., : self.offset, :] = self.values[..., : self.offset, :]
        self.keys, self.values = new_k, new_v

    def update_and_fetch(self, ctx_kv, block_kv):
        """Commit the context rows, append the block as scratch, return all rows."""
        (ck, cv), (bk, bv) = ctx_kv, block_kv
        C = 0 if ck is None else ck.shape[2]
        L = 0 if bk is None else bk.shape[2]
        ref_k, ref_v = (ck, cv) if C else (bk, bv)
        self._reserve(ref_k, ref_v, C + L)
        if C:
            self.keys[..., self.offset : self.offset + C, :] = ck
            self.values[..., self.offset : self.offset + C, :] = cv
            self.offset += C
        if L:
            self.keys[..., self.offset : self.offset + L, :] = bk
            self.values[..., self.offset : self.offset + L, :] = bv
        end = self.offset + L
        if self.bound is not None and self.offset > sum(self.bound):
            # The first rows and the most recent ones: draft cost stays flat as the context grows.
            sinks, recent = self.bound
            cut = self.offset - recent
            return (mx.concatenate([self.keys[..., :sinks, :], self.keys[..., cut:end, :]], axis=2),
                    mx.concatenate([self.values[..., :sinks, :], self.values[..., cut:end, :]], axis=2))
        return self.keys[..., :end, :], self.values[..., :end, :]

    @property
    def length(self):
        return self.start + self.offset

    def skip(self, n: int) -> None:
        """n committed rows no block will read: their positions are taken, their keys
        and values never computed (zeros where the buffer holds them)."""
        if self.keys is None:
            self.start += n
            return
        a = self.length
        self._reserve(self.keys, self.values, n)
        self.offset += n
        if self.holes and self.holes[-1][1] == a:
            self.holes = self.holes[:-1] + ((self.holes[-1][0], a + n),)
        else:
            self.holes = self.holes + ((a, a + n),)

    def trim(self, n: int) -> None:
        """Forget the last n committed rows (no copy); beyond the buffer (rows a window
        dropped), keep the position and lose the context."""
        if n > self.offset:
            self.start, self.offset = self.length - n, 0
        else:
            self.offset -= n
        end = self.length
        self.holes = tuple((a, min(b, end)) for a, b in self.holes if a < end)

    def absent(self, lo: int, hi: int) -> Optional[int]:
        """The first row in [lo, hi) this cache lacks (before its buffer, or skipped), or None."""
        gaps = [max(a, lo) for a, b in ((0, self.start), *self.holes) if a < hi and b > lo]
        return min(gaps) if gaps else None

    def block_mask(self, L: int, S: int, q_start: int, causal: bool, window: Optional[int]):
        """[L, S] bool: which of the S rows (from `start`) each block row (from `q_start`) sees;
        None: all of them."""
        return visible(mx.arange(q_start, q_start + L), mx.arange(self.start, self.start + S), causal, window)


class DraftCaches:
    """One drafter layer's contexts of B sequences, each sequence's in its own `DraftCache`, for a
    pass over all of their blocks (`pool.DraftBatch`): `DFlashDrafter.ragged` sets `counts`, each
    sequence's real rows of the right-padded context being committed, before each pass."""

    def __init__(self, caches: Sequence[DraftCache] = ()):
        self.caches: List[DraftCache] = list(caches)
        self.counts: List[int] = []

    @property
    def offset(self) -> mx.array:
        """Each sequence's committed context length (its block's first position, before this pass's rows)."""
        return mx.array([c.length for c in self.caches])

    def update_and_fetch(self, ctx_kv, block_kv):
        """Commit each sequence's context rows (a pass without a block)."""
        for b, c in enumerate(self.caches):
            c.update_and_fetch(self._rows(ctx_kv, b), (None, None))

    def attend(self, q: mx.array, ctx_kv, block_kv, attn: "Attention") -> mx.array:
        """Each sequence's context rows committed and its block [1, H, L, D] of `q` attending over
        its own context and block, as it does alone: [B, H, L, D]."""
        bk, bv = block_kv
        L = q.shape[2]
        outs = []
        for b, c in enumerate(self.caches):
            keys, values = c.update_and_fetch(self._rows(ctx_kv, b), (bk[b : b + 1], bv[b : b + 1]))
            mask = c.block_mask(L, keys.shape[2], c.length, attn.is_causal, attn.window)
            outs.append(mx.fast.scaled_dot_product_attention(q[b : b + 1], keys, values, scale=attn.scale, mask=mask))
        return mx.concatenate(outs, axis=0)

    def _rows(self, ctx_kv, b: int):
        ck, cv = ctx_kv
        n = self.counts[b] if ck is not None else 0
        return (ck[b : b + 1, :, :n], cv[b : b + 1, :, :n]) if n else (None, None)


def visible(q_pos: mx.array, k_pos: mx.array, causal: bool, window: Optional[int]) -> Optional[mx.array]:
    """[..., Lq, Lk] bool: whether a query at each of `q_pos` [..., Lq] sees a key at each of
    `k_pos` [Lk], in a layer with a causal mask and/or a window; None: every key."""
    if not causal and window is None:
        return None
    q, k = q_pos[..., :, None], k_pos
    seen = mx.ones(q.shape[:-1] + k.shape, dtype=mx.bool_)
    if causal:
        seen = seen & (k <= q)
    if window is not None:
        seen = seen & (q - k < window)
        if not causal:
            seen = seen & (k - q < window)
    return seen


class Attention(nn.Module):
    def __init__(self, args: DrafterConfig, layer_idx: int):
        super().__init__()
        dim = args.hidden_size
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.head_dim = args.head_dim
        self.scale = self.head_dim**-0.5
        bias = args.attention_bias
        self.q_proj = nn.Linear(dim, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, dim, bias=bias)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)
        self.k_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)
        self.is_causal = args.layer_is_causal(layer_idx)
        self.window = args.layer_window(layer_idx)
        self.rope = initialize_rope(
            self.head_dim,
            args.rope_theta,
            args.rope_scaling,
            args.max_position_embeddings,
        )

    def _kv(self, x: mx.array, offset: int):
        B, L, _ = x.shape
        k = self.k_norm(self.k_proj(x).reshape(B, L, self.n_kv_heads, -1))
        k = self.rope(k.transpose(0, 2, 1, 3), offset=offset)
        v = self.v_proj(x).reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        return k, v

    def context_kv(self, ctx: mx.array, offset: int):
        return self._kv(ctx, offset)

    def __call__(self, x, ctx_kv, cache: DraftCache, offset: int):
        B, L, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(B, L, self.n_heads, -1))
        q = self.rope(q.transpose(0, 2, 1, 3), offset=offset)
        if isinstance(cache, DraftCaches):  # several sequences, each over its own context
            out = cache.attend(q, ctx_kv, self._kv(x, offset), self)
        else:
            keys, values = cache.update_and_fetch(ctx_kv, self._kv(x, offset))
            mask = cache.block_mask(L, keys.shape[2], offset, self.is_causal, self.window)
            out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))

    def forward_blocks(self, x, ctx, anchors):
        """Training: x [K, L, D] blocks at `anchors`, ctx [1, T, D] at 0..T-1."""
        K, L, _ = x.shape
        T = ctx.shape[1]
        q = self.q_norm(self.q_proj(x).reshape(K, L, self.n_heads, -1))
        q = self.rope(q.transpose(0, 2, 1, 3), offset=anchors)
        kc, vc = self._kv(ctx, 0)
        kb = self.k_norm(self.k_proj(x).reshape(K, L, self.n_kv_heads, -1))
        kb = self.rope(kb.transpose(0, 2, 1, 3), offset=anchors)
        vb = self.v_proj(x).reshape(K, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        shape = (K, self.n_kv_heads, T, self.head_dim)
        keys = mx.concatenate([mx.broadcast_to(kc, shape), kb], axis=2)
        values = mx.concatenate([mx.broadcast_to(vc, shape), vb], axis=2)
        mask = block_mask(anchors, T, L, self.is_causal, self.window)
        out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(K, L, -1))


def block_mask(anchors: mx.array, T: int, L: int, is_causal: bool, window=None) -> mx.array:
    """Training mask [K, 1, L, T + L]: block k (tokens at anchors[k] + 0..L-1)
    sees context positions strictly before its anchor and its own block only
    (causally and/or windowed as the layer says). Other blocks are separate
    batch rows, so no block can see another."""
    q_pos = anchors[:, None, None] + mx.arange(L)[None, :, None]  # [K, L, 1]
    ctx_pos = mx.arange(T)[None, None, :]
    ctx = ctx_pos < anchors[:, None, None]
    blk_pos = anchors[:, None, None] + mx.arange(L)[None, None, :]
    blk = mx.ones((anchors.shape[0], L, L), dtype=mx.bool_)
    if is_causal:
        blk = blk & (blk_pos <= q_pos)
    if window is not None:
        ctx = ctx & (q_pos - ctx_pos < window)
        blk = blk & (q_pos - blk_pos < window)
        if not is_causal:
            blk = blk & (blk_pos - q_pos < window)
    ctx = mx.broadcast_to(ctx, (anchors.shape[0], L, T))
    return mx.concatenate([ctx, blk], axis=-1)[:, None]


class MLP(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=False)

    def __call__(self, x):
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, args: DrafterConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(args, layer_idx)
        self.mlp = MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x, ctx_kv, cache, offset):
        h = x + self.self_attn(self.input_layernorm(x), ctx_kv, cache, offset)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDrafter(nn.Module):
    """Weights named as in the z-lab checkpoints (no embedding, no LM head)."""

    layer_class = DecoderLayer

    def __init__(self, args: DrafterConfig):
        super().__init__()
        self.args = args
        n_taps = len(args.target_layer_ids)
        self.fc = nn.Linear(n_taps * args.hidden_size, args.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.layers = [self.layer_class(args, i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def bound_context(self, recent: Optional[int], sinks: int = CONTEXT_SINKS) -> bool:
        """Let blocks see only the first `sinks` and the last `recent` context
        rows (None, the default: every row, as the checkpoint was trained).
        Only for drafters whose layers are all unmasked full attention (a mask
        needs contiguous positions); returns whether the bound applies. Output
        stays exact; drafts past `sinks + recent` rows change, and so may acceptance."""
        full = all(not l.self_attn.is_causal and l.self_attn.window is None for l in self.layers)
        # A plain attribute: a tuple set on an mlx Module would become one of its parameters.
        object.__setattr__(self, "_bound", (sinks, recent) if recent is not None and full else None)
        return self._bound is not None

    @property
    def context_bound(self) -> Optional[Tuple[int, int]]:
        """(sinks, recent) context rows each block sees, or None for all of them."""
        return self.__dict__.get("_bound")

    @property
    def horizon(self) -> Optional[Tuple[int, int]]:
        """(first, last): a block reads at most the first `first` and the last `last`
        committed context rows (the context bound, or every layer's sliding
        window); None when it may read any of them."""
        if self.context_bound is not None:
            return self.context_bound
        windows = [l.self_attn.window for l in self.layers]
        return None if None in windows else (0, max(windows))

    @property
    def batchable(self) -> bool:
        """Whether blocks of several sequences can be drafted in one pass (`pool.py`): its
        blocks see every row of the context their layers' masks allow (no `context_bound`)."""
        return self.context_bound is None

    def make_cache(self) -> List[DraftCache]:
        return [DraftCache(layer.self_attn.window, self.context_bound) for layer in self.layers]

    def _context_kv(self, target_hidden: Optional[mx.array], cache: List[DraftCache]):
        if target_hidden is None or target_hidden.shape[1] == 0:
            return [(None, None)] * len(self.layers)
        ctx = self.hidden_norm(self.fc(target_hidden))
        offset = cache[0].length
        return [l.self_attn.context_kv(ctx, offset) for l in self.layers]

    def add_context(self, target_hidden: mx.array, cache: List[DraftCache]):
        """Commit context rows without drafting (used during chunked prefill)."""
        for c, kv in zip(cache, self._context_kv(target_hidden, cache)):
            c.update_and_fetch(kv, (None, None))

    def __call__(self, block_embeddings, target_hidden, cache: List[DraftCache]):
        """Hidden states of the block after committing `target_hidden` as context.

        The block starts at the position right after the committed context.
        """
        ctx_kv = self._context_kv(target_hidden, cache)
        offset = cache[0].length + (0 if target_hidden is None else target_hidden.shape[1])
        h = block_embeddings
        for layer, c, kv in zip(self.layers, cache, ctx_kv):
            h = layer(h, kv, c, offset)
        return self.norm(h)

    def ragged(self, block_embeddings: Optional[mx.array], target_hidden: Optional[mx.array],
               counts: List[int], cache: list) -> Optional[mx.array]:
        """`__call__` for B sequences at once (`DraftCaches`): sequence b
        commits the first counts[b] rows of its `target_hidden` [B, R, D] (right-padded) as
        context, then its block [B, L, D] (None: no block) sits right after its own context."""
        ends = cache[0].offset
        if target_hidden is None:
            ctx_kv = [(None, None)] * len(self.layers)
        else:
            ctx = self.hidden_norm(self.fc(target_hidden))
            ctx_kv = [l.self_attn.context_kv(ctx, ends) for l in self.layers]
        for c in cache:
            c.counts = counts
        if block_embeddings is None:
            for c, kv in zip(cache, ctx_kv):
                c.update_and_fetch(kv, (None, None))
            return None
        h, offset = block_embeddings, ends + mx.array(counts)
        for layer, c, kv in zip(self.layers, cache, ctx_kv):
            h = layer(h, kv, c, offset)
        return self.norm(h)

    def forward_blocks(self, block_embeddings, target_hidden, anchors):
        """Training: hidden states of K blocks in one pass, no cache."""
        ctx = self.hidden_norm(self.fc(target_hidden))
        h = block_embeddings
        for layer in self.layers:
            a = layer.self_attn.forward_blocks(layer.input_layernorm(h), ctx, anchors)
            h = h + a
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.norm(h)

    def finish_logits(self, logits: mx.array) -> mx.array:
        args = self.args
        if args.output_multiplier != 1.0:
            logits = logits * args.output_multiplier
        if args.final_logit_softcapping:
            cap = args.final_logit_softcapping
            logits = mx.tanh(logits / cap) * cap
        return logits
