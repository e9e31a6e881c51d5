"""Several sequences in one target pass: the ragged batch cache, and batched speculative decoding."""

import mlx.core as mx
import pytest
from conftest import Counted, decode_turn
from mlx_lm.models.cache import make_prompt_cache

from dflash_mlx.target.ragged import RaggedKVCache

PROMPTS = [[5, 9, 14, 3, 22, 7, 31], [8, 4], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 40, 41]]


def single(model, prompt):
    cache = make_prompt_cache(model)
    model(mx.array([prompt]), cache=cache)
    return cache


def batched(model, caches):
    return [RaggedKVCache.merge([c[layer] for c in caches]) for layer in range(len(caches[0]))]


def same(a, b):
    return mx.allclose(a, b, atol=1e-4, rtol=1e-4).item()


def generate_batch(pair, prompts, max_tokens, width, join_at=None):
    """Each prompt's greedy tokens, decoded in one batch (`join_at[i]`: the cycle at which prompt i
    joins, prefilled together with the others joining then; the rest join before the first)."""
    from dflash_mlx.decode.decoder import Decoder

    join_at = join_at or {}
    dec = Decoder(pair, width)
    out, uid_of, cycle = {}, {}, 0
    waiting = list(range(len(prompts)))
    while waiting or len(dec):
        now = [i for i in waiting if join_at.get(i, 0) <= cycle]
        waiting = [i for i in waiting if i not in now]
        for i, first in zip(now, dec.add_many([prompts[i] for i in now], [max_tokens] * len(now))):
            uid_of[first.uid] = i
            out[i] = list(first.tokens)
        for c in dec.step():
            out[uid_of[c.uid]] += c.tokens
        cycle += 1
    return [out[i] for i in range(len(prompts))]


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_a_ragged_batch_pass_equals_each_sequence_alone(baselines, family):
    """Each sequence's rows of a batched pass are its own pass's, whatever the other sequences'
    lengths, after crops of different depths, after one leaves and another joins."""
    model = baselines[family]
    alone = [single(model, p) for p in PROMPTS]
    batch = batched(model, [single(model, p) for p in PROMPTS])

    def both(blocks):
        out = model(mx.array(blocks), cache=batch)
        for b, block in enumerate(blocks):
            own = model(mx.array([block]), cache=alone[b])
            assert same(out[b], own[0]), (family, b)

    both([[1, 2, 3], [4, 5, 6], [7, 8, 9]])
    drops = [0, 2, 1]
    for c in batch:
        c.crop(drops)
    for b, d in enumerate(drops):
        for c in alone[b]:
            c.trim(d)
    assert batch[0].ends == [len(p) + 3 - d for p, d in zip(PROMPTS, drops)]
    both([[10, 11], [12, 13], [14, 15]])
    both([[16], [17], [18]])  # plain steps of ragged sequences

    for c in batch:  # the second sequence leaves; a new one joins
        c.filter([0, 2])
    alone = [alone[0], alone[2]]
    joining = [3, 1, 4, 1, 5, 9, 2, 6]
    alone.append(single(model, joining))
    for layer, c in enumerate(batch):
        c.extend([single(model, joining)[layer]])
    both([[20, 21, 22, 23], [24, 25, 26, 27], [28, 29, 30, 31]])
    for b in range(3):
        kept = batch[0].extract(b)
        assert kept.offset == alone[b][0].offset and same(kept.keys, alone[b][0].keys[..., : kept.offset, :])


@pytest.mark.parametrize("order", [(0, 1, 2), (1, 0, 2), (1, 2, 0)])
def test_sequences_with_and_without_rows_join_in_any_order(baselines, order):
    """A batch layer built from single-sequence caches, some still empty (a prompt nothing is
    cached for), in any order: each sequence holds exactly its own rows, and a pass over all
    of them equals each one's own pass."""
    from mlx_lm.models.cache import KVCache

    model = baselines["qwen3"]
    alone = [single(model, PROMPTS[0]), [KVCache() for _ in model.layers], single(model, PROMPTS[2])]
    copies = [single(model, PROMPTS[0]), [KVCache() for _ in model.layers], single(model, PROMPTS[2])]
    batch = [RaggedKVCache() for _ in model.layers]
    for i in order:
        for layer, c in enumerate(batch):
            c.extend([copies[i][layer]])
    assert batch[0].ends == [[len(PROMPTS[0]), 0, len(PROMPTS[2])][i] for i in order]
    blocks = [[1, 2], [3, 4], [5, 6]]
    out = model(mx.array([blocks[i] for i in order]), cache=batch)
    for b, i in enumerate(order):
        assert same(out[b], model(mx.array([blocks[i]]), cache=alone[i])[0]), (order, i)


