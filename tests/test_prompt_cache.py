"""The prompt cache: a request that starts from kept caches gives exactly the
tokens a cold run gives, and reuses what it should."""

import mlx.core as mx
import pytest
import tiny
from conftest import FAMILIES, ScriptedWidths, plain_greedy

import dflash_mlx
from dflash_mlx.policy.plan import Plan
from dflash_mlx.decode.passes import prefill
from dflash_mlx.errors import DFlashError
from dflash_mlx.cache.prompt_cache import PromptCache

# Lookup copies, plain steps (one launched ahead) and drafter blocks, so caches
# end after every kind of cycle.
WIDTHS = [Plan(4, 3), 1, 1, 8, Plan(8, 2), 3]


def run(pair, prompt, cache=None, max_tokens=24, widths=WIDTHS, **kw):
    tokens, events = [], []
    for ev in dflash_mlx.stream_generate(pair, prompt, max_tokens=max_tokens, block_size=ScriptedWidths(widths),
                                         prompt_cache=cache, **kw):
        tokens += ev.tokens
        events.append(ev)
    return tokens, events[-1].stats


@pytest.mark.parametrize("family", FAMILIES)
def test_a_growing_conversation_reuses_the_last_answer(pairs, baselines, family):
    pair, tok = pairs[family], pairs[family].tokenizer
    cache = PromptCache(pair)
    prompt = tok.encode("Once upon a time there was a tiny language model that could count: one two")
    prev = []
    for turn in range(3):
        warm, stats = run(pair, prompt, cache)
        cold, _ = run(pair, prompt)
        assert warm == cold == plain_greedy(baselines[family], prompt, 24)
        if turn:
            # Everything the last request computed is reused: its prompt and
            # answer but the last token (or all of it when a step ran ahead).
            assert stats.cached_tokens >= len(prev) - 1 and stats.cached_tokens < len(prompt)
        else:
            assert stats.cached_tokens == 0
        prev = prompt + warm
        prompt = prev + tok.encode(f" turn {turn} def add(a, b):")
    assert cache.hits == 2 and cache.misses == 1


@pytest.mark.parametrize("family", FAMILIES)
def test_a_branch_reuses_the_common_prefix_where_the_cache_can_be_trimmed(pairs, baselines, family):
    pair, tok = pairs[family], pairs[family].tokenizer
    cache = PromptCache(pair)
    base = tok.encode("The quick brown fox jumps over the lazy dog. import math")
    run(pair, base + tok.encode(" print(math.sqrt(2))"), cache)
    branch = base + tok.encode(" for i in range(10):")
    warm, stats = run(pair, branch, cache)
    assert warm == plain_greedy(baselines[family], branch, 24)
    if family == "qwen3_5":
        # Recurrent states are kept at the end of a prompt and of an answer only.
        assert stats.cached_tokens == 0
    else:
        common = next(i for i, (a, b) in enumerate(zip(branch, base + tok.encode(" print(math.sqrt(2))"))) if a != b)
        assert stats.cached_tokens == common


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_the_same_prompt_again_and_its_own_prefix(pairs, baselines, family):
    pair, tok = pairs[family], pairs[family].tokenizer
    cache = PromptCache(pair)
    prompt = tok.encode("for i in range(10):\n    print(i * i)\n")
    first, _ = run(pair, prompt, cache)
    again, stats = run(pair, prompt, cache)
    assert again == first == plain_greedy(baselines[family], prompt, 24)
    assert stats.cached_tokens == len(prompt) - 1  # the snapshot at the end of the prompt
    shorter = prompt[:-3]
    warm, stats = run(pair, shorter, cache)
    assert warm == plain_greedy(baselines[family], shorter, 24)
    assert stats.cached_tokens == (0 if family == "qwen3_5" else len(shorter) - 1)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_a_stop_string_with_a_cycle_in_flight_leaves_exact_caches(pairs, baselines, family):
    pair, tok = pairs[family], pairs[family].tokenizer
    prompt = tok.encode("Once upon a time there was a tiny language model")
    full = plain_greedy(baselines[family], prompt, 40)
    stop = tok.decode(full[6:8])
    for widths in ([8], [1], [Plan(4, 3), 8]):
        cache = PromptCache(pair)
        answer, stats = run(pair, prompt, cache, max_tokens=40, widths=widths, stop=[stop])
        assert stats.finish_reason == "stop"
        nxt = prompt + answer + tok.encode(" and then")
        warm, stats = run(pair, nxt, cache, widths=widths)
        assert warm == plain_greedy(baselines[family], nxt, 24)
        assert stats.cached_tokens >= len(prompt)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_a_request_stopped_early_keeps_what_it_computed(pairs, baselines, family):
    """A caller that stops reading (a client that left) ends the request as a stop string
    would, alone (the generator closed with a cycle in flight) or in a batch (`remove`): the
    prompt cache keeps what it computed, and the next turn from there is still exact."""
    from dflash_mlx.decode.decoder import Decoder

    pair, tok = pairs[family], pairs[family].tokenizer
    prompt = tok.encode("Once upon a time there was a tiny language model")
    for alone in (True, False):
        cache, answer = PromptCache(pair), []
        if alone:
            events = dflash_mlx.stream_generate(pair, prompt, max_tokens=40, block_size=ScriptedWidths([4, 1, 1]),
                                                prompt_cache=cache)
            for ev in events:
                answer += ev.tokens
                if len(answer) >= 6:
                    break
            events.close()
        else:
            dec = Decoder(pair, 4, prompt_cache=cache)
            first = dec.add(prompt, 40)
            answer = list(first.tokens)
            while len(answer) < 6:
                answer += dec.step(4 if len(answer) % 2 else 1)[0].tokens
            dec.remove(first.uid)
            dec.keep()
            assert len(dec) == 0
        assert cache.reach(pair.target, pair.draft_source, prompt + answer) >= len(prompt) + len(answer) - 1
        nxt = prompt + answer + tok.encode(" and then")
        warm, stats = run(pair, nxt, cache)
        assert warm == plain_greedy(baselines[family], nxt, 24), alone
        assert stats.cached_tokens >= len(prompt) + len(answer) - 1, alone


def test_sampling_with_a_seed_gives_the_cold_text(pairs):
    pair, tok = pairs["qwen3"], pairs["qwen3"].tokenizer
    cache = PromptCache(pair)
    prompt = tok.encode("A small model proposes, a large model disposes.")
    params = dflash_mlx.SamplingParams(temp=1.0, seed=7)
    first, _ = run(pair, prompt, cache, sampling=params)
    nxt = prompt + first + tok.encode(" Speculative")
    cold, _ = run(pair, nxt, sampling=params)
    warm, stats = run(pair, nxt, cache, sampling=params)
    assert warm == cold and stats.cached_tokens > len(prompt)


def test_the_drafter_context_is_restored():
    """The trained demo drafter sees the same context warm as cold: its
    drafts, and so the accepted counts of every cycle, are the same."""
    pair = dflash_mlx.load("demo")
    tok = pair.tokenizer
    cache = PromptCache(pair)
    prompt = tok.encode("def mean(values):\n    total = 0\n    for v in values:\n")
    first, _ = run(pair, prompt, cache, max_tokens=40, widths=[8, 1, 1])
    nxt = prompt + first + tok.encode("\ndef median(values):\n")
    cold = [(e.tokens, e.accepted) for e in dflash_mlx.stream_generate(pair, nxt, max_tokens=48, block_size=8)]
    warm = [(e.tokens, e.accepted) for e in
            dflash_mlx.stream_generate(pair, nxt, max_tokens=48, block_size=8, prompt_cache=cache)]
    assert warm == cold
    assert sum(a for _, a in cold) >= len(cold) // 2  # drafts are accepted: the context matters

    # The kept context is every row the target holds, equal to a cold prefill's.
    source = pair.draft_source
    tcache, state, n = cache.fetch(pair.target, source, nxt)
    assert n == len(nxt) - 1 and all(c.offset == n for c in tcache)
    kept = source.save(state)
    cold_t, cold_s = pair.target.make_cache(), source.new_state()
    _, taps = prefill(pair.target, source, cold_s, mx.array(nxt), cold_t)
    source.add_context(cold_s, mx.concatenate(taps, axis=1)[:, :n])
    for r, c in zip(kept, source.save(cold_s)):
        assert r.cache.length == c.cache.length == n
        assert mx.allclose(r.cache.keys[..., :n, :], c.cache.keys[..., :n, :], atol=1e-4).item()
        assert mx.allclose(r.cache.values[..., :n, :], c.cache.values[..., :n, :], atol=1e-4).item()


