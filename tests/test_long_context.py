"""Long prompts: the model's window is enforced with a clear error."""

import json

import numpy as np
import pytest

import dflash_mlx
from dflash_mlx.errors import DFlashError


def test_a_prompt_beyond_the_window_is_one_clear_error(pairs):
    pair = pairs["qwen3"]
    window = pair.target.args.max_position_embeddings
    with pytest.raises(DFlashError, match=f"{window + 1} tokens but the model reads at most {window};"):
        dflash_mlx.generate(pair, [5] * (window + 1), max_tokens=4)
    text, stats = dflash_mlx.generate(pair, [5] * 8, max_tokens=4)  # within it: fine
    assert stats.generation_tokens == 4


@pytest.mark.parametrize("block_size", [1, 4, "auto"])
def test_generation_stops_at_the_window_with_finish_reason_length(pairs, baselines, block_size):
    """A prompt near the end of the window with a larger budget: the tokens fed to the
    target stay in its window (the last generated token is never fed), as mlx-lm's own
    greedy tokens, and the request ends with `length`."""
    from conftest import plain_greedy

    pair = pairs["qwen3"]
    window = pair.target.args.max_position_embeddings
    prompt = (pair.tokenizer.encode("def add(a, b):\n    return a + b\n") * window)[: window - 6]
    events = list(dflash_mlx.stream_generate(pair, prompt, max_tokens=40, block_size=block_size))
    tokens = [t for ev in events for t in ev.tokens]
    want = plain_greedy(baselines["qwen3"], prompt, 7)
    assert len(want) == 7  # no EOS before the window's end on this prompt
    assert tokens == want and events[-1].stats.finish_reason == "length"  # fed positions up to window - 1


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
    """A long prompt's rows behind the drafter's bound (after its first rows)
    are skipped in prefill: never projected, their taps never computed. Every
    cycle drafts and accepts what a run that projected them all does, and the
    output is plain greedy."""
    from conftest import plain_greedy

    from dflash_mlx.decode.passes import prefill_chunks
    from dflash_mlx.draft.source import DFlashDraftSource

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
    # After a prompt cache's 10 rows (its first 2 among them), from the first new row.
    assert prefill_chunks(20, 8, (2, 5), 21, before=10) == [(0, 8, False), (8, 16, False), (16, 20, True)]
    assert prefill_chunks(20, 8, (2, 5), 21, before=1) == [(0, 1, True), (1, 9, False), (9, 16, False),
                                                           (16, 20, True)]
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
    finally:
        restore_bound(pair.drafter, before)
    (skipping, added, skipped, at), (full, added_all, none, at_all) = runs
    assert skipped == len(prompt) - 16 - 2 and none == 0
    assert added + skipped == added_all  # every row accounted for, in either form
    assert skipping == full and at == at_all
    assert [t for ts, _ in skipping for t in ts] == plain_greedy(baselines["qwen3"], prompt, 24)


def test_a_prompt_cache_never_hands_a_draft_the_rows_a_prefill_skipped(pairs, baselines):
    """With a prompt cache, prefill skips rows too (the entry keeps where). A request
    that continues the conversation reuses all of it; one that branches inside the
    skipped rows reuses the prefix only up to the first skipped row its first draft
    would read, and runs the rest again. Each drafts, accepts and outputs what a
    cold run without a cache does."""
    from conftest import plain_greedy

    from dflash_mlx.cache.prompt_cache import PromptCache

    from dflash_mlx.draft.source import DFlashDraftSource

    class Recorded(DFlashDraftSource):
        def propose(self, state, last, hidden, width):
            logits = super().propose(state, last, hidden, width)
            self.drafts.append(logits.tolist())
            return logits

    pair = pairs["qwen3"]
    tok = pair.tokenizer
    prompt = tok.encode("Once upon a time there was a tiny language model that could count " * 8)
    before = pair.drafter.context_bound
    assert pair.drafter.bound_context(16, 2)
    kept = Recorded(pair.drafter, pair.target)
    try:
        def run(ids, cache=None):
            source = kept if cache is not None else Recorded(pair.drafter, pair.target)
            source.drafts = []
            events = list(dflash_mlx.stream_generate(pair, ids, max_tokens=12, block_size=4, prompt_cache=cache,
                                                     prefill_step=32, draft_source=source))
            return [(e.tokens, e.accepted) for e in events], source.drafts, events[-1].stats.cached_tokens

        cache = PromptCache(pair)
        first, _, _ = run(prompt, cache)
        holes = cache._lru.trie.get(id(kept), prompt + [t for ts, _ in first for t in ts][:-1])
        holes = [r.cache.holes for r in holes.cache[len(pair.target.make_cache()):]]
        assert holes[0] and holes[0][0][0] == 2 and all(h == holes[0] for h in holes)  # after the 2 sink rows
        answer = [t for ts, _ in first for t in ts]
        more = prompt + answer + tok.encode(" and so on")
        branch = prompt[:60] + tok.encode(" and then it stopped")
        assert 2 < 60 - 16 and holes[0][0][1] > 60  # the branch point lies in the skipped rows
        for ids in (more, branch):
            warm, drafts, reused = run(ids, cache)
            cold, cold_drafts, none = run(ids)
            assert warm == cold and none == 0
            assert len(drafts) == len(cold_drafts) > 2  # and the drafter read the same rows:
            assert all(np.allclose(d, c, atol=1e-4) for d, c in zip(drafts, cold_drafts))
            assert [t for ts, _ in warm for t in ts] == plain_greedy(baselines["qwen3"], ids, 12)
            if ids is more:
                assert reused == len(prompt) + len(answer) - 1  # the whole entry
            else:  # up to the first skipped row the branch's first draft reads
                assert reused == len(branch) - 16
    finally:
        restore_bound(pair.drafter, before)


