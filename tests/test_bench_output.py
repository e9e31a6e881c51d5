"""What `dflash-mlx bench` prints and writes: results on stdout, progress on stderr, tables
uncut at any width, a partial result when it is interrupted, counts in the right number."""

import io
import json
import os
import re
import subprocess
import sys

import pytest
from rich.console import Console
from typer.testing import CliRunner

from dflash_mlx import bench
from dflash_mlx.cli.bench import _print_bench
from dflash_mlx.cli.main import app
from dflash_mlx.decode.events import GenerationStats

HEADER_WORDS = ("suite", "block", "baseline", "DFlash", "tok/s", "speedup", "accept.", "identical", "prompt",
                "ratio", "TTFT", "ms")


@pytest.fixture(scope="module")
def result(pairs):
    return bench.run_bench(pairs["qwen3"], {"code": ["import math"], "chat": ["def add(a, b):"]}, max_tokens=8,
                           block_sizes=[4, "auto"])


def printed(result, console):
    _print_bench(result, 0.0, console)
    return console.file.getvalue()


def test_off_a_terminal_tables_take_their_natural_width(result):
    text = printed(result, Console(file=io.StringIO(), width=80, force_terminal=False))
    assert "…" not in text
    for word in HEADER_WORDS:
        assert word in text, word
    # Each row on one line, all three speedup figures in it, however wide that is.
    rows = [line for line in text.splitlines() if line.startswith("│ overall")]
    assert len(rows) == 4 and max(len(line) for line in text.splitlines()) > 80
    assert all(re.search(r"\d\.\d\dx \(\d+\.\d\dx, \d+\.\d\dx\)", line) for line in rows[:2]), rows


def test_on_a_narrow_terminal_no_header_is_cut(result):
    text = printed(result, Console(file=io.StringIO(), width=80, force_terminal=True, color_system=None))
    assert "…" not in text
    for word in HEADER_WORDS:
        assert word in text, word
    table_lines = [line for line in text.splitlines() if line[:1] in "┏┃┡│└"]
    assert table_lines and max(len(line) for line in table_lines) <= 80


def test_results_go_to_stdout_and_progress_to_stderr(targets, drafters, tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_MLX_CACHE", str(tmp_path))
    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"prompt": "import math"}) + "\n")
    out = tmp_path / "r.json"
    r = CliRunner().invoke(app, ["bench", "--model", str(targets["qwen3"]), "--draft", str(drafters["old"]),
                                 "--prompts", str(p), "-m", "8", "--block-size", "4", "--out", str(out)],
                           env={"COLUMNS": "80"})
    assert r.exit_code == 0, r.output
    assert "BLAS" in r.stdout and "baseline tok/s" in r.stdout and "accept." in r.stdout
    assert "prompt processing: medians" in r.stdout and "…" not in r.stdout
    assert r.stderr.startswith("benchmark ...") and f"wrote {out}" in r.stderr
    assert "BLAS" not in r.stderr and "benchmark" not in r.stdout and "wrote" not in r.stdout
    assert json.loads(out.read_text())["partial"] is False


def interrupt_on_call(monkeypatch, n):
    """Ctrl-C during the n-th DFlash run (the warm-up's count)."""
    real, calls = bench._dflash_run, []

    def run(*a, **k):
        calls.append(1)
        if len(calls) == n:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(bench, "_dflash_run", run)


def test_an_interrupted_run_returns_what_it_measured(pairs, monkeypatch):
    prompts = {"code": ["import math", "def add(a, b):"], "chat": ["hello"]}
    interrupt_on_call(monkeypatch, 3)  # warm-up, the first prompt, then the second prompt's run
    with pytest.raises(bench.Interrupted) as stopped:
        bench.run_bench(pairs["qwen3"], prompts, max_tokens=8, block_sizes=[4])
    r = stopped.value.result
    bench.validate(r)
    json.dumps(r)
    assert r["partial"] is True and (r["prompts_measured"], r["prompts_planned"]) == (1, 3)
    assert list(r["prompts"]) == ["code"] and len(r["prompts"]["code"]) == 1 and list(r["suites"]) == ["code"]
    assert r["overall"]["4"]["prompts"] == 1 and r["overall"]["4"]["identical"] == 1
    assert "partial results: 1 of 3 prompts measured" in printed(r, Console(file=io.StringIO()))

    interrupt_on_call(monkeypatch, 1)  # in the warm-up: nothing measured, and the summary still holds
    with pytest.raises(bench.Interrupted) as stopped:
        bench.run_bench(pairs["qwen3"], prompts, max_tokens=8, block_sizes=[4, "auto"])
    r = stopped.value.result
    assert r["prompts_measured"] == 0 and r["suites"] == {} and r["overall"]["4"]["speedup"] is None
    assert "n/a" in printed(r, Console(file=io.StringIO()))


