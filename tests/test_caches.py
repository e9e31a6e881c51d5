"""Cropping and rollback of target caches; the drafter's context cache."""

import mlx.core as mx
import pytest
from conftest import FAMILIES

from dflash_mlx.drafter import DraftCache

BLOCK = 8


def _states(adapter, cache):
    out = []
    for i, c in enumerate(cache):
        if i in adapter._gdn:
            out += [c[0], c[1]]
        else:
            out += [c.keys[..., : c.offset, :], c.values[..., : c.offset, :]]
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_crop_equals_decoding_only_the_kept_prefix(pairs, family):
    target = pairs[family].target
    prompt = mx.array([[5, 17, 33, 2, 91, 40, 7]])
    block = mx.array([[12, 250, 3, 3, 77, 140, 9, 61]])
    for keep in range(1, BLOCK + 1):
        cache = target.make_cache()
        target(prompt, cache)
        target(block, cache, record=True)
        kv = {i: c.keys for i, c in enumerate(cache) if i not in target._gdn}
        target.crop(cache, keep, BLOCK)
        # KV caches are cropped by moving the offset: the buffers are not copied.
        assert all(cache[i].keys is k for i, k in kv.items())
        fresh = target.make_cache()
        target(prompt, fresh)
        target(block[:, :keep], fresh)
        for a, b in zip(_states(target, cache), _states(target, fresh)):
            assert a.shape == b.shape
            assert mx.allclose(a, b, atol=1e-5).item(), (family, keep)
        # And decoding goes on identically from the cropped cache.
        nxt = mx.array([[keep + 20]])
        la, _ = target(nxt, cache)
        lb, _ = target(nxt, fresh)
        assert mx.allclose(la, lb, atol=1e-4).item()


def test_recurrent_family_has_taped_layers(pairs):
    assert len(pairs["qwen3_5"].target._gdn) == 4
    assert len(pairs["qwen3"].target._gdn) == 0


@pytest.mark.parametrize("layout", ["old", "new"])
def test_drafter_incremental_context_equals_full_recompute(pairs, monkeypatch, layout):
    monkeypatch.setattr(DraftCache, "step", 8)  # force buffer growth and window compaction
    pair = pairs["qwen3"] if layout == "old" else pairs["llama"]
    drafter, target = pair.drafter, pair.target
    F = len(drafter.args.target_layer_ids) * drafter.args.hidden_size
    mx.random.seed(3)
    ctx = mx.random.normal((1, 40, F))
    block = target.embed(mx.array([[7] + [drafter.args.mask_token_id] * 5]))

    cache = drafter.make_cache()
    drafter.add_context(ctx[:, :11], cache)
    commits = [11, 14, 15, 22, 30, 40]
    for a, b in zip(commits, commits[1:]):
        h_inc = drafter(block, ctx[:, a:b], cache)
        # Only committed context is kept, each row once.
        assert all(c.length == b for c in cache)
        fresh = drafter.make_cache()
        h_full = drafter(block, ctx[:, :b], fresh)
        assert mx.allclose(h_inc, h_full, atol=1e-4).item(), (layout, b)
    window = drafter.args.sliding_window
    for layer, c in zip(drafter.layers, cache):
        if layer.self_attn.window is not None:
            # Rows no query can see any more were dropped.
            assert c.start > 0 and c.offset < 40 - window
        else:
            assert c.start == 0 and c.offset == 40


def test_sliding_layer_is_causal_and_windowed(pairs):
    args = pairs["llama"].drafter.args
    assert args.layer_types == ["sliding_attention", "full_attention"]
    attn0, attn1 = (l.self_attn for l in pairs["llama"].drafter.layers)
    assert attn0.is_causal and attn0.window == 6
    assert not attn1.is_causal and attn1.window is None
    mask = attn0._mask(3, 10, key_start=5, q_start=12)
    # query 12 sees keys 7..12 (window 6, causal); query 14 sees 9..14
    assert mask[0].tolist() == [False, False, True, True, True, True, True, True, False, False]
    assert mask[2].tolist() == [False] * 4 + [True] * 6
