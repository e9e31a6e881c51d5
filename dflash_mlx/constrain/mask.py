"""A grammar's token masks applied to logits on the device: one bit per token, 32 to a word, as
llguidance fills them on the host."""

import functools

import mlx.core as mx
import numpy as np


@functools.lru_cache(maxsize=8)
def _columns(V: int):
    cols = mx.arange(V, dtype=mx.uint32)
    return cols // 32, cols % 32


def upload(bits: np.ndarray) -> mx.array:
    """Host masks [..., words] (int32, llguidance's) as a device array of unsigned words."""
    return mx.array(bits.view(np.uint32))


def allowed(logits: mx.array, bits: mx.array) -> mx.array:
    """`logits` [..., V] where the masks `bits` [..., words] (`upload`) allow a token, -inf elsewhere."""
    word, bit = _columns(logits.shape[-1])
    on = (mx.take(bits, word, axis=-1) >> bit) & 1
    return mx.where(on.astype(mx.bool_), logits, -mx.inf)
