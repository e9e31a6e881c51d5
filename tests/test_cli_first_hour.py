"""A new user's first hour with `dflash-mlx`: bad input is one `error:` line before
any model loads, names to type are never cut, and every run says what it did."""

import os
import re
import shutil
import subprocess
import sys

import pytest
from rich.console import Console
from typer.testing import CliRunner

import dflash_mlx
import dflash_mlx.cli.list_models as list_command
from dflash_mlx.cli.main import app
from dflash_mlx.hub import aliases, builtin_path

runner = CliRunner()


def one_error_line(r, *words):
    assert r.exit_code == 1, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), r.stderr
    assert "Traceback" not in r.output and "Usage:" not in r.output
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


@pytest.fixture
def no_model_loads(monkeypatch):
    def load(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(dflash_mlx, "load", load)


# 1. Input that is not UTF-8


def test_undecodable_stdin_is_one_error_line(no_model_loads):
    r = runner.invoke(app, ["generate", "--max-tokens", "16"], input=b"def f(x):\n    return \xff\xfe\x80 x\n")
    one_error_line(r, "stdin is not UTF-8 text", "0xff", "line 2", "iconv")


def test_undecodable_prompt_and_system_are_one_error_line(no_model_loads):
    # Python hands undecodable command-line bytes over as surrogate escapes.
    r = runner.invoke(app, ["generate", "--prompt", "def f(x): return \udcff x"])
    one_error_line(r, "--prompt is not UTF-8 text", "0xff")
    r = runner.invoke(app, ["generate", "--prompt", "hi", "--system", "caf\udce9"])
    one_error_line(r, "--system is not UTF-8 text", "0xe9")


def test_undecodable_stdin_in_a_real_process(tmp_path):
    exe = shutil.which("dflash-mlx")
    cmd = [exe] if exe else [sys.executable, "-m", "dflash_mlx.cli.main"]
    r = subprocess.run(cmd + ["generate", "--max-tokens", "16"], input=b"def f(x):\n    return \xff\xfe\x80 x\n",
                       capture_output=True, timeout=120,
                       env=dict(os.environ, HF_HUB_OFFLINE="1", DFLASH_MLX_CACHE=str(tmp_path)))
    err = r.stderr.decode()
    assert r.returncode == 1 and "Traceback" not in err, err
    assert err.strip().startswith("error: stdin is not UTF-8 text") and len(err.strip().splitlines()) == 1


# 2. Out-of-range numbers, on every command


TRAIN = ["train", "--model", "x", "--data", "y", "--out", "z"]


@pytest.mark.parametrize("args, words", [
    (["generate", "-p", "hi", "--max-tokens", "-5"], ["--max-tokens must be 1 or more (got -5)"]),
    (["generate", "-p", "hi", "-m", "0"], ["--max-tokens must be 1 or more (got 0)"]),
    (["generate", "-p", "hi", "--temp", "-1"], ["--temp must be from 0 to 2 (got -1)"]),
    (["generate", "-p", "hi", "--top-k", "-3"], ["--top-k must be 0 or more (got -3)"]),
    (["generate", "-p", "hi", "--min-p", "1.5"], ["--min-p must be from 0 to 1 (got 1.5)"]),
    (["generate", "-p", "hi", "--tree", "9"], ["--tree must be from 0 to 8 (got 9)"]),
    (["generate", "-p", "hi", "--draft-context", "0"], ["--draft-context must be 1 or more (got 0)"]),
    (["generate", "-p", "hi", "--timeout", "-2.5"], ["--timeout must be 0 or more (got -2.5)"]),
    (["generate", "-p", "hi", "--top-p", "1.5"], ["--top-p", "1.5"]),
    (["bench", "--max-tokens", "0"], ["--max-tokens must be 1 or more (got 0)"]),
    (["bench", "--repeats", "0"], ["--repeats must be 1 or more (got 0)"]),
    (["bench", "--temp", "-0.5"], ["--temp must be from 0 to 2 (got -0.5)"]),
    (["serve", "--port", "70000"], ["--port must be from 0 to 65535 (got 70000)"]),
    (["serve", "--temp", "3"], ["--temp must be from 0 to 2 (got 3)"]),
    (["serve", "--default-max-tokens", "0"], ["--default-max-tokens must be 1 or more (got 0)"]),
    (TRAIN + ["--layers", "0"], ["--layers must be from 1 to 64 (got 0)"]),
    (TRAIN + ["--block-size", "65"], ["--block-size must be from 2 to 64 (got 65)"]),
    (TRAIN + ["--lr", "-1"], ["--lr must be 0 or more (got -1)"]),
])
def test_out_of_range_numbers_are_one_error_line(no_model_loads, args, words):
    one_error_line(runner.invoke(app, args), *words)


def test_ranges_show_in_help():
    r = runner.invoke(app, ["generate", "--help"], env={"COLUMNS": "200"})
    text = " ".join(re.sub(r"[│╭╮╰╯─]", " ", r.stdout).split())
    assert "Range: 1 or more." in text and "Range: 0 to 1." in text and "Range: 0 to 8." in text


def test_unknown_options_stay_usage_errors():
    r = runner.invoke(app, ["generate", "-p", "hi", "--bogus"])
    assert r.exit_code == 2 and "No such option" in r.output


# 3. `list`: the names to type are never cut


def _ids():
    table = aliases()
    targets = [e["target"] for e in table.values() if not e.get("builtin")]
    targets += [r for e in table.values() for r in (e.get("variants") or {}).values()]
    drafters = [e["draft"] for e in table.values() if not e.get("builtin")]
    return list(table), targets, drafters


def _list(monkeypatch, width=None):
    if width:
        monkeypatch.setattr(list_command, "_stdout", lambda: Console(highlight=False, force_terminal=True, width=width,
                                                             color_system=None))
    r = runner.invoke(app, ["list"], env={"COLUMNS": "60"})
    assert r.exit_code == 0, r.output
    return r.stdout


def test_list_off_a_terminal_cuts_nothing(monkeypatch):
    out = _list(monkeypatch)  # CliRunner's stdout is not a terminal; COLUMNS=60 does not narrow it
    names, targets, drafters = _ids()
    assert "…" not in out
    for name in names + targets + drafters:
        assert re.search(rf"(^|\s){re.escape(name)}(\s|$)", out, re.M), name
    assert "ids confirmed by" in out and "Left out" not in out
    assert "Run `dflash-mlx generate --model ALIAS`" in out  # the hint is one line too


@pytest.mark.parametrize("width", [60, 80, 120, 160, 300])
def test_list_on_a_narrow_terminal_keeps_names_whole(monkeypatch, width):
    out = _list(monkeypatch, width)
    names, targets, drafters = _ids()
    assert "…" not in out
    table = [line for line in out.splitlines() if line[:1] in "┏┃┡│└"]
    assert max(len(line) for line in table) <= width
    for name in names:
        assert re.search(rf"^│ {re.escape(name)} +│", out, re.M), name
    if width >= 80:  # wide enough for the alias and target columns
        for repo in targets:
            assert re.search(rf"│ (:\w+ )?{re.escape(repo)}\s", out), repo
    if width >= 120:
        for repo in drafters:
            assert f"│ {repo} " in out, repo
    left_out = "Left out to fit this terminal" in out
    assert left_out == (width < 300) and ("`dflash-mlx list | cat` prints every column" in out) == left_out


# 4. An empty prompt


@pytest.mark.parametrize("args, stdin", [(["--prompt", ""], None), (["--prompt", " \n "], None), ([], ""),
                                         (["-p", "-"], "\n")])
def test_an_empty_prompt_is_refused_before_the_model_loads(no_model_loads, args, stdin):
    r = runner.invoke(app, ["generate", *args], input=stdin)
    one_error_line(r, "The prompt is empty")


# 5. The demo says what it is


def test_the_demo_says_it_is_a_demo_and_names_a_real_model():
    for args in (["--model", "demo"], []):  # the default is the demo
        r = runner.invoke(app, ["generate", *args, "-p", "def fib(n):", "-m", "8", "--block-size", "8"])
        assert r.exit_code == 0, r.output
        notes = [line for line in r.stderr.splitlines() if "demo model" in line]
        assert len(notes) == 1 and "tiny 4-layer demo model" in notes[0] and "repetitive" in notes[0]
        real = re.search(r"dflash-mlx generate --model (\S+)", notes[0]).group(1)
        assert real in aliases() and not aliases()[real].get("builtin") and "dflash-mlx list" in notes[0]
    # the same weights from a directory are not announced as the demo
    r = runner.invoke(app, ["generate", "--model", builtin_path("demo/target"), "--draft", builtin_path("demo/drafter"),
                            "-p", "def fib(n):", "-m", "8", "--block-size", "8"])
    assert r.exit_code == 0 and "demo model" not in r.stderr, r.output


# 6. What the default decided, in the stats line's words


def _curve(monkeypatch, cycle, verify=None, copy=None, W=16):
    """Cycle costs (in plain steps) per width, in place of this machine's."""
    from dflash_mlx.pair import CostCurve, DFlashPair  # the class of the pair's own curve

    def rows(f):
        return [[float(f(w)) for w in range(1, W + 1)]]

    curve = CostCurve([64], rows(verify or cycle), [[0.0] * W], rows(cycle), rows(copy) if copy else None)
    monkeypatch.setattr(DFlashPair, "cost_curve", lambda self, **k: curve)


def _auto(*extra):
    r = runner.invoke(app, ["generate", "--model", "demo", "-p", "class Stack:\n    def push(self, x):",
                            "--no-chat-template", "-m", "60", *extra])
    assert r.exit_code == 0, r.output
    lines = r.stderr.strip().splitlines()
    decided = [line for line in lines if line.startswith("the default ")]
    return r, lines, decided


def test_a_plain_default_says_so_as_the_stats_do(monkeypatch):
    _curve(monkeypatch, float)  # every width costs its width in tokens: drafting cannot pay
    r, lines, decided = _auto("--no-lookup")
    assert "plain decoding (no cycle drafted)" in lines[-1]
    assert decided == ["the default decoded plainly, as the cost curve predicted"]
    before = [line for line in lines if line.startswith("the cost curve predicts")]
    assert len(before) == 1 and "the drafter does not pay here" in before[0] and "--block-size 16" in before[0]
    assert lines.index(before[0]) < lines.index(decided[0]) == len(lines) - 2


def test_lookup_drafts_are_named_as_the_stats_count_them(monkeypatch):
    # only a bare verify (a lookup draft, no drafter pass) pays on this curve
    flat = lambda w: 1.0 + 0.02 * (w - 1)  # noqa: E731
    _curve(monkeypatch, float, verify=flat, copy=flat)
    r, lines, decided = _auto()
    used, drafted = map(int, re.search(r"\((\d+) of (\d+) draft cycles from lookup\)", lines[-1]).groups())
    assert used == drafted > 0
    assert len(decided) == 1 and decided[0].startswith(f"the default drafted from the n-gram lookup only ({drafted} "
                                                       "cycles")
    # a prediction of plain decoding names the lookup drafts the stats count
    assert all("starts by decoding plainly, drafting from the n-gram lookup" in line
               for line in lines if "plainly" in line and not line.startswith("the default "))


def test_drafter_drafts_are_named_as_the_stats_count_them(monkeypatch):
    _curve(monkeypatch, lambda w: 1.0 + 0.01 * w)  # a wide cycle costs about one token: drafting pays
    r, lines, decided = _auto("--no-lookup")
    assert "acceptance" in lines[-1] and "plain decoding" not in lines[-1]
    assert not any(line.startswith("the cost curve predicts") for line in lines)
    assert len(decided) == 1 and re.match(r"the default drafted with the drafter \(\d+ cycles\): ", decided[0])


def test_a_fixed_block_size_has_no_default_to_explain():
    r = runner.invoke(app, ["generate", "--model", "demo", "-p", "def fib(n):", "-m", "8", "--block-size", "4"])
    assert r.exit_code == 0 and "the default" not in r.stderr and "cost curve" not in r.stderr, r.output
