"""Everything that touches mlx-lm internals lives here.

The target is an unmodified mlx-lm model. We wrap *instances* (never classes):
tapped decoder layers record their outputs, and Gated DeltaNet mixers record
an update tape during verification so their recurrent state can be rolled
back to any accepted length. Two adapters in one process share nothing.
"""

from typing import Any, Dict, List, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import cache as cache_lib
from mlx_lm.models.gated_delta import compute_g, normalize_qk
from mlx_lm.models.rope_utils import initialize_rope as _mlx_lm_rope
from mlx_lm.utils import load_model, load_tokenizer

from .errors import DFlashError
from .kernels import backend, gdn_replay, gdn_verify, qmm_verify

SUPPORTED_FAMILIES = ("qwen3", "llama", "qwen3_5", "qwen3_5_moe")


def initialize_rope(dims, base, scaling_config, max_position_embeddings):
    return _mlx_lm_rope(
        dims,
        base=base,
        traditional=False,
        scaling_config=scaling_config,
        max_position_embeddings=max_position_embeddings,
    )


def load_target(path, tokenizer_config: Optional[dict] = None):
    """Load an mlx-lm model and tokenizer from a local directory."""
    import json
    from pathlib import Path

    cfg_path = Path(path) / "config.json"
    try:
        model_type = json.loads(cfg_path.read_text()).get("model_type")
    except FileNotFoundError:
        raise DFlashError(f"No config.json in {path}; --model must be an mlx-lm model directory, repo id or alias.")
    if model_type not in SUPPORTED_FAMILIES:
        raise DFlashError(
            f"Target family '{model_type}' is not supported; supported families: "
            f"{', '.join(SUPPORTED_FAMILIES)}."
        )
    try:
        model, config = load_model(Path(path))
    except (ValueError, FileNotFoundError) as e:
        raise DFlashError(f"Could not load the target from {path}: {str(e).splitlines()[0]}")
    tokenizer = load_tokenizer(
        Path(path), tokenizer_config or {}, eos_token_ids=config.get("eos_token_id")
    )
    return model, tokenizer, config


def materialize(model: nn.Module) -> None:
    """Evaluate every array a model holds, private ones (e.g. RoPE frequencies)
    included, so the model can run on any thread."""
    arrays = [v for _, v in tree_flatten(model.parameters())]
    for _, m in model.named_modules():
        # Modules keep arrays as dict entries; "_"-prefixed ones are not parameters.
        arrays += [v for v in list(m.values()) + list(vars(m).values()) if isinstance(v, mx.array)]
    mx.eval(arrays)


def model_dims(model: nn.Module):
    """(hidden size, vocabulary, layers) of an mlx-lm model."""
    lm = getattr(model, "language_model", model)
    return lm.args.hidden_size, lm.args.vocab_size, len(lm.model.layers)


class _Taps:
    """Holds the tapped hidden states of one forward pass (not module state)."""

    def __init__(self):
        self.values: Dict[int, mx.array] = {}
        self.recording = False
        self.tape: Dict[int, tuple] = {}


class _Wrapper(nn.Module):
    """Base for instance wrappers: unknown attributes resolve on the wrapped module."""

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            inner = super().__getattr__("inner")
            return getattr(inner, name)


class TappedLayer(_Wrapper):
    def __init__(self, inner: nn.Module, index: int, taps: _Taps):
        super().__init__()
        self.inner = inner
        self._index = index
        self._taps = taps

    def __call__(self, *args, **kwargs):
        out = self.inner(*args, **kwargs)
        self._taps.values[self._index] = out
        return out


class TapedGatedDeltaNet(_Wrapper):
    """A Gated DeltaNet mixer that, while recording, keeps an update tape.

    The tape (the block's k, gates and per-step deltas, the conv input and the
    state before the block) lets `rollback` rebuild the exact state after any
    prefix with the state updates alone: no projections, no reductions.
    """

    def __init__(self, inner: nn.Module, index: int, taps: _Taps):
        super().__init__()
        self.inner = inner
        self._index = index
        self._taps = taps

    def __call__(self, inputs, mask=None, cache=None):
        if not self._taps.recording or cache is None or mask is not None:
            return self.inner(inputs, mask, cache)
        g = self.inner
        B, S, _ = inputs.shape
        qkv = g.in_proj_qkv(inputs)
        z = g.in_proj_z(inputs).reshape(B, S, g.num_v_heads, g.head_v_dim)
        b = g.in_proj_b(inputs)
        a = g.in_proj_a(inputs)
        conv_state = cache[0]
        if conv_state is None:
            conv_state = mx.zeros((B, g.conv_kernel_size - 1, g.conv_dim), dtype=inputs.dtype)
        conv_input = mx.concatenate([conv_state, qkv], axis=1)
        cache[0] = conv_input[:, -(g.conv_kernel_size - 1) :, :]
        conv_out = nn.silu(g.conv1d(conv_input))
        q, k, v = [
            t.reshape(B, S, h, d)
            for t, h, d in zip(
                mx.split(conv_out, [g.key_dim, 2 * g.key_dim], -1),
                [g.num_k_heads, g.num_k_heads, g.num_v_heads],
                [g.head_k_dim, g.head_k_dim, g.head_v_dim],
            )
        ]
        q, k = normalize_qk(q, k, inv_scale=g.head_k_dim**-0.5, eps=1e-6)
        state0 = cache[1]
        if state0 is None:
            state0 = mx.zeros((B, g.num_v_heads, g.head_v_dim, g.head_k_dim), dtype=mx.float32)
        # The same gates mlx-lm's gated_delta_update computes.
        gate, beta = compute_g(g.A_log, a, g.dt_bias), mx.sigmoid(b)
        out, state, delta = gdn_verify(q, k, v, gate, beta, state0)
        self._taps.tape[self._index] = (k, gate, delta, conv_input, state0)
        cache[1] = state
        cache.advance(S)
        out = g.norm(out, z)
        return g.out_proj(out.reshape(B, S, -1))

    def rollback(self, cache, keep: int):
        """Set `cache` to the state after the first `keep` tokens of the taped block."""
        k, gate, delta, conv_input, state0 = self._taps.tape[self._index]
        g = self.inner
        cache[1] = gdn_replay(state0, k, gate, delta, keep) if keep else state0
        cache[0] = conv_input[:, keep : keep + g.conv_kernel_size - 1, :]


