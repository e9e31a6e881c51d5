"""Benchmark statistics and schema, the plain baseline, the oracle."""

import hashlib
import json
import time

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from typer.testing import CliRunner

import dflash_mlx
from dflash_mlx.cli.main import app
from dflash_mlx.target import baseline
from dflash_mlx import bench
from dflash_mlx.errors import DFlashError
from dflash_mlx.target.adapter import (GroupedAttention, TapedGatedDeltaNet, TappedLayer, VerifyQuantizedLinear,
                                      _SharedInput, _SharedOutput, wrap_quantized_linears)


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
        assert s["speedup_median_per_prompt"] == pytest.approx((per_prompt[0] + per_prompt[1]) / 2)
        assert sum(s["acceptance_histogram"].values()) == sum(
            len(r["dflash"][key]["acceptance_lengths"]) for r in result["prompts"]["mini"])
        for count in ("draft_cycles", "lookup_cycles", "tree_cycles"):
            assert s[count] == sum(r["dflash"][key][count] for r in result["prompts"]["mini"]) <= s["cycles"]
    assert result["overall"]["4"]["tree_cycles"] == 0  # a fixed width verifies linearly unless told
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

    def recording(pair, ids, max_tokens, params, block_size, source=None, grammar=None):
        r = real(pair, ids, max_tokens, params, block_size, source, grammar)
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
    assert s["overhead_seconds_per_cycle"] > 0 and s["verify_seconds_per_cycle"] > 0


def test_oracle_overhead_is_split_from_the_same_runs(pairs, monkeypatch):
    """The loop's own work and the bare verify passes are measured on each
    run's own cycles: a verify pass made slower shows in the verify time, not
    in the overhead, and the summary is the total of its runs."""
    pair, delay = pairs["qwen3"], 0.04  # well above the loop's own work per cycle on a busy 2-core machine
    monkeypatch.setattr(bench, "measure_cost_curve", None)  # no separately measured curve
    real, splits = type(pair.target).__call__, []

    def slow(*a, **k):  # the target's pass itself
        time.sleep(delay)
        return real(*a, **k)

    real_split = bench._oracle_split

    def spy(pair, ids, run, *a):
        out = real_split(pair, ids, run, *a)
        splits.append((len(run["acceptance_lengths"]), run["decode_seconds"], out))
        return out

    monkeypatch.setattr(type(pair.target), "__call__", slow)
    monkeypatch.setattr(bench, "_oracle_split", spy)
    prompts = {"mini": ["def add(a, b):", "import math"]}
    result = bench.run_bench(pair, prompts, max_tokens=24, block_sizes=[4], repeats=2, oracle=True)
    s = result["overall"]["4"]
    assert len(splits) == 4
    for cycles, seconds, out in splits:
        assert out["cycles"] == cycles and out["seconds"] == seconds
        assert out["verify_seconds"] >= delay * cycles > out["overhead_seconds"] > 0
    cycles = sum(c for c, _, _ in splits)
    assert s["seconds_per_cycle"] == pytest.approx(sum(o["seconds"] for _, _, o in splits) / cycles)
    assert s["verify_seconds_per_cycle"] == pytest.approx(sum(o["verify_seconds"] for _, _, o in splits) / cycles)
    assert s["overhead_seconds_per_cycle"] == pytest.approx(sum(o["overhead_seconds"] for _, _, o in splits) / cycles)
    assert 0 < s["overhead_seconds_per_cycle"] < delay <= s["verify_seconds_per_cycle"]
    assert delay <= s["seconds_per_cycle"]