TEXTS = ["def fibonacci(n):", "The quick brown fox", "import os\nimport sys\n\ndef main():",
         "class Stack:\n    def __init__(self):", "Once upon a time"]


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen3_5"])
@pytest.mark.parametrize("width", [1, 3, 8])
def test_batched_greedy_equals_each_prompt_alone(pairs, baselines, family, width):
    """Every sequence of the batch decodes exactly what mlx-lm's greedy decoding gives for it
    alone, whatever the others accept; two join while the rest decode, and sequences leave
    at different times (different budgets reached through EOS-free text)."""
    from conftest import plain_greedy

    pair = pairs[family]
    prompts = [pair.tokenizer.encode(t) for t in TEXTS]
    got = generate_batch(pair, prompts, max_tokens=24, width=width, join_at={2: 1, 3: 3, 4: 3})
    eos = tuple(pair.tokenizer.eos_token_ids)
    for p, out in zip(prompts, got):
        assert out == plain_greedy(baselines[family], p, 24, eos=eos)


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen3_5"])
@pytest.mark.parametrize("apart", [False, True])
@pytest.mark.parametrize("oracle", [False, True])
def test_a_sequence_that_keeps_no_drafter_context_steps_plainly_while_the_others_draft(pairs, baselines, family,
                                                                                         apart, oracle, monkeypatch):
    """A request whose policy never drafts (`block_size=1`: no drafter context kept, as a long
    prompt whose drafted cycles cannot pay) verifies its last token alone in the batch's drafted
    cycles, in a padded array with the others (its other rows pad the block and are cropped) or
    held `apart` (its one row only); the others draft at the batch's width, with the pooled drafter
    or (`oracle`) sources of their own whose drafts are accepted up to a rejection that moves through
    the block. Every output is mlx-lm's greedy decoding, every accepted count the oracle's."""
    from conftest import OracleSource, greedy_ref, plain_greedy

    from dflash_mlx.decode import caches
    from dflash_mlx.decode.decoder import Decoder
    from dflash_mlx.decode.running import Asks

    if apart:
        monkeypatch.setattr(caches, "PART_ROWS", 0)  # every sequence a part of its own
    pair, base, n = pairs[family], baselines[family], 40  # the rejection moves through every position
    prompts = [pair.tokenizer.encode(t) for t in TEXTS[:3]]
    refs = [plain_greedy(base, p, n, eos=tuple(pair.tokenizer.eos_token_ids)) for p in prompts]
    sources = [None] * 3
    if oracle:
        feature_dim = len(pair.target.tap_ids) * pair.target.hidden_size
        sources[0], sources[2] = (OracleSource(p + greedy_ref(base, p, n), pair.target.vocab_size, feature_dim,
                                               lambda c, w: c % w if c % w < w - 1 else None)
                                  for p in (prompts[0], prompts[2]))
    dec = Decoder(pair, 8)
    firsts = [dec.add(p, n, s, asks=a) for p, s, a in zip(prompts, sources, [Asks(), Asks(block_size=1), Asks()])]
    assert [s.tapped for s in dec.seqs] == [True, False, True]
    assert dec.caches.alone()[1] == (apart and dec.target.splits)
    out = {f.uid: list(f.tokens) for f in firsts}
    plain_uid, plain_widths, drafting_widths, accepted = firsts[1].uid, [], [], {0: [], 2: []}
    while len(dec):
        committed = dec.step()
        for c in committed:
            out[c.uid] += c.tokens
            if len(committed) > 1:
                (plain_widths if c.uid == plain_uid else drafting_widths).append(c.plan.width)
            if c.uid != plain_uid and c.finish is None:
                accepted[c.uid].append(c.accepted)
    assert plain_widths and set(plain_widths) == {1}
    assert set(drafting_widths) == {8}
    if oracle:
        for b in (0, 2):
            assert accepted[b] == sources[b].expected[: len(accepted[b])] and max(accepted[b]) == 7
    assert [out[f.uid] for f in firsts] == refs


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen3_5"])
@pytest.mark.parametrize("width", [4, 8])
def test_each_sequence_is_cropped_at_its_own_rejection(pairs, baselines, family, width):
    """Drafts of the target's own continuation, each sequence corrupted on its own schedule
    (`OracleSource`), so in one verify pass the sequences accept 0 .. width - 1 drafts each
    and are cropped apart: every cycle accepts exactly up to its corrupted draft, and every
    output is plain greedy decoding."""
    from conftest import ROLLBACK_SCHEDULES, OracleSource, greedy_ref

    from dflash_mlx.decode.decoder import Decoder

    pair, base = pairs[family], baselines[family]
    n = width * (width + 1) // 2 + 4  # the cycling schedule reaches every position
    prompts = [pair.tokenizer.encode(t) for t in TEXTS[: len(ROLLBACK_SCHEDULES)]]
    feature_dim = len(pair.target.tap_ids) * pair.target.hidden_size
    refs = [greedy_ref(base, p, n) for p in prompts]
    sources = [OracleSource(p + r, pair.target.vocab_size, feature_dim, corrupt)
               for p, r, corrupt in zip(prompts, refs, ROLLBACK_SCHEDULES.values())]
    dec = Decoder(pair, width)
    assert dec.width == width
    out, accepted = {}, {}
    for p, s in zip(prompts, sources):
        first = dec.add(p, n, s)
        out[first.uid], accepted[first.uid] = list(first.tokens), []
    while len(dec):
        for c in dec.step():
            out[c.uid] += c.tokens
            if c.finish is None:
                accepted[c.uid].append(len(c.tokens) - 1)
    for uid, (ref, source) in enumerate(zip(refs, sources)):
        assert out[uid] == ref[: len(out[uid])] and len(out[uid]) == n
        assert accepted[uid] == source.expected[: len(accepted[uid])]
    assert {a for acc in accepted.values() for a in acc} == set(range(width))


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen3_5"])
def test_the_width_may_change_every_cycle(pairs, baselines, family):
    """Plain batched steps and drafted cycles of any width alternate; the drafter still reads
    every committed token's taps (plain steps' included) and the output is plain greedy."""
    from conftest import plain_greedy

    from dflash_mlx.decode.decoder import Decoder

    pair = pairs[family]
    prompts = [pair.tokenizer.encode(t) for t in TEXTS]
    dec = Decoder(pair, 8)
    out = {}
    for p in prompts:
        first = dec.add(p, 30)
        out[first.uid] = list(first.tokens)
    widths = [1, 3, 8, 1, 1, 2, 5]
    cycle = 0
    while len(dec):
        for c in dec.step(widths[cycle % len(widths)]):
            out[c.uid] += c.tokens
        cycle += 1
    eos = tuple(pair.tokenizer.eos_token_ids)
    for uid, p in enumerate(prompts):
        assert out[uid] == plain_greedy(baselines[family], p, 30, eos=eos)


def test_the_batch_width_is_the_fastest_measured_at_each_batch_size():
    """The candidates are tried from the narrowest while each is faster than the one before, then
    the best per batch size runs and its neighbours are retried now and then: where speed
    changes, the choice follows."""
    from dflash_mlx.policy.batch import RETRY, TRIES, BatchWidths

    speed = {1: {1: 10.0, 2: 14.0, 4: 18.0, 8: 16.0}, 8: {1: 60.0, 2: 55.0, 4: 50.0, 8: 30.0}}
    p = BatchWidths(16)
    assert p.widths == [1, 2, 4, 8]

    def run(batch, cycles):
        chosen = []
        for _ in range(cycles):
            w = p.choose(batch)
            chosen.append(w)
            p.update(batch, w, 1.0, speed[batch][w])
        return chosen

    first = run(1, 4 * TRIES)
    assert first == [w for w in (1, 2, 4, 8) for _ in range(TRIES)]  # climbing while each beats the last
    later = run(1, 4 * RETRY)
    assert later.count(4) > 0.9 * len(later) and set(later) == {2, 4, 8}  # the best, its neighbours retried
    assert run(8, 4 * TRIES) == [1] * TRIES + [2] * TRIES + [1] * (2 * TRIES)  # width 2 is slower: no 4 or 8
    assert run(8, 10) == [1] * 10  # per batch size
    speed[1] = {1: 10.0, 2: 30.0, 4: 12.0, 8: 12.0}  # the text changes: width 2 now pays most
    assert run(1, 8 * RETRY)[-20:].count(2) >= 18


def test_a_costly_retry_is_rare_and_one_retry_shows_a_large_change():
    """A neighbour of the best width is retried the more rarely the more a retry loses: a drafted
    width whose cycle takes 4 plain steps and commits less than one costs few cycles, a width a
    little behind is retried often; and a retry after a long pause counts as much as the stale
    figure, so the choice moves to a width on the retry after it starts to pay."""
    from dflash_mlx.policy.batch import RETRY_BUDGET, BatchWidths

    def run(p, seconds, speed, cycles):
        chosen = []
        for _ in range(cycles):
            w = p.choose(8)
            chosen.append(w)
            p.update(8, w, seconds[w], speed[w] * seconds[w])
        return chosen

    close, far = BatchWidths(16), BatchWidths(16)
    same = {1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0}
    near_speed = {1: 60.0, 2: 55.0, 4: 50.0, 8: 30.0}
    costly, far_speed = {1: 1.0, 2: 4.0, 4: 5.0, 8: 6.0}, {1: 60.0, 2: 15.0, 4: 10.0, 8: 5.0}
    assert run(close, same, near_speed, 1000)[20:].count(2) >= 15  # a retry loses 1/12 of a cycle: every 32
    assert run(far, costly, far_speed, 1000)[20:].count(2) <= 6  # one loses 3 cycles: every 192
    far_speed[2] = 200.0  # the text starts to repeat: width 2 pays
    after = run(far, costly, far_speed, 3 * RETRY_BUDGET + 48)  # its next retry comes within 192 cycles
    retry = after.index(2)
    assert after[retry : retry + 40].count(1) <= 1 and after[-20:].count(2) >= 18  # from that retry on


