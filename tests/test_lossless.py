"""Greedy DFlash output equals plain mlx-lm decoding token for token (float32)."""

import mlx.core as mx
import pytest
from conftest import FAMILIES, plain_greedy

import dflash_mlx
from dflash_mlx.decode import DraftSource

PROMPTS = [
    "def add(a, b):",
    "The quick brown fox",
    "Once upon a time there was a tiny language model that could count: one two three",
    "import math",
    "A",
]


def dflash_tokens(pair, prompt, max_tokens, **kw):
    tokens, events = [], []
    for ev in dflash_mlx.stream_generate(pair, prompt, max_tokens=max_tokens, **kw):
        tokens += ev.tokens
        events.append(ev)
    return tokens, events


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("block_size", [1, 2, 3, 4, 7, 8, 16])
def test_random_drafter_is_lossless(pairs, baselines, family, block_size):
    pair = pairs[family]
    for text in PROMPTS[:3]:
        prompt = pair.tokenizer.encode(text)
        ref = plain_greedy(baselines[family], prompt, 48)
        out, events = dflash_tokens(pair, prompt, 48, block_size=block_size)
        assert out == ref, (family, block_size, text)
        assert all(1 <= a <= block_size for a in events[-1].stats.acceptance_lengths)


class OracleSource(DraftSource):
    """Drafts the target's own greedy continuation, corrupted at a chosen index.

    `corrupt(cycle, width)` returns the draft index to corrupt, or None for a
    perfect draft. It also checks that the loop hands over exactly the taps of
    the committed tokens, each once.
    """

    def __init__(self, sequence, vocab_size, feature_dim, corrupt):
        self.seq = sequence
        self.V = vocab_size
        self.feature_dim = feature_dim
        self.corrupt = corrupt
        self.block_size = 16
        self.expected = []

    def new_state(self):
        return {"committed": 0, "cycle": 0}

    def add_context(self, state, hidden):
        assert hidden.shape[-1] == self.feature_dim
        state["committed"] += hidden.shape[1]

    def propose(self, state, last, hidden, width):
        if hidden is not None:
            self.add_context(state, hidden)
        P = state["committed"]
        assert last.item() == self.seq[P]
        draft = list(self.seq[P + 1 : P + width])
        draft += [1] * (width - 1 - len(draft))
        k = self.corrupt(state["cycle"], width)
        if k is not None:
            draft[k] = (draft[k] + 1) % self.V
        self.expected.append(width - 1 if k is None else k)
        state["cycle"] += 1
        return mx.eye(self.V)[mx.array(draft)] * 30.0


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("block_size", [4, 8, 16])
def test_rollback_at_every_block_position(pairs, baselines, family, block_size):
    pair = pairs[family]
    prompt = pair.tokenizer.encode(PROMPTS[0])
    n = 60
    ref = plain_greedy(baselines[family], prompt, n)
    feature_dim = len(pair.target.tap_ids) * pair.target.hidden_size
    schedules = {
        "cycle through positions": lambda c, w: c % w if c % w < w - 1 else None,
        "always full": lambda c, w: None,
        "always first": lambda c, w: 0,
        "always last": lambda c, w: w - 2,
    }
    for name, corrupt in schedules.items():
        source = OracleSource(prompt + ref, pair.target.vocab_size, feature_dim, corrupt)
        out, events = [], []
        for ev in dflash_mlx.stream_generate(
            pair, prompt, max_tokens=n, block_size=block_size, draft_source=source
        ):
            out += ev.tokens
            events.append(ev)
        assert out == ref, name
        # Cycles of width 1 (the budget's last token) draft nothing.
        accepted = [e.accepted for e in events[1:]]
        assert accepted[: len(source.expected)] == source.expected, name
        assert len(source.expected) >= len(accepted) - 1
        if name == "always full":
            assert events[-1].stats.mean_acceptance > block_size * 0.7


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_and_long_prompt(pairs, baselines, family):
    pair = pairs[family]
    prompt = pair.tokenizer.encode(" ".join(PROMPTS) * 3)
    ref = plain_greedy(baselines[family], prompt, 24)
    out, _ = dflash_tokens(pair, prompt, 24, block_size=5, prefill_step=7)
    assert out == ref


def test_max_tokens_never_overshoots(pairs):
    pair = pairs["qwen3"]
    prompt = pair.tokenizer.encode(PROMPTS[1])
    for n in [1, 2, 5, 17]:
        out, events = dflash_tokens(pair, prompt, n, block_size=8)
        assert len(out) == n
        assert events[-1].finish_reason == "length"
        assert events[-1].stats.generation_tokens == n


def test_stops_at_eos_without_emitting_it(targets, drafters, baselines):
    pair = dflash_mlx.load(str(targets["qwen3"]), str(drafters["old"]))
    prompt = pair.tokenizer.encode(PROMPTS[0])
    ref = plain_greedy(baselines["qwen3"], prompt, 60, eos=())
    eos = ref[13]  # a token the tiny target does emit, made an EOS id
    pair.tokenizer.eos_token_ids = {0, eos}
    cut = ref.index(eos)
    for block_size in [1, 4, 16]:
        out, events = dflash_tokens(pair, prompt, 60, block_size=block_size)
        assert out == ref[:cut]
        assert events[-1].finish_reason == "stop"
        assert events[-1].stats.generation_tokens == cut


def test_stop_string_truncates_text(pairs):
    pair = pairs["llama"]
    prompt = pair.tokenizer.encode(PROMPTS[0])
    full, _ = dflash_mlx.generate(pair, prompt, max_tokens=40, block_size=4)
    assert len(full) > 6
    stop = full[3:6]
    text, stats = dflash_mlx.generate(pair, prompt, max_tokens=40, block_size=4, stop=[stop])
    assert text == full[: full.index(stop)]
    assert stats.finish_reason == "stop"


def test_streamed_text_matches_tokenizer_decode(pairs):
    pair = pairs["qwen3_5"]
    prompt = pair.tokenizer.encode(PROMPTS[2])
    tokens, events = dflash_tokens(pair, prompt, 40, block_size=6)
    detok = pair.tokenizer.detokenizer  # mlx-lm's streaming detokenizer, token by token
    detok.reset()
    for t in tokens:
        detok.add_token(t)
    detok.finalize()
    assert len(events) > 3
    assert "".join(e.text for e in events) == detok.text


class Counting:
    """Counts calls to a wrapped model; everything else passes through."""

    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def __call__(self, *a, **kw):
        self.calls += 1
        return self.inner(*a, **kw)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("family", FAMILIES)
def test_one_target_pass_and_one_drafter_pass_per_cycle(pairs, family):
    import dataclasses

    from dflash_mlx.decode import DFlashDraftSource

    pair = pairs[family]
    target, drafter = Counting(pair.target), Counting(pair.drafter)
    counted = dataclasses.replace(pair, target=target, draft_source=DFlashDraftSource(drafter, target))
    prompt = pair.tokenizer.encode(PROMPTS[2])
    events = list(dflash_mlx.stream_generate(counted, prompt, max_tokens=40, block_size=5, prefill_step=8))
    stats = events[-1].stats
    chunks = -(-len(prompt) // 8)
    assert stats.cycles >= 8
    assert target.calls == chunks + stats.cycles
    # Every cycle drafts once, except a last one of width 1.
    assert drafter.calls in (stats.cycles, stats.cycles - 1)