class VerifyQuantizedLinear(_Wrapper):
    """A 4/8-bit affine QuantizedLinear whose 2-16 row calls go through `qmm_verify`."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def __call__(self, x):
        rows = x.size // x.shape[-1]
        q = self.inner
        if not 2 <= rows <= 16:
            return q(x)
        y = qmm_verify(x.reshape(rows, x.shape[-1]), q["weight"], q["scales"], q["biases"], q.group_size, q.bits)
        y = y.reshape(*x.shape[:-1], y.shape[-1])
        return y + q["bias"] if "bias" in q else y


def wrap_quantized_linears(model: nn.Module) -> int:
    """Route verify-width calls of the model's affine 4/8-bit linears through `qmm_verify`."""
    wrapped = [
        (path, VerifyQuantizedLinear(m)) for path, m in model.named_modules()
        if isinstance(m, nn.QuantizedLinear) and getattr(m, "mode", "affine") == "affine"
        and m.bits in (4, 8) and m.get("biases") is not None
    ]
    if wrapped:
        model.update_modules(tree_unflatten(wrapped))
    return len(wrapped)


class TargetAdapter:
    """Runs an mlx-lm model and returns logits plus the tapped hidden states."""

    def __init__(self, model: nn.Module, tap_ids: Sequence[int], model_type: str = "",
                 quantization: Optional[dict] = None):
        self.model = model
        self.quantization = quantization  # the checkpoint's, as mlx-lm's config.json gives it
        self.model_type = model_type or getattr(model, "model_type", "")
        lm = getattr(model, "language_model", model)
        self.inner = lm.model
        self.args = lm.args
        self.embed_tokens = self.inner.embed_tokens
        if getattr(self.args, "tie_word_embeddings", False) or not hasattr(lm, "lm_head"):
            self.head = self.embed_tokens.as_linear
        else:
            self.head = lm.lm_head
        layers = self.inner.layers
        self.num_layers = len(layers)
        self.hidden_size = self.args.hidden_size
        self.vocab_size = self.args.vocab_size
        self.tap_ids = list(tap_ids)
        bad = [i for i in self.tap_ids if not 0 <= i < self.num_layers]
        if bad:
            raise DFlashError(
                f"The drafter taps target layer(s) {bad} but the target has {self.num_layers} "
                "layers; use the drafter trained for this target."
            )
        self._taps = _Taps()
        self._gdn: Dict[int, TapedGatedDeltaNet] = {}
        for i, layer in enumerate(layers):
            if isinstance(layer, TappedLayer):
                raise DFlashError("This model instance is already wrapped by another adapter; load it again.")
            if hasattr(layer, "linear_attn"):
                wrapped = TapedGatedDeltaNet(layer.linear_attn, i, self._taps)
                layer.linear_attn = wrapped
                self._gdn[i] = wrapped
            if i in self.tap_ids and i != self.num_layers - 1:
                layers[i] = TappedLayer(layer, i, self._taps)
        # Only where a kernel can run: elsewhere the stock op is all qmm_verify would call.
        self.verify_linears = wrap_quantized_linears(model) if backend() is not None else 0

    @property
    def dtype(self) -> mx.Dtype:
        """The model's float dtype (a quantized embedding's scales carry it)."""
        return getattr(self.embed_tokens, "scales", self.embed_tokens.weight).dtype

    def make_cache(self) -> List[Any]:
        cache = cache_lib.make_prompt_cache(self.model)
        for i, c in enumerate(cache):
            if isinstance(c, cache_lib.KVCache) or (
                isinstance(c, cache_lib.ArraysCache) and i in self._gdn
            ):
                continue
            raise DFlashError(
                f"Target layer {i} uses a {type(c).__name__}, which cannot be cropped exactly; "
                "this target is not supported."
            )
        return cache

    def embed(self, tokens: mx.array) -> mx.array:
        return self.embed_tokens(tokens)

    def __call__(self, tokens: mx.array, cache, last_only: bool = False, record: bool = False):
        """Logits (all positions, or the last only) and the concatenated taps."""
        self._taps.values.clear()
        self._taps.recording = record
        try:
            h = self.inner(tokens, cache=cache)
        finally:
            self._taps.recording = False
        # HF reports the last layer's entry after the final norm: match it.
        feats = [
            h if i == self.num_layers - 1 else self._taps.values[i] for i in self.tap_ids
        ]
        self._taps.values.clear()
        if last_only:
            h = h[:, -1:]
        return self.head(h), mx.concatenate(feats, axis=-1)

    def crop(self, cache, keep: int, width: int):
        """Keep the first `keep` of the last `width` positions (after a recorded pass)."""
        drop = width - keep
        if drop == 0:
            self._taps.tape.clear()
            return
        for i, c in enumerate(cache):
            if i in self._gdn:
                self._gdn[i].rollback(c, keep)
            else:
                c.trim(drop)
        self._taps.tape.clear()