def test_with_the_sequences_acceptance_a_width_is_rated_by_its_expected_tokens_per_second():
    """Given the tokens the batch expects each width to commit (its sequences' statistics), the
    choice is those over each width's measured seconds per cycle, so a cycle whose drafts were
    unluckily rejected does not turn it away from a width that pays."""
    from dflash_mlx.policy.batch import TRIES, BatchWidths

    seconds = {1: 1.0, 2: 1.2, 4: 1.6, 8: 3.0}
    gains = {1: 8.0, 2: 13.0, 4: 18.0, 8: 20.0}  # per second: 8, 10.8, 11.25, 6.7
    p = BatchWidths(16)
    chosen = []
    for cycle in range(4 * TRIES + 20):
        w = p.choose(8, gains)
        chosen.append(w)
        luck = 0.3 if (cycle % 3 == 0 and w == 4) else 1.0  # width 4's drafts often all rejected
        p.update(8, w, seconds[w], int(8 + (gains[w] - 8) * luck))
    assert chosen[: 4 * TRIES] == [w for w in (1, 2, 4, 8) for _ in range(TRIES)]
    assert chosen[4 * TRIES :].count(4) >= 18
    assert BatchWidths(16).choose(8, None) == 1  # without statistics: the measured climb


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen3_5"])
def test_batched_requests_start_from_and_feed_the_prompt_cache(pairs, baselines, family):
    """A batch keeps each finished sequence in the prompt cache, and a later batch's requests
    that extend those conversations start from it: fewer tokens prefilled, the same output."""
    from conftest import plain_greedy

    import dflash_mlx

    pair, base = pairs[family], baselines[family]
    eos = tuple(pair.tokenizer.eos_token_ids)
    cache = dflash_mlx.PromptCache(pair)

    def run(prompts, n):
        return decode_turn(pair, prompts, n, cache)

    first = [pair.tokenizer.encode(t) for t in TEXTS[:3]]
    answers = run(first, 20)
    assert answers == [plain_greedy(base, p, 20, eos=eos) for p in first]
    # A recurrent state cannot be trimmed back: its state at the prompt's end is kept beside it.
    assert len(cache) == 3 * (2 if pair.target.recurrent else 1) and cache.hits == 0
    # The three conversations go on, and two new ones (prefilled together) join them.
    second = [p + a + pair.tokenizer.encode(" and then") for p, a in zip(first, answers)]
    second += [pair.tokenizer.encode(t) for t in TEXTS[3:5]]
    assert run(second, 12) == [plain_greedy(base, p, 12, eos=eos) for p in second]
    assert cache.hits == 3 and cache.misses == 5
    assert cache.cached_tokens >= sum(len(p) + len(a) - 1 for p, a in zip(first, answers))


def test_the_batch_width_follows_the_block_size(pairs):
    """`batch_width`: the widest cycle a server's batches run (hybrid targets too); None where the
    target cannot be batched (sliding windows: tests/test_families.py checks which families batch)."""
    from dflash_mlx.decode.decoder import batch_width

    assert batch_width(pairs["qwen3"], "auto") == min(8, pairs["qwen3"].draft_source.block_size)
    assert batch_width(pairs["qwen3_5"], "auto") == min(8, pairs["qwen3_5"].draft_source.block_size)
    assert batch_width(pairs["qwen3"], 3) == 3


def run_streams(pair, joining, widths, join_at=None, width=8):
    """Each request's events, decoded together by `Streams` at the cycle widths `widths`
    (cycling; `join_at[i]`: the cycle request i joins at)."""
    from dflash_mlx.decode.streams import Streams
    from dflash_mlx.policy.batch import FixedBatchWidth

    class Scripted(FixedBatchWidth):
        cycle = 0

        def choose(self, batch, gains=None, columns=0):
            self.cycle += 1
            return widths[self.cycle % len(widths)]

    join_at = join_at or {}
    streams = Streams(pair, width, Scripted(width))
    events, index, cycle = {}, {}, 0
    waiting = list(range(len(joining)))
    while waiting or len(streams):
        now = [i for i in waiting if join_at.get(i, 0) <= cycle]
        waiting = [i for i in waiting if i not in now]
        if now:
            for i, (uid, event) in zip(now, streams.add_many([joining[i] for i in now])):
                index[uid], events[i] = i, [] if event is None else [event]  # None: prefilled a chunk a cycle
        for uid, event in streams.step():
            events[index[uid]].append(event)
        cycle += 1
    return [events[i] for i in range(len(joining))]


@pytest.mark.parametrize("family, widths", [
    ("qwen3", [1, 4, 2, 8, 3, 1, 1, 6]),  # the width changes every cycle
    ("qwen3", [1, 1, 1, 1, 1, 1, 1, 4]),  # mostly plain steps, each launched before the last is read
    ("qwen3_5", [1, 1, 1, 3]),  # recurrent state: plain steps one ahead, set back where dropped
])
def test_sampled_penalised_and_logprob_requests_in_a_batch_equal_each_alone(pairs, family, widths):
    """Greedy and sampled requests, with penalties, logit bias, log probabilities and stop
    strings, decoded together while requests join late: each gets the tokens (and log
    probabilities) it gets from `stream_generate` alone. A sampled request's draws follow its
    seed and its positions only (`sampling.Draws`), also in a plain step launched before the
    one it follows is read (its processors see that step's token, its draws are a position on)."""
    import dflash_mlx
    from dflash_mlx.decode.decoder import Asks
    from dflash_mlx.decode.streams import Joining
    from dflash_mlx.sampling import SamplingParams, make_processors

    pair = pairs[family]
    penalty = {"repetition_penalty": 1.3, "repetition_context_size": 16}
    bias = {"logit_bias": {"17": 4.0, 23: -100.0}}
    cases = [  # (text, params, processor arguments, logprobs, stop)
        (TEXTS[0], SamplingParams(), {}, 3, ()),
        (TEXTS[1], SamplingParams(temp=0.9, seed=5), {}, None, ()),
        (TEXTS[2], SamplingParams(temp=1.2, top_p=0.9, top_k=20, seed=6), penalty, 2, ()),
        (TEXTS[3], SamplingParams(temp=0.7, min_p=0.05, seed=7), bias, None, ()),
        (TEXTS[4], SamplingParams(), penalty, None, ()),
        (TEXTS[0], SamplingParams(temp=1.0, seed=8), {}, 0, ("e",)),
    ]
    n = 20
    alone = []
    for text, params, procs, top, stop in cases:
        alone.append(list(dflash_mlx.stream_generate(pair, text, max_tokens=n, sampling=params, block_size=4,
                                                     logits_processors=make_processors(procs), logprobs=top,
                                                     stop=list(stop))))
    joining = [Joining(pair.tokenizer.encode(text), n, list(stop), Asks(params, make_processors(procs), top))
               for text, params, procs, top, stop in cases]
    batched = run_streams(pair, joining, widths=widths, join_at={3: 2, 4: 5, 5: 5})
    for (text, params, *_), mine, own in zip(cases, batched, alone):
        tokens = [t for ev in mine for t in ev.tokens]
        assert tokens == [t for ev in own for t in ev.tokens], (text, params)
        assert "".join(ev.text for ev in mine) == "".join(ev.text for ev in own)
        assert mine[-1].finish_reason == own[-1].finish_reason
        lps = [row for ev in mine for row in ev.logprobs or []]
        theirs = [row for ev in own for row in ev.logprobs or []]
        assert len(lps) == len(theirs)
        for (lp, top), (lp2, top2) in zip(lps, theirs):
            assert abs(lp - lp2) < 1e-3 and [t for t, _ in top] == [t for t, _ in top2]
    assert batched[5][-1].finish_reason == "stop" and len([t for ev in batched[5] for t in ev.tokens]) < n
    assert len({tuple(t for ev in mine for t in ev.tokens) for mine in batched}) == len(cases)


