"""Cropping and rollback of target caches; the drafter's context cache."""

import mlx.core as mx
import pytest
from conftest import FAMILIES

from dflash_mlx.draft.drafter import DraftCache

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
    from dflash_mlx.draft.drafter import visible

    mask = visible(mx.arange(12, 15), mx.arange(5, 15), attn0.is_causal, attn0.window)
    assert visible(mx.arange(3), mx.arange(5), attn1.is_causal, attn1.window) is None  # sees every key
    # query 12 sees keys 7..12 (window 6, causal); query 14 sees 9..14
    assert mask[0].tolist() == [False, False, True, True, True, True, True, True, False, False]
    assert mask[2].tolist() == [False] * 4 + [True] * 6


# -- the sliding-window cache with slack (Gemma 4, gpt-oss) -------------------

def _window_reference(history_k, history_v, queries, start, window):
    """Attention of queries at positions start.. over exactly the last `window` positions of the history."""
    outs = []
    for j in range(queries.shape[2]):
        p = start + j
        lo = max(0, p - window + 1)
        outs.append(mx.fast.scaled_dot_product_attention(
            queries[:, :, j : j + 1], history_k[:, :, lo : p + 1], history_v[:, :, lo : p + 1], scale=0.5, mask=None))
    return mx.concatenate(outs, axis=2)


def _window_pass(cache, k, v, q, window):
    mask = cache.make_mask(q.shape[2], window_size=window)
    keys, values = cache.update_and_fetch(k, v)
    return mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.5, mask=mask)


@pytest.mark.parametrize("window, slack", [(8, 16), (5, 3)])
def test_window_cache_shows_each_query_exactly_its_window_through_crops(window, slack):
    """Passes of every kind (a long prefill chunk, passes within the slack, single
    steps) with crops of up to `slack` rows after each, long after the ring
    wrapped: each query attends to exactly the last `window` committed positions."""
    from dflash_mlx.target.caches import WindowCache

    mx.random.seed(7)
    B, H, D = 1, 2, 8
    cache = WindowCache(window, slack)
    hist_k = mx.zeros((B, H, 0, D))
    hist_v = mx.zeros((B, H, 0, D))
    # (pass width, rows cropped after it)
    plan = [(3, 0), (1, 0), (slack, slack - 1), (2, 2), (30, 0), (1, 0), (slack, slack - 1), (3, 2), (1, 0), (slack + 1, 0), (2, 1)] + \
           [(w, c) for w in range(1, slack + 1) for c in sorted({0, w // 2, min(w, slack) - 1})]
    plan += [(40, 0), (4, 4), (slack, slack)] + [(1, 0)] * 5
    for width, crop in plan:
        k, v, q = (mx.random.normal((B, H, width, D)) for _ in range(3))
        start = cache.offset
        out = _window_pass(cache, k, v, q, window)
        hist_k = mx.concatenate([hist_k[:, :, :start], k], axis=2)
        hist_v = mx.concatenate([hist_v[:, :, :start], v], axis=2)
        want = _window_reference(hist_k, hist_v, q, start, window)
        assert mx.allclose(out, want, atol=1e-5).item(), (width, crop, start)
        before = cache.keys
        cache.trim(crop)
        assert cache.keys is before  # a crop moves the offset: nothing is copied
        assert cache.offset == start + width - crop
    assert cache.offset > 4 * cache.capacity  # the ring wrapped many times
    assert cache.keys.shape[2] == window + slack  # and never held more than window + slack rows


def test_window_cache_refuses_a_crop_beyond_its_slack_and_grows_it():
    from dflash_mlx.target.caches import WindowCache

    cache = WindowCache(8, 4)
    k = mx.random.normal((1, 1, 40, 4))
    cache.update_and_fetch(k, k)
    with pytest.raises(ValueError, match="slack"):
        cache.trim(6)
    cache.trim(5)  # slack + 1: the window before the new end is still whole
    cache.update_and_fetch(k[:, :, :5], k[:, :, :5])
    cache.grow_slack(12)  # a wider recorded pass is coming: one copy, then exact crops of up to 12
    q = mx.random.normal((1, 1, 12, 4))
    hist = mx.concatenate([k[:, :, :35], k[:, :, :5]], axis=2)
    new = mx.random.normal((1, 1, 12, 4))
    out = _window_pass(cache, new, new, q, 8)
    hist = mx.concatenate([hist, new], axis=2)
    assert mx.allclose(out, _window_reference(hist, hist, q, 40, 8), atol=1e-5).item()
    cache.trim(12)
    one = mx.random.normal((1, 1, 1, 4))
    out = _window_pass(cache, one, one, one, 8)
    hist = mx.concatenate([hist[:, :, :40], one], axis=2)
    assert mx.allclose(out, _window_reference(hist, hist, one, 40, 8), atol=1e-5).item()


def test_window_cache_equals_mlx_lm_rotating_cache_in_plain_decoding():
    """Prefill then single steps, no crops: the same attention as mlx-lm's RotatingKVCache."""
    from mlx_lm.models.cache import RotatingKVCache

    from dflash_mlx.target.caches import WindowCache

    mx.random.seed(3)
    ours, theirs = WindowCache(8, 16), RotatingKVCache(max_size=8)
    for width in [13, 5] + [1] * 40:
        k, v, q = (mx.random.normal((1, 2, width, 8)) for _ in range(3))
        a = _window_pass(ours, k, v, q, 8)
        b = _window_pass(theirs, k, v, q, 8)
        assert mx.allclose(a, b, atol=1e-5).item(), width
