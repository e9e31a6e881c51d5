"""The `dflash-mlx` command line, through typer's runner and as a real process."""

import os
import re
import shutil
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from dflash_mlx.cli.main import app
from dflash_mlx.hub import aliases, resolve
from dflash_mlx.policy.proposal import SCALES

runner = CliRunner()


def run_cli(*args, input=None):
    return runner.invoke(app, ["generate", *args], input=input)


def test_generate_from_local_directories(pairs, targets, drafters, baselines):
    from conftest import plain_greedy

    r = run_cli("--model", str(targets["qwen3"]), "--draft", str(drafters["old"]),
                "--prompt", "def add(a, b):", "--no-chat-template", "-m", "20", "--block-size", "4")
    assert r.exit_code == 0, r.output
    tok = pairs["qwen3"].tokenizer
    expected = tok.decode(plain_greedy(baselines["qwen3"], tok.encode("def add(a, b):"), 20))
    assert r.stdout == expected + "\n"
    stats = r.stderr.strip().splitlines()[-1]
    assert "20 tokens" in stats and "tok/s" in stats and "acceptance" in stats and "peak memory" in stats


def test_prompt_from_stdin_with_chat_template_and_verbose(targets, drafters):
    r = run_cli("--model", str(targets["qwen3_5"]), "--draft", str(drafters["new"]),
                "-m", "8", "--system", "be brief", "--verbose", "--disable-thinking", input="hello there")
    assert r.exit_code == 0, r.output
    assert "acceptance histogram" in r.stderr and "block size auto" in r.stderr


def test_sampling_flags_are_accepted(targets, drafters):
    r = run_cli("--model", str(targets["llama"]), "--draft", str(drafters["new"]), "-p", "hi",
                "-m", "12", "--temp", "0.8", "--top-p", "0.9", "--top-k", "20", "--min-p", "0.05",
                "--seed", "7")
    assert r.exit_code == 0, r.output
    # A sample may end at EOS early (which plans `auto` picks depends on this machine's measured costs).
    n = int(re.search(r"(\d+) tokens, [\d.]+ tok/s", r.stderr).group(1))
    assert 1 <= n <= 12


@pytest.mark.parametrize(
    "args, words, code",
    [
        (["--temp", "-1"], "error: --temp must be from 0 to 2 (got -1).", 1),
        (["--max-tokens", "0"], "error: --max-tokens must be 1 or more (got 0).", 1),
        (["--top-k", "-3"], "error: --top-k must be 0 or more (got -3).", 1),
        (["--bogus"], "No such option", 2),
    ],
)
def test_bad_flags_are_refused(args, words, code):
    """Out of range: one error line, as the commands' own checks give; unknown: a usage error."""
    r = run_cli("--model", "x", "-p", "hi", *args)
    assert r.exit_code == code
    assert words in r.output


def test_bad_block_size_is_one_clear_line():
    for value in ["0", "big", "65"]:
        r = run_cli("--model", "x", "-p", "hi", "--block-size", value)
        assert r.exit_code == 1 and "--block-size takes" in r.stderr


def test_bad_proposal_scale_is_one_clear_line():
    for value in ["0", "-1", "flat"]:
        r = run_cli("--model", "x", "-p", "hi", "--proposal-scale", value)
        assert r.exit_code == 1 and "--proposal-scale takes a number > 0 or 'auto'" in r.stderr


def test_verbose_sampling_shows_the_learned_proposal_scales(targets, drafters):
    """Rejection sampling (no seed) learns its proposal scales; a seed's draws use none."""
    args = ("--model", str(targets["qwen3"]), "--draft", str(drafters["old"]), "-p", "hi", "--no-chat-template",
            "-m", "24", "--temp", "1", "--block-size", "4", "--verbose")
    r = run_cli(*args)
    assert r.exit_code == 0, r.output
    scales = re.search(r"proposal scales per position: ([\d. ]+)", r.stderr).group(1).split()
    assert len(scales) == 7 and all(float(s) in SCALES for s in scales)  # the drafter's 8-token block
    fixed = run_cli(*args, "--proposal-scale", "1")
    assert fixed.exit_code == 0 and "proposal scales" not in fixed.stderr
    seeded = run_cli(*args, "--seed", "3")
    assert seeded.exit_code == 0 and "proposal scales" not in seeded.stderr
    both = run_cli(*args, "--seed", "3", "--proposal-scale", "1.5")
    assert both.exit_code == 1 and "Drop --seed or --proposal-scale" in both.stderr


