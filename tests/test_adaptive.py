"""The block-size policies and the cost curve behind `--block-size auto`."""

import json
import time
from types import SimpleNamespace

import mlx.core as mx
import pytest

import dflash_mlx
from dflash_mlx import adaptive
from dflash_mlx.adaptive import BlockSizer, CostCurve, CostSamples, FixedWidth
from dflash_mlx.sampling import SamplingParams

from conftest import plain_greedy


def curve(rows, contexts=(64,)):
    return CostCurve(list(contexts), rows, [[0.0] * len(rows[0]) for _ in rows], rows)


FLAT = [1.0 + 0.01 * (w - 1) for w in range(1, 17)]  # drafting always pays
STEEP = [1.0 * w for w in range(1, 17)]  # a w-token verify costs w tokens: it never does


def fake_cycle(seconds_per_width, made):
    """make_cycle for the measurement: a cycle at width w sleeps w * seconds_per_width."""

    def make(n):
        made.append(n)
        return (lambda w: mx.array([0] * (w - 1)),
                lambda w, tokens: time.sleep(w * seconds_per_width))

    return make


def test_measurement_keeps_to_its_budget_and_later_runs_refine_it():
    made = []
    tic = time.perf_counter()
    samples = adaptive.measure_cost_curve(fake_cycle(0.002, made), 8, contexts=(64, 1024), budget=0.25,
                                          tolerance=1e-6)
    took = time.perf_counter() - tic
    round_s = 0.002 * sum(range(1, 9))
    assert took < 0.25 + 3 * round_s  # the cap holds, give or take the round under way
    assert len(samples.cycle[0]) >= 3 and len(samples.parts[0]) == 1  # the first context always gets its rounds
    before = sum(len(r) for r in samples.cycle)
    adaptive.measure_cost_curve(fake_cycle(0.002, made), 8, budget=0.25, samples=samples, tolerance=1e-6)
    assert sum(len(r) for r in samples.cycle) > before  # a later run adds to the same samples
    assert all(len(r) >= 3 for r in samples.cycle)
    c = CostCurve.from_samples(samples)
    assert c.contexts == [64, 1024] and c.relative()[7] == pytest.approx(8.0, rel=0.25)


def test_a_context_that_does_not_fit_waits_for_a_later_run():
    made = []
    samples = adaptive.measure_cost_curve(fake_cycle(0.01, made), 8, contexts=(64, 1024), budget=0.5)
    assert made == [64] and samples.cycle[1] == []
    assert CostCurve.from_samples(samples).contexts == [64]  # usable meanwhile, clamped to what was measured


def test_load_or_measure_caches_per_key_and_refines_briefly(tmp_path):
    made = []
    first = adaptive.load_or_measure("k1", fake_cycle(0.001, made), 4, tmp_path, budget=0.2, refine=0.05,
                                     tolerance=1e-9, max_rounds=1000)
    stored = json.loads(next((tmp_path / "costs").glob("k1-*.json")).read_text())
    n = sum(len(r) for r in stored["cycle"])
    tic = time.perf_counter()
    again = adaptive.load_or_measure("k1", fake_cycle(0.001, made), 4, tmp_path, budget=0.2, refine=0.05,
                                     tolerance=1e-9, max_rounds=1000)
    assert time.perf_counter() - tic < 0.2  # a later run refines within its shorter budget
    stored = json.loads(next((tmp_path / "costs").glob("k1-*.json")).read_text())
    assert sum(len(r) for r in stored["cycle"]) > n and again.max_width == first.max_width == 4
    made.clear()
    done = adaptive.load_or_measure("k1", fake_cycle(0.001, made), 4, tmp_path, max_rounds=1)
    assert made == [] and done.max_width == 4  # settled (here: enough rounds): nothing more is measured


def test_curve_key_separates_quantization_dtype_and_blas(monkeypatch):
    def pair(quant=None, dtype=mx.float16, dquant=None):
        return SimpleNamespace(target_path="/t", draft_path="/d",
                               target=SimpleNamespace(quantization=quant, dtype=dtype),
                               drafter=SimpleNamespace(args=SimpleNamespace(quantization=dquant)))

    base = adaptive.curve_key(pair())
    assert adaptive.curve_key(pair()) == base
    assert adaptive.curve_key(pair(quant={"group_size": 64, "bits": 4})) != base
    assert adaptive.curve_key(pair(quant={"group_size": 64, "bits": 8})) != adaptive.curve_key(
        pair(quant={"group_size": 64, "bits": 4}))
    assert adaptive.curve_key(pair(dquant={"group_size": 64, "bits": 4})) != base
    assert adaptive.curve_key(pair(dtype=mx.bfloat16)) != base
    monkeypatch.setattr(adaptive, "blas_name", lambda: "another-blas")
    assert adaptive.curve_key(pair()) != base


