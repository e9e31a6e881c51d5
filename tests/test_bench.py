"""Benchmark statistics and schema, cost-curve caching, adaptive block size."""

import json
import random

import mlx.core as mx
import mlx.nn as nn
import pytest
from conftest import plain_greedy
from mlx.utils import tree_flatten
from typer.testing import CliRunner

import dflash_mlx
from dflash_mlx.cli.main import app
from dflash_mlx import adaptive, baseline, bench
from dflash_mlx.adaptive import BlockSizer, CostCurve
from dflash_mlx.adapter import TapedGatedDeltaNet, TappedLayer, VerifyQuantizedLinear, wrap_quantized_linears


def curve(verify, draft=None, contexts=(64,)):
    rows = [list(verify)] if not isinstance(verify[0], list) else verify
    draft = draft or [[0.0] + [0.1 * rows[0][0]] * (len(rows[0]) - 1)] * len(rows)
    return CostCurve(list(contexts), rows, draft)


def feed(sizer, accept_prob, cycles=300, width=16):
    """Feed the sizer cycles whose drafts are accepted i.i.d. with accept_prob."""
    import random

    rnd = random.Random(0)
    for _ in range(cycles):
        a = 0
        while a < width - 1 and rnd.random() < accept_prob:
            a += 1
        sizer.update(width, a)


def brute_force_best(sizer, context):
    rates = {w: sizer.expected_tokens(w) / sizer.curve.cost(w, context) for w in range(1, sizer.max_width + 1)}
    return max(rates, key=rates.get)


def test_expected_tokens_from_acceptance_rates():
    s = BlockSizer(curve([1.0] * 16), 16, decay=0.995)
    feed(s, 0.8, cycles=2000)
    assert all(abs(a - 0.8) < 0.08 for a in s.alphas()[:4])  # ~200 effective observations (decay)
    a = s.alphas()
    assert s.expected_tokens(3) == pytest.approx(1 + a[0] + a[0] * a[1])
    assert abs(s.expected_tokens(8) - sum(0.8 ** k for k in range(8))) < 0.6


@pytest.mark.parametrize("accept, slope, lo, hi", [
    (0.9, 0.0, 16, 16),    # free verify: widest block
    (0.9, 0.15, 5, 16),
    (0.3, 0.15, 1, 3),     # poor drafter, costly width: small blocks
    (0.0, 0.05, 1, 1),     # nothing accepted: plain decoding
])
def test_choice_maximises_tokens_per_second(accept, slope, lo, hi):
    s = BlockSizer(curve([1.0 + slope * (w - 1) for w in range(1, 17)]), 16)
    feed(s, accept)
    b = s.choose(64)
    assert b == brute_force_best(s, 64)
    assert lo <= b <= hi


def test_choice_adapts_as_context_grows():
    flat = [1.0 + 0.01 * (w - 1) for w in range(1, 17)]
    steep = [3.0 + 0.6 * (w - 1) for w in range(1, 17)]
    s = BlockSizer(curve([flat, steep], contexts=(64, 4096)), 16)
    feed(s, 0.7)
    short, long = s.choose(64), s.choose(4096)
    assert short > long
    assert long == brute_force_best(s, 4096)
    assert s.curve.cost(8, 2080) == pytest.approx((s.curve.cost(8, 64) + s.curve.cost(8, 4096)) / 2)


def test_untested_depths_borrow_the_last_estimate():
    s = BlockSizer(curve([1.0] * 16), 16)
    feed(s, 1.0, cycles=50, width=4)  # only positions 1..3 ever checked
    a = s.alphas()
    assert a[2] > 0.9 and a[10] == pytest.approx(a[2], abs=0.05)


def test_a_request_starts_from_shared_statistics_and_then_follows_its_own():
    root = BlockSizer(curve([1.0 + 0.15 * (w - 1) for w in range(1, 17)]), 16)
    first = root.start()
    feed(first, 0.9)  # a drafter that copies well on this prompt
    wide = first.choose(64)
    assert wide >= 8 and root.alphas()[0] == pytest.approx(first.alphas()[0], abs=0.05)  # shared learnt it too
    second = root.start()
    assert second.choose(64) == wide  # the next request starts where the last one left off
    for _ in range(40):  # ... but this prompt's drafts all miss
        second.update(second.choose(64), 0)
    assert second.choose(64) <= 2
    assert root.start().choose(64) > 4  # the shared statistics move more slowly
    assert first.choose(64) == wide  # and leave other requests alone


def test_requests_record_into_the_shared_statistics_once():
    root = BlockSizer(curve([1.0] * 8), 8, decay=1.0)
    run = root.start()
    run.update(8, 3)
    assert root.shared.tried[1:5] == [1.0] * 4 and root.shared.accepted[1:5] == [1.0, 1.0, 1.0, 0.0]
    root.update(8, 3)  # the root records into the shared statistics directly
    assert root.shared.tried[1] == 2.0


