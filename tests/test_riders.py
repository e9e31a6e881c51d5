"""A joining prompt's prefill chunk riding in the batch's own pass (`target.adapter.Rider`)."""

import mlx.core as mx
import pytest
from conftest import Counted

from dflash_mlx.target.adapter import Rider
from dflash_mlx.target.ragged import RaggedKVCache

PROMPTS = [[5, 9, 14, 3, 22, 7, 31], [8, 4], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 40, 41]]
JOINER = [30, 2, 19, 44, 5, 6, 60, 61, 3, 9, 12, 17, 23, 29, 31, 37, 41]


def close(a, b):
    return mx.allclose(a, b, atol=1e-4, rtol=1e-4).item()


def rides_as_apart(target, tokens, cache, ref, chunk, rider_cache, solo_cache, **kwargs) -> bool:
    """Whether a pass over `tokens` carrying `chunk` returns the logits and taps of the same pass
    apart (over `ref`, caches like `cache`), and leaves the chunk the taps of its own pass."""
    rider = Rider(chunk, rider_cache)
    logits, taps = target(tokens, cache, rider=rider, **kwargs)
    want_logits, want_taps = target(tokens, ref, **kwargs)
    _, want_rider = target(chunk, solo_cache, last_only=True)
    return close(logits, want_logits) and close(taps, want_taps) and close(rider.hidden, want_rider)


def own(target, prompt):
    cache = target.make_cache()
    mx.eval(target(mx.array([prompt]), cache)[0], [c.state for c in cache])
    return cache