def test_prompt_throughput_is_each_loops_own_on_the_same_prompt(pairs, monkeypatch):
    pair = pairs["llama"]
    seen, real_base, real_ours = [], bench.baseline_generate, bench._dflash_run

    def base(model, tok, ids, *a):
        seen.append(("baseline", list(ids)))
        return real_base(model, tok, ids, *a)

    def ours(pair, ids, *a):
        seen.append(("dflash", list(ids)))
        return real_ours(pair, ids, *a)

    monkeypatch.setattr(bench, "baseline_generate", base)
    monkeypatch.setattr(bench, "_dflash_run", ours)
    prompts = {"mini": ["import math", "def add(a, b):\n    return a + b\n\ndef sub(a, b):"]}
    result = bench.run_bench(pair, prompts, max_tokens=6, block_sizes=[4], repeats=2)
    longest = max((bench.build_prompt(pair.tokenizer, t) for t in prompts["mini"]), key=len)
    assert seen[0] == ("baseline", longest) and seen[1] == ("dflash", longest)  # warm-up on the longest prompt
    for row in result["prompts"]["mini"]:
        ids = bench.build_prompt(pair.tokenizer, row["prompt"])
        assert sorted(w for w, i in seen[2:] if i == ids) == ["baseline"] * 2 + ["dflash"] * 2
        assert row["baseline"]["prompt_tps"] > 0 and row["dflash"]["4"]["prompt_tps"] > 0
    s = result["overall"]["4"]
    assert s["prompt_speedup"] == pytest.approx(s["dflash_prompt_tps"] / s["baseline_prompt_tps"])


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
    assert "BLAS" in r.stdout and "speedup" in r.stdout
    assert "prompt processing: medians of mlx-lm's and our own figures" in " ".join(r.stdout.split())
    r = runner.invoke(app, ["bench", "--model", str(targets["qwen3"]), "--draft", str(drafters["old"]),
                            "--prompts", str(p), "-m", "8", "--block-size", "4", "--oracle"])
    assert r.exit_code == 0, r.output
    assert "the loop's own work" in " ".join(r.stdout.split())
    # The sweep's measurement in fewer rounds than its own (a 60 s budget, 8 rounds a context):
    # the command and its table are under test here, the measurement in test_adaptive.
    real = bench.measure_cost_curve
    monkeypatch.setattr(bench, "measure_cost_curve",
                        lambda *a, **k: real(*a, **dict(k, budget=3.0, min_rounds=3, split_rounds=3)))
    r = runner.invoke(app, ["bench", "--model", str(targets["qwen3"]), "--draft", str(drafters["old"]),
                            "--block-size", "sweep"])
    assert r.exit_code == 0, r.output
    assert "verify/1" in r.stdout and "draft/verify1" in r.stdout
    for args, words in [(["--block-size", "big"], "--block-size"), (["--suite", "poetry"], "--suite"),
                        (["--prompts", str(tmp_path / "none.jsonl")], "does not exist"),
                        (["--out", str(tmp_path / "no" / "r.json")], "folder does not exist"),
                        (["--out", str(tmp_path)], "it is a folder")]:
        r = runner.invoke(app, ["bench", "--model", str(targets["qwen3"]), "--draft", str(drafters["old"]), *args])
        assert r.exit_code == 1 and words in r.stderr, (args, r.stderr)


def wrappers(model):
    """Our wrapper classes found in a model instance."""
    kinds = (TappedLayer, TapedGatedDeltaNet, VerifyQuantizedLinear, GroupedAttention, _SharedInput, _SharedOutput)
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
    # A quantized linear's kernel wrapper nests inside the attention's shared projection wrappers.
    assert wrappers(pair.target.model) == {"TappedLayer", "TapedGatedDeltaNet", "VerifyQuantizedLinear",
                                           "GroupedAttention", "_SharedInput", "_SharedOutput"}
    plain = baseline.plain_target(pair)
    assert wrappers(plain) == set()
    assert any(isinstance(m, nn.QuantizedLinear) for _, m in plain.named_modules())
    x = mx.array([pair.tokenizer.encode("def add(a, b):")])
    assert mx.array_equal(plain(x), load(str(q))[0](x))


def test_shipped_suites():
    suites = bench.load_prompts("all")
    assert set(suites) == {"code", "math", "chat", "json"}
    assert all(len(suites[s]) == 12 for s in ("code", "math", "chat")) and len(suites["json"]) == 8
    assert all(isinstance(p, dict) and isinstance(p["schema"], dict) for p in suites["json"])


def test_machine_info_comes_from_mlx():
    m = bench.machine_info()
    assert m["chip"] == mx.device_info()["device_name"] and m["memory_gb"] > 0 and m["blas"]


def test_bench_by_context_length(targets, drafters, tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_MLX_CACHE", str(tmp_path))
    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"prompt": "import math"}) + "\n")
    out = tmp_path / "r.json"
    base = ["bench", "--model", str(targets["qwen3"]), "--draft", str(drafters["old"]), "--prompts", str(p),
            "-m", "8", "--block-size", "4"]
    r = CliRunner().invoke(app, base + ["--context", "300,1k", "--out", str(out)])
    assert r.exit_code == 0, r.output
    result = json.loads(out.read_text())
    assert list(result["contexts"]) == ["300", "1024"]
    for c, res in result["contexts"].items():
        bench.validate(res)
        (row,) = res["prompts"]["p"]
        assert abs(row["prompt_tokens"] - int(c)) <= 16 and res["settings"]["context"] == int(c)
        assert row["dflash"]["4"]["identical"]
    assert "each suite prompt after a long document" in " ".join(r.stdout.split())
    window = json.loads((targets["qwen3"] / "config.json").read_text())["max_position_embeddings"]
    for arg, words in [("8k", f"does not fit the model's window of {window} tokens"),
                       ("lots", "--context takes token counts")]:
        r = CliRunner().invoke(app, base + ["--context", arg])
        assert r.exit_code == 1 and words in r.stderr, r.stderr


def test_a_context_must_leave_room_for_the_answer_in_the_window(pairs):
    pair = pairs["qwen3"]
    window = pair.target.args.max_position_embeddings
    bench.check_context(pair, [window - 100], max_tokens=8)
    with pytest.raises(DFlashError, match=f"--context {window - 100} with 96 new tokens does not fit"):
        bench.check_context(pair, [window - 100], max_tokens=96)
    # Every context prompt is within the slack of its context.
    ids = bench.context_prompt(pair.tokenizer, "import math", 1000)
    assert abs(len(ids) - 1000) <= bench.CONTEXT_SLACK