@pytest.mark.parametrize("family, after", [("qwen3", 1), ("qwen3", 3), ("qwen3_5", 1), ("qwen3_5", 3)])
def test_a_request_joined_mid_stream_goes_on_in_a_batch(pairs, family, after):
    """A request decoding alone (its own policy's cycles, on its own caches) is joined after its
    `after`-th event (1: right after its first token, before its first drafted cycle) by a
    newcomer and goes on beside it in one batch: greedy and seeded sampled requests (a hybrid's
    recurrent state included) give the text they give alone, and so does the newcomer."""
    from conftest import joined_mid_stream

    import dflash_mlx
    from dflash_mlx.decode.decoder import Asks
    from dflash_mlx.decode.streams import Streams
    from dflash_mlx.sampling import SamplingParams

    pair = pairs[family]
    for params in (SamplingParams(), SamplingParams(temp=0.9, top_k=30, seed=3)):
        want = [t for ev in dflash_mlx.stream_generate(pair, TEXTS[0], max_tokens=30, sampling=params)
                for t in ev.tokens]
        other = [t for ev in dflash_mlx.stream_generate(pair, TEXTS[1], max_tokens=20) for t in ev.tokens]
        streams = Streams(pair, 4, prompt_cache=dflash_mlx.PromptCache(pair))
        got, theirs = joined_mid_stream(streams, pair.tokenizer.encode(TEXTS[0]), after,
                                        pair.tokenizer.encode(TEXTS[1]), 30, asks=Asks(params))
        assert got == want and theirs == other, (family, params)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_one_drafter_pass_drafts_what_each_sequence_drafts_alone(pairs, family):
    """`DraftBatch` holds several sequences' drafter contexts (different lengths,
    each given a different number of new rows per pass) and drafts every block in one pass:
    each sequence's draft logits are those of its own pass over its own context; the pool holds
    the contexts the sequences brought, and one that leaves goes on alone as if it had never been
    pooled."""
    from dflash_mlx.draft.pool import DraftBatch

    pair = pairs[family]
    source = pair.draft_source.pooled()
    assert source is not None and source.drafter.batchable
    D = len(pair.target.tap_ids) * pair.target.hidden_size
    key = iter(mx.random.split(mx.random.key(4), 20))
    alone, brought = [source.new_state() for _ in range(3)], [source.new_state() for _ in range(3)]
    for a, s, n in zip(alone, brought, (7, 2, 13)):  # the contexts the sequences bring
        context = mx.random.normal((1, n, D), key=next(key))
        source.add_context(a, context)
        source.add_context(s, context)
    pool = DraftBatch(source)
    pool.join([source.context(s) for s in brought])
    assert all(pool.extract(b)[0] is source.context(s)[0] for b, s in enumerate(brought))  # held, not copied
    lasts = mx.array([5, 9, 3], dtype=mx.uint32)
    for width, rows in ((4, (2, 0, 5)), (8, (1, 3, 1)), (3, (0, 0, 0))):
        hiddens = [mx.random.normal((1, r, D), key=next(key)) if r else None for r in rows]
        together = pool.propose(lasts, hiddens, width)
        for b, state in enumerate(alone):
            own = source.propose(state, lasts[b : b + 1], hiddens[b], width)
            assert same(together[b], own), (width, b)
        lasts = mx.argmax(together[:, -1], axis=-1).astype(mx.uint32)
    pool.filter([0, 2])  # the second leaves: its state goes on alone as if it had never been pooled
    h = mx.random.normal((1, 2, D), key=next(key))
    assert same(source.propose(brought[1], lasts[1:2], h, 5), source.propose(alone[1], lasts[1:2], h, 5))


