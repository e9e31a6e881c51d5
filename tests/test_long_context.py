"""Long prompts: the model's window is enforced with a clear error."""

import pytest

import dflash_mlx
from dflash_mlx.errors import DFlashError


def test_a_prompt_beyond_the_window_is_one_clear_error(pairs):
    pair = pairs["qwen3"]
    window = pair.target.args.max_position_embeddings
    with pytest.raises(DFlashError, match=f"{window + 1} tokens but the model reads at most {window} "):
        dflash_mlx.generate(pair, [5] * (window + 1), max_tokens=4)
    text, stats = dflash_mlx.generate(pair, [5] * 8, max_tokens=4)  # within it: fine
    assert stats.generation_tokens == 4


def restore_bound(drafter, bound):
    """Put back a drafter's context bound as `context_bound` gave it: the
    session's pairs are shared, and a prompt cache's disk key includes it."""
    drafter.bound_context(bound[1], bound[0]) if bound else drafter.bound_context(None)


def drafter_outputs(drafter, ctx, block, bound=None, start=0):
    """The drafter's block output after committing `ctx` rows (positions from `start`)."""
    before = drafter.context_bound
    drafter.bound_context(*bound) if bound else drafter.bound_context(None)
    cache = drafter.make_cache()
    for c in cache:
        c.start = start
    drafter.add_context(ctx, cache)
    out = drafter(block, None, cache)
    restore_bound(drafter, before)
    return out


def test_a_bounded_drafter_context_is_the_sinks_and_the_recent_rows(pairs):
    import mlx.core as mx

    drafter = pairs["qwen3"].drafter  # DFlash 1, all full attention
    D = drafter.args.hidden_size
    mx.random.seed(5)
    ctx = mx.random.normal((1, 300, D * len(drafter.args.target_layer_ids)))
    block = mx.random.normal((1, 8, D))
    full = drafter_outputs(drafter, ctx, block)
    # A bound wider than the context changes nothing.
    assert mx.array_equal(drafter_outputs(drafter, ctx, block, (400, 4)), full).item()
    # The last 64 rows alone, at their own positions, are what a (64, no sinks) bound sees.
    recent = drafter_outputs(drafter, ctx, block, (64, 0))
    alone = drafter_outputs(drafter, ctx[:, -64:], block, start=300 - 64)
    assert mx.allclose(recent, alone, atol=1e-5).item()
    assert not mx.allclose(recent, full, atol=1e-3).item()
    sinks = drafter_outputs(drafter, ctx, block, (64, 4))
    assert not mx.allclose(sinks, recent, atol=1e-3).item()  # the first rows are seen too


def test_a_bounded_drafter_context_keeps_output_exact(pairs, baselines):
    from conftest import plain_greedy

    pair = pairs["qwen3"]
    prompt = pair.tokenizer.encode("Once upon a time there was a tiny language model that could count " * 6)
    before = pair.drafter.context_bound
    assert pair.drafter.bound_context(16, 2)
    try:
        text, stats = dflash_mlx.generate(pair, prompt, max_tokens=24, block_size=4)
        ids = [t for e in dflash_mlx.stream_generate(pair, prompt, max_tokens=24, block_size=4) for t in e.tokens]
    finally:
        restore_bound(pair.drafter, before)
    assert ids == plain_greedy(baselines["qwen3"], prompt, 24)
    # Drafters with causal or sliding-window layers keep their own attention.
    other = pairs["qwen3_5"].drafter
    before = other.context_bound
    bounded = other.bound_context(16)
    restore_bound(other, before)
    assert not bounded or all(l.self_attn.window is None for l in other.layers)