def test_the_context_document_is_long_and_prompts_end_with_the_task(pairs):
    tok = pairs["qwen3"].tokenizer
    ids = bench.context_prompt(tok, "import math", 2000)
    assert abs(len(ids) - 2000) <= 16 and "\n\nimport math" in tok.decode(ids[-24:])
    assert "import" in tok.decode(ids[:200])  # the document: this package's code
    # Frozen: every version builds the same context prompts (a deliberate change updates this digest,
    # and figures taken before it no longer compare).
    assert hashlib.sha256(bench.document().encode()).hexdigest() == "e27c87ee3d6b32ac7dd227feea2780b980d0447517883a4b13b48fd7e9fe061b"
    assert bench.context_prompt(tok, "import math", 0) == bench.build_prompt(tok, "import math")


def test_our_peers_runner_describes_and_samples_exactly_its_settings():
    """Our runner's settings live in several tables (width and lookup, temperature,
    seeding, trees, the description written to the results): each names only settings
    it runs, every setting is described, and the sampled ones are exactly the "t1-*"
    settings, which the runner compares with mlx-lm's sampled decoding."""
    import importlib
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "peers" / "runners"))
    try:
        ours = importlib.import_module("ours")
    finally:  # the runners' generic module names stay out of the other tests' way
        sys.path.pop(0)
        sys.modules.pop("ours", None)
        sys.modules.pop("_common", None)
    settings = set(ours.BLOCKS)
    assert set(ours.DESCRIBED) == settings
    assert set(ours.TEMPS) == {s for s in settings if s.startswith("t1-")}
    assert ours.SEEDED <= set(ours.TEMPS) and set(ours.TREES) <= settings
    for s in settings:
        block, _ = ours.BLOCKS[s]
        assert f"block_size={block!r}" in ours.DESCRIBED[s]
        assert ("temp=1.0" in ours.DESCRIBED[s]) == (s in ours.TEMPS)


def test_peers_runner_pairs_runtimes_prompt_by_prompt():
    """The peers runner's paired figures: each row's median of per-prompt ratios to
    mlx-lm, and our default against each peer's default prompt by prompt (median and
    geometric mean of the ratios, the fastest peer by geomean), over the prompts both
    have a figure for (a one-token answer has none)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "peers_run", Path(__file__).resolve().parents[1] / "benchmarks" / "peers" / "run.py")
    run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run)

    def answers(tps):  # three prompts, two repeats each
        return [[{"tps": t, "cycles": 4, "cycle_tokens": 8, "ids": [1, 2]}] * 2 for t in tps]

    runs = {("mlxlm", "default"): answers([100.0, 200.0, 400.0]), ("ours", "default"): answers([300.0, 200.0, None]),
            ("zlab", "default"): answers([150.0, 100.0, 400.0]), ("dspark", "default"): answers([100.0, 400.0, 400.0])}
    summary = run.summarise(runs, list(runs), 3)
    assert summary["ours/default"]["ratio_median_per_prompt"] == pytest.approx(2.0)  # median of 3.0 and 1.0
    assert summary["zlab/default"]["ratio_median_per_prompt"] == pytest.approx(1.0)  # of 1.5, 0.5, 1.0
    h2h = run.head_to_head(summary)
    assert h2h["fastest_peer"] == "dspark/default"
    assert h2h["against"]["zlab/default"]["per_prompt"] == pytest.approx([2.0, 2.0])
    assert h2h["against"]["dspark/default"]["median"] == pytest.approx(1.75)  # of 3.0 and 0.5
    assert h2h["against"]["dspark/default"]["geomean"] == pytest.approx(1.5 ** 0.5)
    text = run.table({"summary": summary, "head_to_head": h2h})
    assert "ours/default vs dspark/default (the fastest peer default): 1.75x median per prompt" in text


def test_a_json_prompt_is_constrained_in_both_loops_and_its_answer_validated(pairs):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "maximum": 9,
                                                                               "minimum": 0}},
              "required": ["ok", "n"], "additionalProperties": False}
    result = bench.run_bench(pairs["qwen3"], {"json": [{"prompt": "status:", "schema": schema}]}, max_tokens=40,
                             block_sizes=[4])
    s = result["suites"]["json"]["4"]
    assert s["identical"] == 1 and s["stopped"] == 1 and s["invalid_prompts"] == [] and s["forced_tokens"] > 0
    row = result["prompts"]["json"][0]
    assert row["dflash"]["4"]["valid"] is True and row["baseline"]["generated_tokens"] < 40
    assert bench.validates('{"ok": true, "n": 3}', schema) and not bench.validates('{"ok": 1, "n": 3}', schema)