def test_the_sizer_is_told_how_many_rows_the_drafter_has_not_seen(pairs):
    """At every choice the loop reports the context rows whose taps the drafter
    has not been given yet (what a drafted cycle would first catch up on): the
    whole prompt before the first draft, then what plain steps added since."""
    from conftest import ScriptedWidths

    from dflash_mlx.draft.source import DFlashDraftSource

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


def test_a_drafter_cache_keeps_where_rows_were_skipped_through_trims_and_the_disk():
    import mlx.core as mx

    from dflash_mlx.draft.source import ContextRows
    from dflash_mlx.draft.drafter import DraftCache
    from dflash_mlx.cache.prompt_store import decode, encode

    c = DraftCache(bound=(2, 4))
    kv = mx.ones((1, 1, 3, 2))
    c.update_and_fetch((kv, kv), (None, None))
    c.skip(4)
    c.skip(2)  # next to the last: one range
    c.update_and_fetch((kv, kv), (None, None))
    assert c.holes == ((3, 9),) and c.length == 12
    assert c.absent(0, 3) is None and c.absent(0, 12) == 3 and c.absent(5, 12) == 5 and c.absent(9, 12) is None
    view = ContextRows(c).__copy__()
    view.trim(5)  # a trimmed view: the range ends where its rows do; the original keeps its own
    assert view.cache.holes == ((3, 7),) and c.holes == ((3, 9),)
    view.trim(5)
    assert view.cache.holes == () and view.cache.length == 2
    arrays, layers = encode([ContextRows(c)], object)
    (restored,) = decode(arrays, json.loads(json.dumps(layers)), object)  # as the file's header keeps them
    assert restored.cache.holes == ((3, 9),) and restored.cache.length == 12


def test_a_long_backlog_reaches_the_drafter_in_pieces_with_the_same_context(pairs):
    """At its first drafted cycle after a long prompt the drafter is given the held
    taps a piece at a time (each evaluated before the next, so memory holds one
    piece's work), and its context equals what one hand-over of them all gives."""
    import mlx.core as mx

    from dflash_mlx.decode.passes import PREFILL_STEP, caught_up, joined

    pair = pairs["qwen3"]
    source = pair.draft_source.inner
    D = pair.drafter.args.hidden_size * len(pair.drafter.args.target_layer_ids)
    mx.random.seed(3)
    pieces = [mx.random.normal((1, n, D)) for n in (PREFILL_STEP, 1500, 700)]
    steps = [tuple(mx.random.normal((1, 1, D // len(pair.drafter.args.target_layer_ids)))
                   for _ in pair.drafter.args.target_layer_ids) for _ in range(3)]
    taps = pieces + steps
    whole, parts = source.new_state(), source.new_state()
    source.add_context(whole, joined(taps))
    given = []
    base = source.add_context

    def add(state, hidden):
        given.append(hidden.shape[1])
        base(state, hidden)

    source.add_context = add
    try:
        left = caught_up(source, parts, taps)
    finally:
        del source.add_context
    assert given == [PREFILL_STEP, 1500] and len(left) == 4  # down to at most PREFILL_STEP rows left
    source.add_context(parts, joined(left))
    for a, b in zip(whole, parts):
        assert a.length == b.length == sum(t.shape[1] for t in pieces) + len(steps)
        assert mx.allclose(a.keys[..., : a.offset, :], b.keys[..., : b.offset, :], atol=1e-5).item()
        assert mx.allclose(a.values[..., : a.offset, :], b.values[..., : b.offset, :], atol=1e-5).item()
    assert caught_up(source, source.new_state(), steps) == steps  # a short backlog: nothing early