def test_costs_are_not_extrapolated_beyond_the_measured_contexts():
    cheap_wide = [1.0 + 0.5 * (w - 1) for w in range(1, 17)]
    cheaper_wide = [2.0 + 0.1 * (w - 1) for w in range(1, 17)]
    c = curve([cheap_wide, cheaper_wide], contexts=(64, 1024))
    assert c.costs(10**6) == c.costs(1024)  # linear extrapolation would make wide blocks cost less than free
    assert c.costs(1) == c.costs(64)
    assert c.cost(8, 544) == pytest.approx((c.cost(8, 64) + c.cost(8, 1024)) / 2)


def test_explain_says_why_auto_decodes_plainly():
    steep = BlockSizer(curve([STEEP]), 16)
    why = steep.explain(64)
    assert "drafting does not pay here" in why and "16.0x one token" in why and "--block-size 16" in why
    assert BlockSizer(curve([FLAT]), 16).explain(64) is None


def test_seeded_requests_do_not_depend_on_earlier_ones():
    root = BlockSizer(curve([[1.0 + 0.15 * (w - 1) for w in range(1, 17)]]), 16)
    fresh = root.start(seeded=True).choose(64)
    for _ in range(200):
        root.update(16, 0)  # earlier requests' drafts all missed
    assert root.start().choose(64) < fresh  # an unseeded request follows them
    assert root.start(seeded=True).choose(64) == fresh  # a seeded one starts from the prior alone


def test_fixed_width_policy():
    p = FixedWidth(5)
    run = p.start(seeded=True)
    run.update(5, 2)
    assert run.choose(10) == 5 and run.choose(10**6) == 5


def install_curve(monkeypatch, pair, rows, contexts=(64,)):
    """Give the pair (for this test) an auto sizer over a synthetic cost curve: no timing."""
    monkeypatch.setattr(pair, "_sizer", BlockSizer(curve(rows, contexts), pair.draft_source.block_size))


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_auto_drafts_where_it_pays_and_stays_lossless(pairs, baselines, family, monkeypatch):
    pair = pairs[family]
    install_curve(monkeypatch, pair, [FLAT[: pair.draft_source.block_size]])
    prompt = pair.tokenizer.encode("def add(a, b):")
    events = list(dflash_mlx.stream_generate(pair, prompt, max_tokens=40, block_size="auto"))
    assert [t for ev in events for t in ev.tokens] == plain_greedy(baselines[family], prompt, 40)
    assert events[-1].stats.draft_cycles > 0  # auto did draft


def test_auto_beyond_the_measured_context_is_lossless(pairs, baselines, monkeypatch):
    pair = pairs["llama"]
    w = pair.draft_source.block_size
    install_curve(monkeypatch, pair, [FLAT[:w], [3.0 - 0.1 * (k - 1) for k in range(1, w + 1)]], contexts=(16, 64))
    text = " ".join(["The quick brown fox jumps over the lazy dog."] * 12)
    prompt = pair.tokenizer.encode(text)
    assert len(prompt) > 64
    events = list(dflash_mlx.stream_generate(pair, prompt, max_tokens=24, block_size="auto"))
    assert [t for ev in events for t in ev.tokens] == plain_greedy(baselines["llama"], prompt, 24)
    assert events[-1].stats.draft_cycles > 0


def test_same_seed_same_text_whatever_came_before(pairs, monkeypatch):
    pair = pairs["qwen3"]
    install_curve(monkeypatch, pair, [[1.0 + 0.15 * (k - 1) for k in range(1, pair.draft_source.block_size + 1)]])
    params = SamplingParams(temp=1.0, seed=11)
    prompt = pair.tokenizer.encode("Once upon a time")
    first, _ = dflash_mlx.generate(pair, prompt, max_tokens=30, sampling=params, block_size="auto")
    for _ in range(300):
        pair._sizer.update(pair.draft_source.block_size, 0)  # earlier requests taught the sizer to stay narrow
    dflash_mlx.generate(pair, "an unrelated request", max_tokens=10, sampling=SamplingParams(temp=1.0),
                        block_size="auto")
    again, _ = dflash_mlx.generate(pair, prompt, max_tokens=30, sampling=params, block_size="auto")
    assert again == first


def test_stop_string_ends_the_count_too(pairs):
    pair = pairs["qwen3"]
    tok = pair.tokenizer
    prompt = tok.encode("def add(a, b):")
    full = list(dflash_mlx.stream_generate(pair, prompt, max_tokens=30, block_size=4))
    ids = [t for ev in full for t in ev.tokens]
    text = "".join(ev.text for ev in full)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = text.index(stop)
    need = next(n for n in range(1, len(ids) + 1) if stop in tok.decode(ids[:n]))
    events = list(dflash_mlx.stream_generate(pair, prompt, max_tokens=30, block_size=4, stop=[stop]))
    assert "".join(ev.text for ev in events) == text[:cut]
    assert events[-1].finish_reason == "stop"
    kept = [t for ev in events for t in ev.tokens]
    assert kept == ids[:need] and events[-1].stats.generation_tokens == need < len(ids)