def test_a_batch_drafts_in_one_pass_and_accepts_as_drafting_apart(pairs, baselines):
    """The decoder pools its sequences' drafter contexts at their first drafted cycle (one
    drafter pass per cycle) and accepts, cycle for cycle, what drafting each apart accepts.
    A sequence with a source of its own sends the pool's contexts back to their sequences,
    which go on drafting apart from exactly where they were (and pool again once it left)."""
    from conftest import OracleSource, greedy_ref, plain_greedy

    from dflash_mlx.decode.decoder import Decoder

    pair = pairs["qwen3"]
    prompts = [pair.tokenizer.encode(t) for t in TEXTS]
    intruder = prompts[1]
    oracle = OracleSource(intruder + greedy_ref(baselines["qwen3"], intruder, 12), pair.target.vocab_size,
                          len(pair.target.tap_ids) * pair.target.hidden_size, lambda c, w: None)

    def run(pooling, intrude_at=None):
        dec = Decoder(pair, 8)
        if not pooling:
            dec.drafting.poolable = None
        out, accepted, pooled = {}, [], []
        for first in dec.add_many(prompts, [24] * len(prompts)):
            out[first.uid] = list(first.tokens)
        cycle = 0
        while len(dec):
            if cycle == intrude_at:
                first = dec.add(intruder, 12, oracle)
                out[first.uid] = list(first.tokens)
            committed = dec.step([8, 4, 1, 8][cycle % 4])
            pooled.append(dec.drafting.pool is not None)
            accepted.append(sorted((c.uid, c.accepted) for c in committed if c.uid < len(prompts)))
            for c in committed:
                out[c.uid] += c.tokens
            cycle += 1
        return out, accepted, pooled

    together, acc_together, pooled = run(True)
    apart, acc_apart, never = run(False)
    assert together == apart and acc_together == acc_apart
    assert pooled[0] and not any(never)
    eos = tuple(pair.tokenizer.eos_token_ids)
    assert [together[i] for i in range(len(prompts))] == [plain_greedy(baselines["qwen3"], p, 24, eos=eos)
                                                          for p in prompts]
    mixed, acc_mixed, pooled = run(True, intrude_at=2)
    assert pooled[:3] == [True] * 3 and not pooled[3]  # apart from the intruder's first drafted cycle on
    assert acc_mixed == acc_together and all(mixed[i] == together[i] for i in range(len(prompts)))


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_a_long_prompt_joins_a_chunk_per_cycle(pairs, baselines, family, monkeypatch):
    """A long prompt joining sequences that decode is prefilled a chunk per cycle: the others
    commit tokens every cycle meanwhile, its first token comes once its last chunk is in, and
    every output is plain greedy decoding (a cancelled one leaves without a trace)."""
    from conftest import plain_greedy

    from dflash_mlx.decode.decoder import Decoder
    from dflash_mlx.policy import join

    for name in ("FIRST_CHUNK", "MIN_CHUNK", "MAX_CHUNK"):  # chunks of 16, whatever the timings
        monkeypatch.setattr(join, name, 16)
    pair = pairs[family]
    short = [pair.tokenizer.encode(t) for t in TEXTS[:2]]
    long = pair.tokenizer.encode(" ".join(TEXTS) * 3)
    assert len(long) > 4 * 16
    dec = Decoder(pair, 4)
    out = {f.uid: list(f.tokens) for f in dec.add_many(short, [40, 40], chunked=True)}
    for c in dec.step():
        out[c.uid] += c.tokens
    joining = dec.add(long, 12, chunked=True)
    gone = dec.add(long[:40], 12, chunked=True)
    assert joining.filling and not joining.tokens and gone.filling and len(dec) == 4
    fills = 0
    while joining.uid not in out:
        firsts = dec.fill()
        dec.remove(gone.uid)
        committed = dec.step(4)
        assert {c.uid for c in committed} >= {u for u in out if u < 2 and len(out[u]) < 40}
        for c in firsts + committed:
            assert c.first == (c.uid not in out)
            out.setdefault(c.uid, []).extend(c.tokens)
        fills += 1
    assert fills >= len(long) // 16 and gone.uid not in out
    while len(dec):
        for c in dec.fill() + dec.step():
            out[c.uid] += c.tokens
    eos = tuple(pair.tokenizer.eos_token_ids)
    base = baselines[family]
    assert [out[u] for u in (0, 1)] == [plain_greedy(base, p, 40, eos=eos) for p in short]
    assert out[joining.uid] == plain_greedy(base, long, 12, eos=eos)


def test_lookup_copies_in_a_batch(pairs, baselines, monkeypatch):
    """With `lookup`, each sequence's sizer run copies as much of its n-gram lookup's offer
    into a drafted cycle's first positions as it expects to pay (learning from the offers it
    scored): on text that repeats, fewer cycles than the drafter alone, the same tokens."""
    from conftest import plain_greedy
    from test_adaptive import install_curve

    from dflash_mlx.decode.decoder import Decoder

    pair, base = pairs["qwen3"], baselines["qwen3"]
    install_curve(monkeypatch, pair, [[1.0 + 0.05 * (k - 1) for k in range(1, pair.draft_source.block_size + 1)]])
    prompts = [pair.tokenizer.encode(t * 6) for t in ("a b c d e f ", "x = x + 1\n", "one two three ")]
    eos = tuple(pair.tokenizer.eos_token_ids)

    def run(lookup):
        dec = Decoder(pair, 8, lookup=lookup)
        out = {f.uid: list(f.tokens) for f in dec.add_many(prompts, [60] * len(prompts))}
        cycles = 0  # summed over the sequences
        while len(dec):
            for c in dec.step(8):
                out[c.uid] += c.tokens
                cycles += 1
        return [out[u] for u in sorted(out)], cycles

    copied, with_lookup = run(True)
    assert pair.learned.greedy.shared_lookup  # the offers were scored
    drafted, without = run(False)
    assert copied == drafted == [plain_greedy(base, p, 60, eos=eos) for p in prompts]
    assert with_lookup < 0.8 * without, (with_lookup, without)


