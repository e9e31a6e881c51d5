"""The command line's help, as a newcomer reads it: every option described, flags shown as flags,
the same range for the same setting everywhere, `--version`, and an answer without loading MLX."""

import re
import subprocess
import sys

import pytest
from typer.main import get_command
from typer.testing import CliRunner

from dflash_mlx.cli.main import app

runner = CliRunner()
COMMANDS = get_command(app).commands


def _options():
    return [(name, p) for name, cmd in COMMANDS.items() for p in cmd.params]


@pytest.mark.parametrize("name, param", _options(), ids=lambda v: v if isinstance(v, str) else v.opts[0])
def test_every_option_says_what_it_does(name, param):
    described = re.sub(r"\s*Range: [^.]*\.$", "", param.help or "")
    assert len(described) > 10, f"{name} {param.opts[0]} has no description"


@pytest.mark.parametrize("name", list(COMMANDS))
def test_help_shows_every_word_of_the_help_texts(name):
    """Rich markup must not eat text: a `[...]` in a help text would vanish from the page."""
    r = runner.invoke(app, [name, "--help"], env={"COLUMNS": "400"})
    assert r.exit_code == 0, r.output
    page = " ".join(re.sub(r"[│╭╮╰╯─]", " ", r.stdout).split())
    for p in COMMANDS[name].params:
        for words in re.findall(r"[A-Za-z][\w' -]{12,}", p.help or ""):
            assert " ".join(words.split()) in page, (p.opts[0], words)


def test_flags_show_no_value_and_take_none():
    r = runner.invoke(app, ["generate", "--help"], env={"COLUMNS": "200"})
    rows = {line.split()[1]: line for line in r.stdout.splitlines() if line.startswith("│ --")}
    for flag in ("--verbose", "--chat-template", "--lookup", "--help"):
        assert "<" not in rows[flag], rows[flag]
    assert "<int>" in rows["--max-tokens"]
    r = runner.invoke(app, ["convert", "--help"], env={"COLUMNS": "200"})
    force = next(line for line in r.stdout.splitlines() if line.split()[1:2] == ["--force"])
    assert "<" not in force, force


def test_temperature_has_one_range_everywhere():
    ranges = {name: p.help.rsplit("Range:", 1)[1] for name, p in _options() if p.opts[0] == "--temp"}
    assert set(ranges) == {"generate", "serve", "bench", "train"} and len(set(ranges.values())) == 1, ranges


def test_serve_names_both_apis():
    assert "Anthropic" in COMMANDS["serve"].help and "OpenAI" in COMMANDS["serve"].help


def test_version():
    from importlib.metadata import version

    r = runner.invoke(app, ["--version"])
    assert r.exit_code == 0 and r.stdout.strip() == f"dflash-mlx {version('dflash-mlx')}"


def test_the_command_line_loads_no_model_code_until_a_command_needs_it():
    code = ("import sys, dflash_mlx.cli.main; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'mlx', 'mlx_lm', 'transformers', 'torch', "
            "'numpy', 'llguidance', 'starlette', 'huggingface_hub'}))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr
