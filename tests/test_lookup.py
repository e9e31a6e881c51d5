"""Lookup drafts: the n-gram index, and lossless decoding through lookup and mixed blocks."""

import random

import pytest
from conftest import ScriptedWidths, plain_greedy
from test_lossless import PROMPTS, ContextChecked, dflash_tokens

import dflash_mlx
from dflash_mlx.decode import cycle as cycle_mod
from dflash_mlx.decode import decoder as decoder_mod
from dflash_mlx.policy.costs import CostCurve
from dflash_mlx.policy.sizer import BlockSizer
from dflash_mlx.policy.plan import Plan
from dflash_mlx.draft.lookup import BULK, NgramIndex, WithLookup


def brute_propose(tokens, k, orders, with_order=False):
    """The index's rule by rescanning: longest recurring suffix, its latest earlier
    occurrence, then an overlapping copy of what followed (and that suffix's length)."""
    for n in sorted(orders, reverse=True):
        if len(tokens) < n:
            continue
        suffix = tokens[-n:]
        for j in range(len(tokens) - 1, n - 1, -1):  # j: the position that followed the occurrence
            if tokens[j - n : j] == suffix:
                out = []
                for i in range(k):
                    out.append(tokens[j + i] if j + i < len(tokens) else out[i - (len(tokens) - j)])
                return (out, n) if with_order else out
    return ([], 0) if with_order else []


def test_index_matches_a_rescan_token_by_token():
    rnd = random.Random(0)
    for alphabet in (2, 3, 6):
        stream = [rnd.randrange(alphabet) for _ in range(300)]
        index = NgramIndex(stream[:5], orders=(4, 3, 2))
        for t in range(5, len(stream)):
            for k in (1, 4, 9):
                got, (want, order) = index.propose(k), brute_propose(stream[:t], k, (4, 3, 2), with_order=True)
                assert got == want and got.order == order, (alphabet, t, k)
            # Whether one more token could give a match, whatever it is.
            assert index.may_propose_next() == any(
                brute_propose(stream[:t] + [x], 1, (2,)) for x in range(alphabet))
            index.extend([stream[t]])


@pytest.mark.parametrize("orders", [(6, 5, 4, 3), (5, 3, 2, 1), (2,), (1,)])
def test_an_index_built_in_bulk_equals_one_built_token_by_token(orders):
    """A prompt's tokens (BULK or more at once) are indexed from slices; chunks of every
    size after any start give the same index as one token at a time."""
    rnd = random.Random(len(orders))
    for trial in range(40):
        stream = [rnd.randrange(3 if trial % 2 else 50) for _ in range(rnd.randrange(0, 400))]
        one = NgramIndex(orders=orders)
        for t in stream:
            one.extend([t])
        bulk, i = NgramIndex(orders=orders), 0
        while i < len(stream):
            k = rnd.choice([1, 2, BULK - 1, BULK, 150])
            bulk.extend(stream[i : i + k])
            i += k
        assert (bulk.tokens, bulk.follow, bulk.heads) == (one.tokens, one.follow, one.heads)
        assert bulk.propose(5) == one.propose(5) and bulk.may_propose_next() == one.may_propose_next()


def test_index_prefers_long_and_recent_matches_and_copies_periodic_text():
    index = NgramIndex([1, 2, 3, 9, 7, 2, 3, 5, 1, 2, 3], orders=(3, 2))
    assert index.propose(2) == [9, 7]  # "1 2 3" recurs: its 3-gram beats the later "2 3 5"
    index = NgramIndex([4, 2, 3, 8, 2, 3], orders=(2,))
    assert index.propose(1) == [8]  # the latest earlier "2 3"
    index = NgramIndex([5, 6, 7, 5, 6, 7, 5], orders=(2,))
    assert index.propose(7) == [6, 7, 5, 6, 7, 5, 6]  # an overlapping copy goes on with the period
    assert NgramIndex([1, 2, 3], orders=(2,)).propose(4) == []
    with pytest.raises(ValueError):
        NgramIndex(orders=(0,))