def test_batch_gains_count_the_lookup_offers(pairs, monkeypatch):
    """What the batch expects a width to commit counts each sequence's lookup offer, copied as
    its cycle would copy it: on text that repeats, the cycles with offers expect more than the
    drafter's statistics alone (a random drafter), and they do commit more."""
    from test_adaptive import install_curve

    from dflash_mlx.decode.decoder import Decoder

    pair = pairs["qwen3"]
    install_curve(monkeypatch, pair, [[1.0 + 0.05 * (k - 1) for k in range(1, pair.draft_source.block_size + 1)]])
    prompts = [pair.tokenizer.encode(t * 6) for t in ("a b c d e f ", "x = x + 1\n", "one two three ")]
    dec = Decoder(pair, 8, lookup=True)
    dec.add_many(prompts, [200] * len(prompts))
    for _ in range(10):
        dec.step(8)
    offered, not_offered = [], []
    for _ in range(20):
        extra = dec.planner.gains(dec.seqs, [8])[8] - sum(s.sizer.expected_tokens(8) for s in dec.seqs)
        committed = sum(len(c.tokens) for c in dec.step(8))
        (offered if extra > 1 else not_offered).append(committed)
    assert len(offered) >= 3 and not_offered
    assert sum(offered) / len(offered) > 1.2 * sum(not_offered) / len(not_offered), (offered, not_offered)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_plain_steps_run_one_ahead_and_drop_it_when_the_batch_changes(pairs, baselines, family):
    """Plain batched steps launch the next before the host reads the current (as mlx-lm's);
    the step in flight is dropped when a sequence ends, leaves or joins, or a cycle drafts
    (a hybrid target's recurrent states set back): every output is still plain greedy decoding."""
    from conftest import plain_greedy

    from dflash_mlx.decode.decoder import Decoder

    pair, base = pairs[family], baselines[family]
    prompts = [pair.tokenizer.encode(t) for t in TEXTS]
    eos = tuple(pair.tokenizer.eos_token_ids)
    dec = Decoder(pair, 4)
    firsts = dec.add_many(prompts[:3], [30, 12, 30])
    out = {f.uid: list(f.tokens) for f in firsts}
    ahead, cycle = [], 0
    while len(dec):
        if cycle == 5:
            dec.remove(firsts[2].uid)
            out.pop(firsts[2].uid)
        if cycle == 8:
            late = dec.add(prompts[3], 20)
            out[late.uid] = list(late.tokens)
        for c in dec.step(4 if cycle == 15 else 1):
            out[c.uid] += c.tokens
        ahead.append(dec._ahead is not None)
        cycle += 1
    assert sum(ahead) > 10  # mostly a step in flight
    want = {firsts[0].uid: plain_greedy(base, prompts[0], 30, eos=eos),
            firsts[1].uid: plain_greedy(base, prompts[1], 12, eos=eos),
            late.uid: plain_greedy(base, prompts[3], 20, eos=eos)}
    assert out == want


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen3_5"])
def test_a_plain_step_in_flight_runs_on_for_those_left_when_sequences_finish(pairs, baselines, family):
    """Sequences ending one after another at each step (budgets, a stand-in EOS) or removed while a
    plain step is in flight: only their rows of it are cropped, it runs for the others, so no
    target pass is computed to be dropped until one sequence is left (it then decodes alone).
    Every output is plain greedy decoding, and an ended sequence's caches continue its
    conversation as plain decoding does."""
    from conftest import plain_greedy

    import dflash_mlx
    from dflash_mlx.decode.decoder import Decoder

    pair, base = pairs[family], baselines[family]
    prompts = [pair.tokenizer.encode(t) for t in TEXTS] + [pair.tokenizer.encode(TEXTS[0] + " return")]
    budgets = [3, 4, 5, 6, 7, 24]
    alone = plain_greedy(base, prompts[1], 24, eos=())
    stop = next(t for i, t in enumerate(alone) if i >= 2 and t not in alone[:i])  # ends prompt 1 early
    eos = tuple(pair.tokenizer.eos_token_ids) + (stop,)
    cache = dflash_mlx.PromptCache(pair)
    dec = Decoder(pair, 4, prompt_cache=cache)
    dec.eos = set(eos)
    firsts = dec.add_many(prompts, budgets)
    dec.target = counted = Counted(dec.target)
    out = {f.uid: list(f.tokens) for f in firsts}
    removed = firsts[4].uid
    counted.passes, steps, left = 0, 0, []
    while len(dec) > 1:
        if steps == 2:
            dec.remove(removed)
            out.pop(removed)
        for c in dec.step(1):
            out[c.uid] += c.tokens
        dec.keep()
        steps += 1
        left.append(len(dec))
    assert len(set(left)) >= 4, left  # they left at different steps
    assert counted.passes == steps + 1  # each step launched ahead ran: only the last, as one was left, dropped
    while len(dec):
        for c in dec.step(1):
            out[c.uid] += c.tokens
        dec.keep()
    want = {f.uid: plain_greedy(base, p, n, eos=eos) for f, p, n in zip(firsts, prompts, budgets) if f.uid != removed}
    assert out == want
    assert len(out[firsts[1].uid]) < budgets[1]  # it ended at the stand-in EOS
    later = prompts[1] + out[firsts[1].uid] + pair.tokenizer.encode(" and then")
    again = Decoder(pair, 4, prompt_cache=cache)
    again.eos = set(eos)
    first = again.add(later, 8)
    tokens = list(first.tokens)
    while len(again):
        tokens += [t for c in again.step(1) for t in c.tokens]
    assert tokens == plain_greedy(base, later, 8, eos=eos)
    assert cache.hits >= 1


def test_a_plain_step_launches_the_next_only_where_the_next_cycle_is_plain(pairs, baselines):
    """Told the next cycle's width (`then`), a plain step launches the next plain step ahead only
    where it will run: a batch whose plain steps and drafted cycles alternate runs one target
    pass per cycle, none computed to be dropped, and its output is plain greedy decoding.
    The planner chooses each width a cycle ahead and passes it on."""
    from conftest import plain_greedy

    from dflash_mlx.decode.decoder import Decoder
    from dflash_mlx.decode.streams import Streams, Joining

    pair, base = pairs["qwen3"], baselines["qwen3"]
    prompts = [pair.tokenizer.encode(t) for t in TEXTS[:3]]
    eos = tuple(pair.tokenizer.eos_token_ids)
    dec = Decoder(pair, 4)
    dec.target = counted = Counted(dec.target)
    firsts = dec.add_many(prompts, [40] * 3)
    out = {f.uid: list(f.tokens) for f in firsts}
    widths = [1, 1, 4, 1, 4, 4, 1, 1, 1, 2, 1, 4]
    counted.passes = 0
    for w, then in zip(widths, widths[1:] + [4]):
        for c in dec.step(w, then):
            out[c.uid] += c.tokens
    assert counted.passes == len(widths)  # ignoring `then`: one more, dropped, before each drafted cycle
    while len(dec):
        for c in dec.step(1):
            out[c.uid] += c.tokens
    assert [out[f.uid] for f in firsts] == [plain_greedy(base, p, 40, eos=eos) for p in prompts]

    class Script:
        widths = (1, 4)

        def __init__(self, choices):
            self.choices = iter(choices)

        def choose(self, batch, gains=None, columns=0):
            return next(self.choices)

        def branches(self, batch, width, most, columns=0):
            return 0

        def update(self, batch, width, seconds, tokens, branches=0, columns=0):
            pass

    streams = Streams(pair, 4, Script([1, 4, 1, 1, 4, 1, 1, 1]))
    ran = []
    planner = streams.decoder.planner
    batch = planner.batch
    planner.batch = lambda *a, **k: (lambda p: ran.append((p.width, p.then)) or p)(batch(*a, **k))
    streams.add_many([Joining(p, 40) for p in prompts])
    for _ in range(7):
        streams.step()
    assert ran == [(1, 1), (1, 4), (4, 1), (1, 1), (1, 4), (4, 1), (1, 1)]


def test_the_policy_learns_a_plain_step_only_from_the_seconds_of_its_own_pass(pairs):
    """A plain run's first step launches the next before its own tokens are read (on a CPU, both
    passes run within it) and its last finds its pass already done: the batch policy learns plain
    steps from the steady ones between (launched ahead, launching the next) and from a lone plain
    step between drafted cycles, and every drafted cycle."""
    from dflash_mlx.decode.decoder import Decoder

    class Script:
        widths = (1, 4)

        def __init__(self, choices):
            self.choices, self.updates = iter(choices), []

        def choose(self, batch, gains=None, columns=0):
            return next(self.choices)

        def branches(self, batch, width, most, columns=0):
            return 0

        def update(self, batch, width, seconds, tokens, branches=0, columns=0):
            self.updates.append(width)

    pair = pairs["qwen3"]
    # Widths are chosen a cycle ahead (the first cycle runs the first choice): 1 1 1 1 1 4 1 4 4 1.
    script = Script([1, 1, 1, 1, 4, 1, 4, 4, 1, 1, 1])
    dec = Decoder(pair, 4, policy=script)
    dec.add_many([pair.tokenizer.encode(t) for t in TEXTS[:3]], [60] * 3)
    for _ in range(10):
        dec.step()
    # Counted: the run's 2nd to 4th steps, the drafted cycles, the lone plain step; not a run's first or last.
    assert script.updates == [1, 1, 1, 4, 1, 4, 4], script.updates


