"""Greedy DFlash output equals plain mlx-lm decoding token for token: float32,
bfloat16 and 4-bit targets (written by mlx-lm's own converter), every family."""

import mlx.core as mx
import pytest
from conftest import (FAMILIES, LOSSLESS_FAMILIES, OracleSource, ScriptedWidths, check_rollback_at_every_position,
                      greedy_ref, plain_greedy)

import dflash_mlx
from dflash_mlx.draft.source import DFlashDraftSource

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
# 1: plain steps; 2: one draft; 5: below the drafters' own block (8); 16: beyond it.
@pytest.mark.parametrize("block_size", [1, 2, 5, 8, 16])
def test_random_drafter_is_lossless(pairs, baselines, family, block_size):
    pair = pairs[family]
    for text in PROMPTS[:3]:
        prompt = pair.tokenizer.encode(text)
        ref = greedy_ref(baselines[family], prompt, 48)
        out, events = dflash_tokens(pair, prompt, 48, block_size=block_size)
        assert out == ref, (family, block_size, text)
        # Each cycle commits its accepted drafts plus one token of the target's own,
        # never more than its width, and the cycles account for every token.
        stats = events[-1].stats
        assert stats.acceptance_lengths == [e.accepted + 1 for e in events[1:]]
        assert all(len(e.tokens) == e.accepted + 1 for e in events[1:-1])
        assert len(events[-1].tokens) <= events[-1].accepted + 1
        done = 1  # the prompt's own token
        for a in stats.acceptance_lengths:
            assert 1 <= a <= min(block_size, 48 - done), (done, stats.acceptance_lengths)  # within this cycle's width
            done += a
        if events[-1].finish_reason == "length":
            assert 1 + sum(stats.acceptance_lengths) == len(out) == 48


# bfloat16 and 4-bit (bfloat16 scales) targets of every family, and the MoE family in float32.
VARIANT_CASES = [(f, v) for v in ("bfloat16", "4bit") for f in LOSSLESS_FAMILIES] + [("qwen3_5_moe", "float32")]


@pytest.mark.parametrize("family, variant", VARIANT_CASES, ids=[f"{f}-{v}" for f, v in VARIANT_CASES])
def test_low_precision_and_moe_targets_are_lossless(zoo, family, variant):
    """Greedy ids equal mlx-lm's generate_step on the same (cast or quantized) model.

    Picks are argmaxes of log probabilities rounded to the model's dtype, as in
    mlx-lm, so a verify row must give exactly the logits of mlx-lm's one-row step.
    """
    if (family, variant) == ("qwen3_5_moe", "bfloat16") and mx.default_device() == mx.cpu:
        pytest.skip("MLX's CPU gather_mm is float32-only: plain mlx-lm cannot run a bfloat16 MoE here")
    pair, base = zoo.pair(family, variant), zoo.baseline(family, variant)
    for text in PROMPTS[:3]:
        prompt = pair.tokenizer.encode(text)
        ref = plain_greedy(base, prompt, 24)
        assert len(ref) > 8  # the tiny model does not stop at once
        for block_size in (1, 2, 4, 16):
            out, events = dflash_tokens(pair, prompt, 24, block_size=block_size)
            assert out == ref, (family, variant, block_size, text)


@pytest.mark.parametrize("family, variant", [("qwen3", "bfloat16"), ("qwen3_5", "bfloat16"), ("llama", "4bit"),
                                             ("qwen3_5_moe", "4bit")], ids=lambda x: x)
def test_verify_rows_equal_mlx_lm_one_row_steps_bitwise(zoo, family, variant):
    """The premise of greedy equality in low precision: the logits of a 16-row
    verify pass (recording the Gated DeltaNet tape) are bit for bit those of
    mlx-lm's one-row steps on the same prefix. True on this backend (MLX's CPU
    matmuls reduce each output element in an order that does not depend on the
    row count); backends whose one-row and many-row kernels differ need this
    test to hold for DFlash to stay lossless there."""
    from mlx_lm.models.cache import make_prompt_cache

    pair, base = zoo.pair(family, variant), zoo.baseline(family, variant)
    prompt = pair.tokenizer.encode(PROMPTS[2])
    block = prompt[-1:] + list(range(20, 35))
    cache = make_prompt_cache(base)
    base(mx.array([prompt[:-1]]), cache=cache)
    steps = mx.stack([base(mx.array([[t]]), cache=cache)[0, -1] for t in block])
    tcache = pair.target.make_cache()
    pair.target(mx.array([prompt[:-1]]), tcache)
    logits = pair.target(mx.array([block]), tcache, record=True)[0][0]
    assert logits.dtype == steps.dtype == (mx.float32 if variant == "float32" else mx.bfloat16)
    assert mx.array_equal(logits, steps).item()


