"""Log probabilities under speculation are mlx-lm's: for each committed token,
from the target's logits at its position, whichever cycle committed it."""

from pathlib import Path

import mlx.core as mx
import pytest
from conftest import FAMILIES, ScriptedWidths

import dflash_mlx
from dflash_mlx.policy.plan import Plan


def mlx_lm_logprobs(model, prompt, n):
    """(tokens, log probability vectors) from mlx-lm's generate_step, greedy."""
    from mlx_lm.generate import generate_step

    out = []
    for (tok, lp), _ in zip(generate_step(mx.array(prompt), model, max_tokens=n), range(n)):
        out.append((int(tok), lp))
    return out


def ours(pair, prompt, n, k, block_size, **kw):
    tokens, lps = [], []
    for ev in dflash_mlx.stream_generate(pair, prompt, max_tokens=n, block_size=block_size, logprobs=k, **kw):
        assert len(ev.logprobs) == len(ev.tokens)
        tokens += ev.tokens
        lps += ev.logprobs
    return tokens, lps


def check(want, tokens, lps, k):
    """Equal up to floating point: a verify row and a one-row step sum in another
    order, which shows in half precision (the demo target is float16)."""
    assert tokens == [t for t, _ in want][: len(tokens)]
    for (t, vec), (lp, top) in zip(want, lps):
        tol = 1e-5 if vec.dtype == mx.float32 else 2e-2
        assert lp == pytest.approx(vec[t].item(), abs=tol)
        best = mx.argsort(-vec)[:k].tolist()
        assert [i for i, _ in top] == best
        assert [v for _, v in top] == pytest.approx([vec[i].item() for i in best], abs=tol)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("widths", [[1], [4], [Plan(4, 3), 1, 8, Plan(8, 2)]], ids=["plain", "block4", "mixed"])
def test_logprobs_equal_mlx_lm(pairs, baselines, family, widths):
    pair = pairs[family]
    prompt = pair.tokenizer.encode("Once upon a time there was a tiny language model")
    tokens, lps = ours(pair, prompt, 24, 4, ScriptedWidths(widths))
    assert len(tokens) == 24 and len(lps) == 24
    check(mlx_lm_logprobs(baselines[family], prompt, 24), tokens, lps, 4)


def test_logprobs_of_accepted_drafts_on_the_trained_demo_pair():
    from mlx_lm import load

    pair = dflash_mlx.load("demo")
    model, _ = load(str(Path(dflash_mlx.__file__).parent / "demo" / "target"))
    prompt = pair.tokenizer.encode("def mean(values):\n    total = 0\n    for v in values:\n")
    events = list(dflash_mlx.stream_generate(pair, prompt, max_tokens=48, block_size=8, logprobs=2))
    assert sum(e.accepted for e in events) >= 10  # most positions come from accepted drafts
    tokens = [t for e in events for t in e.tokens]
    lps = [x for e in events for x in e.logprobs]
    check(mlx_lm_logprobs(model, prompt, 48), tokens, lps, 2)


def test_no_top_logprobs_and_truncation_at_a_stop_string(pairs, baselines):
    pair = pairs["qwen3"]
    prompt = pair.tokenizer.encode("The quick brown fox")
    full = mlx_lm_logprobs(baselines["qwen3"], prompt, 30)
    stop = pair.tokenizer.decode([t for t, _ in full][10:12])
    tokens, lps = ours(pair, prompt, 30, 0, 4, stop=[stop])
    assert 0 < len(tokens) < 30 and all(top == [] for _, top in lps)
    check(full, tokens, lps, 0)
    with pytest.raises(dflash_mlx.DFlashError, match="logprobs must be >= 0"):
        ours(pair, prompt, 4, -1, 4)