def test_bad_top_p_is_one_clear_line(targets, drafters):
    r = run_cli("--model", str(targets["qwen3"]), "--draft", str(drafters["old"]), "-p", "hi", "--top-p", "1.5")
    assert r.exit_code == 1
    assert "--top-p must be in (0, 1]" in r.stderr and "Traceback" not in r.output


def test_missing_model_and_unknown_names():
    r = run_cli("--model", "no such thing", "-p", "hi")
    assert r.exit_code == 1 and "not a directory, a Hugging Face repo id" in r.stderr
    r = run_cli("--model", "someone/unknown-model", "-p", "hi")
    assert r.exit_code == 1 and "No DFlash drafter is known" in r.stderr


def test_alias_registry_resolution():
    table = aliases()
    for name in ["qwen3-4b", "qwen3-8b", "llama3.1-8b", "qwen3.5-4b", "qwen3.5-9b",
                 "qwen3.5-27b", "qwen3.6-27b", "qwen3.6-35b-a3b"]:
        assert name in table and "/" in table[name]["target"] and "/" in table[name]["draft"]
    r = resolve("qwen3-4b")
    assert (r.target, r.draft, r.enable_thinking) == ("Qwen/Qwen3-4B", "z-lab/Qwen3-4B-DFlash-b16", False)
    # A known target given by repo id finds its drafter through the registry.
    r = resolve("qwen/qwen3.5-9b")
    assert r.draft == "z-lab/Qwen3.5-9B-DFlash" and r.alias == "qwen3.5-9b"
    # --draft takes an alias too, and an explicit drafter wins.
    assert resolve("Qwen/Qwen3-8B", "qwen3-4b").draft == "z-lab/Qwen3-4B-DFlash-b16"
    assert resolve("qwen3-4b", "me/my-drafter").draft == "me/my-drafter"


def _process(args, env):
    exe = shutil.which("dflash-mlx") or ""
    cmd = [exe] if exe else [sys.executable, "-m", "dflash_mlx.cli.main"]
    full = dict(os.environ, **env)
    return subprocess.run(cmd + ["generate", *args], capture_output=True, text=True, env=full, timeout=300)


