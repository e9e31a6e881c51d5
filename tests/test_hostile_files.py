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
    from dflash_mlx.policy import costs
    from test_adaptive import FakeClock, fake_cycle

    clock = FakeClock(monkeypatch)
    clock.now = 0.0
    return costs.load_or_measure("k", fake_cycle(clock, 0.001, made), 4, tmp_path, budget=0.2,
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
    from dflash_mlx.policy import costs

    made = []
    _curve(tmp_path, monkeypatch, made)
    path = tmp_path / "costs" / "k-w4.json"
    raw = json.loads(path.read_text())
    path.write_text(json.dumps(dict(raw, version=costs.CURVE_VERSION - 1)))
    made.clear()
    with caplog.at_level("WARNING", logger="dflash_mlx"):
        _curve(tmp_path, monkeypatch, made)
    assert made == [64, 1024] and not caplog.records and not path.with_name("k-w4.json.damaged").exists()


# --- drafter configs: every field checked for type and range before anything is built ---

def _dflash(change):
    return lambda c: change(c.setdefault("dflash_config", {}))


CONFIG_DAMAGE = {
    "hidden_size 'abc'": (lambda c: c.update(hidden_size="abc"), 'hidden_size must be an integer from 1 to 65536 (got "abc")'),
    "hidden_size 1e400": (lambda c: c.update(hidden_size=float("inf")), "hidden_size must be an integer"),
    "num_attention_heads 0": (lambda c: c.update(num_attention_heads=0), "num_attention_heads must be an integer from 1"),
    "num_key_value_heads 3": (lambda c: c.update(num_key_value_heads=3), "must be a divisor of num_attention_heads"),
    "num_hidden_layers 10**5": (lambda c: c.update(num_hidden_layers=10**5), "num_hidden_layers must be an integer from 1 to 256"),
    "rms_norm_eps 'x'": (lambda c: c.update(rms_norm_eps="x"), "rms_norm_eps must be a number above 0.0"),
    "block_size 0": (_dflash(lambda d: d.update(block_size=0)), "block_size must be an integer from 2 to 256 (got 0)"),
    "block_size -4": (_dflash(lambda d: d.update(block_size=-4)), "block_size must be an integer from 2 to 256"),
    "block_size 10**9": (_dflash(lambda d: d.update(block_size=10**9)), "block_size must be an integer from 2 to 256"),
    "block_size 1e9": (_dflash(lambda d: d.update(block_size=1e9)), "block_size must be an integer from 2 to 256"),
    "target_layer_ids '0,1'": (_dflash(lambda d: d.update(target_layer_ids="0,1")), "target_layer_ids must be a non-empty list"),
    "target_layer_ids negative": (_dflash(lambda d: d.update(target_layer_ids=[-1, 0, 1, 2])), "target_layer_ids must be an integer from 0"),
    "mask_token_id '1'": (_dflash(lambda d: d.update(mask_token_id="1")), "mask_token_id must be an integer"),
    "mask_token_id -5": (_dflash(lambda d: d.update(mask_token_id=-5)), "mask_token_id must be an integer from 0 to 2047"),
    "dflash_config a string": (lambda c: c.update(dflash_config="abc"), "dflash_config must be an object"),
    "rope_parameters a string": (lambda c: c.update(rope_parameters="abc"), "rope_parameters must be an object"),
    "rope factor a string": (lambda c: c.update(rope_scaling={"rope_type": "linear", "factor": "x"}), "rope_scaling.factor must be a number"),
    "rope_theta negative": (lambda c: c.update(rope_parameters={"rope_theta": -1.0}), "rope_theta must be a number above 0.0"),
    "architectures a number": (lambda c: c.update(architectures=5), "architectures must be a list of strings"),
    "is_causal 'yes'": (lambda c: c.update(is_causal="yes"), "is_causal must be true or false"),
    "quantization a string": (lambda c: c.update(quantization="4bit"), "quantization must be an object"),
    "sliding_window 'big'": (lambda c: c.update(sliding_window="big"), "sliding_window must be an integer"),
    "max_position_embeddings -1": (lambda c: c.update(max_position_embeddings=-1), "max_position_embeddings must be an integer"),
}


@pytest.mark.parametrize("case", sorted(CONFIG_DAMAGE))
def test_a_bad_drafter_config_field_is_one_line_naming_it(tmp_path, drafter, case):
    change, words = CONFIG_DAMAGE[case]
    edit(drafter / "config.json", change)
    refused(["convert", "--hf-path", drafter, "--mlx-path", tmp_path / "o"], words)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("content, words", [
    (b'{"a":' * 100_000 + b"1" + b"}" * 100_000, "nested too deeply"),
    (b'{"hidden_size": "\xff\xfe"}', "is not UTF-8 text"),
    (b"{", "is not valid JSON"),
    (b"[]", "does not hold a JSON object"),
    (b" " * (2**20 + 1), "is not a config"),
])
def test_an_unreadable_drafter_config_is_one_line(tmp_path, drafter, content, words):
    (drafter / "config.json").write_bytes(content)
    refused(["convert", "--hf-path", drafter, "--mlx-path", tmp_path / "o"], words)
    refused(["generate", "--model", DEMO / "target", "--draft", drafter, "-p", "x", "-m", "2"], words)


# --- target folders: checked before mlx-lm builds anything from them ------------------

def _index(t, weight_map):
    (t / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _outside(t):
    other = t.parent / "other"
    other.mkdir()
    (t / "model.safetensors").rename(other / "model.safetensors")
    _index(t, {"model.embed_tokens.weight": "../other/model.safetensors"})


TARGET_DAMAGE = {
    "config '{'": (lambda t: (t / "config.json").write_text("{"), "is not valid JSON"),
    "config []": (lambda t: (t / "config.json").write_text("[]"), "the config must be a JSON object"),
    "no hidden_size": (lambda t: edit(t / "config.json", lambda c: c.pop("hidden_size")), "lacks hidden_size"),
    "hidden_size 'abc'": (lambda t: edit(t / "config.json", lambda c: c.update(hidden_size="abc")),
                          "hidden_size must be an integer"),
    "num_hidden_layers 10**9": (lambda t: edit(t / "config.json", lambda c: c.update(num_hidden_layers=10**9)),
                                "num_hidden_layers must be an integer from 1 to 4096"),
    "more layers than weights": (lambda t: edit(t / "config.json", lambda c: c.update(num_hidden_layers=100)),
                                 "num_hidden_layers is 100 but the weights hold 4 layers"),
    "model_type a number": (lambda t: edit(t / "config.json", lambda c: c.update(model_type=5)),
                            "model_type must be a string"),
    "truncated weights": (lambda t: (t / "model.safetensors").write_bytes((t / "model.safetensors").read_bytes()[:-999]),
                          "truncated"),
    "no weights": (lambda t: (t / "model.safetensors").unlink(), "No weights"),
    "bad tokenizer JSON": (lambda t: (t / "tokenizer.json").write_text("{"), "Could not load the target's tokenizer"),
    "no tokenizer files": (lambda t: (t / "tokenizer.json").unlink(), "No tokenizer files"),
    "a shard outside the folder": (_outside, "names shard '../other/model.safetensors' outside its folder"),
    "weight_map a list": (lambda t: _index(t, ["model.safetensors"]), "weight_map must map tensor names"),
}


@pytest.mark.parametrize("case", sorted(TARGET_DAMAGE))
def test_a_damaged_target_folder_is_one_line(target, case):
    damage, words = TARGET_DAMAGE[case]
    damage(target)
    refused(["generate", "--model", target, "--draft", DEMO / "drafter", "-p", "x", "-m", "2"], words)


# --- PyTorch archives: no entry is inflated beyond the archive's own size ----------------

@pytest.mark.parametrize("entry", ["archive/data.pkl", "archive/data/0"])
def test_a_zip_bomb_checkpoint_is_refused_before_it_is_inflated(tmp_path, drafter, entry):
    import tracemalloc
    import zipfile

    from test_convert import tensor_pickle

    (drafter / "model.safetensors").unlink()
    bomb = 64 * 2**20  # zeros: a few kilobytes deflated
    with zipfile.ZipFile(drafter / "pytorch_model.bin", "w", zipfile.ZIP_DEFLATED) as z:
        if entry != "archive/data.pkl":
            z.writestr("archive/data.pkl", tensor_pickle(0, (4,), (1,)))  # a tensor in storage "0"
        with z.open(entry, "w", force_zip64=True) as f:
            for _ in range(bomb // 2**20):
                f.write(bytes(2**20))
    assert (drafter / "pytorch_model.bin").stat().st_size < 2**20
    tracemalloc.start()
    try:
        refused(["convert", "--hf-path", drafter, "--mlx-path", tmp_path / "o"], f"entry {entry} inflates to {bomb}")
        assert tracemalloc.get_traced_memory()[1] < bomb // 4
    finally:
        tracemalloc.stop()


# --- converted drafters: checked as the converter checks, a damaged cache entry redone ---

def _forged(folder):
    """The checksum in the config recomputed, as someone forging a conversion would."""
    from dflash_mlx.convert.convert import file_digest

    edit(folder / "config.json", lambda c: c["dflash_mlx"].update(sha256=file_digest(folder / "model.safetensors")))


def _int_tensor(folder):
    import mlx.core as mx

    w = mx.load(str(folder / "model.safetensors"))
    w["norm.weight"] = w["norm.weight"].astype(mx.int32)
    mx.save_safetensors(str(folder / "model.safetensors"), w)
    _forged(folder)


def _overlapping(folder):
    path = folder / "model.safetensors"
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    a, b = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])[:2]
    header[b]["data_offsets"][0] = header[a]["data_offsets"][0]  # b starts inside a
    text = json.dumps(header).encode().ljust(n)
    path.write_bytes(n.to_bytes(8, "little") + text + raw[8 + n :])
    _forged(folder)


@pytest.mark.parametrize("damage, words", [(_int_tensor, "tensor norm.weight has dtype I32"),
                                           (_overlapping, "safetensors")])
def test_a_damaged_converted_drafter_is_refused_and_a_cache_entry_converted_again(tmp_path, drafter, damage, words,
                                                                                   caplog):
    import mlx.core as mx

    from dflash_mlx.pair import converted_path, load_drafter

    want = load_drafter(drafter)  # converted into the cache
    cached = converted_path(drafter)
    damage(cached)
    with caplog.at_level("WARNING", logger="dflash_mlx"):
        again = load_drafter(drafter)  # set aside and converted again from the checkpoint on disk
    assert [r.getMessage() for r in caplog.records if "set aside" in r.getMessage()]
    assert cached.with_name(cached.name + ".damaged").is_dir()
    assert mx.array_equal(want.norm.weight, again.norm.weight)
    # A converted folder of the user's own is not rebuilt: one line says what is wrong.
    mine = tmp_path / "mine"
    shutil.copytree(cached, mine)
    damage(mine)
    refused(["generate", "--model", DEMO / "target", "--draft", mine, "-p", "x", "-m", "2"], words)


def test_nan_or_infinite_weights_are_refused(tmp_path, drafter):
    import mlx.core as mx

    w = mx.load(str(drafter / "model.safetensors"))
    w["norm.weight"] = mx.where(mx.arange(w["norm.weight"].size) == 3, float("nan"), w["norm.weight"])
    mx.save_safetensors(str(drafter / "model.safetensors"), w)
    refused(["convert", "--hf-path", drafter, "--mlx-path", tmp_path / "o"], "weight norm.weight holds NaN")


def test_a_bin_beside_safetensors_is_named_not_used_silently(tmp_path, drafter, caplog):
    (drafter / "pytorch_model.bin").write_bytes(b"not read")
    with caplog.at_level("WARNING", logger="dflash_mlx"):
        r = runner.invoke(app, ["convert", "--hf-path", str(drafter), "--mlx-path", str(tmp_path / "o")])
    assert r.exit_code == 0, r.output
    assert any("pytorch_model.bin" in m and "not read" in m for m in caplog.messages)
    # The command line says it as it says an error: one line, `warning: ` and the message.
    (warned,) = [line for line in r.stderr.splitlines() if "warning" in line.lower()]
    assert warned.startswith(f"warning: {drafter} holds both") and "pytorch_model.bin" in warned



@pytest.mark.parametrize("command", ["convert", "generate"])
def test_damaged_safetensors_beside_a_bin_is_one_error_line_naming_both(tmp_path, drafter, monkeypatch, command):
    """No warning about the .bin first: the error names the damaged file and the way out."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file

    monkeypatch.setenv("DFLASH_MLX_CACHE", str(tmp_path / "cache"))
    weights = drafter / "model.safetensors"
    torch.save(load_file(str(weights)), str(drafter / "pytorch_model.bin"))
    weights.write_bytes(weights.read_bytes()[:-100])
    args = (["convert", "--hf-path", drafter, "--mlx-path", tmp_path / "o"] if command == "convert"
            else ["generate", "--model", "demo", "--draft", drafter, "-p", "x", "-m", "2"])
    r = refused(args, f"{weights} is truncated or damaged")
    assert r.stderr.rstrip().endswith(f"download it again, or move the safetensors files out of {drafter} "
                                      "to use pytorch_model.bin instead.")


# --- prompt-cache entries on disk: verified before use, dropped with one line -------------

def _rewrite_entry(path, change, crafted):
    """Load an entry, `change(arrays, meta, layers)`, save it again; `crafted`: with its checksum
    recomputed, as someone forging an entry would."""
    import mlx.core as mx

    from dflash_mlx.cache import prompt_store

    arrays, meta = mx.load(str(path), return_metadata=True)
    layers = json.loads(meta["layers"])
    change(arrays, meta, layers)
    meta["layers"] = json.dumps(layers)
    if crafted:
        meta["sha256"] = prompt_store.checksum(json.loads(meta["tokens"]), layers, arrays)
    mx.save_safetensors(str(path), arrays, meta)


def _rows(layers):
    return next(l["rows"] for l in layers if "rows" in l)


def _nan(arrays, meta, layers):
    import mlx.core as mx

    k = sorted(arrays)[0]
    arrays[k] = mx.full(arrays[k].shape, float("nan"), dtype=arrays[k].dtype)


def _target_offset(arrays, meta, layers):
    tokens = json.loads(meta["tokens"])
    layer = next(l for l in layers if l.get("class") == "KVCache")
    key = next(k for k, v in layer["leaves"].items() if isinstance(v, int))
    layer["leaves"][key] = len(tokens) + 50


ENTRY_DAMAGE = {
    "negative offset": lambda a, m, l: _rows(l).__setitem__(2, -5),
    "huge offset": lambda a, m, l: _rows(l).__setitem__(2, 10**12),
    "non-numeric offset": lambda a, m, l: _rows(l).__setitem__(2, "x"),
    "layers []": lambda a, m, l: l.clear(),
    "NaN arrays": _nan,
    "a target offset beyond its tokens": _target_offset,
}


def _flip(path):
    raw = bytearray(path.read_bytes())
    for i in range(len(raw) - 64, len(raw) - 16, 4):
        raw[i] ^= 0x5A
    path.write_bytes(bytes(raw))


def _spilled(pair, tmp_path, prompt):
    from dflash_mlx.cache.prompt_cache import PromptCache
    from test_prompt_cache_disk import file_of, run

    first = PromptCache(pair, disk_bytes=1 << 30, disk_dir=tmp_path)
    answer, _, _ = run(pair, prompt, first)
    assert first.spill() >= 1
    return answer, file_of(first.disk, prompt)


# Each damage as it happens (the checksum fails) and forged (its checksum recomputed:
# the structural checks catch it); flipped bytes only happen.
@pytest.mark.parametrize("case, crafted", [(c, f) for c in sorted(ENTRY_DAMAGE) for f in (False, True)]
                         + [("flipped data bytes", False)])
def test_a_damaged_prompt_cache_entry_is_dropped_and_the_text_is_a_cold_runs(pairs, tmp_path, case, crafted):
    from dflash_mlx.cache.prompt_cache import PromptCache
    from dflash_mlx.cache.prompt_store import PromptStoreWarning
    from test_prompt_cache_disk import run

    pair = pairs["qwen3"]
    tok = pair.tokenizer
    prompt = tok.encode("Once upon a time there was a tiny language model that could count: one two")
    answer, path = _spilled(pair, tmp_path, prompt)
    if case == "flipped data bytes":
        _flip(path)
    else:
        _rewrite_entry(path, ENTRY_DAMAGE[case], crafted)
    nxt = prompt + answer + tok.encode(" turn two def add(a, b):")
    with pytest.warns(PromptStoreWarning) as caught:
        again = PromptCache(pair, disk_bytes=1 << 30, disk_dir=tmp_path)
        warm, stats, _ = run(pair, nxt, again)
    cold, _, _ = run(pair, nxt)
    assert warm == cold and stats.cached_tokens == 0
    assert len([w for w in caught if issubclass(w.category, PromptStoreWarning)]) == 1
    assert not path.exists()  # dropped: the next start does not meet it again


def test_a_fifo_named_like_an_entry_does_not_stop_the_cache(pairs, tmp_path):
    import os
    import threading

    from dflash_mlx.cache.prompt_cache import PromptCache
    from dflash_mlx.cache.prompt_store import PromptStoreWarning

    pair = pairs["qwen3"]
    prompt = pair.tokenizer.encode("Once upon a time")
    _, path = _spilled(pair, tmp_path, prompt)
    fifo = path.with_name("0" * 32 + ".safetensors")
    os.mkfifo(fifo)
    done = []
    with pytest.warns(PromptStoreWarning, match="not a regular file"):
        t = threading.Thread(target=lambda: done.append(PromptCache(pair, disk_bytes=1 << 30, disk_dir=tmp_path)),
                             daemon=True)
        t.start()
        t.join(timeout=30)
    assert done and len(done[0].disk) == 1 and fifo.exists()


def test_a_converted_drafter_whose_bytes_changed_fails_its_checksum(tmp_path, drafter, caplog):
    from dflash_mlx.pair import converted_path, load_drafter

    load_drafter(drafter)
    cached = converted_path(drafter)
    assert json.loads((cached / "config.json").read_text())["dflash_mlx"]["sha256"]
    _flip(cached / "model.safetensors")  # data bytes only: every header check still passes
    with caplog.at_level("WARNING", logger="dflash_mlx"):
        load_drafter(drafter)
    assert any("checksum" in m and "set aside" in m for m in caplog.messages)
    mine = tmp_path / "mine"
    shutil.copytree(cached, mine)
    _flip(mine / "model.safetensors")
    refused(["generate", "--model", DEMO / "target", "--draft", mine, "-p", "x", "-m", "2"],
            "does not match the checksum written when it was converted")


@pytest.mark.parametrize("content, words", [
    (b'{"prompt": "\xff"}\n', "is not UTF-8 text"),
    (b'{"a":' * 100_000 + b"1" + b"}" * 100_000 + b"\n", "must be a JSON object"),
    (b"\n\n", "holds no prompts"),
    (b'{"prompt": 5}\n', "must be a JSON object with a 'prompt' string"),
])
def test_a_bad_bench_prompts_file_is_one_line(tmp_path, content, words):
    p = tmp_path / "p.jsonl"
    p.write_bytes(content)
    refused(["bench", "--prompts", p, "-m", "2", "--block-size", "4"], words)


@pytest.mark.parametrize("content, words", [
    (b'{"prompt": "\xff"}\n', "is not UTF-8 text"),
    (b'{"a":' * 100_000 + b"1" + b"}" * 100_000 + b"\n", "is not valid JSON"),
])
def test_a_bad_training_prompts_file_is_one_line(tmp_path, content, words):
    p = tmp_path / "p.jsonl"
    p.write_bytes(content)
    refused(["train", "--model", DEMO / "target", "--data", p, "--out", tmp_path / "o", "--steps", "1"], words)
    assert not (tmp_path / "o" / "checkpoints").exists()


@pytest.mark.parametrize("case", ["flipped data bytes", "non-numeric offset"])
def test_a_server_answers_a_damaged_entrys_prefix_as_a_cold_server(pairs, targets, tmp_path, case):
    """`serve --prompt-cache-disk-bytes`: a damaged entry on disk (as it happens, or forged) is dropped
    at the next request that would extend it, which gets HTTP 200 and a cold server's text."""
    import threading

    import http.client

    from dflash_mlx.cache.prompt_store import PromptStoreWarning
    from dflash_mlx.serve.http_server import make_server

    model = str(targets["qwen3"])

    def answer(messages, **cache):
        server = make_server(pairs["qwen3"], model, "127.0.0.1", 0, **cache)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=60)
            conn.request("POST", "/v1/chat/completions", json.dumps(
                {"model": model, "messages": messages, "max_tokens": 8, "temperature": 0}))
            response = conn.getresponse()
            assert response.status == 200
            body = json.loads(response.read())
            conn.close()
        finally:
            server.shutdown()
            server.engine.close()  # with a disk tier: memory is spilled to it
        return body

    disk = dict(prompt_cache_disk_bytes=1 << 30, prompt_cache_dir=tmp_path)
    messages = [{"role": "user", "content": "def add(a, b):"}]
    body = answer(messages, **disk)
    (path,) = tmp_path.glob("*/*.safetensors")
    if case == "flipped data bytes":
        _flip(path)
    else:
        _rewrite_entry(path, ENTRY_DAMAGE[case], crafted=True)
    messages += [{"role": "assistant", "content": body["choices"][0]["message"]["content"]},
                 {"role": "user", "content": "import math"}]
    with pytest.warns(PromptStoreWarning):
        warm = answer(messages, **disk)
    cold = answer(messages, prompt_cache_bytes=0)
    assert warm["choices"][0]["message"]["content"] == cold["choices"][0]["message"]["content"]
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
