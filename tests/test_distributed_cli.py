"""`dflash-mlx generate` under `mlx.launch`: the target sharded across the
processes, rank 0 printing what one process prints."""

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import DRAFTER_LAYOUT
from test_distributed import free_ports, ring_ports

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
LAUNCH = shutil.which("mlx.launch") or str(BIN / "mlx.launch")
CLI = shutil.which("dflash-mlx") or str(BIN / "dflash-mlx")

pytestmark = pytest.mark.skipif(not Path(LAUNCH).exists(), reason="mlx.launch is not installed")


def run(cmd, timeout=240):
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=dict(os.environ, TOKENIZERS_PARALLELISM="false"), start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        pytest.fail(f"hung for {timeout} s:\n{out}{err}")
    return p.returncode, out, err


def test_generate_under_mlx_launch_prints_what_one_process_prints(targets, drafters):
    args = ["generate", "--model", str(targets["qwen3"]), "--draft", str(drafters[DRAFTER_LAYOUT.get("qwen3", "new")]),
            "--prompt", "def add(a, b):", "--max-tokens", "24", "--no-chat-template"]
    rc, alone, alone_err = run([CLI, *args, "--block-size", "4"])
    assert rc == 0, alone_err
    rc, out, err = run([LAUNCH, "-n", "2", "--backend", "ring", "--starting-port", str(ring_ports()), "--",
                        CLI, *args])  # --block-size auto: the drafter's, on every rank
    assert rc == 0, out + err
    assert out == alone and out.strip()  # the same text, printed once (rank 0 only)
    assert err.count("[2 ranks]") == 1 and "times one machine" in err
    assert "rank 1" not in err


def test_bench_under_mlx_launch_compares_with_sharded_plain_decoding(targets, drafters, tmp_path):
    """mlx-lm's own plain decoding of the same sharded model is the baseline; the
    result says how many all_sums a pass makes and what they cost alone."""
    import json

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "def add(a, b):"}) + "\n")
    out = tmp_path / "bench.json"
    rc, stdout, err = run([LAUNCH, "-n", "2", "--backend", "ring", "--starting-port", str(ring_ports()), "--",
                           CLI, "bench", "--model", str(targets["llama"]),
                           "--draft", str(drafters[DRAFTER_LAYOUT.get("llama", "new")]),
                           "--prompts", str(prompts), "--max-tokens", "12", "--block-size", "4,auto", "--out", str(out)])
    assert rc == 0, stdout + err
    result = json.loads(out.read_text())
    d = result["distributed"]
    layers = json.loads((targets["llama"] / "config.json").read_text())["num_hidden_layers"]
    assert d["ranks"] == 2 and d["collectives_per_pass"] == 2 * layers  # o_proj and down_proj in each layer
    assert set(d["seconds_per_pass"]) >= {"1", "4"} and all(s > 0 for s in d["seconds_per_pass"].values())
    assert set(d["share"]) >= {"baseline", "4"}
    row = result["prompts"]["custom"][0] if "custom" in result["prompts"] else \
        next(iter(result["prompts"].values()))[0]
    assert all(v["identical"] for v in row["dflash"].values())  # equal to sharded mlx-lm greedy
    assert stdout.count("collectives per target pass") == 1 and "rank 1" not in err + stdout


def test_bench_under_pipeline_parallelism(targets, drafters, baselines, root, tmp_path):
    """`bench --sharding pipeline`: the baseline is mlx-lm's plain decoding of the
    same pipelined model (each rank loads its own layers); outputs identical."""
    import json

    from test_distributed import indexed_path

    path = indexed_path("qwen3_5", baselines["qwen3_5"], targets["qwen3_5"], root)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "def add(a, b):"}) + "\n")
    out = tmp_path / "bench.json"
    rc, stdout, err = run([LAUNCH, "-n", "2", "--backend", "ring", "--starting-port", str(ring_ports()), "--",
                           CLI, "bench", "--model", str(path), "--draft", str(drafters[DRAFTER_LAYOUT["qwen3_5"]]),
                           "--sharding", "pipeline", "--prompts", str(prompts), "--max-tokens", "10",
                           "--block-size", "4", "--out", str(out)])
    assert rc == 0, stdout + err
    result = json.loads(out.read_text())
    assert result["distributed"]["ranks"] == 2 and result["distributed"]["collectives_per_pass"] == 2
    row = next(iter(result["prompts"].values()))[0]
    assert all(v["identical"] for v in row["dflash"].values())


def test_serve_under_mlx_launch_keeps_the_ranks_in_step(targets, drafters):
    """Rank 0 serves HTTP and sends each request to the other rank, which runs it
    too: greedy answers equal one process's, before and after a sampled request
    and a stream the client left early (which ends on both ranks)."""
    import json
    import time
    import urllib.request

    import dflash_mlx

    model, draft = str(targets["qwen3"]), str(drafters[DRAFTER_LAYOUT.get("qwen3", "new")])
    port = free_ports(1)
    cmd = [LAUNCH, "-n", "2", "--backend", "ring", "--starting-port", str(ring_ports()), "--", CLI, "serve",
           "--model", model, "--draft", draft, "--port", str(port), "--block-size", "4"]
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=dict(os.environ, TOKENIZERS_PARALLELISM="false"), start_new_session=True)

    def post(body, timeout=120):
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        return urllib.request.urlopen(req, timeout=timeout)

    try:
        deadline = time.time() + 240
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5)
                break
            except OSError:
                if p.poll() is not None or time.time() > deadline:
                    pytest.fail(f"the server did not start:\n{p.stdout.read() if p.poll() is not None else ''}")
                time.sleep(1)
        pair = dflash_mlx.load(model, draft)

        def alone(prompt, n):
            return dflash_mlx.generate(pair, pair.tokenizer.encode(prompt), max_tokens=n, block_size=4)[0]

        first = json.loads(post({"prompt": "def add(a, b):", "max_tokens": 16, "temperature": 0}).read())
        assert first["choices"][0]["text"] == alone("def add(a, b):", 16)
        sampled = json.loads(post({"prompt": "Once upon", "max_tokens": 12, "temperature": 1.0}).read())
        assert sampled["usage"]["completion_tokens"] > 0
        with post({"prompt": "import math", "max_tokens": 64, "temperature": 0, "stream": True}) as stream:
            stream.readline()  # the first event, then the client goes away
        again = json.loads(post({"prompt": "The quick brown fox", "max_tokens": 16, "temperature": 0}).read())
        assert again["choices"][0]["text"] == alone("The quick brown fox", 16)
        assert p.poll() is None
    finally:
        os.killpg(p.pid, signal.SIGTERM)
        try:
            p.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)


@pytest.mark.parametrize("command", ["generate", "bench", "serve"])
def test_an_unknown_sharding_is_refused(command):
    from typer.testing import CliRunner

    from dflash_mlx.cli.main import app

    prompt = ["--prompt", "x"] if command == "generate" else []
    r = CliRunner().invoke(app, [command, "--model", "demo", *prompt, "--sharding", "diagonal"], env={"COLUMNS": "300"})
    assert r.exit_code == 1
    assert "--sharding must be one of auto, tensor, pipeline (got 'diagonal')" in r.output