def test_bounded_by_bytes_and_bound_to_one_pair(pairs):
    pair = pairs["qwen3"]
    probe = PromptCache(pair)
    run(pair, pair.tokenizer.encode("import math"), probe)
    one = probe.nbytes
    cache = PromptCache(pair, max_bytes=int(2.5 * one))
    for text in ["import math", "The quick brown fox", "A small model proposes", "for i in range(10):"]:
        run(pair, pair.tokenizer.encode(text), cache)
        assert cache.nbytes <= 2.5 * one
    assert len(cache) == 2
    with pytest.raises(DFlashError, match="another model"):
        run(pairs["llama"], pair.tokenizer.encode("import math"), cache)


@pytest.mark.parametrize("family", ["gemma4_text", "gpt_oss", "qwen3_next"])
def test_sliding_window_and_other_families_reuse_exact_prefixes(root, tokenizer_dir, vocab, drafters, family):
    """Sliding-window caches keep only a few rows beyond the window, so like
    recurrent states they are reused for their whole prefix (snapshots at the
    end of the prompt and of the answer); the windows wrap during the test."""
    from mlx_lm import load

    path = tiny.build_target(root / f"cache-{family}", family, tokenizer_dir, vocab[0])
    pair, model = dflash_mlx.load(str(path), str(drafters["old"])), load(str(path))[0]
    tok = pair.tokenizer
    cache = PromptCache(pair)
    prompt = tok.encode("Once upon a time there was a tiny language model that could count: one two")
    prev = []
    for turn in range(3):
        warm, stats = run(pair, prompt, cache)
        assert warm == plain_greedy(model, prompt, 24)
        assert stats.cached_tokens == (0 if turn == 0 else len(prev) - 1) or stats.cached_tokens == len(prev)
        prev = prompt + warm
        prompt = prev + tok.encode(f" turn {turn} def add(a, b):")
    branch = prompt[:20] + tok.encode(" import math")
    warm, stats = run(pair, branch, cache)
    assert warm == plain_greedy(model, branch, 24) and stats.cached_tokens == 0
    again, stats = run(pair, branch, cache)
    assert again == warm and stats.cached_tokens == len(branch) - 1


class _Rows:
    """A stand-in layer cache: its size, and whether it can be trimmed (`trim` counts rows)."""

    def __init__(self, nbytes, trimmable=True):
        self.nbytes, self.trimmable, self.trimmed = nbytes, trimmable, 0

    def is_trimmable(self):
        return self.trimmable

    def trim(self, n):
        self.trimmed += n
        return n


def test_the_bound_evicts_the_least_recently_stored_or_used_and_hands_it_over():
    from dflash_mlx.cache.prompt_cache import _Lru

    evicted = []
    lru = _Lru(max_entries=3, max_bytes=100, evicted=evicted)
    for t in ([1, 2], [5, 6], [7, 8]):
        lru.insert("m", t, [_Rows(10, trimmable=False)])
    cache, rest = lru.nearest("m", [1, 2, 3])  # a use: [1, 2] is now the most recent
    assert rest == [3] and cache[0].nbytes == 10
    lru.insert("m", [9], [_Rows(10, trimmable=False)])
    assert [t for _, t, _ in evicted] == [[5, 6]] and len(lru) == 3 and lru.nbytes == 30
    assert lru.holds("m", [1, 2]) and not lru.holds("m", [5, 6])
    lru.insert("m", [4], [_Rows(85, trimmable=False)])  # over both bounds: oldest first until it fits
    assert [t for _, t, _ in evicted] == [[5, 6], [7, 8], [1, 2]] and lru.nbytes == 95
    # A trimmable entry replaces its prefixes' entries (it serves them), which are not handed over.
    lru.insert("m", [4, 1], [_Rows(5)])
    assert not lru.holds("m", [4]) and lru.nbytes == 15 and len(evicted) == 3
    # A longer entry serves a shorter prompt, trimmed to the common prefix (its last token runs again).
    cache, rest = lru.nearest("m", [4])
    assert rest == [4] and cache[0].trimmed == 2
    lru.trim_to(0, 0)
    assert len(lru) == 0 and lru.nbytes == 0 and evicted[-1][1] == [4, 1]