def test_curve_profile_ignores_drift_between_rounds():
    shape = [0.5] + [0.8 + 0.03 * w for w in range(1, 16)]
    rnd = random.Random(0)
    rounds = []
    for r in range(15):
        speed = rnd.uniform(0.6, 1.6)  # the whole machine runs faster or slower this round
        rounds.append([speed * c * rnd.uniform(0.97, 1.03) for c in shape])
    rounds[3][5] *= 20  # one cycle stalled by something else
    got = adaptive.profile(rounds)
    scale = got[0] / shape[0]
    assert all(g / scale == pytest.approx(c, rel=0.03) for g, c in zip(got, shape))
    # A plain per-width median, as before, bends the shape under such drift.
    plain = [sorted(col)[len(col) // 2] for col in zip(*rounds)]
    assert max(abs(p / plain[0] * shape[0] / c - 1) for p, c in zip(plain, shape)) > 0.05


def test_curve_measurement_stops_once_settled():
    rnd = random.Random(0)
    quiet = [[c * rnd.uniform(0.995, 1.005) for c in (1.0, 2.0, 3.0)] for _ in range(5)]
    noisy = [[c * rnd.uniform(0.7, 1.3) for c in (1.0, 2.0, 3.0)] for _ in range(5)]
    assert adaptive.settled(quiet, 0.01) and not adaptive.settled(noisy, 0.01)
    assert not adaptive.settled(quiet[:2], 0.01)  # too few rounds to tell


def test_narrow_cycles_do_not_erase_deeper_statistics():
    s = BlockSizer(curve([1.0] * 16), 16)
    feed(s, 0.95, cycles=300)
    before = s.alphas()
    for _ in range(2000):
        s.update(1, 0)  # width 1 checks no draft position
    assert s.alphas() == before


def test_choice_sticks_unless_clearly_better():
    s = BlockSizer(curve([1.0] * 16), 16, stick=1.5)
    feed(s, 0.5, cycles=400)
    first = s.choose(64)
    for _ in range(40):  # acceptance improves a little: not enough to move
        s.update(16, 2)
    assert s.choose(64) == first


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_auto_block_size_is_lossless(pairs, baselines, family, monkeypatch, tmp_path):
    monkeypatch.setenv("DFLASH_MLX_CACHE", str(tmp_path))
    pair = pairs[family]
    prompt = pair.tokenizer.encode("def add(a, b):")
    tokens = [t for ev in dflash_mlx.stream_generate(pair, prompt, max_tokens=40, block_size="auto")
              for t in ev.tokens]
    assert tokens == plain_greedy(baselines[family], prompt, 40)


def test_bench_json_schema_and_identical_check(pairs, tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_MLX_CACHE", str(tmp_path))
    pair = pairs["llama"]
    prompts = {"mini": ["def add(a, b):", "import math"]}
    result = bench.run_bench(pair, prompts, max_tokens=12, block_sizes=[4, "auto"])
    bench.validate(result)
    json.dumps(result)
    for key in ("4", "auto"):
        s = result["overall"][key]
        assert s["identical"] == 2 and s["mismatched_prompts"] == []
        assert s["speedup"] == pytest.approx(s["dflash_tps"] / s["baseline_tps"])
        per_prompt = [r["dflash"][key]["generation_tps"] / r["baseline"]["generation_tps"]
                      for r in result["prompts"]["mini"]]
        assert s["speedup_geomean"] == pytest.approx((per_prompt[0] * per_prompt[1]) ** 0.5)
        assert sum(s["acceptance_histogram"].values()) == sum(
            len(r["dflash"][key]["acceptance_lengths"]) for r in result["prompts"]["mini"])
    assert result["machine"]["blas"] and result["machine"]["backend"]


def test_bench_flags_a_mismatch(pairs, tmp_path, monkeypatch):
    pair = pairs["qwen3"]
    real = bench._dflash_run

    def corrupt(*a, **k):
        r = real(*a, **k)
        r["tokens"] = r["tokens"][:-1] + [(r["tokens"][-1] + 1) % 300]
        return r

    monkeypatch.setattr(bench, "_dflash_run", corrupt)
    result = bench.run_bench(pair, {"mini": ["import math"]}, max_tokens=8, block_sizes=[4])
    assert result["overall"]["4"]["identical"] == 0
    assert result["overall"]["4"]["mismatched_prompts"] == ["import math"]


def test_repeats_interleave_settings_and_each_repeat_is_checked(pairs, monkeypatch):
    pair = pairs["qwen3"]
    real, calls = bench._dflash_run, []

    def recording(pair, ids, max_tokens, params, block_size, source=None):
        r = real(pair, ids, max_tokens, params, block_size, source)
        calls.append(block_size)
        if block_size == 4 and calls.count(4) == 3:  # the second measured repeat of block 4 goes wrong
            r["tokens"] = r["tokens"][:-1] + [(r["tokens"][-1] + 1) % 300]
        return r

    monkeypatch.setattr(bench, "_dflash_run", recording)
    result = bench.run_bench(pair, {"mini": ["import math"]}, max_tokens=8, block_sizes=[2, 4], repeats=2)
    assert calls[:2] == [2, 4] and sorted(calls[2:4]) == sorted(calls[4:]) == [2, 4]  # warm-up, then each once per repeat
    assert result["overall"]["2"]["identical"] == 1 and result["overall"]["4"]["identical"] == 0


def test_oracle_accepts_every_block_and_reports_overhead(pairs):
    pair = pairs["qwen3_5"]
    result = bench.run_bench(pair, {"mini": ["def add(a, b):"]}, max_tokens=33, block_sizes=[8], oracle=True)
    s = result["overall"]["8"]
    hist = {int(k): v for k, v in s["acceptance_histogram"].items()}
    assert hist[8] >= 3 and set(hist) <= {1, 2, 8}
    assert s["identical"] == 1
    assert "overhead_seconds_per_cycle" in s and s["verify_seconds"] > 0


def test_bench_cli_and_bad_flags(targets, drafters, tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_MLX_CACHE", str(tmp_path))
    runner = CliRunner()
    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"prompt": "import math"}) + "\n")
    out = tmp_path / "r.json"
    r = runner.invoke(app, ["bench", "--model", str(targets["qwen3"]), "--draft", str(drafters["old"]),
                            "--prompts", str(p), "-m", "8", "--block-size", "2,auto", "--out", str(out)])
    assert r.exit_code == 0, r.output
    bench.validate(json.loads(out.read_text()))
    assert "BLAS" in r.stderr and "speedup" in r.stderr
    r = runner.invoke(app, ["bench", "--model", str(targets["qwen3"]), "--draft", str(drafters["old"]),
                            "--block-size", "sweep"])
    assert r.exit_code == 0, r.output
    assert "verify/1" in r.stderr and "draft/verify1" in r.stderr
    for args, words in [(["--block-size", "big"], "--block-size"), (["--suite", "poetry"], "--suite"),
                        (["--prompts", str(tmp_path / "none.jsonl")], "does not exist"),
                        (["--out", str(tmp_path / "no" / "r.json")], "folder does not exist"),
                        (["--out", str(tmp_path)], "it is a folder")]:
        r = runner.invoke(app, ["bench", "--model", str(targets["qwen3"]), "--draft", str(drafters["old"]), *args])
        assert r.exit_code == 1 and words in r.stderr, (args, r.stderr)


def wrappers(model):
    """Our wrapper classes found in a model instance."""
    kinds = (TappedLayer, TapedGatedDeltaNet, VerifyQuantizedLinear)
    return {type(m).__name__ for _, m in model.named_modules() if isinstance(m, kinds)}


def test_baseline_is_plain_mlx_lm_on_an_unwrapped_target(pairs, monkeypatch):
    pair = pairs["qwen3_5"]
    assert wrappers(pair.target.model) >= {"TappedLayer", "TapedGatedDeltaNet"}
    models, real = [], bench.baseline_generate

    def spy(model, *a, **k):
        models.append(model)
        return real(model, *a, **k)

    monkeypatch.setattr(bench, "baseline_generate", spy)
    result = bench.run_bench(pair, {"mini": ["def add(a, b):", "import math"]}, max_tokens=16, block_sizes=[4])
    assert len(models) == 3  # warm-up, then one per prompt
    for m in models:
        assert m is not pair.target.model and wrappers(m) == set(), wrappers(m)
    assert result["overall"]["4"]["identical"] == 2  # its greedy output is DFlash's


def test_plain_target_holds_the_pairs_weights_in_their_dtype(targets, drafters):
    pair = dflash_mlx.load(str(targets["qwen3"]), str(drafters["old"]))
    # Not the files' dtype (float32), as load() casts the demo pair on CPU.
    pair.target.model.set_dtype(mx.float16)
    plain = baseline.plain_target(pair)
    assert wrappers(plain) == set()
    assert {v.dtype for _, v in tree_flatten(plain.parameters())} == {mx.float16}
    x = mx.array([pair.tokenizer.encode("def add(a, b):")])
    assert mx.array_equal(plain(x), pair.target.model(x))


def test_plain_target_unwraps_nested_quantized_wrappers(targets, drafters, tmp_path):
    from mlx_lm import convert, load

    q = tmp_path / "q4"
    convert(str(targets["qwen3_5"]), str(q), quantize=True, q_group_size=32, q_bits=4)
    pair = dflash_mlx.load(str(q), str(drafters["new"]))
    wrap_quantized_linears(pair.target.model)  # as the adapter does where a kernel runs (a GPU)
    assert wrappers(pair.target.model) == {"TappedLayer", "TapedGatedDeltaNet", "VerifyQuantizedLinear"}
    plain = baseline.plain_target(pair)
    assert wrappers(plain) == set()
    assert any(isinstance(m, nn.QuantizedLinear) for _, m in plain.named_modules())
    x = mx.array([pair.tokenizer.encode("def add(a, b):")])
    assert mx.array_equal(plain(x), load(str(q))[0](x))


def test_shipped_suites():
    suites = bench.load_prompts("all")
    assert set(suites) == {"code", "math", "chat"} and all(len(v) == 12 for v in suites.values())
