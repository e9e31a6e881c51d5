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


# --- files the runtime keeps for itself: cost curves and learnt rates -------------

def _curve(tmp_path, monkeypatch, made):
    from dflash_mlx import adaptive
    from test_adaptive import FakeClock, fake_cycle

    clock = FakeClock(monkeypatch)
    clock.now = 0.0
    return adaptive.load_or_measure("k", fake_cycle(clock, 0.001, made), 4, tmp_path, budget=0.2,
                                    contexts=(64, 1024), max_rounds=3)


def _with_data(change):
    def damage(path):
        raw = json.loads(path.read_text())
        change(raw["data"])
        from dflash_mlx import kept_files

        raw["sha256"] = kept_files._digest(raw["data"])  # a crafted file: its checksum fits
        path.write_text(json.dumps(raw))

    return damage


def _fifo(path):
    import os

    path.unlink()
    os.mkfifo(path)


CURVE_DAMAGE = {
    "random bytes": lambda p: p.write_bytes(bytes(range(256)) * 2),
    "invalid utf-8": lambda p: p.write_bytes(b'{"kind": "\xff\xfe"}'),
    "a 5000-digit number": lambda p: p.write_text('{"kind": "dflash_mlx.cost_curve", "version": ' + "9" * 5000 + "}"),
    "deep nesting": lambda p: p.write_text("[" * 100_000 + "]" * 100_000),
    "a flipped byte": lambda p: p.write_text(p.read_text().replace("0.00", "0.10", 1)),
    "truncated": lambda p: p.write_text(p.read_text()[:-40]),
    "too large": lambda p: p.write_bytes(b" " * (16 * 2**20 + 1)),
    "a fifo": _fifo,
    "contexts 'abc'": _with_data(lambda d: d.update(contexts="abc")),
    "max_width 0": _with_data(lambda d: d.update(max_width=0)),
    "all-zero timings": _with_data(lambda d: d.update(cycle=[[[0.0] * 4 for _ in r] for r in d["cycle"]])),
    "an infinite timing": _with_data(lambda d: d["cycle"][0][0].__setitem__(0, 1e400)),
    "a string timing": _with_data(lambda d: d["cycle"][0][0].__setitem__(0, "fast")),
    "rounds of another width": _with_data(lambda d: d["cycle"][0].append([0.001] * 9)),
    "catch-up as a string": _with_data(lambda d: d.update(catch_up="abc")),
    "an unknown field": _with_data(lambda d: d.update(extra=1)),
    "a foreign tree": _with_data(lambda d: d.update(tree_shapes=[[99, 7]])),
    "a negative set-up": _with_data(lambda d: d.update(setup_per_token=-1.0)),
}


@pytest.mark.parametrize("case", sorted(CURVE_DAMAGE))
def test_a_damaged_cost_curve_is_set_aside_and_measured_again(tmp_path, monkeypatch, caplog, case):
    made = []
    first = _curve(tmp_path, monkeypatch, made)
    path = tmp_path / "costs" / "k-w4.json"
    CURVE_DAMAGE[case](path)
    made.clear()
    with caplog.at_level("WARNING", logger="dflash_mlx"):
        again = _curve(tmp_path, monkeypatch, made)
    assert made == [64, 1024]  # measured again, from scratch
    assert (tmp_path / "costs" / "k-w4.json.damaged").exists()  # set aside, not deleted
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "cost curve" in warnings[0] and "set aside" in warnings[0], warnings
    assert again.contexts == first.contexts and again.cost(4, 64) == pytest.approx(first.cost(4, 64))
    made.clear()
    _curve(tmp_path, monkeypatch, made)
    assert made == []  # the new file reads back


def test_a_cost_curve_of_an_older_version_is_replaced_quietly(tmp_path, monkeypatch, caplog):
    from dflash_mlx import adaptive

    made = []
    _curve(tmp_path, monkeypatch, made)
    path = tmp_path / "costs" / "k-w4.json"
    raw = json.loads(path.read_text())
    path.write_text(json.dumps(dict(raw, version=adaptive.CURVE_VERSION - 1)))
    made.clear()
    with caplog.at_level("WARNING", logger="dflash_mlx"):
        _curve(tmp_path, monkeypatch, made)
    assert made == [64, 1024] and not caplog.records and not path.with_name("k-w4.json.damaged").exists()