def test_a_width_is_rated_by_its_tokens_over_its_seconds_pooled():
    """A width's measured rate pools its cycles' tokens and seconds: the last plain step of a
    run, whose work the step before launched, takes almost no time, and does not make plain
    decoding look many times faster than it is."""
    from dflash_mlx.policy.batch import TRIES, BatchWidths

    p = BatchWidths(16)
    for seconds in [2.0] + [1.0] * (TRIES - 1) + [1e-6]:
        p.update(8, 1, seconds, 8)
    assert 5.0 < p.rate(8, 1) < 9.0


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_a_sequence_ending_while_a_plain_step_is_in_flight_keeps_its_own_state(pairs, baselines, family):
    """A sequence that ends at EOS while the next plain step is in flight gives the prompt cache
    its caches as of its last token (the step in flight dropped, the EOS step's row undone, a
    hybrid target's recurrent state set back to before both): its conversation continues from
    there as plain decoding continues it."""
    from conftest import plain_greedy

    import dflash_mlx

    pair, base = pairs[family], baselines[family]
    prompts = [pair.tokenizer.encode(t) for t in TEXTS[:3]]
    alone = plain_greedy(base, prompts[0], 16, eos=())
    stop = next(t for i, t in enumerate(alone) if i >= 5 and t not in alone[:i])
    eos = tuple(pair.tokenizer.eos_token_ids) + (stop,)
    cache = dflash_mlx.PromptCache(pair)

    def run(prompts, n):
        return decode_turn(pair, prompts, n, cache, eos=eos, width=1)

    answers = run(prompts, 16)
    assert answers == [plain_greedy(base, p, 16, eos=eos) for p in prompts]
    assert len(answers[0]) < 16  # it ended at the stand-in EOS, the others going on
    later = [prompts[0] + answers[0] + pair.tokenizer.encode(" and then")]
    assert run(later, 10) == [plain_greedy(base, later[0], 10, eos=eos)]
    assert cache.hits == 1


def test_join_chunks_take_a_set_number_of_cycles():
    """A join chunk is sized from the measured seconds of a prefill row to take JOIN_CYCLES of
    the batch's typical cycles beside a typical one, within its bounds; before anything is timed
    it is FIRST_CHUNK."""
    from dflash_mlx.policy.join import FIRST_CHUNK, JOIN_CYCLES, JOIN_TTFT, MAX_CHUNK, MIN_CHUNK, JoinChunks

    j = JoinChunks()
    assert j.size() == FIRST_CHUNK
    j.cycle(0.1)
    assert j.size() == FIRST_CHUNK  # no prefill row timed yet
    j.chunk(100, 0.2)  # 2 ms a row
    assert j.size() == int(JOIN_CYCLES * 0.1 / 0.002)
    j.chunk(100, 0.6)  # rows grew dearer (a longer context): smaller chunks
    assert j.size() < int(JOIN_CYCLES * 0.1 / 0.002)
    fast, slow = JoinChunks(), JoinChunks()
    for j, cycle in ((fast, 1e-6), (slow, 1e6)):
        j.cycle(cycle)
        j.chunk(100, 0.2)
    assert fast.size() == MIN_CHUNK and slow.size() == MAX_CHUNK
    # A cycle that carried a chunk costs the rows what it took beyond cycles of its own shape, and
    # the next chunk fills what a cycle of that shape leaves of 1 + JOIN_CYCLES typical cycles.
    j = JoinChunks()
    j.cycle(0.1, (3, 1))
    j.cycle(0.2, (3, 4))  # typical: 0.15
    j.chunk(100, 0.5)
    j.rode(50, 0.3, (3, 4))
    assert j.row_seconds == pytest.approx((0.005 + 0.1 / 50) / 2)
    assert j.size() == int(((1 + JOIN_CYCLES) * 0.15 - 0.2) / j.row_seconds)
    j.rode(50, 0.15, (2, 1))  # a shape not seen alone: against the typical cycle; rows not free
    assert j.row_seconds == pytest.approx((0.0035 + 0.1 * 0.15 / 50) / 2)
    for seconds in (0.1, 0.1, 0.1, 1.0):  # one slow cycle moves neither the typical nor its shape's
        j.cycle(seconds, (3, 1))
    assert j.cycle_seconds == 0.1 and j._own((3, 1)) == 0.1
    # While a prompt joins, a cycle may take 1 - 1 / JOIN_TTFT of a step of 1 + JOIN_CYCLES typical ones.
    j = JoinChunks()
    cap = (1 + JOIN_CYCLES) * 0.1 * (1 - 1 / JOIN_TTFT)
    for seconds, width in [(0.5 * cap, 1), (0.99 * cap, 2), (1.01 * cap, 4)] + [(0.1, 8)] * 5:
        j.cycle(seconds, (3, width))
    assert j.cycle_seconds == 0.1 and cap < 0.1
    assert [j.fits((3, w)) for w in (1, 2, 4, 8, 16)] == [True, True, False, False, False]  # 16: not timed
    assert JoinChunks().fits((3, 16))  # nothing timed yet


