"""A batch that holds each sequence's K/V apart (`target/sequences.py`): each sequence attends over
its own caches, the projections run once for all, and joining, leaving and cropping copy nothing."""

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.cache import KVCache

from dflash_mlx.target.adapter import GroupedAttention, _Taps
from dflash_mlx.target.sequences import SequenceKV

# Very different lengths: a long prompt beside short ones.
LENGTHS = [300, 3, 41]


def prompt(n, seed):
    return [(seed * 7 + 3 * i) % 200 + 1 for i in range(n)]


def own_caches(target, tokens):
    cache = target.make_cache()
    target(mx.array([tokens]), cache)
    return cache


def close(a, b):
    return mx.allclose(a, b, atol=1e-4, rtol=1e-4).item()


@pytest.fixture
def apart(monkeypatch):
    """Parts that cost nothing: every sequence of a different length is held apart."""
    from dflash_mlx.decode import caches

    monkeypatch.setattr(caches, "PART_ROWS", 0)


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen3_5"])
def test_a_batch_of_very_different_lengths_equals_each_sequence_alone(pairs, apart, family):
    """Each sequence's logits and taps in a batched pass are its own pass's, whatever the others'
    lengths, after crops of different depths, after one leaves and another joins; and a sequence
    handed back is the very cache it brought (nothing copied)."""
    target = pairs[family].target
    assert target.splits
    prompts = [prompt(n, s) for s, n in enumerate(LENGTHS)]
    alone = [own_caches(target, p) for p in prompts]
    brought = [own_caches(target, p) for p in prompts]
    from dflash_mlx.decode.caches import Caches

    caches = Caches(split=True)
    for c in brought:
        caches.add(c)
    kv = [c for c in caches.layers if isinstance(c, SequenceKV)]
    assert kv and all(c.parts[c.where(b)[0]] is brought[b][i] for i, c in enumerate(caches.layers)
                      if isinstance(c, SequenceKV) for b in range(3))

    def both(blocks, keeps=None):
        """A batched pass and each sequence's own; with `keeps`, each then keeps that many rows."""
        record = keeps is not None
        logits, hidden = target(mx.array(blocks), caches.layers, record=record)
        mx.eval(logits, hidden)
        if record:
            target.crop_each(caches.layers, keeps, len(blocks[0]))
        for b, block in enumerate(blocks):
            own, own_hidden = target(mx.array([block]), alone[b], record=record)
            assert close(logits[b], own[0]) and close(hidden[b], own_hidden[0]), (family, b)
            if record:
                target.crop(alone[b], keeps[b], len(block))

    keeps = [3, 1, 2]
    both([[1, 2, 3], [4, 5, 6], [7, 8, 9]], keeps)
    assert kv[0].ends == [n + k for n, k in zip(LENGTHS, keeps)]
    both([[10, 11], [12, 13], [14, 15]])
    both([[16], [17], [18]])  # plain steps
    both([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]], [0, 4, 2])

    caches.keep_only([0, 2], 3)  # the second leaves; a new one joins
    alone = [alone[0], alone[2]]
    joining = prompt(17, 9)
    alone.append(own_caches(target, joining))
    caches.add(own_caches(target, joining))
    both([[20, 21, 22, 23], [24, 25, 26, 27], [28, 29, 30, 31]])
    for b in range(3):
        assert all(caches.of(b)[i].offset == alone[b][i].offset for i, c in enumerate(caches.layers)
                   if isinstance(c, SequenceKV))


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_joins_and_leaves_in_every_order_copy_no_other_sequence_s_rows(pairs, apart, family):
    """A sequence that joins or leaves leaves every other sequence's K/V buffers as they were (the
    same arrays), and the batch holds exactly the bytes its sequences hold."""
    from itertools import permutations

    from dflash_mlx.decode.caches import Caches

    target = pairs[family].target
    for order in permutations(range(3)):
        seqs = [own_caches(target, prompt(n, s)) for s, n in enumerate(LENGTHS)]
        caches = Caches(split=True)
        for i in order:
            before = [(p.keys, p.values) for c in caches.layers if isinstance(c, SequenceKV)
                      for p in c.parts] if caches.batched else []
            caches.add(seqs[i])
            after = [(p.keys, p.values) for c in caches.layers if isinstance(c, SequenceKV) for p in c.parts[:-1]]
            assert all(k0 is k1 and v0 is v1 for (k0, v0), (k1, v1) in zip(before, after))
        kv = [i for i, c in enumerate(caches.layers) if isinstance(c, SequenceKV)]
        assert sum(caches.layers[i].nbytes for i in kv) == sum(seqs[s][i].nbytes for s in range(3) for i in kv)
        kept = [caches.layers[i].parts[caches.layers[i].where(2)[0]] for i in kv]
        caches.keep_only([2], 3)
        assert not caches.batched and all(caches.layers[i] is k for i, k in zip(kv, kept))