def test_rows_no_draft_reads_are_skipped_and_the_drafts_stay_the_same(pairs, baselines):
    """Without a prompt cache, a long prompt's rows behind the drafter's bound
    (after its first rows) are skipped in prefill: never projected, their taps
    never computed. Every cycle drafts and accepts what a run that projected
    them all does, and the output is plain greedy."""
    from conftest import plain_greedy

    from dflash_mlx.decode import DFlashDraftSource, prefill_chunks
    from dflash_mlx.prompt_cache import PromptCache

    class Counted(DFlashDraftSource):
        def __init__(self, pair, skips):
            super().__init__(pair.drafter, pair.target)
            self.added, self.skipped, self.skips, self.positions = 0, 0, skips, []

        def horizon(self, state):
            return super().horizon(state) if self.skips else None

        def add_context(self, state, hidden):  # rows given to the drafter, here or with a draft
            self.added += hidden.shape[1]
            super().add_context(state, hidden)

        def draft_states(self, state, last, hidden, width):
            rows = 0 if hidden is None else hidden.shape[1]
            self.added += rows
            self.positions.append(state[0].length + rows)  # the block's position
            return super().draft_states(state, last, hidden, width)

        def skip(self, state, n):
            self.skipped += n
            super().skip(state, n)

    assert prefill_chunks(10, 4) == [(0, 4, True), (4, 8, True), (8, 10, True)]  # mlx-lm's, where nothing is skipped
    assert prefill_chunks(20, 8, (2, 5), 21) == [(0, 2, True), (2, 10, False), (10, 16, False), (16, 20, True)]
    assert prefill_chunks(20, 8, (2, 25), 21) == prefill_chunks(20, 8)
    pair = pairs["qwen3"]
    prompt = pair.tokenizer.encode("Once upon a time there was a tiny language model that could count " * 8)
    before = pair.drafter.context_bound
    assert pair.drafter.bound_context(16, 2)
    try:
        runs = []
        for skips in (True, False):
            source = Counted(pair, skips)
            events = [(e.tokens, e.accepted) for e in dflash_mlx.stream_generate(
                pair, prompt, max_tokens=24, block_size=4, draft_source=source, prefill_step=32)]
            runs.append((events, source.added, source.skipped, source.positions))
        source = Counted(pair, True)  # a prompt cache may later need any row: none is skipped
        list(dflash_mlx.stream_generate(pair, prompt, max_tokens=4, block_size=4, draft_source=source,
                                        prompt_cache=PromptCache(pair)))
        assert source.skipped == 0
    finally:
        restore_bound(pair.drafter, before)
    (skipping, added, skipped, at), (full, added_all, none, at_all) = runs
    assert skipped == len(prompt) - 16 - 2 and none == 0
    assert added + skipped == added_all  # every row accounted for, in either form
    assert skipping == full and at == at_all
    assert [t for ts, _ in skipping for t in ts] == plain_greedy(baselines["qwen3"], prompt, 24)


def test_the_sizer_is_told_how_many_rows_the_drafter_has_not_seen(pairs):
    """At every choice the loop reports the context rows whose taps the drafter
    has not been given yet (what a drafted cycle would first catch up on): the
    whole prompt before the first draft, then what plain steps added since."""
    from conftest import ScriptedWidths

    from dflash_mlx.decode import DFlashDraftSource

    pair = pairs["qwen3"]

    class Given(DFlashDraftSource):
        rows = 0

        def add_context(self, state, hidden):
            self.rows += hidden.shape[1]
            super().add_context(state, hidden)

        def draft_states(self, state, last, hidden, width):
            self.rows += 0 if hidden is None else hidden.shape[1]
            return super().draft_states(state, last, hidden, width)

    source = Given(pair.drafter, pair.target)

    class Watched(ScriptedWidths):
        def choose(self, context, offer=(), unseen=0, left=0):
            self.given.append(context - 1 - source.rows)  # rows with taps (all but the last token's) not given
            return super().choose(context, offer, unseen, left)

    policy = Watched([1, 1, 4, 1, 1, 1, 3])
    policy.given = []
    prompt = pair.tokenizer.encode("Once upon a time there was a tiny language model that could count")
    list(dflash_mlx.stream_generate(pair, prompt, max_tokens=32, block_size=policy, draft_source=source))
    assert policy.unseen == policy.given
    assert policy.unseen[0] == len(prompt) and max(policy.unseen[3:]) > 1 and 0 < min(policy.unseen)