@pytest.mark.parametrize("family, carries", [("qwen3", True), ("qwen3_5", True), ("qwen3", False)])
def test_a_joining_prompt_is_prefilled_in_chunks_of_the_measured_size(pairs, monkeypatch, family, carries):
    """Each chunk of a joining prompt is as many tokens as the join policy says then, timed: in
    the batch's cycle it rides in where the target carries it (K/V and Gated DeltaNet layers),
    else on its own; the batch times its cycles alone. Its drafter reads each chunk's taps in
    that chunk, so that the first cycle beside the others holds only its last token's."""
    from dflash_mlx.decode.decoder import Decoder

    pair = pairs[family]
    if not carries:
        monkeypatch.setattr(pair.target, "can_carry", lambda cache: False)
    dec = Decoder(pair, 4)
    dec.add(pair.tokenizer.encode(TEXTS[0]), 40)
    sizes = iter([20, 7, 33, 5, 1000])

    class Scripted:
        def __init__(self):
            self.asked, self.chunks, self.cycles = [], [], 0

        def size(self):
            self.asked.append(next(sizes))
            return self.asked[-1]

        def chunk(self, tokens, seconds):
            assert seconds > 0
            self.chunks.append(tokens)

        def rode(self, tokens, seconds, shape=None):
            assert seconds > 0
            self.chunks.append(-tokens)

        def cycle(self, seconds, shape=None):
            self.cycles += 1

    dec.joins = Scripted()
    long = pair.tokenizer.encode(" ".join(TEXTS) * 2)
    joining = dec.add(long, 4, chunked=True)  # asks a size once to decide that it is long
    assert joining.filling
    while not any(c.uid == joining.uid for c in dec.fill()):
        dec.step()
    assert next(s for s in dec.seqs if s.uid == joining.uid).unseen == 1
    # The first size asked decided that the prompt is long; the chunks follow the next ones.
    assert dec.joins.asked[0] == 20 and len(long) - 1 > 45
    rides = -1 if carries else 1
    assert dec.joins.chunks == [rides * n for n in (7, 33, 5, len(long) - 1 - 45)]
    assert dec.joins.cycles >= (0 if carries else 3)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_a_sequence_alone_launches_its_next_drafted_cycle_before_its_tokens_are_read(pairs, baselines, family):
    """Alone, each cycle's successor (drafted too) is launched before `step` hands its tokens
    back. A prompt that joins runs it to its end first (its tokens come with the next `step`,
    no pass is computed to be dropped); a sequence that leaves drops it, and its caches (a
    hybrid target's recurrent states too) hold its conversation as of its last token: kept in
    the prompt cache, it continues as plain decoding continues it."""
    from conftest import plain_greedy

    import dflash_mlx
    from dflash_mlx.decode.decoder import Decoder

    pair, base = pairs[family], baselines[family]
    eos = tuple(pair.tokenizer.eos_token_ids)
    prompts = [pair.tokenizer.encode(t) for t in TEXTS[:3]]
    counted = Counted(pair.target)
    dec = Decoder(pair, 4, block_size=4)
    dec.target = counted
    first = dec.add(prompts[0], 30)
    prefills = counted.passes
    out, drafted_ahead, ran, steps = {first.uid: list(first.tokens)}, 0, 1, 0
    while len(dec):
        if steps == 4:
            before = counted.passes
            late = dec.add(prompts[1], 12)
            prefills += counted.passes - before
            out[late.uid] = list(late.tokens)
            assert [c.uid for c in dec.early] == [first.uid]  # the cycle ahead ran, its tokens wait
        ran += not dec.early
        for c in dec.step():
            out[c.uid] += c.tokens
        steps += 1
        ahead = dec._ahead
        drafted_ahead += ahead is not None and not ahead.plain
    assert drafted_ahead > 3
    assert counted.passes == prefills + ran  # one target pass per cycle, none dropped
    assert out == {first.uid: plain_greedy(base, prompts[0], 30, eos=eos),
                   late.uid: plain_greedy(base, prompts[1], 12, eos=eos)}

    cache = dflash_mlx.PromptCache(pair)
    dec = Decoder(pair, 4, prompt_cache=cache, block_size=4)
    first = dec.add(prompts[2], 40)
    answer = list(first.tokens)
    for _ in range(5):
        answer += dec.step()[0].tokens
    assert dec._ahead is not None and not dec._ahead.plain
    dec.remove(first.uid)
    dec.keep()
    later = prompts[2] + answer + pair.tokenizer.encode(" and then")
    dec = Decoder(pair, 4, prompt_cache=cache, block_size=4)
    again = dec.add(later, 10)
    tokens = list(again.tokens)
    while len(dec):
        tokens += dec.step()[0].tokens
    assert again.cached > len(prompts[2])
    assert tokens == plain_greedy(base, later, 10, eos=eos)


class _Unbatchable(Counted):
    """A target whose caches batched decoding cannot hold together."""

    batchable = False


def test_a_target_that_cannot_be_batched_decodes_one_sequence_at_a_time(pairs, baselines):
    """Where the target's caches cannot be batched, a second sequence is refused with one clear
    line before any model work, and the one decoding goes on as it would alone."""
    import copy

    from conftest import plain_greedy

    from dflash_mlx.decode.decoder import Decoder, batch_width
    from dflash_mlx.errors import DFlashError

    pair, base = copy.copy(pairs["qwen3"]), baselines["qwen3"]
    pair.target = _Unbatchable(pair.target)
    assert batch_width(pair, "auto") is None
    prompts = [pair.tokenizer.encode(t) for t in TEXTS[:2]]
    dec = Decoder(pair, 4)
    first = dec.add(prompts[0], 20)
    out = list(first.tokens) + dec.step()[0].tokens
    passes = pair.target.passes
    for add in (lambda: dec.add(prompts[1], 8), lambda: dec.add_many([prompts[1], prompts[1]], [8, 8])):
        with pytest.raises(DFlashError, match="decoded one at a time") as e:
            add()
        assert "\n" not in str(e.value)
    assert pair.target.passes == passes and len(dec) == 1 and not dec.early  # its cycle ahead still in flight
    while len(dec):
        out += dec.step()[0].tokens
    assert out == plain_greedy(base, prompts[0], 20, eos=tuple(pair.tokenizer.eos_token_ids))


def test_a_tree_cycle_launched_ahead_is_dropped_when_its_sequence_leaves(pairs, baselines):
    """Alone, a tree cycle is launched ahead too; a sequence that leaves drops it, and its
    caches hold its conversation as of its last token: it continues as plain decoding does."""
    from conftest import plain_greedy

    import dflash_mlx
    from dflash_mlx.decode.decoder import Asks, Decoder

    pair, base = pairs["qwen3"], baselines["qwen3"]
    eos = tuple(pair.tokenizer.eos_token_ids)
    prompt = pair.tokenizer.encode(TEXTS[0])
    cache = dflash_mlx.PromptCache(pair)
    dec = Decoder(pair, 4, prompt_cache=cache, block_size=4)
    first = dec.add(prompt, 40, asks=Asks(tree=2))
    answer = list(first.tokens)
    for _ in range(4):
        answer += dec.step()[0].tokens
    assert dec._ahead is not None and dec._ahead.plans[0].branches == 2
    dec.remove(first.uid)
    dec.keep()
    later = prompt + answer + pair.tokenizer.encode(" and then")
    dec = Decoder(pair, 4, prompt_cache=cache, block_size=4)
    again = dec.add(later, 10)
    tokens = list(again.tokens)
    while len(dec):
        tokens += dec.step()[0].tokens
    assert again.cached > len(prompt)
    assert tokens == plain_greedy(base, later, 10, eos=eos)


def test_a_plan_chosen_for_a_plain_step_is_spent_once_it_runs(pairs):
    """While a plain step runs, `Planner.plain_next` chooses the next plan now, or leaves it to be chosen
    when it comes (with the lookup's offer, where one may be worth waiting for): a plan chosen
    for the step in flight is never reused for the one after it."""
    from dflash_mlx.decode.running import Asks, new_sequence
    from dflash_mlx.policy.plan import PLAIN, Plan
    from dflash_mlx.policy.planner import Planner

    pair = pairs["qwen3"]
    prompt = pair.tokenizer.encode(TEXTS[0])
    seq = new_sequence(pair, 0, prompt, 40, pair.draft_source, pair.draft_source.new_state(),
                       pair.target.make_cache(), Asks(), 4, False, False)
    seq.history, seq.generated = list(prompt), 1

    class Run:
        offer_pays = True

        def lookup_pays(self, context):
            return self.offer_pays

        def choose(self, context, offer=(), unseen=0, left=0):
            return Plan(4)

    class Source:
        def may_offer(self, state):
            return True

    seq.run, seq.source, seq.lookup = Run(), Source(), True
    seq.chosen = PLAIN  # chosen for the plain step now in flight
    assert not Planner.plain_next(seq) and seq.chosen is None  # the next waits for the lookup's offer
    seq.run.offer_pays = False
    assert not Planner.plain_next(seq) and seq.chosen == Plan(4)