def test_an_interrupted_context_run_writes_the_contexts_measured(targets, drafters, tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_MLX_CACHE", str(tmp_path))
    p = tmp_path / "p.jsonl"
    p.write_text(json.dumps({"prompt": "import math"}) + "\n")
    out = tmp_path / "r.json"
    interrupt_on_call(monkeypatch, 4)  # each context: a warm-up, then the prompt
    r = CliRunner().invoke(app, ["bench", "--model", str(targets["qwen3"]), "--draft", str(drafters["old"]),
                                 "--prompts", str(p), "-m", "8", "--block-size", "4", "--context", "300,1k",
                                 "--out", str(out)])
    assert r.exit_code == 130, r.output
    result = json.loads(out.read_text())
    assert result["partial"] is True and (result["prompts_measured"], result["prompts_planned"]) == (1, 2)
    assert list(result["contexts"]) == ["300"] and result["contexts"]["300"]["partial"] is False
    assert "interrupted: 1 of 2 prompts measured" in r.stderr and "each suite prompt after" in r.stdout
    # Interrupted before any prompt is done: an earlier results file is left as it was.
    interrupt_on_call(monkeypatch, 1)
    r = CliRunner().invoke(app, ["bench", "--model", str(targets["qwen3"]), "--draft", str(drafters["old"]),
                                 "--prompts", str(p), "-m", "8", "--block-size", "4", "--out", str(out)])
    assert r.exit_code == 130 and "interrupted before a prompt was measured" in r.stderr
    assert json.loads(out.read_text()) == result


# Runs the command in a process that signals itself right after its third DFlash run
# (the warm-up's, the first prompt's, the second prompt's): the first prompt is measured,
# the second is not, whatever the machine's speed.
SELF_SIGNAL = """
import os, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)  # a background job may inherit it ignored
from dflash_mlx import bench
sig, real, calls = getattr(signal, sys.argv[1]), bench._dflash_run, []
def run(*a, **k):
    out = real(*a, **k)
    calls.append(1)
    if len(calls) == 3:
        os.kill(os.getpid(), sig)
    return out
bench._dflash_run = run
from dflash_mlx.cli.main import app
sys.argv = ["dflash-mlx", *sys.argv[2:]]
app()
"""


@pytest.mark.parametrize("name,code", [("SIGINT", 130), ("SIGTERM", 143)])
def test_a_signal_writes_the_prompts_measured_and_exits_128_plus_its_number(targets, drafters, tmp_path, name,
                                                                            code):
    p = tmp_path / "p.jsonl"
    p.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in ("import math", "def add(a, b):", "x = 1")))
    out = tmp_path / "r.json"
    out.write_text("an earlier run's results\n")
    r = subprocess.run([sys.executable, "-c", SELF_SIGNAL, name, "bench", "--model", str(targets["qwen3"]),
                        "--draft", str(drafters["old"]), "--prompts", str(p), "-m", "8", "--block-size", "4",
                        "--out", str(out)], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, DFLASH_MLX_CACHE=str(tmp_path / "cache")))
    assert r.returncode == code, r.stderr
    result = json.loads(out.read_text())
    assert result["partial"] is True and (result["prompts_measured"], result["prompts_planned"]) == (1, 3)
    assert result["prompts"]["p"][0]["prompt"] == "import math"
    assert "partial results: 1 of 3 prompts measured" in r.stdout and "baseline tok/s" in r.stdout
    assert "interrupted: 1 of 3 prompts measured" in r.stderr and not list(tmp_path.glob("*.tmp"))


def test_counts_are_singular_or_plural():
    one = GenerationStats(prompt_tokens=1, generation_tokens=1, cycles=1, draft_cycles=1, lookup_cycles=1,
                          tree_cycles=1, branch_cycles=1, forced_tokens=1, acceptance_lengths=[1])
    line = one.line()
    assert line.startswith("1 token, ") and "prompt 1 token at" in line
    assert "(1 of 1 draft cycle from lookup)" in line and "(1 token forced by the grammar)" in line
    assert "(1 of 1 tree cycle through a branch)" in line
    two = GenerationStats(prompt_tokens=2, generation_tokens=2, cycles=2, draft_cycles=2, lookup_cycles=1,
                          tree_cycles=2, branch_cycles=1, forced_tokens=2, acceptance_lengths=[1, 1]).line()
    assert two.startswith("2 tokens, ") and "prompt 2 tokens at" in two and "(1 of 2 draft cycles from lookup)" in two
    assert "(2 tokens forced by the grammar)" in two and "(1 of 2 tree cycles through a branch)" in two


def test_bench_summary_lines_count_in_the_right_number(pairs, capsys):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    result = bench.run_bench(pairs["qwen3"], {"json": [{"prompt": "status:", "schema": schema}]}, max_tokens=40,
                             block_sizes=[4])
    s = result["suites"]["json"]["4"]
    s["forced_tokens"], result["overall"]["4"]["mismatched_prompts"] = 1, ["status:"]
    result["machine"]["cores"] = 1
    text = " ".join(printed(result, Console(file=io.StringIO(), width=80)).split())
    assert "(1 core," in text
    assert "1 of 1 answer ended within the budget, 1 of them valid against its schema; 1 token forced by the " \
           "grammar;" in text
    assert "1 greedy output differs from plain mlx-lm decoding" in " ".join(capsys.readouterr().err.split())
