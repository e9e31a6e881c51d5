"""Penalties and logit bias (mlx-lm's logits processors) under speculation:
every block position is processed with the tokens before it, drafts included,
so greedy output equals mlx-lm's with the same processors."""

import mlx.core as mx
import pytest
from conftest import FAMILIES, ScriptedWidths
from mlx_lm.sample_utils import make_logits_processors

import dflash_mlx
from dflash_mlx.policy.plan import Plan

SETTINGS = {
    "repetition": dict(repetition_penalty=1.5, repetition_context_size=20),
    "presence+frequency": dict(presence_penalty=1.2, frequency_penalty=0.7),
    "bias": dict(logit_bias={7: 4.0, 11: -100.0, 42: 2.5}),
}


def mlx_lm_greedy(model, prompt, n, processors, eos=(0,)):
    from mlx_lm.generate import generate_step

    out = []
    for (tok, lp), _ in zip(generate_step(mx.array(prompt), model, max_tokens=n, logits_processors=processors),
                            range(n)):
        if int(tok) in eos:
            break
        out.append((int(tok), lp))
    return out


# Lookup copies, plain steps and drafter blocks in one run; plain decoding alone once.
CASES = [(f, s, "mixed") for f in FAMILIES for s in SETTINGS] + [("qwen3", s, "plain") for s in SETTINGS]
WIDTHS = {"plain": [1], "mixed": [Plan(4, 3), 1, 8, Plan(8, 2), 4]}


@pytest.mark.parametrize("family, setting, widths", CASES, ids=["-".join(c) for c in CASES])
def test_greedy_with_processors_equals_mlx_lm(pairs, baselines, family, setting, widths):
    widths = WIDTHS[widths]
    pair = pairs[family]
    prompt = pair.tokenizer.encode("Once upon a time there was a tiny language model that could count")
    want = mlx_lm_greedy(baselines[family], prompt, 32, make_logits_processors(**SETTINGS[setting]))
    tokens, lps = [], []
    for ev in dflash_mlx.stream_generate(pair, prompt, max_tokens=32, block_size=ScriptedWidths(widths),
                                         logits_processors=make_logits_processors(**SETTINGS[setting]),
                                         logprobs=0):
        tokens += ev.tokens
        lps += ev.logprobs
    assert tokens == [t for t, _ in want]
    # Log probabilities are of the processed logits, as mlx-lm reports them.
    assert [lp for lp, _ in lps] == pytest.approx([v[t].item() for t, v in want], abs=1e-5)


def test_processors_change_the_output(pairs, baselines):
    """The settings above are strong enough to matter (else the test above proves little)."""
    pair = pairs["qwen3"]
    prompt = pair.tokenizer.encode("Once upon a time there was a tiny language model that could count")
    plain = dflash_mlx.generate(pair, prompt, max_tokens=32, block_size=4)
    for setting in SETTINGS.values():
        ids = [t for ev in dflash_mlx.stream_generate(pair, prompt, max_tokens=32, block_size=4,
                                                       logits_processors=make_logits_processors(**setting))
               for t in ev.tokens]
        assert ids != [t for ev in dflash_mlx.stream_generate(pair, prompt, max_tokens=32, block_size=4)
                       for t in ev.tokens]
    assert plain


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_accepted_drafts_are_processed_with_the_drafts_before_them(pairs, baselines, family, setting):
    """Drafts of mlx-lm's own processed output, wrong at a different position
    each cycle: acceptance reaches deep into blocks, and each verify row must
    see the drafts before it for the output to stay mlx-lm's."""
    from conftest import OracleSource

    pair = pairs[family]
    prompt = pair.tokenizer.encode("Once upon a time there was a tiny language model that could count")
    want = [t for t, _ in mlx_lm_greedy(baselines[family], prompt, 40, make_logits_processors(**SETTINGS[setting]))]
    oracle = OracleSource(prompt + want, pair.target.vocab_size, pair.target.hidden_size * len(pair.drafter.args.target_layer_ids),
                          lambda cycle, width: None if cycle % 3 == 0 else cycle % (width - 1))
    events = list(dflash_mlx.stream_generate(pair, prompt, max_tokens=len(want), block_size=8, draft_source=oracle,
                                             logits_processors=make_logits_processors(**SETTINGS[setting])))
    assert [t for ev in events for t in ev.tokens] == want
    assert [ev.accepted for ev in events[1:]] == oracle.expected[: len(events) - 1]
    assert sum(oracle.expected) >= len(want) // 2