def test_offline_with_empty_cache_is_one_clear_line(tmp_path):
    r = _process(["--model", "qwen3-4b", "-p", "hi"],
                 {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")})
    assert r.returncode == 1
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert len(lines) == 1, r.stderr
    assert "Qwen3-4B" in lines[0] and "offline" in lines[0] and "Traceback" not in r.stderr


def test_unreachable_hub_is_one_clear_line(tmp_path):
    r = _process(["--model", "qwen3-8b", "-p", "hi"],
                 {"HF_HOME": str(tmp_path / "hf"), "HF_ENDPOINT": "http://127.0.0.1:9"})
    assert r.returncode == 1
    assert "Cannot download" in r.stderr and "Qwen3-8B" in r.stderr and "Traceback" not in r.stderr


def _seed_hf_cache(cache, repo, src):
    """Lay a directory out as the Hugging Face cache stores a downloaded repo."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    base = cache / ("models--" + repo.replace("/", "--"))
    snap = base / "snapshots" / commit
    shutil.copytree(src, snap)
    (base / "refs").mkdir(parents=True)
    (base / "refs" / "main").write_text(commit)


def test_repo_ids_load_from_the_hf_cache_offline(tmp_path, targets, drafters):
    cache = tmp_path / "hub"
    _seed_hf_cache(cache, "tiny-org/tiny-qwen3", targets["qwen3"])
    _seed_hf_cache(cache, "tiny-org/tiny-qwen3-dflash", drafters["old"])
    r = _process(["--model", "tiny-org/tiny-qwen3", "--draft", "tiny-org/tiny-qwen3-dflash",
                  "-p", "def add(a, b):", "-m", "10", "--no-chat-template"],
                 {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)})
    assert r.returncode == 0, r.stderr
    assert "10 tokens" in r.stderr


def test_demo_pair_is_the_offline_default(tmp_path):
    """No --model: the pair shipped in the package runs with no network."""
    r = _process(["-p", "def fibonacci(n):", "-m", "24", "--block-size", "8"],
                 {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "DFLASH_MLX_CACHE": str(tmp_path / "c")})
    assert r.returncode == 0, r.stderr
    assert "24 tokens" in r.stderr and "acceptance" in r.stderr
    assert len(r.stdout.strip()) > 0
    same = run_cli("--model", "demo", "-p", "def fibonacci(n):", "-m", "24", "--block-size", "8")
    assert same.exit_code == 0 and same.stdout == r.stdout


def test_first_auto_run_shows_progress_off_a_terminal_and_says_what_it_chose(targets, drafters, tmp_path,
                                                                              monkeypatch):
    monkeypatch.setenv("DFLASH_MLX_CACHE", str(tmp_path))
    monkeypatch.setattr(os, "getloadavg", lambda: (0.1, 0.1, 0.1))
    args = ("--model", str(targets["qwen3"]), "--draft", str(drafters["old"]), "-p", "def add(a, b):", "-m", "8")
    r = run_cli(*args)  # CliRunner's stderr is not a terminal: plain lines, no animation
    assert r.exit_code == 0, r.output
    lines = r.stderr.splitlines()
    assert lines[0].startswith("measuring this machine's verify costs") and lines[0].endswith("...")
    assert any(l.startswith("measuring") and l.endswith(": done") for l in lines)
    assert ("plain decoding" in lines[-1]) == ("the default decoded plainly" in lines[-2])
    again = run_cli(*args)
    assert "measuring" not in again.stderr  # measured once; later runs refine quietly
    monkeypatch.setenv("DFLASH_MLX_CACHE", str(tmp_path / "other"))
    monkeypatch.setattr(os, "getloadavg", lambda: (8.0, 8.0, 8.0))
    busy = run_cli(*args)
    assert busy.stderr.splitlines()[0].startswith("note: this machine is busy (load 8.0")


@pytest.mark.parametrize("steep", [True, False])
def test_auto_says_why_it_decodes_plainly(targets, drafters, monkeypatch, steep):
    from dflash_mlx.policy.costs import CostCurve
    from dflash_mlx.pair import DFlashPair

    rows = [[float(w) if steep else 1.0 + 0.01 * w for w in range(1, 7)]]
    monkeypatch.setattr(DFlashPair, "cost_curve", lambda self, **k: CostCurve([64], rows, rows, rows))
    r = run_cli("--model", str(targets["qwen3"]), "--draft", str(drafters["old"]), "-p", "def add(a, b):", "-m", "8")
    assert r.exit_code == 0, r.output
    stats = r.stderr.strip().splitlines()[-1]
    if steep:
        assert "the cost curve predicts the drafter does not pay here: a 6-token verify cycle costs 6.0x one token" \
            in r.stderr
        assert "--block-size 6 shows the drafter" in r.stderr and "plain decoding" in stats
        assert r.stderr.strip().splitlines()[-2] == "the default decoded plainly, as the cost curve predicted"
    else:
        assert "does not pay" not in r.stderr and "acceptance" in stats


def test_mlx_lm_flag_spellings_are_accepted(targets, drafters, pairs, baselines):
    from conftest import plain_greedy

    r = run_cli("--model", str(targets["qwen3"]), "--draft-model", str(drafters["old"]), "--system-prompt", "x",
                "--ignore-chat-template", "-p", "def add(a, b):", "-m", "12", "--block-size", "4")
    assert r.exit_code == 0, r.output
    tok = pairs["qwen3"].tokenizer
    # no chat template: the system prompt goes before the prompt as plain text
    ids = tok.encode("x\n\ndef add(a, b):")
    assert r.stdout == tok.decode(plain_greedy(baselines["qwen3"], ids, 12)) + "\n"


def test_progress_prints_plain_lines_off_a_terminal():
    import io

    from rich.console import Console

    from dflash_mlx.cli.progress import progress

    out = io.StringIO()
    with progress(Console(file=out, force_terminal=False), "working", total=4, every=0) as update:
        update(1)
        update(3, description="working hard")
    lines = out.getvalue().splitlines()
    assert lines[0] == "working ..." and lines[1].startswith("working 1/4 (")
    assert lines[2].startswith("working hard 3/4 (") and lines[-1].endswith(": done")
    term = io.StringIO()
    with progress(Console(file=term, force_terminal=True), "working", total=4) as update:
        update(2)
    assert "working ..." not in term.getvalue()  # a live bar, not plain lines


def test_a_long_step_still_shows_progress_off_a_terminal():
    import io
    import time

    from rich.console import Console

    from dflash_mlx.cli.progress import progress

    out = io.StringIO()
    with progress(Console(file=out, force_terminal=False), "benchmark", total=2, every=0.2) as update:
        update(0, description="context 16384: warming up")
        time.sleep(1.0)  # one long step, no update
    lines = out.getvalue().splitlines()
    assert sum(line.startswith("context 16384: warming up 0/2 (") for line in lines) >= 3
    late = io.StringIO()
    with progress(Console(file=late, force_terminal=False), "slow", quiet_for=0.3, every=0.2):
        time.sleep(0.8)  # outlasts quiet_for without an update
    assert late.getvalue().startswith("slow (") and late.getvalue().rstrip().endswith(": done")


def test_quick_work_prints_no_progress_off_a_terminal():
    import io

    from rich.console import Console

    from dflash_mlx.cli.progress import progress

    out = io.StringIO()
    with progress(Console(file=out, force_terminal=False), "quick", quiet_for=60) as update:
        update(1)
    assert out.getvalue() == ""


def test_progress_with_a_total_says_the_time_left():
    import io

    from rich.console import Console

    from dflash_mlx.cli.progress import Rate, about, progress

    rate = Rate()
    assert rate.left(10) is None
    rate.record(0, now=100.0)
    rate.record(2, now=110.0)
    assert rate.left(10) == pytest.approx(40.0) and rate.left(None) is None
    rate.record(10, now=150.0)
    assert rate.left(10) is None  # all done
    resumed = Rate()  # work done before the first update (a resumed run) does not count
    resumed.record(100, now=0.0)
    resumed.record(110, now=10.0)
    assert resumed.left(200) == pytest.approx(90.0)
    assert [about(s) for s in (0.2, 40, 95, 660, 3600, 7500)] == [
        "about 1 s", "about 40 s", "about 2 min", "about 11 min", "about 1 h", "about 2 h 5 min"]

    out = io.StringIO()
    with progress(Console(file=out, force_terminal=False), "benchmark", total=96, every=0) as update:
        update(0)
        update(12)
    lines = out.getvalue().splitlines()
    assert lines[1] == "benchmark 0/96 (0 s)"  # nothing done yet: no rate to go by
    assert re.fullmatch(r"benchmark 12/96 \(\d+ s, about \d+ s left\)", lines[2]), lines
    assert "left" not in lines[-1] and lines[-1].endswith(": done")
    term = io.StringIO()
    with progress(Console(file=term, force_terminal=True, width=100), "benchmark", total=96) as update:
        update(0)
        update(12)
    assert re.search(r"about \d+ s left", term.getvalue()), term.getvalue()


def test_doctor_shows_progress_on_stderr_and_its_report_on_stdout(monkeypatch):
    from contextlib import contextmanager

    from dflash_mlx.cli import progress as P
    from dflash_mlx.kernels import REGISTRY

    real, seen = P.progress, []

    @contextmanager
    def spy(console, description, **kwargs):
        with real(console, description, **kwargs) as update:
            def recording(done, total=None, description=None):
                seen.append((done, total, description))
                update(done, total, description)

            yield recording

    monkeypatch.setattr(P, "progress", spy)
    r = runner.invoke(app, ["doctor"])
    assert r.exit_code == 0, r.output
    n = len(REGISTRY)
    assert [d for _, _, d in seen[:n + 1]] == [f"checking kernel {k}" for k in REGISTRY] + [
        "checking the target families"]
    assert [done for done, _, _ in seen] == list(range(n + 2)) and {t for _, t, _ in seen} == {n + 1}
    lines = r.stderr.splitlines()
    assert lines[0] == "loading MLX and the kernels ..." and lines[-1].endswith(": done"), r.stderr
    assert "BLAS" in r.stdout and "Target families" in r.stdout and "kernel" in r.stdout
    assert "BLAS" not in r.stderr and "checking" not in r.stdout


def test_unsupported_drafter_is_refused_before_the_target_downloads(tmp_path, monkeypatch):
    import json

    d = tmp_path / "dflash2"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["DFlash2DraftModel"], "dflash_config": {}}))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    r = run_cli("--model", "some-org/a-target-not-downloaded", "--draft", str(d), "-p", "hi")
    assert r.exit_code == 1 and "DFlash2DraftModel" in r.stderr and "Cannot download" not in r.stderr


def test_lookup_drafts_can_be_turned_off(monkeypatch):
    """On a curve where only a bare verify pays, `auto` drafts from the lookup on the
    demo pair's repetitive text; --no-lookup decodes plainly; the text is the same."""
    from dflash_mlx.policy.costs import CostCurve
    from dflash_mlx.pair import DFlashPair

    W = 16
    steep = [float(w) for w in range(1, W + 1)]
    flat = [1.0 + 0.02 * (w - 1) for w in range(1, W + 1)]
    monkeypatch.setattr(DFlashPair, "cost_curve",
                        lambda self, **k: CostCurve([64], [flat], [[0.0] * W], [steep], [flat]))
    args = ["--model", "demo", "-p", "class Stack:\n    def push(self, x):", "--no-chat-template", "-m", "60"]
    on, off = run_cli(*args), run_cli(*args, "--no-lookup")
    assert on.exit_code == 0 and off.exit_code == 0, on.output + off.output
    assert "draft cycles from lookup" in on.stderr and "plain decoding" in off.stderr
    assert on.stdout == off.stdout


def test_a_draft_context_bound_is_applied_reported_and_exact():
    """`--draft-context N` is said on stderr, changes no output, and is refused
    (one line, exit 1) for a drafter with windows of its own; by default no line."""
    prompt = "import os\nimport sys\n\n\ndef main(argv):\n    " * 4
    plain = run_cli("--model", "demo", "-p", prompt, "--no-chat-template", "-m", "24", "--block-size", "8")
    bounded = run_cli("--model", "demo", "-p", prompt, "--no-chat-template", "-m", "24", "--block-size", "8",
                      "--draft-context", "16")
    assert plain.exit_code == 0 and bounded.exit_code == 0, bounded.output
    assert bounded.stdout == plain.stdout
    assert "drafts read the first 4 and the last 16 context rows (--draft-context)" in bounded.stderr
    assert "--draft-context" not in plain.stderr
    windowed = run_cli("--model", "demo-dflash2", "-p", "hi", "-m", "4", "--draft-context", "16")
    assert windowed.exit_code == 1 and "declares its own windows" in windowed.stderr
    assert len(windowed.stderr.strip().splitlines()) == 1
    assert run_cli("--model", "demo", "-p", "hi", "--draft-context", "0").exit_code == 1


def test_only_the_package_warnings_become_warning_lines():
    """Its warnings and its logger's records print as `warning: <message>`;
    other packages' warnings keep Python's format, with their source line."""
    code = """if True:
        import logging, warnings
        from rich.console import Console
        from dflash_mlx.cli.warning_lines import show_warnings
        from dflash_mlx.cache.prompt_store import PromptStoreWarning
        console = Console(stderr=True, highlight=False, soft_wrap=True)
        show_warnings(console)
        show_warnings(console)
        warnings.warn("ours", PromptStoreWarning)
        logging.getLogger("dflash_mlx.kernels").warning("logged %s", "here")
        warnings.warn("theirs", UserWarning)
    """
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    lines = r.stderr.splitlines()
    assert r.returncode == 0 and lines[:2] == ["warning: ours", "warning: logged here"], r.stderr
    assert "<string>:" in lines[2] and "UserWarning: theirs" in lines[2]


def test_structured_output_flags(tmp_path):
    import json

    import jsonschema

    import dflash_mlx
    from dflash_mlx.constrain import Grammar

    schema = {"type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]},
                                               "days": {"type": "integer", "minimum": 1, "maximum": 7}},
              "required": ["unit", "days"], "additionalProperties": False}
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    (tmp_path / "sum.lark").write_text('start: "x = " /[0-9]{1,3}/ " + " /[0-9]{1,3}/\n')
    pair = dflash_mlx.load("demo")
    common = ("--prompt", "The forecast as JSON:", "--no-chat-template", "-m", "60")
    for flag in (str(tmp_path / "schema.json"), json.dumps(schema)):
        r = run_cli(*common, "--json-schema", flag)
        assert r.exit_code == 0, r.output
        jsonschema.validate(json.loads(r.stdout), schema)
        want = dflash_mlx.generate(pair, pair.tokenizer.encode("The forecast as JSON:"), max_tokens=60,
                                   grammar=Grammar.json_schema(schema))[0]
        assert r.stdout == want + "\n"
    r = run_cli(*common, "--grammar", str(tmp_path / "sum.lark"))
    assert r.exit_code == 0 and re.fullmatch(r"x = [0-9]{1,3} \+ [0-9]{1,3}\n", r.stdout), r.output
    r = run_cli(*common, "--regex", "(yes|no)!")
    assert r.exit_code == 0 and r.stdout in ("yes!\n", "no!\n"), r.output


@pytest.mark.parametrize("args, words", [
    (("--regex", "a", "--json-schema", "{}"), "give one of them"),
    (("--json-schema", "missing.json"), "no such file"),
    (("--json-schema", '{"type": "object", "properties": {"a": {"type": "strin"}}}'), "unknown type 'strin' for property 'a'"),
    (("--json-schema", "{oops"), "not valid JSON"),
    (("--regex", "a(b"), "regex"),
])
def test_bad_structured_output_flags_are_one_clear_line(args, words):
    r = run_cli("--prompt", "hi", "--no-chat-template", "-m", "4", *args)
    assert r.exit_code != 0
    lines = r.stderr.strip().splitlines()  # the demo pair's note may come first, once it is loaded
    assert lines[-1].startswith("error:") and words in lines[-1] and len(lines) <= 2, r.stderr