def test_a_batch_holds_what_its_sequences_hold_in_bytes(pairs):
    """The bytes of a layer's keys and values: each sequence's own buffer, grown in steps as mlx-lm's
    KVCache grows it, where a padded batch holds every sequence at the longest's length."""
    from dflash_mlx.target.ragged import RaggedKVCache

    target = pairs["qwen3"].target
    lengths = [1000, 3, 41]
    seqs = [own_caches(target, prompt(n, s)) for s, n in enumerate(lengths)]
    k = seqs[0][0].keys
    _, H, _, D = k.shape
    columns = [-(-n // KVCache.step) * KVCache.step for n in lengths]
    assert SequenceKV([s[0] for s in seqs]).nbytes == sum(2 * H * c * D * k.dtype.size for c in columns)
    padded = RaggedKVCache.merge([s[0] for s in seqs])
    assert padded.nbytes == 2 * len(lengths) * H * max(columns) * D * k.dtype.size


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_each_input_projection_runs_once_for_the_whole_batch(pairs, apart, family):
    """In a pass over B sequences held apart, every attention's q, k, v and output projections are
    each called once on all B sequences' rows, not once per sequence."""
    from dflash_mlx.decode.caches import Caches

    target = pairs[family].target
    caches = Caches(split=True)
    for s, n in enumerate(LENGTHS):
        caches.add(own_caches(target, prompt(n, s)))
    target(mx.array([[1], [2], [3]]), caches.layers)  # the first grouped call also checks the layout once
    attn = next(m for _, m in target.model.named_modules() if isinstance(m, GroupedAttention))
    calls = {}

    class Counting(nn.Module):
        def __init__(self, name, inner):
            super().__init__()
            self.name, self.inner = name, inner

        def __call__(self, x):
            calls[self.name] = calls.get(self.name, []) + [x.shape]
            return self.inner(x)

    wrappers = [attn.inner[name] for name in ("q_proj", "k_proj", "v_proj", "o_proj")]
    for name, wrapper in zip(("q_proj", "k_proj", "v_proj", "o_proj"), wrappers):
        wrapper.inner = Counting(name, wrapper.inner)
    try:
        target(mx.array([[1, 2], [3, 4], [5, 6]]), caches.layers)
    finally:  # the pair is the session's: its model goes back as it was
        for wrapper in wrappers:
            wrapper.inner = wrapper.inner.inner
    assert {n: len(v) for n, v in calls.items()} == {"q_proj": 1, "k_proj": 1, "v_proj": 1, "o_proj": 1}
    assert all(shape[:2] == (1, 6) for v in calls.values() for shape in v)


class Attention(nn.Module):
    """An attention that returns its output projection's output, or (`after`) works on it further:
    the grouped call must not defer the projection past such work."""

    def __init__(self, after: bool, dims=16, heads=2):
        super().__init__()
        self.after, self.heads = after, heads
        self.q_proj, self.k_proj = nn.Linear(dims, dims, bias=False), nn.Linear(dims, dims, bias=False)
        self.v_proj, self.o_proj = nn.Linear(dims, dims, bias=False), nn.Linear(dims, dims, bias=False)
        self.rope = nn.RoPE(dims // heads)

    def __call__(self, x, mask=None, cache=None):
        B, L, D = x.shape
        q, k, v = (p(x).reshape(B, L, self.heads, -1).transpose(0, 2, 1, 3)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = self.rope(q, offset=cache.offset), self.rope(k, offset=cache.offset)
        k, v = cache.update_and_fetch(k, v)
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=1.0, mask=mask)
        out = self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, D))
        return mx.tanh(out) if self.after else out


@pytest.mark.parametrize("after", [False, True])
def test_the_output_projection_runs_once_only_where_the_attention_ends_with_it(after):
    """A grouped call over sequences held apart equals each sequence's own call, whether the
    attention returns its output projection's output (projected once after every part) or works on
    it further (projected per part)."""
    mx.random.seed(0)
    module = Attention(after)
    mx.eval(module.parameters())
    lengths = [5, 1, 12]
    own, held = [], []
    for n in lengths:
        x = mx.random.normal((1, n, 16))
        for caches in (own, held):
            c = KVCache()
            module(x, "causal", c)
            caches.append(c)
    grouped = GroupedAttention(module, _Taps())
    x = mx.random.normal((3, 2, 16))
    batch = SequenceKV(held)
    out = grouped(x, batch.make_mask(2, return_array=False, window_size=None), batch)
    for b in range(3):
        assert close(out[b], grouped.inner(x[b : b + 1], own[b].make_mask(2, return_array=False, window_size=None), own[b])[0])
    assert grouped._defer is (not after)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5", "gpt_oss", "gemma4_text"])
@pytest.mark.parametrize("width", [1, 4])
def test_a_long_prompt_beside_short_ones_decodes_each_as_alone(pairs, baselines, more, monkeypatch, family, width):
    """A 300-token prompt and short ones decoded in one batch, the short ones joining while it decodes:
    each sequence's tokens are mlx-lm's greedy tokens for it alone. Targets whose attention runs per
    part hold the long one apart and the short ones in one padded group (full attention, Gated
    DeltaNet hybrids, sliding windows); Gemma 4, whose layers share caches, keeps one padded batch."""
    from conftest import plain_greedy

    from dflash_mlx.decode import caches
    from dflash_mlx.decode.decoder import Decoder
    from dflash_mlx.target.ragged import RaggedKVCache

    monkeypatch.setattr(caches, "PART_ROWS", 16)  # 300 tokens count as long beside a few
    monkeypatch.setattr(caches, "REGROUP_ROWS", 0)
    pair, base = (pairs[family], baselines[family]) if family in pairs else more(family)
    eos = tuple(pair.tokenizer.eos_token_ids)
    long = prompt(300, 1)
    short = [pair.tokenizer.encode(t) for t in ("def add(a, b):", "Once upon a time", "x")]
    dec = Decoder(pair, width, block_size=4)
    out = {c.uid: list(c.tokens) for c in dec.add_many([long], [20])}
    for _ in range(2):
        for c in dec.step():
            out[c.uid] += c.tokens
    out.update({c.uid: list(c.tokens) for c in dec.add_many(short, [16, 8, 12])})
    layers = [c for c in dec.caches.layers if not hasattr(c, "cache")]  # the K/V layers
    assert all(isinstance(c, SequenceKV if pair.target.splits else RaggedKVCache) for c in layers)
    assert pair.target.splits is (family != "gemma4_text")
    if pair.target.splits:
        assert dec.caches.groups() == [[0], [1, 2, 3]]
    while len(dec):
        for c in dec.step():
            out[c.uid] += c.tokens
    want = [plain_greedy(base, p, n, eos=eos) for p, n in zip([long] + short, [20, 16, 8, 12])]
    assert [out[u] for u in sorted(out)] == want


@pytest.mark.parametrize("family", ["qwen3", "gpt_oss"])
def test_prompts_of_different_lengths_prefill_in_one_pass_without_padding(pairs, more, family):
    """`TargetAdapter.apart`: blocks of different lengths, each over its own caches (one of them
    holding a prefix already), in one pass: each block's last logits and its taps are its own
    pass's, and each cache holds exactly its own rows (sliding windows of 8 included)."""
    pair = pairs[family] if family in pairs else more(family)[0]
    target = pair.target
    blocks = [prompt(13, 1), prompt(3, 2), prompt(1, 3)]
    prefix = prompt(5, 4)
    mine = [target.make_cache(), own_caches(target, prefix), target.make_cache()]
    alone = [target.make_cache(), own_caches(target, prefix), target.make_cache()]
    logits, taps = target.apart([mx.array(b) for b in blocks], mine)
    for b, block in enumerate(blocks):
        own, own_taps = target(mx.array([block]), alone[b])
        assert close(logits[b, 0], own[0, -1]) and close(taps[b], own_taps), b
        assert mine[b][0].offset == alone[b][0].offset == len(block) + (len(prefix) if b == 1 else 0)
    nxt = mx.array([[7]])
    assert all(close(target(nxt, mine[b])[0], target(nxt, alone[b])[0]) for b in range(3))


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen3_5"])
@pytest.mark.parametrize("width", [1, 3, 8])
@pytest.mark.parametrize("part_rows", [0, 8])
def test_a_batch_in_parts_whatever_its_lengths_equals_each_prompt_alone(pairs, baselines, monkeypatch, family,
                                                                      width, part_rows):
    """With parts that cost nothing (each sequence apart, but for equal lengths) or little (groups
    of similar lengths, not next to each other in the batch), regrouped at every change, prompts
    joining at different cycles and leaving at different times decode exactly mlx-lm's greedy
    tokens."""
    from conftest import plain_greedy
    from test_batch import TEXTS, generate_batch

    from dflash_mlx.decode import caches

    monkeypatch.setattr(caches, "PART_ROWS", part_rows)
    monkeypatch.setattr(caches, "REGROUP_ROWS", 0)
    seen = []
    regroup = caches.Caches._regroup

    def spy(self, *fresh):
        regroup(self, *fresh)
        seen.append(self.groups())

    monkeypatch.setattr(caches.Caches, "_regroup", spy)
    pair = pairs[family]
    prompts = [pair.tokenizer.encode(t) for t in TEXTS]
    got = generate_batch(pair, prompts, max_tokens=24, width=width, join_at={2: 1, 3: 3, 4: 3})
    eos = tuple(pair.tokenizer.eos_token_ids)
    assert [plain_greedy(baselines[family], p, 24, eos=eos) for p in prompts] == got
    assert any(len(g) >= 2 for g in seen), seen  # the batch was held in several parts
    if part_rows:  # a group whose sequences are not next to each other in the batch
        assert any(len(p) > 1 and p != list(range(p[0], p[0] + len(p))) for g in seen for p in g), seen


def test_a_group_joining_takes_in_the_sequences_held_apart_that_would_share_its_part(pairs, monkeypatch):
    """A padded group made for a join (prompts prefilled together) and a sequence held apart of a
    similar length become one group, one padded array: no step pays a part more for it. Beside a
    sequence of a very different length the group is kept as it was made (nothing copied)."""
    from dflash_mlx.decode import caches as layout
    from dflash_mlx.decode.caches import Caches
    from dflash_mlx.target.ragged import RaggedKVCache, add_to, batch_of

    monkeypatch.setattr(layout, "PART_ROWS", 64)
    target = pairs["qwen3"].target

    def group(lengths, seed):
        own = [own_caches(target, prompt(n, seed + s)) for s, n in enumerate(lengths)]
        out = [batch_of(c, False) for c in own[0]]
        for i, g in enumerate(out):
            add_to(g, *(c[i] for c in own[1:]))
        return out

    for first, want in ((40, [[0, 1, 2, 3]]), (300, [[0], [1, 2, 3]])):
        caches = Caches(split=True)
        caches.add(own_caches(target, prompt(first, 1)))
        joining = group([41, 42, 43], 5)
        caches.join(joining)
        assert caches.groups() == want
        kv = [c for c in caches.layers if not hasattr(c, "cache")]
        if len(want) == 1:
            assert all(isinstance(c, RaggedKVCache) for c in kv)
        else:
            assert all(c.parts[1] is j for c, j in zip(kv, joining))
        assert caches.lengths() == [first, 41, 42, 43]


@pytest.mark.parametrize("family", ["qwen3", "gpt_oss"])
def test_cached_prompts_that_would_share_a_part_join_in_one_padded_pass(pairs, baselines, more, monkeypatch, family):
    """Prompts joining from the prompt cache with a few tokens each left to prefill: where their
    lengths would share one part of the batch, the rests run as one padded pass (one attention
    call per layer); where one is much longer, or the padding would outweigh the rests, each runs
    over its own caches (`TargetAdapter.apart`). Either way each decodes mlx-lm's greedy tokens."""
    from conftest import decode_turn, plain_greedy

    import dflash_mlx
    from dflash_mlx.decode import caches

    monkeypatch.setattr(caches, "PART_ROWS", 64)
    pair, base = (pairs[family], baselines[family]) if family in pairs else more(family)
    eos = tuple(pair.tokenizer.eos_token_ids)
    apart = []
    run_apart = type(pair.target).apart
    monkeypatch.setattr(type(pair.target), "apart", lambda self, *a, **k: apart.append(len(a[0])) or run_apart(self, *a, **k))
    cache = dflash_mlx.PromptCache(pair)

    def turn(prompts, n=6):
        return decode_turn(pair, prompts, n, cache)

    firsts = [prompt(40 + s, s) for s in range(4)] + [prompt(200, 9)]
    answers = [turn([p]) for p in firsts]  # each in the cache alone
    nexts = [p + a[0] + prompt(2 + b % 3, 20 + b) for b, (p, a) in enumerate(zip(firsts, answers))]
    hits = cache.hits
    alike = nexts[:4]
    assert turn(alike) == [plain_greedy(base, p, 6, eos=eos) for p in alike]
    assert cache.hits == hits + 4 and apart == []  # one padded pass
    mixed = nexts[2:]
    assert turn(mixed) == [plain_greedy(base, p, 6, eos=eos) for p in mixed]
    assert apart == [3]  # the 200-token prompt would be a part of its own: each over its own caches


@pytest.mark.parametrize("family", ["qwen3", "gpt_oss"])
def test_the_layout_follows_the_lengths_and_changes_copy_each_sequence_once(pairs, baselines, more, family):
    """Similar lengths share one padded array; a long prompt joining makes the batch hold each
    sequence apart, and its leaving makes it padded again; every sequence decodes mlx-lm's greedy
    tokens through both changes."""
    from conftest import plain_greedy

    from dflash_mlx.decode.caches import waste
    from dflash_mlx.decode.decoder import Decoder
    from dflash_mlx.target.ragged import RaggedKVCache

    pair, base = (pairs[family], baselines[family]) if family in pairs else more(family)
    eos = tuple(pair.tokenizer.eos_token_ids)
    short = [pair.tokenizer.encode(t) for t in ("def add(a, b):", "Once upon a time", "import os")]
    dec = Decoder(pair, 4, block_size=4)
    out = {c.uid: list(c.tokens) for c in dec.add_many(short, [40, 40, 40])}

    def layout():
        return {type(c) for c in dec.caches.layers if not hasattr(c, "cache")}

    def steps(n):
        for _ in range(n):
            for c in dec.step():
                out[c.uid] += c.tokens

    steps(2)
    assert layout() == {RaggedKVCache} and waste(dec.caches.lengths()) < 1.5
    out.update({c.uid: list(c.tokens) for c in dec.add_many([prompt(300, 5)], [6])})
    assert layout() == {SequenceKV}
    while 3 in {s.uid for s in dec.seqs}:
        steps(1)
    assert layout() == {RaggedKVCache}  # the long one has left
    while len(dec):
        steps(1)
    want = [plain_greedy(base, p, n, eos=eos) for p, n in zip(short + [prompt(300, 5)], [40, 40, 40, 6])]
    assert [out[u] for u in sorted(out)] == want


def test_the_best_layout_holds_a_long_prompt_apart_and_similar_lengths_together():
    """`best_groups` is the layout of least cost over every way to split the batch (checked against
    all partitions of small batches); a 16k-token prompt beside 512-token ones is held apart."""
    import random

    from dflash_mlx.decode.caches import PART_ROWS, best_groups, cost

    assert best_groups([16384] + [512] * 7) == [[0], list(range(1, 8))]
    assert best_groups([300, 500, 700]) == [[0, 1, 2]]
    assert best_groups([512, 16384, 530, 16000]) == [[0, 2], [1, 3]]

    def partitions(items):
        if not items:
            yield []
            return
        first, rest = items[0], items[1:]
        for p in partitions(rest):
            yield [[first]] + p
            for i in range(len(p)):
                yield p[:i] + [[first] + p[i]] + p[i + 1 :]

    rng = random.Random(0)
    for _ in range(40):
        lengths = [rng.choice([rng.randint(1, 3 * PART_ROWS), rng.randint(1, 200)]) for _ in range(rng.randint(1, 6))]
        least = min(cost(p, lengths) for p in partitions(list(range(len(lengths)))))
        assert cost(best_groups(lengths), lengths) == least, lengths


def test_sequences_that_join_a_group_copy_none_of_its_rows(pairs, monkeypatch):
    """A batch holding a group: a long prompt and then short ones join as parts of their own, the
    short ones grouped among themselves (each copying its own rows once); the group's arrays are
    never copied, until the layout costs `REGROUP_ROWS` more than the best, which regroups once."""
    from dflash_mlx.decode import caches as layout
    from dflash_mlx.decode.caches import Caches

    monkeypatch.setattr(layout, "PART_ROWS", 16)
    monkeypatch.setattr(layout, "REGROUP_ROWS", 64)
    target = pairs["qwen3"].target
    caches = Caches(split=True)
    caches.add(*(own_caches(target, prompt(n, s)) for s, n in enumerate([40, 41, 42])))
    assert caches.groups() == [[0, 1, 2]]
    group = [c.keys for c in caches.layers if hasattr(c, "ends")]  # one padded array per K/V layer

    def group_kept():
        held = [c.parts[0].keys for c in caches.layers if isinstance(c, SequenceKV)]
        return len(held) == len(group) and all(a is b for a, b in zip(held, group))

    caches.add(own_caches(target, prompt(300, 3)))
    assert caches.groups() == [[0, 1, 2], [3]] and group_kept()
    caches.add(own_caches(target, prompt(43, 4)))
    assert caches.groups() == [[0, 1, 2], [3], [4]] and group_kept()
    caches.add(own_caches(target, prompt(44, 5)))
    assert caches.groups() == [[0, 1, 2], [3], [4, 5]] and group_kept()  # the two joiners grouped
    lengths = [40, 41, 42, 300, 43, 44]
    while len(caches.groups()) > 2:  # more parts with each joiner, until one regroup
        assert group_kept() and len(lengths) < 12
        caches.add(own_caches(target, prompt(44, len(lengths))))
        lengths.append(44)
    B = len(lengths)
    assert caches.groups() == [[b for b in range(B) if b != 3], [3]]  # one group of similar lengths
    mine = [own_caches(target, prompt(n, s)) for s, n in enumerate(lengths)]
    logits, _ = target(mx.array([[5]] * B), caches.layers)
    for b, own in enumerate(mine):
        assert close(logits[b], target(mx.array([[5]]), own)[0][0]), b


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen3_5", "gpt_oss"])
@pytest.mark.parametrize("width", [3, 8])
def test_sequences_that_verify_fewer_rows_than_the_batch_decode_each_as_alone(pairs, baselines, more, monkeypatch,
                                                                             family, width):
    """A sequence held apart may verify fewer rows than the batch's width (`planner.narrow`, here
    whenever its length is even): its other rows neither attend nor stay cached, a recurrent
    state is rolled back over them, and every sequence still decodes exactly mlx-lm's greedy
    tokens, joining and leaving at different cycles."""
    from conftest import plain_greedy
    from test_batch import TEXTS, generate_batch

    from dflash_mlx.decode import caches, cycle
    from dflash_mlx.policy import planner

    monkeypatch.setattr(caches, "PART_ROWS", 0)  # every sequence apart
    monkeypatch.setattr(planner, "narrow",
                        lambda s, w, share=0.0: 1 + (len(s.history) % 3 == 1) if len(s.history) % 2 else w)
    narrowed = []
    init = cycle.LinearCycle.__init__

    def spy(self, rows, block):
        narrowed.append(block.widths)
        init(self, rows, block)

    monkeypatch.setattr(cycle.LinearCycle, "__init__", spy)
    pair, base = (pairs[family], baselines[family]) if family in pairs else more(family)
    prompts = [pair.tokenizer.encode(t) for t in TEXTS]
    got = generate_batch(pair, prompts, max_tokens=24, width=width, join_at={2: 1, 3: 3, 4: 3})
    eos = tuple(pair.tokenizer.eos_token_ids)
    assert [plain_greedy(base, p, 24, eos=eos) for p in prompts] == got
    assert sum(w is not None and min(w) < max(w) for w in narrowed) >= 3, narrowed


@pytest.mark.parametrize("family", ["qwen3", "gpt_oss"])
def test_a_narrow_pass_packs_its_rows_flat_and_each_sequence_gets_its_own_pass(pairs, more, monkeypatch, family):
    """Where a long sequence held apart verifies one row of a block the others verify whole, the
    pass runs only the rows that are verified, packed flat (no padding rows through the
    projections and MLPs): each sequence's verified rows' logits and taps are its own pass's,
    and its caches grow by those rows only."""
    from dflash_mlx.decode import caches as layout
    from dflash_mlx.decode.caches import Caches

    monkeypatch.setattr(layout, "PART_ROWS", 64)
    target = (pairs[family] if family in pairs else more(family)[0]).target
    lengths, L = [300, 40, 41, 42], 4
    prompts = [prompt(n, s) for s, n in enumerate(lengths)]
    caches = Caches(split=True)
    caches.add(*(own_caches(target, p) for p in prompts))
    assert sorted(caches.groups()) == [[0], [1, 2, 3]]  # the long one apart, the short ones one part
    alone = [own_caches(target, p) for p in prompts]
    rows = []
    flat = type(target)._flat
    monkeypatch.setattr(type(target), "_flat", lambda self, x, *a: rows.append(x.shape[1]) or flat(self, x, *a))
    blocks = mx.array([prompt(L, 10 + b) for b in range(len(lengths))])
    narrow = [1, L, L, L]
    logits, taps = target(blocks, caches.layers, record=True, narrow=narrow)
    assert rows == [1 + 3 * L]  # one flat pass over the verified rows only
    for b, w in enumerate(narrow):
        own_logits, own_taps = target(blocks[b : b + 1, :w], alone[b])
        assert close(logits[b, :w], own_logits[0]) and close(taps[b, :w], own_taps[0]), b
    assert caches.lengths() == [300 + 1, 40 + L, 41 + L, 42 + L]


@pytest.mark.parametrize("family", ["qwen3", "gpt_oss"])
def test_a_decoder_prices_a_column_of_kv_against_the_weights_once_the_batch_holds_kv(pairs, more, family):
    """`Planner.column_share` (what `narrow` charges a draft row per column where the cost curve timed one
    context) is set when sequences join, by either path: a token's K/V bytes over the full-attention layers
    (a sliding-window layer reads its window at any length), over the target's weight bytes."""
    from mlx.utils import tree_flatten

    from dflash_mlx.decode.decoder import Decoder

    pair = pairs[family] if family in pairs else more(family)[0]
    args = pair.target.model.args
    full = [t == "full_attention" for t in getattr(args, "layer_types", None) or ["full_attention"] * args.num_hidden_layers]
    assert (family == "gpt_oss") == (0 < sum(full) < len(full))
    head_dim = getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads
    kv = sum(full) * 2 * args.num_key_value_heads * head_dim * 4  # float32 keys and values
    weights = sum(v.nbytes for _, v in tree_flatten(pair.target.model.parameters()))
    for add in (lambda d: d.add(prompt(9, 1), 4), lambda d: d.add_many([prompt(9, 1), prompt(5, 2)], [4, 4])):
        dec = Decoder(pair, 4)
        assert dec.planner.column_share == 0.0
        add(dec)
        assert dec.planner.column_share == pytest.approx(kv / weights)
