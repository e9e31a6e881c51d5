"""Damaged and hostile files, built from the shipped demo pair: each ends in one
clear line and a non-zero exit (or a correct run where the file is valid), with
no traceback, no raw control characters on the terminal and nothing of the
user's changed."""

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dflash_mlx.cli.main import app
from dflash_mlx.hub import builtin_path

DEMO = Path(builtin_path("demo"))
runner = CliRunner()


def refused(args, words):
    r = runner.invoke(app, [str(a) for a in args])
    assert r.exit_code == 1, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), r.stderr
    assert "Traceback" not in r.output and "\x1b" not in r.stderr and "\x07" not in r.stderr
    assert words in r.stderr, r.stderr
    return r


@pytest.fixture
def drafter(tmp_path):
    """The demo drafter as a z-lab checkpoint (its original config), to be damaged."""
    d = tmp_path / "d"
    d.mkdir()
    shutil.copy(DEMO / "drafter" / "model.safetensors", d)
    shutil.copy(DEMO / "drafter" / "config.original.json", d / "config.json")
    return d


@pytest.fixture
def target(tmp_path):
    t = tmp_path / "t"
    shutil.copytree(DEMO / "target", t)
    return t


def edit(path: Path, change):
    cfg = json.loads(path.read_text())
    change(cfg)
    path.write_text(json.dumps(cfg))


EVIL = "[/evil]\x1b]0;owned\x07\x1b[2J"
SHOWN = "[/evil]\\x1b]0;owned\\x07\\x1b[2J"  # as the error line prints it


@pytest.mark.parametrize("field", ["architectures", "layer_types"])
def test_markup_and_escapes_in_a_drafter_config_are_printed_escaped(tmp_path, drafter, field):
    edit(drafter / "config.json", lambda c: c.update({field: [EVIL] * (1 if field == "architectures" else 4)}))
    refused(["convert", "--hf-path", drafter, "--mlx-path", tmp_path / "o"], SHOWN)


def test_markup_and_escapes_in_a_tensor_name_are_printed_escaped(tmp_path, drafter):
    import mlx.core as mx

    w = mx.load(str(drafter / "model.safetensors"))
    w[EVIL] = mx.zeros((2,))
    mx.save_safetensors(str(drafter / "model.safetensors"), w)
    refused(["convert", "--hf-path", drafter, "--mlx-path", tmp_path / "o"], f"unknown weight(s) {SHOWN}")


def test_markup_and_escapes_in_a_target_family_are_printed_escaped(target):
    edit(target / "config.json", lambda c: c.update(model_type=EVIL))
    refused(["generate", "--model", target, "--draft", DEMO / "drafter", "-p", "x", "-m", "2"], SHOWN)