@pytest.mark.parametrize("family", ["qwen3", "llama"])
@pytest.mark.parametrize("width", [1, 4])
def test_a_rider_changes_nothing_of_the_pass_it_rides_in(pairs, family, width):
    """A pass carrying a prompt's chunk returns the logits and taps it returns alone; the chunk's
    taps are those of its own pass, and its caches go on as after its own (the next chunk too)."""
    target = pairs[family].target
    caches = [own(target, p) for p in PROMPTS]
    batch = [RaggedKVCache.merge([c[i] for c in caches]) for i in range(len(caches[0]))]
    alone = [RaggedKVCache.merge([c[i] for c in [own(target, p) for p in PROMPTS]]) for i in range(len(caches[0]))]
    rider_cache, solo_cache = own(target, JOINER[:3]), own(target, JOINER[:3])
    assert target.can_carry(rider_cache)
    block = mx.array([[p[-1]] * width for p in PROMPTS])
    for start, end in ((3, 10), (10, len(JOINER))):
        chunk = mx.array([JOINER[start:end]])
        rider = Rider(chunk, rider_cache)
        logits, taps = target(block, batch, record=True, rider=rider)
        want_logits, want_taps = target(block, alone, record=True)
        _, want_rider = target(chunk, solo_cache, last_only=True)
        assert logits.shape == want_logits.shape and close(logits, want_logits)
        assert taps.shape == want_taps.shape and close(taps, want_taps)
        assert rider.hidden.shape == want_rider.shape and close(rider.hidden, want_rider)
        assert [c.offset for c in rider_cache] == [c.offset for c in solo_cache] == [end] * len(rider_cache)
    one_row = mx.array([width - 1, 0, width // 2])  # a row per sequence to the head, as a batched prefill asks
    rider = Rider(mx.array([[7, 8]]), rider_cache, taps=False)
    logits, layers = target(block, batch, rows=one_row, taps="layers", rider=rider)
    want, want_layers = target(block, alone, rows=one_row, taps="layers")
    assert logits.shape == want.shape and close(logits, want) and rider.hidden is None
    assert all(close(a, b) for a, b in zip(layers, want_layers))
    nxt = mx.array([[50]])
    assert close(target(nxt, rider_cache)[0], target(mx.array([[7, 8, 50]]), solo_cache)[0][:, -1:])


def test_a_target_whose_layers_share_caches_carries_no_riders(more):
    """Gemma 4's layers that read another layer's K/V: a joiner is prefilled in passes of its own."""
    target = more("gemma4_text")[0].target
    assert not target.can_carry(own(target, JOINER))


def test_a_hybrid_target_carries_riders(pairs):
    """Gated DeltaNet layers (qwen3_5): a chunk rides in a batch's recorded pass, each group's rows
    through the mixer on its own states and only the batch's taped: the pass returns what it
    returns alone, the chunk's taps and states are its own pass's, and each sequence's rollback
    to its accepted rows is what it is alone."""
    from dflash_mlx.target.ragged import add_to, batch_of

    target = pairs["qwen3_5"].target

    def batched():
        caches = [own(target, p) for p in PROMPTS]
        out = [batch_of(c) for c in caches[0]]
        for c in caches[1:]:
            for layer, one in zip(out, c):
                add_to(layer, one)
        return out

    batch, alone = batched(), batched()
    rider_cache, solo_cache = own(target, JOINER[:3]), own(target, JOINER[:3])
    assert target.can_carry(rider_cache)
    block = mx.array([[p[-1]] * 4 for p in PROMPTS])
    chunk = mx.array([JOINER[3:]])
    rider = Rider(chunk, rider_cache)
    logits, taps = target(block, batch, record=True, rider=rider)
    target.crop_each(batch, [1, 4, 2], 4)
    want_logits, want_taps = target(block, alone, record=True)
    target.crop_each(alone, [1, 4, 2], 4)
    _, want_rider = target(chunk, solo_cache, last_only=True)
    assert close(logits, want_logits) and close(taps, want_taps) and close(rider.hidden, want_rider)
    nxt = mx.array([[50]] * 3)
    assert close(target(nxt, batch)[0], target(nxt, alone)[0])
    assert close(target(nxt[:1], rider_cache)[0], target(nxt[:1], solo_cache)[0])


@pytest.mark.parametrize("family", ["gpt_oss"])
def test_sliding_window_targets_carry_riders(more, family):
    """Sliding-window layers (window 8): a chunk longer than the window rides in a batch's pass
    (ragged windows) and in a sequence's own (its ring of slack rows, the pass recorded to be
    cropped): each pass returns what it returns alone, the chunk's taps are its own pass's, and
    its caches go on as after its own pass."""
    from dflash_mlx.target.caches import WindowCache

    target = more(family)[0].target
    solo_cache = own(target, JOINER[:3])
    rider_cache = own(target, JOINER[:3])
    assert target.can_carry(rider_cache) and any(isinstance(c, WindowCache) for c in rider_cache)
    caches = [own(target, p) for p in PROMPTS]
    batch = [RaggedKVCache.merge([c[i] for c in caches]) for i in range(len(caches[0]))]
    alone = [RaggedKVCache.merge([c[i] for c in [own(target, p) for p in PROMPTS]]) for i in range(len(caches[0]))]
    lone, lone_ref = own(target, PROMPTS[2]), own(target, PROMPTS[2])
    block = mx.array([[p[-1]] * 4 for p in PROMPTS])
    for (start, end), (cache, ref, rows) in zip(((3, 14), (14, len(JOINER))), ((batch, alone, block),
                                                                              (lone, lone_ref, block[2:]))):
        chunk = mx.array([JOINER[start:end]])
        assert rides_as_apart(target, rows, cache, ref, chunk, rider_cache, solo_cache, record=True)
    nxt = mx.array([[50]])
    assert close(target(nxt, rider_cache)[0], target(nxt, solo_cache)[0])
    target.crop(lone, 1, 4)  # the lone pass's rows but its first dropped, as a cycle rejecting them does
    target.crop(lone_ref, 1, 4)
    assert close(target(nxt, lone)[0], target(nxt, lone_ref)[0])


TEXTS = ["def add(a, b):\n    return a + b\n", "The quick brown fox jumps over the lazy dog.",
         "for i in range(10):\n    print(i * i)\n"]


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen3_5"])
@pytest.mark.parametrize("decoding, width", [(1, None), (2, 1), (2, 4)])
def test_a_joining_prompt_rides_in_the_cycles_of_those_decoding(pairs, baselines, monkeypatch, family, decoding,
                                                                width):
    """Each chunk of a long prompt joining rides in the pass of the cycle of those decoding (one
    alone, as its policy plans; two, at plain steps and drafted cycles): while it joins, a step is
    one target pass (and its last token's), the others commit every step, and every output is
    plain greedy decoding."""
    from conftest import plain_greedy

    from dflash_mlx.decode.decoder import Decoder
    from dflash_mlx.policy import join

    for name in ("FIRST_CHUNK", "MIN_CHUNK", "MAX_CHUNK"):
        monkeypatch.setattr(join, name, 16)
    pair, base = pairs[family], baselines[family]
    eos = tuple(pair.tokenizer.eos_token_ids)
    prompts = [pair.tokenizer.encode(t) for t in TEXTS[:decoding]]
    long = pair.tokenizer.encode(" ".join(TEXTS) * 3)
    dec = Decoder(pair, 4, block_size=4)
    out = {c.uid: list(c.tokens) for c in dec.add_many(prompts, [40] * decoding)}
    for _ in range(2):  # alone, the next cycle is launched ahead: the join settles it (`early`)
        for c in dec.step(width):
            out[c.uid] += c.tokens
    counted = Counted(pair.target)
    dec.target = counted
    joining = dec.add(long, 12, chunked=True)
    assert joining.filling
    steps = 0
    while joining.uid not in out:
        before, early = counted.passes, bool(dec.early)
        firsts = dec.fill()
        committed = dec.step(width)
        # Each chunk rode but one, where the step ran no cycle (it handed back the early one's
        # tokens): it ran in a pass of its own. The last rode in the step before the first token.
        assert bool(dec.filling.rode) != early or firsts
        ahead = dec._ahead is not None  # once no prompt joins, the next step is launched ahead again
        assert counted.passes - before == 1 + len(firsts) + ahead and (firsts or not ahead)
        assert {c.uid for c in committed} >= {u for u in out if len(out[u]) < 40}
        for c in firsts + committed:
            out.setdefault(c.uid, []).extend(c.tokens)
        steps += 1
    assert steps >= (len(long) - 1) // 16
    while len(dec):
        for c in dec.fill() + dec.step(width):
            out[c.uid] += c.tokens
    assert [out[u] for u in range(decoding)] == [plain_greedy(base, p, 40, eos=eos) for p in prompts]
    assert out[joining.uid] == plain_greedy(base, long, 12, eos=eos)


@pytest.mark.parametrize("decoding", [1, 2])
def test_a_prompt_joining_a_sliding_window_target_rides_and_stays_lossless(more, monkeypatch, decoding):
    """gpt-oss (window 8): a long prompt joining one sequence alone or two in a batch rides in their
    cycles' passes, chunk after chunk, and every output is plain greedy decoding."""
    from conftest import plain_greedy

    from dflash_mlx.decode.decoder import Decoder
    from dflash_mlx.policy import join

    for name in ("FIRST_CHUNK", "MIN_CHUNK", "MAX_CHUNK"):
        monkeypatch.setattr(join, name, 16)
    pair, base = more("gpt_oss")
    eos = tuple(pair.tokenizer.eos_token_ids)
    prompts = [pair.tokenizer.encode(t) for t in TEXTS[:decoding]]
    long = pair.tokenizer.encode(" ".join(TEXTS) * 3)
    dec = Decoder(pair, 4, block_size=4)
    out = {c.uid: list(c.tokens) for c in dec.add_many(prompts, [40] * decoding)}
    joining = dec.add(long, 12, chunked=True)
    assert joining.filling
    rode = 0
    while len(dec):
        for c in dec.fill() + dec.step(None if decoding == 1 else 4):
            out.setdefault(c.uid, []).extend(c.tokens)
        rode += dec.filling.rode > 0
    assert rode >= (len(long) - 1) // 16 - 1
    assert [out[u] for u in range(decoding)] == [plain_greedy(base, p, 40, eos=eos) for p in prompts]
    assert out[joining.uid] == plain_greedy(base, long, 12, eos=eos)


def test_a_prompt_that_leaves_while_its_chunk_waits_to_ride_costs_nothing(pairs, baselines):
    """A joining request cancelled between `fill` and `step` has its chunk left out of the cycle."""
    from conftest import plain_greedy

    from dflash_mlx.decode.decoder import Decoder

    pair, base = pairs["qwen3"], baselines["qwen3"]
    prompt = pair.tokenizer.encode(TEXTS[0])
    dec = Decoder(pair, 4)
    first = dec.add(prompt, 20)
    out = list(first.tokens)
    joining = dec.add(pair.tokenizer.encode(" ".join(TEXTS) * 3), 12, chunked=True)
    assert joining.filling
    dec.fill()
    dec.remove(joining.uid)
    for c in dec.step():
        out += c.tokens
    assert not dec.filling.rode and len(dec) == 1
    while len(dec):
        for c in dec.fill() + dec.step():
            out += c.tokens
    assert out == plain_greedy(base, prompt, 20, eos=tuple(pair.tokenizer.eos_token_ids))


def test_a_chunk_rides_in_a_tree_s_pass(pairs, baselines, monkeypatch):
    """Beside a sequence alone whose policy plans trees, each chunk of a prompt joining rides in
    the tree's pass (the tree's mask and RoPE runs for its nodes, the chunk's own for its rows):
    one target pass a step, and every output is plain greedy decoding."""
    from conftest import ScriptedWidths, plain_greedy

    from dflash_mlx.decode.decoder import Decoder
    from dflash_mlx.decode.running import Asks
    from dflash_mlx.policy import join
    from dflash_mlx.policy.plan import Plan

    for name in ("FIRST_CHUNK", "MIN_CHUNK", "MAX_CHUNK"):
        monkeypatch.setattr(join, name, 16)
    pair, base = pairs["qwen3"], baselines["qwen3"]
    eos = tuple(pair.tokenizer.eos_token_ids)
    prompt, long = pair.tokenizer.encode(TEXTS[0]), pair.tokenizer.encode(" ".join(TEXTS) * 3)
    dec = Decoder(pair, 4, block_size=4)
    first = dec.add(prompt, 60, asks=Asks(block_size=ScriptedWidths([Plan(4, 0, 2)]), tree=2))
    out = {first.uid: list(first.tokens)}
    counted = Counted(pair.target)
    dec.target = counted
    joining = dec.add(long, 12, chunked=True)
    trees = 0
    while joining.uid not in out:
        before = counted.passes
        firsts = dec.fill()
        committed = dec.step()
        if committed and not firsts:
            assert dec.filling.rode and counted.passes - before == 1
        trees += sum(c.plan.branches > 0 and dec.filling.rode > 0 for c in committed)
        for c in firsts + committed:
            out.setdefault(c.uid, []).extend(c.tokens)
    assert trees > 2
    while len(dec):
        for c in dec.fill() + dec.step():
            out[c.uid] += c.tokens
    assert out == {first.uid: plain_greedy(base, prompt, 60, eos=eos), joining.uid: plain_greedy(base, long, 12, eos=eos)}


def test_a_tree_pass_carrying_a_chunk_equals_both_apart(pairs):
    """A tree pass (a branch off its second node) that carries a chunk returns the tree's logits and
    taps, and the chunk's taps and caches, as the two passes apart do."""
    target = pairs["llama"].target
    tree = (mx.array([[[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 0, 0, 1]]],
                     dtype=mx.bool_), [(0, 4, 0), (4, 5, 2)])
    nodes, chunk = mx.array([[5, 9, 14, 3, 40]]), mx.array([JOINER[3:12]])
    cache, alone = own(target, PROMPTS[0]), own(target, PROMPTS[0])
    rider_cache, solo_cache = own(target, JOINER[:3]), own(target, JOINER[:3])
    assert rides_as_apart(target, nodes, cache, alone, chunk, rider_cache, solo_cache, tree=tree)
    nxt = mx.array([[50]])
    assert close(target(nxt, rider_cache)[0], target(nxt, solo_cache)[0])


def test_while_a_prompt_joins_the_batch_runs_cycles_that_leave_its_chunks_their_share(pairs, baselines,
                                                                                       monkeypatch):
    """The planner caps the batch policy's width while a prompt joins, and for the joiner's first cycle
    beside the others, to the widest whose cycles fit (`JoinChunks.fits`), and lets the policy
    choose again once it has joined."""
    from conftest import plain_greedy

    from dflash_mlx.decode.streams import Joining, Streams
    from dflash_mlx.policy import join
    from dflash_mlx.policy.batch import FixedBatchWidth
    from dflash_mlx.policy.join import JOIN_CYCLES, JOIN_TTFT

    for name in ("FIRST_CHUNK", "MIN_CHUNK", "MAX_CHUNK"):
        monkeypatch.setattr(join, name, 16)

    class Eight(FixedBatchWidth):
        widths = (1, 2, 4, 8)

    pair, base = pairs["qwen3"], baselines["qwen3"]
    streams = Streams(pair, 8, Eight(8))
    prompts = [pair.tokenizer.encode(t) for t in TEXTS[:2]]
    out = {uid: list(e.tokens) for uid, e in streams.add_many([Joining(p, 40) for p in prompts])}
    joins, dec = streams.decoder.joins, streams.decoder
    widths, batch = [], dec.planner.batch
    dec.planner.batch = lambda *a, **k: (lambda p: widths.append((p.width, bool(dec.filling))) or p)(batch(*a, **k))
    for uid, e in streams.step() + streams.step():
        out[uid] += e.tokens
    cap = (1 + JOIN_CYCLES) * (1 - 1 / JOIN_TTFT)
    joins.cycles.clear()
    for seconds, width in [(0.1, 8)] * 5 + [(0.1 * cap * 1.1, 4), (0.1 * cap * 0.9, 2)]:
        joins.cycle(seconds, (2, width))
    long = pair.tokenizer.encode(" ".join(TEXTS) * 3)
    [(uid, first)] = streams.add_many([Joining(long, 8)])
    assert first is None
    while len(streams):
        for u, e in streams.step():
            out.setdefault(u, []).extend(e.tokens)
    # The width is chosen a cycle ahead: from the second cycle of the join on, at most 2.
    during = [w for w, filling in widths[2:] if filling]
    assert len(during) > 3 and max(during[1:]) == 2 and widths[-1][0] == 8
    # The joiner's first cycle beside the others is capped too: three sequences were never timed, so plain.
    last = max(i for i, (_, filling) in enumerate(widths) if filling)
    assert widths[last + 1] == (1, False)
    eos = tuple(pair.tokenizer.eos_token_ids)
    assert [out[u] for u in (0, 1)] == [plain_greedy(base, p, 40, eos=eos) for p in prompts]
    assert out[uid] == plain_greedy(base, long, 8, eos=eos)