def pair_and_baseline(pairs, baselines, zoo, family):
    """The float32 pair and plain mlx-lm model of a family (the shared fixtures' where they have it)."""
    if family in pairs:
        return pairs[family], baselines[family]
    return zoo.pair(family), zoo.baseline(family)


@pytest.mark.parametrize("family", LOSSLESS_FAMILIES)
@pytest.mark.parametrize("block_size", [4, 8, 16])
def test_rollback_at_every_block_position(pairs, baselines, zoo, family, block_size):
    pair, base = pair_and_baseline(pairs, baselines, zoo, family)
    check_rollback_at_every_position(pair, base, pair.tokenizer.encode(PROMPTS[0]), block_size)


@pytest.mark.parametrize("family", LOSSLESS_FAMILIES)
def test_chunked_prefill_and_long_prompt(pairs, baselines, zoo, family):
    pair, base = pair_and_baseline(pairs, baselines, zoo, family)
    prompt = pair.tokenizer.encode(" ".join(PROMPTS) * 3)
    ref = plain_greedy(base, prompt, 24)
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

    from dflash_mlx.draft.source import DFlashDraftSource

    pair = pairs[family]
    target, drafter = Counting(pair.target), Counting(pair.drafter)
    counted = dataclasses.replace(pair, target=target, draft_source=DFlashDraftSource(drafter, target))
    prompt = pair.tokenizer.encode(PROMPTS[2])
    events = list(dflash_mlx.stream_generate(counted, prompt, max_tokens=40, block_size=5, prefill_step=8))
    stats = events[-1].stats
    chunks = -(-(len(prompt) - 1) // 8) + 1  # all but the last prompt token in chunks, then that token alone
    assert stats.cycles >= 8
    assert target.calls == chunks + stats.cycles
    # Every cycle drafts once, except a last one of width 1.
    assert drafter.calls in (stats.cycles, stats.cycles - 1)


class ContextChecked(DFlashDraftSource):
    """The real drafter, checking at every draft that its context cache holds the
    taps of exactly the committed tokens before `last`: its proposal equals one
    from a fresh cache given the taps of a single target pass over them."""

    def __init__(self, pair, sequence):
        super().__init__(pair.drafter, pair.target)
        self.seq = sequence
        self.widths = []

    def new_state(self):
        self.given = 0
        return super().new_state()

    def add_context(self, state, hidden):
        self.given += hidden.shape[1]
        super().add_context(state, hidden)

    def propose(self, state, last, hidden, width):
        if hidden is not None:
            self.given += hidden.shape[1]
        got = super().propose(state, last, hidden, width)
        P = self.given
        assert last.item() == self.seq[P], (P, width)
        _, taps = self.target(mx.array([self.seq[:P]]), self.target.make_cache())
        fresh = super().new_state()
        super().add_context(fresh, taps)
        want = super().propose(fresh, last, None, width)
        assert mx.allclose(got, want, atol=1e-4, rtol=1e-4).item(), (P, width)
        self.widths.append(width)
        return got


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_width_one_then_wider_within_a_request(pairs, baselines, family):
    """Plain cycles (width 1, no draft) followed by drafting ones in one request:
    ids stay identical and the drafter, once it drafts again, has been given
    the taps of every token committed meanwhile."""
    pair = pairs[family]
    prompt = pair.tokenizer.encode(PROMPTS[2])
    n = 40
    ref = greedy_ref(baselines[family], prompt, n)
    always, _ = dflash_tokens(pair, prompt, n, block_size=8, draft_source=ContextChecked(pair, prompt + ref))
    policy = ScriptedWidths([1, 1, 1, 4, 1, 8, 1, 1, 16, 2])
    source = ContextChecked(pair, prompt + ref)
    out, events = dflash_tokens(pair, prompt, n, block_size=policy, draft_source=source)
    assert out == ref == always
    widths = [w for w, _ in policy.updates]
    assert widths[:4] == [1, 1, 1, 4] and 1 in widths[4:] and max(widths) > 4
    # The drafter ran exactly for the wider cycles, after plain ones included.
    assert source.widths == [w for w in widths if w > 1]
    assert [a for _, a in policy.updates] == [e.accepted for e in events[1:]]
    assert all(a == 0 for w, a in policy.updates if w == 1)
    # Each choice saw the committed context length.
    contexts = [c for c, _ in policy.chosen]
    assert contexts[0] == len(prompt) + 1
    assert all(b == a + w_acc + 1 for a, b, w_acc in zip(contexts, contexts[1:], [a for _, a in policy.updates]))


class TapsWatched:
    """A target adapter instance's calls, recording whether each asked for taps."""

    def __init__(self, inner):
        self.inner, self.asked = inner, []

    def __call__(self, *a, taps=True, **kw):
        self.asked.append(taps)
        return self.inner(*a, taps=taps, **kw)

    def __getattr__(self, name):
        return getattr(self.inner, name)


class Untouched(DFlashDraftSource):
    """A draft source that fails the test if the loop gives it anything."""

    def add_context(self, state, hidden):
        raise AssertionError("a block-size-1 request fed the drafter")

    def commit(self, state, tokens):
        raise AssertionError("a block-size-1 request extended the source's index")


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_block_size_one_decodes_as_mlx_lm_without_taps(pairs, baselines, family):
    """A request that can never draft (block size 1, no prompt cache) asks the
    target for no taps, in prefill or in any step, and gives the drafter and
    the n-gram index nothing; the ids are mlx-lm's. A policy that may draft
    keeps the taps of its plain steps."""
    import copy

    pair = pairs[family]
    prompt = pair.tokenizer.encode(PROMPTS[2])
    ref = greedy_ref(baselines[family], prompt, 300)
    watched = copy.copy(pair)
    watched.target = TapsWatched(pair.target)
    out, events = dflash_tokens(watched, prompt, len(ref), block_size=1,
                                draft_source=Untouched(pair.drafter, pair.target))
    assert out == ref and len(ref) > 256  # past the point where held taps would go to the drafter
    assert len(watched.target.asked) == events[-1].stats.cycles + 2  # the prompt: a chunk, then its last token
    assert not any(watched.target.asked)
    watched.target.asked.clear()
    out, _ = dflash_tokens(watched, prompt, 20, block_size=ScriptedWidths([1]))
    assert out == ref[:20] and all(watched.target.asked)


def test_the_drafter_fills_its_trained_block_at_every_width(pairs):
    """However few positions a cycle verifies, the drafter drafts its whole
    trained block (its guesses at the first positions are those of a full
    block); drafting only the verified positions, as z-lab's `dflash_generate`
    does, its guesses differ."""
    pair = pairs["qwen3"]
    source = DFlashDraftSource(pair.drafter, pair.target)
    B = source.block_size
    prompt = pair.tokenizer.encode(PROMPTS[2])
    _, taps = pair.target(mx.array([prompt]), pair.target.make_cache())
    last = mx.array(prompt[-1:])

    def proposal(width, fill=True):
        vars(source).pop("block_rows", None)
        if not fill:
            source.block_rows = lambda w: w  # the verified positions only
        state = source.new_state()
        source.add_context(state, taps)
        return source.propose(state, last, None, width)

    full = proposal(B)
    for w in (2, 4, B - 1):
        assert proposal(w).shape[0] == w - 1 and mx.allclose(proposal(w), full[: w - 1], atol=1e-5).item(), w
    assert not mx.allclose(proposal(4, fill=False), full[:3], atol=1e-3).item()
    assert mx.allclose(proposal(B, fill=False), full, atol=1e-5).item()


def test_the_prompts_token_is_handed_over_before_the_first_draft(pairs, baselines):
    """The first drafted cycle makes the drafter catch up on the whole prompt
    (on a long prompt a large part of the time to first token): the
    prompt's own token is yielded before that cycle is even built."""
    pair = pairs["qwen3"]
    prompt = pair.tokenizer.encode(PROMPTS[2])
    source = ContextChecked(pair, prompt + greedy_ref(baselines["qwen3"], prompt, 24))
    events = dflash_mlx.stream_generate(pair, prompt, max_tokens=24, block_size=8, draft_source=source)
    first = next(events)
    assert first.tokens and source.widths == []
    rest = list(events)
    assert source.widths[0] == 8 and len(source.widths) == rest[-1].stats.draft_cycles


def near_tie(logits):
    """Replace bf16 logits with a near tie: every token 1.5 but EOS (-1) and the
    row's own argmax, one ulp above (1.5078125). Over this vocabulary the bf16 log
    probabilities of 1.5 and 1.5078125 round to the same value, so mlx-lm picks
    token 1 where the raw argmax is the row's own top token."""
    V = logits.shape[-1]
    top = mx.argmax(logits, axis=-1, keepdims=True)
    out = mx.where(mx.arange(V) == top, mx.array(1.5078125, mx.bfloat16), mx.array(1.5, mx.bfloat16))
    return mx.where(mx.arange(V) == 0, mx.array(-1.0, mx.bfloat16), out)


class NearTieModel(Counting):
    """A plain mlx-lm model whose logits go through `near_tie`."""

    def __call__(self, *a, **kw):
        return near_tie(super().__call__(*a, **kw))


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_bf16_near_ties_are_broken_like_mlx_lm_end_to_end(zoo, drafters, family):
    """Every greedy pick of the loop (the prompt's, each verify row's, a width-1
    cycle's) follows mlx-lm's rule on bf16 log probabilities, not the raw argmax."""
    from mlx_lm import load

    from conftest import DRAFTER_LAYOUT

    path = zoo.path(family, "bfloat16")
    base = NearTieModel(load(str(path))[0])
    pair = dflash_mlx.load(str(path), str(drafters[DRAFTER_LAYOUT[family]]))  # its own copy: the head is replaced
    head = pair.target.head
    pair.target.head = lambda h: near_tie(head(h))
    prompt = pair.tokenizer.encode(PROMPTS[0])
    ref = plain_greedy(base, prompt, 20)
    assert ref == [1] * 20  # mlx-lm's pick: the first of the tied tokens (EOS is lower)
    feature_dim = len(pair.target.tap_ids) * pair.target.hidden_size
    for block_size in (1, 4, 16):
        out, _ = dflash_tokens(pair, prompt, 20, block_size=block_size)
        assert out == ref, block_size
        # A drafter that proposes mlx-lm's tokens has them accepted.
        source = OracleSource(prompt + ref, pair.target.vocab_size, feature_dim, lambda c, w: None)
        out, events = dflash_tokens(pair, prompt, 20, block_size=block_size, draft_source=source)
        assert out == ref and [e.accepted for e in events[1:]][: len(source.expected)] == source.expected


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_long_plain_run_then_drafting(pairs, baselines, family):
    """Past 256 plain steps the loop hands the held taps to the drafter in one
    batch; drafting afterwards still sees exactly the committed context."""
    pair = pairs[family]
    prompt, ref = next((p, r) for p in (pair.tokenizer.encode(t) for t in PROMPTS)
                       for r in [plain_greedy(baselines[family], p, 300)] if len(r) >= 290)
    policy = ScriptedWidths([1] * 270 + [4, 8, 1, 4])
    source = ContextChecked(pair, prompt + ref)
    out, _ = dflash_tokens(pair, prompt, len(ref), block_size=policy, draft_source=source)
    assert out == ref
    assert source.widths[:2] == [4, 8] and source.given >= len(prompt) + 270


def test_held_taps_join_as_if_each_step_had_concatenated_its_own():
    """Plain steps hold their tapped layers' outputs unjoined; `joined` gives the
    drafter exactly the rows per-step concatenation would, in order, mixed with
    passes' taps (arrays of rows)."""
    from dflash_mlx.decode.passes import joined

    D, n = 8, 3
    block = mx.random.normal((1, 4, D * n), key=mx.random.key(0))
    steps = [tuple(mx.random.normal((1, 1, D), key=mx.random.key(10 * i + j)) for j in range(n)) for i in range(5)]
    per_step = [mx.concatenate(s, axis=-1) for s in steps]
    taps = [block, *steps[:3], block[:, :2], *steps[3:]]
    want = mx.concatenate([block, *per_step[:3], block[:, :2], *per_step[3:]], axis=1)
    assert joined(taps).shape == (1, 11, D * n) and mx.array_equal(joined(taps), want).item()
    assert mx.array_equal(joined([steps[0]]), per_step[0]).item()
    assert mx.array_equal(joined(list(steps)), mx.concatenate(per_step, axis=1)).item()
    assert joined([block]) is block


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_prefill_leaves_the_taps_of_the_last_rows_to_the_loop(pairs, family):
    """Prefill hands the drafter the rows beyond `hold` bytes chunk by chunk and returns
    the rest (lazy) with the logits: together they are exactly the taps of one
    pass over the prompt, and the logits are the last position's."""
    from dflash_mlx.decode.passes import prefill

    pair = pairs[family]
    target, source = pair.target, pair.draft_source
    prompt = mx.array(pair.tokenizer.encode(" ".join(PROMPTS) * 2))
    n = prompt.shape[0]
    assert n > 40
    given = []
    base_add = source.add_context

    def add(state, hidden):
        given.append(hidden)
        base_add(state, hidden)

    want_logits, want_taps = target(prompt[None], target.make_cache())
    row = want_taps.nbytes // n
    source.add_context = add
    try:
        logits, held = prefill(target, source, source.new_state(), prompt, target.make_cache(), step=8,
                               hold=16 * row)
    finally:
        source.add_context = base_add
    rows = [h.shape[1] for h in given + held]
    assert sum(rows) == n and sum(h.shape[1] for h in held) <= 16 + 8 and given
    assert mx.allclose(mx.concatenate(given + held, axis=1), want_taps, atol=1e-4).item()
    assert mx.allclose(logits, want_logits[0, -1], atol=1e-4).item()