class ForcedOffer(ContextChecked):
    """The real drafter (context-checked) plus a lookup that offers the true
    continuation with a wrong token at position `miss` (None: all right)."""

    def __init__(self, pair, sequence, miss):
        super().__init__(pair, sequence)
        self.miss = miss

    def new_state(self):
        self.committed = 0
        return super().new_state()

    def commit(self, state, tokens):
        self.committed += len(tokens)

    def offer(self, state, limit):
        out = list(self.seq[self.committed : self.committed + limit])
        if self.miss is not None and self.miss < len(out):
            out[self.miss] = (out[self.miss] + 1) % self.vocab_size or 2  # never EOS
        return out

    def may_offer(self, state):
        return True


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
@pytest.mark.parametrize("width", [2, 5, 8])
@pytest.mark.parametrize("mixed", [False, True])
def test_forced_lookup_hits_and_misses_at_every_position(pairs, baselines, family, width, mixed):
    """Lookup-only blocks (no drafter pass) and lookup-then-drafter blocks, with
    the offer wrong at each position in turn: ids equal plain decoding, each
    cycle accepts exactly up to the wrong token, and the drafter, whenever it
    runs, has been given the taps of every committed token."""
    pair = pairs[family]
    prompt = pair.tokenizer.encode(PROMPTS[2])
    n = 24
    ref = plain_greedy(baselines[family], prompt, n)
    copied = max(1, (width - 1) // 2) if mixed else width - 1
    for miss in [*range(width - 1), None]:
        source = ForcedOffer(pair, prompt + ref + [0] * 16, miss)
        policy = ScriptedWidths([Plan(width, copied), 1, Plan(width, copied), 3])
        out, events = dflash_tokens(pair, prompt, n, block_size=policy, draft_source=source)
        assert out == ref, (miss, width)
        for (w, acc), offer, ev in zip(policy.updates, policy.offers, events[1:]):
            if w != width or ev.finish_reason:
                continue
            assert len(offer) == pair.draft_source.block_size - 1
            if miss is not None and miss < copied:
                assert acc == miss, (miss, w, acc)  # right up to the wrong token, never past it
            elif not mixed:
                assert acc == width - 1  # every looked-up token right: all accepted
            else:
                assert acc >= copied  # the lookup's part accepted; the drafter's as it guessed
        drafted = [p.width for p in policy.plans if p.drafts]
        assert len(drafted) > (mixed and 2)
        assert source.widths == drafted  # the drafter ran for exactly the blocks it filled


def test_auto_uses_the_lookup_on_repetitive_text_and_stays_lossless(monkeypatch):
    """The shipped demo pair repeats itself ("of the current line of the current line"):
    on a curve where the drafter never pays but a bare verify does, auto drafts
    from the lookup alone, and the ids stay plain decoding's."""
    from dflash_mlx.target.baseline import generate, plain_target

    pair = dflash_mlx.load("demo")
    W = pair.draft_source.block_size
    steep = [float(w) for w in range(1, W + 1)]
    flat = [1.0 + 0.02 * (w - 1) for w in range(1, W + 1)]
    monkeypatch.setattr(pair.learned, "greedy", BlockSizer(CostCurve([64], [flat], [[0.0] * W], [steep], [flat]), W))
    assert isinstance(pair.draft_source, WithLookup)
    asked = []  # the `taps` of each prefill and plain step: whether the drafter's context was computed
    real_step, real_prefill = cycle_mod.PlainStep.__init__, decoder_mod.prefill_steps
    monkeypatch.setattr(cycle_mod.PlainStep, "__init__",
                        lambda self, rows, *a, **k: asked.append(rows.taps) or real_step(self, rows, *a, **k))
    monkeypatch.setattr(decoder_mod, "prefill_steps", lambda *a, **k: asked.append(k["taps"]) or real_prefill(*a, **k))
    prompt = pair.tokenizer.encode("class Stack:\n    def push(self, x):")
    want = generate(plain_target(pair), pair.tokenizer, prompt, 60, 0.0)["tokens"]
    events = list(dflash_mlx.stream_generate(pair, prompt, max_tokens=60, block_size="auto"))
    assert [t for ev in events for t in ev.tokens] == want
    stats = events[-1].stats
    assert stats.lookup_cycles > 0 and stats.lookup_cycles == stats.draft_cycles  # the drafter never pays here
    # Even with every draft accepted a drafted cycle of width w would cost w plain steps: the request
    # never asks the target for the drafter's context.
    assert len(asked) > 2 and not any(asked)
    assert stats.generation_tokens > stats.cycles  # lookups were accepted: fewer cycles than tokens
    plain = list(dflash_mlx.stream_generate(pair, prompt, max_tokens=60, block_size="auto", lookup=False))
    assert [t for ev in plain for t in ev.tokens] == want and plain[-1].stats.draft_cycles == 0
    cheaper = [1.0] + [0.9 * w for w in range(2, W + 1)]  # where full acceptance would pay, the taps are kept
    monkeypatch.setattr(pair.learned, "greedy", BlockSizer(CostCurve([64], [flat], [[0.0] * W], [cheaper], [flat]), W))
    asked.clear()
    again = list(dflash_mlx.stream_generate(pair, prompt, max_tokens=60, block_size="auto"))
    assert [t for ev in again for t in ev.tokens] == want and asked[0] is True


def test_a_conversations_next_turn_copies_the_kept_index_and_indexes_only_the_rest(pairs, baselines):
    from dflash_mlx.draft.source import DFlashDraftSource
    from dflash_mlx.cache.prompt_cache import PromptCache

    pair = pairs["qwen3"]

    class Counted(WithLookup):
        def index_for(self, tokens):
            out = super().index_for(tokens)
            self.calls.append((len(tokens), self.resumed))
            return out

    source = Counted(DFlashDraftSource(pair.drafter, pair.target))
    source.calls = []
    cache = PromptCache(pair)

    def run(ids):
        out = [t for ev in dflash_mlx.stream_generate(pair, ids, max_tokens=16, draft_source=source,
                                                      prompt_cache=cache, block_size="auto") for t in ev.tokens]
        assert out == plain_greedy(baselines["qwen3"], ids, 16)
        return out

    first = pair.tokenizer.encode("def add(a, b):\n    return a + b\n\ndef sub(a, b):\n")
    answer = run(first)
    then = first + answer + pair.tokenizer.encode("\ndef mul(a, b):\n")
    more = run(then)
    other = run(pair.tokenizer.encode("An unrelated prompt"))
    assert source.calls[0][1] == 0 and source.calls[2][1] == 0  # nothing kept starts them
    assert source.calls[1] == (len(then) + 1, len(first) + len(answer))  # the first turn's index, copied
    # What the copy grew into is the index of every token the second turn committed.
    grown = [i for i in source._kept if i.tokens[: len(then)] == then][0]
    assert grown.tokens == then + more
    fresh = NgramIndex(then + more)
    assert (grown.follow, grown.heads) == (fresh.follow, fresh.heads)
    assert len(source._kept) == WithLookup.KEEP and other
