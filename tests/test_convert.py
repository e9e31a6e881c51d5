"""`dflash-mlx convert`: parity with z-lab's PyTorch drafter, formats, safety."""

import io
import json
import os
import pickle
import random
import shutil
import zipfile
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import tiny
from typer.testing import CliRunner

from dflash_mlx.cli.main import app
from dflash_mlx.convert import convert_drafter, is_converted
from dflash_mlx.convert.readers import read_torch
from dflash_mlx.errors import DFlashError
from dflash_mlx.pair import load_drafter

torch = pytest.importorskip("torch")
reference = pytest.importorskip("dflash.model")

V, CTX, BLOCK = 64, 13, 8
runner = CliRunner()


def reference_drafter(cfg, seed=0):
    from transformers import Qwen3Config

    torch.manual_seed(seed)
    model = reference.DFlashDraftModel(Qwen3Config(**cfg)).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    return model


def reference_logits(model, cfg, ctx, emb):
    block = torch.tensor([[7] + [cfg["dflash_config"]["mask_token_id"]] * (BLOCK - 1)])
    noise = torch.nn.functional.embedding(block, emb)
    with torch.no_grad():
        h = model(target_hidden=ctx, noise_embedding=noise,
                  position_ids=torch.arange(CTX + BLOCK)[None], past_key_values=None, use_cache=False)
        head = torch.nn.Linear(emb.shape[1], V, bias=False)
        head.weight.data = emb
        return model.compute_logits(h[:, 1:], head).numpy(), noise


def mlx_logits(drafter, ctx, noise, emb):
    h = drafter(mx.array(noise.numpy()), mx.array(ctx.numpy()), drafter.make_cache())
    return np.array(drafter.finish_logits(h[:, 1:].astype(mx.float32) @ mx.array(emb.numpy()).T))


def save_checkpoint(model, cfg, out: Path, fmt: str):
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg))
    sd = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file(sd, str(out / "model.safetensors"))
    elif fmt == "bf16-safetensors":
        from safetensors.torch import save_file

        save_file({k: v.to(torch.bfloat16) for k, v in sd.items()}, str(out / "model.safetensors"))
    elif fmt == "sharded":
        from safetensors.torch import save_file

        keys = sorted(sd)
        halves = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
        for name, ks in halves.items():
            save_file({k: sd[k] for k in ks}, str(out / name))
        index = {"weight_map": {k: n for n, ks in halves.items() for k in ks}}
        (out / "model.safetensors.index.json").write_text(json.dumps(index))
    elif fmt == "bin-nested":
        # As training frameworks leave it: nested, prefixed, extra entries.
        torch.save({"state_dict": {f"module.draft_model.{k}": v for k, v in sd.items()}, "step": 7},
                   str(out / "pytorch_model.bin"))
    elif fmt == "bin-state-dict":
        # As `torch.save(model.state_dict())` leaves it: an OrderedDict with `_metadata`.
        torch.save(model.state_dict(), str(out / "pytorch_model.bin"))
    elif fmt == "pt-model-prefix":
        torch.save({"model": {f"model.{k}": v.half() for k, v in sd.items()}}, str(out / "drafter.pt"))
    return out


CASES = [
    ("old", False, "safetensors", 2e-5),
    ("new", True, "safetensors", 2e-5),
    ("new", True, "bin-nested", 2e-5),
    ("old", False, "bin-state-dict", 2e-5),
    ("old", False, "sharded", 2e-5),
    ("new", False, "pt-model-prefix", 5e-2),
    ("new", True, "bf16-safetensors", 1e-1),
]


@pytest.mark.parametrize("layout, sliding, fmt, tol", CASES)
def test_converted_drafter_matches_the_reference(tmp_path, layout, sliding, fmt, tol):
    cfg = tiny.drafter_config(layout, V, 8, mask_token_id=3, sliding=sliding, output_multiplier=0.8)
    ref = reference_drafter(cfg)
    src = save_checkpoint(ref, cfg, tmp_path / "src", fmt)
    dtype = "float32" if tol < 1e-3 else None
    result = convert_drafter(str(src), str(tmp_path / "mlx"), dtype=dtype)
    assert is_converted(result.path)
    assert json.loads((result.path / "config.original.json").read_text()) == cfg
    torch.manual_seed(1)
    ctx, emb = torch.randn(1, CTX, 2 * 64), torch.randn(V, 64)
    want, noise = reference_logits(ref, cfg, ctx, emb)
    got = mlx_logits(load_drafter(result.path), ctx, noise, emb)
    assert np.abs(got - want).max() < tol * max(1.0, np.abs(want).max())
    if tol < 1e-3:
        assert (got.argmax(-1) == want.argmax(-1)).all()


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_output_loads_runs_and_reports_bits(tmp_path, bits):
    cfg = tiny.drafter_config("old", V, 8, mask_token_id=3)
    ref = reference_drafter(cfg)
    src = save_checkpoint(ref, cfg, tmp_path / "src", "safetensors")
    r = runner.invoke(app, ["convert", "--hf-path", str(src), "--mlx-path", str(tmp_path / "q"),
                            "-q", "--q-bits", str(bits), "--q-group-size", "32", "--dtype", "float32"])
    assert r.exit_code == 0, r.output
    assert "bits per weight" in r.stderr
    cfg_out = json.loads((tmp_path / "q" / "config.json").read_text())
    assert cfg_out["quantization"] == {"group_size": 32, "bits": bits, "mode": "affine"}
    drafter = load_drafter(tmp_path / "q")
    assert type(drafter.layers[0].mlp.gate_proj).__name__ == "QuantizedLinear"
    torch.manual_seed(1)
    ctx, emb = torch.randn(1, CTX, 2 * 64), torch.randn(V, 64)
    want, noise = reference_logits(ref, cfg, ctx, emb)
    got = mlx_logits(drafter, ctx, noise, emb)
    rel = np.abs(got - want).mean() / np.abs(want).mean()
    assert rel < (0.05 if bits == 8 else 0.3)
    agree = (got.argmax(-1) == want.argmax(-1)).mean()
    assert agree >= (0.99 if bits == 8 else 0.5)
    bpw = float(r.stderr.split("bits per weight")[0].split(",")[-1])
    assert bits < bpw < bits + 2.5  # float32 scales and biases in groups of 32 add 2 bits


@pytest.mark.parametrize("where", ["top", "dflash_config"])
def test_is_causal_keeps_its_place_and_its_meaning(tmp_path, where):
    cfg = tiny.drafter_config("new", V, 8, mask_token_id=3, sliding=True)
    (cfg if where == "top" else cfg["dflash_config"])["is_causal"] = False
    src = save_checkpoint(reference_drafter(cfg), cfg, tmp_path / "src", "safetensors")
    result = convert_drafter(str(src), str(tmp_path / "mlx"))
    out = json.loads((result.path / "config.json").read_text())
    assert ("is_causal" in out) == (where == "top")
    assert ("is_causal" in out["dflash_config"]) == (where == "dflash_config")

    def causal(c):
        return [layer.self_attn.is_causal for layer in reference_drafter(c).layers]

    # Read as z-lab's reference reads it: top level only.
    assert causal(out) == causal(cfg) == ([False, False] if where == "top" else [True, False])
    assert [layer.self_attn.is_causal for layer in load_drafter(result.path).layers] == causal(cfg)


@pytest.mark.parametrize("dtype, bits", [("float32", 32.0), ("bfloat16", 16.0)])
def test_float_output_reports_its_bits_and_writes_an_mlx_lm_config(tmp_path, good_src, dtype, bits):
    result = convert_drafter(str(good_src), str(tmp_path / "out"), dtype=dtype)
    assert result.bits_per_weight == bits and result.quantization is None
    cfg = json.loads((result.path / "config.json").read_text())
    assert list(cfg) == sorted(cfg) and "quantization" not in cfg  # as mlx-lm's save_config writes it
    assert cfg["dtype"] == dtype


def test_runtime_converts_a_pytorch_drafter_once_and_caches_it(tmp_path, targets, vocab, monkeypatch):
    import dflash_mlx

    monkeypatch.setenv("DFLASH_MLX_CACHE", str(tmp_path / "cache"))
    Vt, mask = vocab
    cfg = tiny.drafter_config("new", Vt, 6, mask_token_id=mask, sliding=True)
    src = save_checkpoint(reference_drafter(cfg), cfg, tmp_path / "zlab", "bin-nested")
    pair = dflash_mlx.load(str(targets["qwen3"]), str(src))
    text, stats = dflash_mlx.generate(pair, "def add", max_tokens=8)
    assert stats.generation_tokens == 8
    converted = list((tmp_path / "cache" / "converted").iterdir())
    assert len(converted) == 1 and is_converted(converted[0])
    stamp = (converted[0] / "model.safetensors").stat().st_mtime_ns
    dflash_mlx.load(str(targets["qwen3"]), str(src))
    assert (converted[0] / "model.safetensors").stat().st_mtime_ns == stamp


# --- safety and errors --------------------------------------------------------


class Exploit:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_malicious_pickle_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "pwned"
    src = tmp_path / "evil"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(tiny.drafter_config("old", V, 8, mask_token_id=3)))
    payload = pickle.dumps({"fc.weight": Exploit(marker)}, protocol=2)
    with zipfile.ZipFile(src / "pytorch_model.bin", "w") as z:  # torch's zip layout
        z.writestr("archive/data.pkl", payload)
        z.writestr("archive/byteorder", "little")
    with pytest.raises(DFlashError, match="Refusing to load .*os.system|Refusing to load .*posix.system"):
        convert_drafter(str(src), str(tmp_path / "out"))
    assert not marker.exists() and not (tmp_path / "out").exists()
    # A raw (non-zip) pickle is refused outright.
    (src / "pytorch_model.bin").write_bytes(payload)
    with pytest.raises(DFlashError, match="not a zip-format PyTorch checkpoint"):
        convert_drafter(str(src), str(tmp_path / "out"))
    assert not marker.exists()
    # Sanity check of the test itself: unpickling normally would have run it.
    pickle.loads(payload)
    assert marker.exists()


def _ops(value) -> bytes:
    """Pickle opcodes building a plain value (no protocol header, STOP or memo)."""
    buf = io.BytesIO()
    p = pickle.Pickler(buf, protocol=2)
    p.fast = True
    p.dump(value)
    return buf.getvalue()[2:-1]


STORAGE = np.arange(6, dtype=np.float32)


def tensor_pickle(offset, size, stride, storage_type=b"FloatStorage", key="0", storage=None) -> bytes:
    """data.pkl of `{"w": tensor}` as torch.save writes it, with any view parameters."""
    pid = b"(" + _ops("storage") + b"ctorch\n" + storage_type + b"\n" + _ops(key) + _ops("cpu") + _ops(6) + b"tQ"
    storage = pid if storage is None else _ops(storage)
    return (b"\x80\x02}" + _ops("w") + b"ctorch._utils\n_rebuild_tensor_v2\n("
            + storage + _ops(offset) + _ops(size) + _ops(stride) + b"\x89}tRs.")


def write_torch_zip(path: Path, payload: bytes, data: bytes = STORAGE.tobytes()) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", payload)
        z.writestr("archive/byteorder", "little")
        if data is not None:
            z.writestr("archive/data/0", data)
    return path


@pytest.fixture
def strided_spy(monkeypatch):
    """Fails the test on any as_strided view reaching outside its base array."""
    real = np.lib.stride_tricks.as_strided

    def checked(x, shape=None, strides=None, **kw):
        if shape and all(shape):
            start = x.__array_interface__["data"][0] - x.base.__array_interface__["data"][0] if x.base is not None else 0
            last = start + sum((n - 1) * s for n, s in zip(shape, strides)) + x.itemsize
            total = x.base.nbytes if x.base is not None else x.nbytes
            assert 0 <= start and last <= total and min(strides) >= 0, "out-of-bounds view"
        return real(x, shape=shape, strides=strides, **kw)

    monkeypatch.setattr(np.lib.stride_tricks, "as_strided", checked)


@pytest.mark.parametrize(
    "offset, size, stride, want",
    [
        (0, (2, 3), (3, 1), [[0, 1, 2], [3, 4, 5]]),
        (0, (3, 2), (1, 3), [[0, 3], [1, 4], [2, 5]]),  # a transposed view
        (5, (1,), (1,), [5]),  # the last element exactly
        (6, (0,), (1,), []),  # empty, just past the end
        (2, (), (), 2),  # a scalar
    ],
)
def test_torch_reader_reads_views_inside_their_storage(tmp_path, strided_spy, offset, size, stride, want):
    w = read_torch(write_torch_zip(tmp_path / "ok.bin", tensor_pickle(offset, size, stride)))["w"]
    assert w.tolist() == want


@pytest.mark.parametrize(
    "offset, size, stride",
    [
        (6, (1,), (1,)),  # offset past the end
        (1, (2, 3), (3, 1)),  # the view runs one element over
        (0, (7,), (1,)),  # size too large
        (0, (2, 3), (4, 1)),  # stride too large
        (2 ** 70, (1,), (1,)),  # offset beyond any integer type
        (0, (2 ** 62,), (0,)),  # in bounds, but allocates without end
        (-1, (1,), (1,)),  # negative offset
        (5, (6,), (-1,)),  # negative stride
        (0, (-1,), (1,)),  # negative size
        (0, (2,), (1, 1)),  # sizes and strides of different lengths
        (0, [2, 3], [3, 1]),  # lists, not tuples
        ("0", (1,), (1,)),  # wrong types
        (0.0, (1,), (1,)),
        (0, (2.0,), (1,)),
        (0, (True,), (1,)),
        (None, None, None),
    ],
)
def test_crafted_tensor_views_are_refused(tmp_path, strided_spy, offset, size, stride):
    path = write_torch_zip(tmp_path / "evil.bin", tensor_pickle(offset, size, stride))
    with pytest.raises(DFlashError, match=r"evil.bin is not a valid checkpoint: .*; ") as e:
        read_torch(path)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "payload, data",
    [
        (tensor_pickle(0, (1,), (1,), storage=("not", "a storage")), STORAGE.tobytes()),  # a forged storage
        (tensor_pickle(0, (1,), (1,), storage=7), STORAGE.tobytes()),
        (tensor_pickle(0, (1,), (1,), key=["0"]), STORAGE.tobytes()),  # unhashable key
        (tensor_pickle(0, (1,), (1,)), None),  # tensor data missing
        (tensor_pickle(0, (1,), (1,)), STORAGE.tobytes()[:-1]),  # not whole elements
        (tensor_pickle(0, (1,), (1,), storage_type=b"BFloat16Storage"), b"\x00\x01\x02"),
        (tensor_pickle(0, (1,), (1,))[:-7], STORAGE.tobytes()),  # truncated pickle
        (b"\x80\x02R.", b""),  # REDUCE on an empty stack
        (b"\x80\x02h\x05.", b""),  # memo entry that does not exist
        (b"\x80\x02ccollections\nOrderedDict\nK\x01\x85R.", b""),  # dict(1): TypeError
        (b"\x80\x02ctorch\nFloatStorage\n)R.", b""),  # calling a storage type
        (b"\x80\x02ctorch\nFloatStorage\n}X\x04\x00\x00\x00nameK\x01sbK\x00.", b""),
        (b"\x80\x02" + b"(" * 10000 + b"l" * 10000 + b".", b""),  # deep nesting
        (b"\x80\x02}r\xff\xff\xff\x7f.", b""),  # a memo of 2**31 entries
        (b"\x80\x02K\x07.", b""),  # not a state dict
        (b"\x80\x02\xff.", b""),  # unknown opcode
    ],
)
def test_every_error_a_crafted_pickle_raises_is_one_line(tmp_path, payload, data):
    path = write_torch_zip(tmp_path / "evil.bin", payload, data)
    with pytest.raises(DFlashError, match=r"evil.bin is not a valid checkpoint: .*; ") as e:
        read_torch(path)
    assert "\n" not in str(e.value)


def test_fuzzed_torch_checkpoints_load_or_fail_with_one_line(tmp_path, strided_spy):
    good = io.BytesIO()
    torch.save({"state_dict": {"a": torch.arange(12.0).reshape(3, 4).t(), "b": torch.ones(2, dtype=torch.bfloat16)}}, good)
    archive = zipfile.ZipFile(io.BytesIO(good.getvalue()))
    members = {i.filename: archive.read(i) for i in archive.infolist()}
    pkl = next(n for n in members if n.endswith("data.pkl"))
    rng = random.Random(0)
    failures = 0
    for i in range(400):
        data = bytearray(members[pkl])
        for _ in range(rng.randint(1, 3)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        path = tmp_path / f"f{i}.bin"
        with zipfile.ZipFile(path, "w") as z:
            for name, raw in members.items():
                z.writestr(name, bytes(data) if name == pkl else raw)
        try:
            read_torch(path)
        except DFlashError as e:
            assert "\n" not in str(e)
            failures += 1
    assert failures > 100  # the mutations did reach the reader
    # Damaged archives, not just pickles.
    raw = (tmp_path / "f0.bin").read_bytes()
    for cut in (len(raw) // 3, len(raw) - 30):
        (tmp_path / "cut.bin").write_bytes(raw[:cut])
        with pytest.raises(DFlashError):
            read_torch(tmp_path / "cut.bin")


def test_crafted_checkpoint_fails_the_cli_with_one_line(tmp_path):
    src = tmp_path / "evil"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(tiny.drafter_config("old", V, 8, mask_token_id=3)))
    write_torch_zip(src / "pytorch_model.bin", tensor_pickle(4, (2, 3), (3, 1)))
    r = runner.invoke(app, ["convert", "--hf-path", str(src), "--mlx-path", str(tmp_path / "out")])
    assert r.exit_code == 1 and "is not a valid checkpoint" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.output
    assert not (tmp_path / "out").exists()


@pytest.fixture
def good_src(tmp_path):
    cfg = tiny.drafter_config("old", V, 8, mask_token_id=3)
    return save_checkpoint(reference_drafter(cfg), cfg, tmp_path / "src", "safetensors")


def _rewrite(src, change):
    from safetensors.numpy import load_file, save_file

    w = load_file(str(src / "model.safetensors"))
    change(w)
    save_file(w, str(src / "model.safetensors"))


def _bad_offsets(path):
    """A header whose first tensor's byte range does not fit its shape."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    key = next(k for k in header if k != "__metadata__")
    header[key]["data_offsets"][1] -= 4
    text = json.dumps(header).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + n :])


@pytest.mark.parametrize(
    "damage, words",
    [
        (lambda s: (s / "model.safetensors").unlink(), "No weights in"),
        (lambda s: (s / "config.json").unlink(), "No config.json"),
        (lambda s: (s / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8})),
         "not a DFlash drafter"),
        (lambda s: (s / "model.safetensors").write_bytes((s / "model.safetensors").read_bytes()[:-100]),
         "truncated"),
        (lambda s: (s / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all"),
         "corrupt safetensors header"),
        (lambda s: (s / "model.safetensors").write_bytes(b""), "truncated"),
        (lambda s: (s / "model.safetensors").write_bytes((10 ** 6).to_bytes(8, "little") + b"{}"), "truncated"),
        (lambda s: _bad_offsets(s / "model.safetensors"), "corrupt safetensors header"),
        (lambda s: _rewrite(s, lambda w: w.update({"lm_head.weight": np.zeros((V, 64), np.float32)})),
         "unknown weight(s) lm_head.weight"),
        (lambda s: _rewrite(s, lambda w: w.pop("layers.1.mlp.up_proj.weight")),
         "missing weight(s) layers.1.mlp.up_proj.weight"),
        (lambda s: _rewrite(s, lambda w: w.update({"fc.weight": np.zeros((64, 64), np.float32)})),
         "has shape (64, 64)"),
        (lambda s: _rewrite(s, lambda w: w.update({"norm.weight": np.zeros(64, np.int32)})),
         "dtype I32"),
    ],
)
def test_bad_inputs_fail_with_one_clear_line(tmp_path, good_src, damage, words):
    damage(good_src)
    r = runner.invoke(app, ["convert", "--hf-path", str(good_src), "--mlx-path", str(tmp_path / "out")])
    assert r.exit_code == 1
    assert words in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.output
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == []


def test_existing_output_needs_force_and_is_kept_intact(tmp_path, good_src):
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("precious")
    r = runner.invoke(app, ["convert", "--hf-path", str(good_src), "--mlx-path", str(out)])
    assert r.exit_code == 1 and "--force" in r.stderr
    assert (out / "mine.txt").read_text() == "precious"
    # Not a previous conversion: one --force is not enough.
    r = runner.invoke(app, ["convert", "--hf-path", str(good_src), "--mlx-path", str(out), "--force"])
    assert r.exit_code == 1 and "is not a previous conversion" in r.stderr and "--force twice" in r.stderr
    assert (out / "mine.txt").read_text() == "precious"
    r = runner.invoke(app, ["convert", "--hf-path", str(good_src), "--mlx-path", str(out), "--force", "--force"])
    assert r.exit_code == 0, r.output
    assert is_converted(out) and not (out / "mine.txt").exists()
    # A previous conversion is replaced with one --force.
    r = runner.invoke(app, ["convert", "--hf-path", str(good_src), "--mlx-path", str(out), "--force", "--dtype",
                            "float16"])
    assert r.exit_code == 0, r.output
    assert json.loads((out / "config.json").read_text())["dtype"] == "float16"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]


def _tree(path):
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("where", ["parent", "same", "inside", "file-parent"])
def test_an_output_at_or_around_the_input_is_refused_and_nothing_is_deleted(tmp_path, good_src, where):
    """`--mlx-path ck --force` with the input at ck/step-5000 would replace ck and with it
    the checkpoint and its siblings: refused, however many --force, before any work."""
    ck = tmp_path / "ck"
    shutil.copytree(good_src, ck / "step-5000")
    (ck / "step-4000").mkdir()
    (ck / "step-4000" / "notes.txt").write_text("keep me")
    src = ck / "step-5000"
    hf, out, words = {
        "parent": (src, ck, "holds the input folder"),
        "same": (src, src, "is the input folder"),
        "inside": (src, src / "mlx", "is inside the input folder"),
        "file-parent": (src / "model.safetensors", ck / "step-5000", "is the input folder"),
    }[where]
    before = _tree(tmp_path)
    r = runner.invoke(app, ["convert", "--hf-path", str(hf), "--mlx-path", str(out), "--force", "--force"])
    assert r.exit_code == 1 and words in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert _tree(tmp_path) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "src"]


def test_force_onto_a_symlink_replaces_its_folder_and_keeps_the_link(tmp_path, good_src):
    real = tmp_path / "real"
    convert_drafter(str(good_src), str(real))
    link = tmp_path / "link"
    link.symlink_to(real, target_is_directory=True)
    r = runner.invoke(app, ["convert", "--hf-path", str(good_src), "--mlx-path", str(link), "--force",
                            "--dtype", "float16"])
    assert r.exit_code == 0, r.output
    assert link.is_symlink() and link.resolve() == real.resolve()
    assert json.loads((real / "config.json").read_text())["dtype"] == "float16"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "real", "src"]  # no stray .old folder


@pytest.mark.parametrize("parent", ["file", "proc"])
def test_an_unwritable_output_parent_is_one_line(tmp_path, good_src, parent):
    if parent == "file":
        (tmp_path / "f").write_text("x")
        out = tmp_path / "f" / "out"
    else:
        out = Path("/proc/dflash-mlx-test/out")
    r = runner.invoke(app, ["convert", "--hf-path", str(good_src), "--mlx-path", str(out)])
    assert r.exit_code == 1 and "Cannot write" in r.stderr, r.output
    assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.output


def test_failed_write_leaves_no_partial_output(tmp_path, good_src, monkeypatch):
    def broken(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(mx, "save_safetensors", broken)
    with pytest.raises(OSError):
        convert_drafter(str(good_src), str(tmp_path / "out"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_target_check_happens_before_writing(tmp_path, good_src, targets):
    r = runner.invoke(app, ["convert", "--hf-path", str(good_src), "--mlx-path", str(tmp_path / "out"),
                            "--target", str(targets["qwen3"])])
    assert r.exit_code == 1 and "vocabulary" in r.stderr
    assert not (tmp_path / "out").exists()


def test_bad_option_values(tmp_path, good_src):
    for args, words in [(["--dtype", "int8"], "--dtype"), (["-q", "--q-bits", "3"], "--q-bits"),
                        (["-q", "--q-group-size", "48"], "--q-group-size")]:
        r = runner.invoke(app, ["convert", "--hf-path", str(good_src), "--mlx-path", str(tmp_path / "o"), *args])
        assert r.exit_code == 1 and words in r.stderr


# --- DFlash 2 -----------------------------------------------------------------

CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")


def dflash2_drafter(seed=0):
    from transformers import Qwen3Config

    cfg = tiny.drafter_config("new", V, 8, mask_token_id=3, sliding=True, output_multiplier=0.8)
    cfg.update(architectures=["DFlash2DraftModel"], is_causal=False, layer_types=["sliding_attention"] * 2)
    cfg["dflash_config"].update(conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=6)
    torch.manual_seed(seed)
    model = reference.DFlash2DraftModel(Qwen3Config(**cfg)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(1.0 if "norm" in name else 0.0, 1.0 if "codebook" in name else 0.2)
    return model, cfg


def _publish(src):
    """Codebooks as published checkpoints store them: without `.weight`."""
    from safetensors.torch import load_file, save_file

    w = load_file(str(src / "model.safetensors"))
    w.update({k: w.pop(f"{k}.weight") for k in CODEBOOKS})
    save_file(w, str(src / "model.safetensors"))


@pytest.mark.parametrize("fmt, published, tol", [
    ("safetensors", True, 2e-5),
    ("safetensors", False, 2e-5),
    ("bin-nested", False, 2e-5),
    ("bf16-safetensors", True, 1e-1),
])
def test_dflash2_checkpoint_converts_with_its_codebooks(tmp_path, fmt, published, tol):
    from safetensors import safe_open

    from dflash_mlx.draft.drafter2 import DFlash2Drafter

    ref, cfg = dflash2_drafter()
    src = save_checkpoint(ref, cfg, tmp_path / "src", fmt)
    if published:
        _publish(src)
    result = convert_drafter(str(src), str(tmp_path / "mlx"), dtype="float32" if tol < 1e-3 else None)
    out = json.loads((result.path / "config.json").read_text())
    assert out["architectures"] == ["DFlash2DraftModel"]
    assert {k: out["dflash_config"][k] for k in cfg["dflash_config"]} == cfg["dflash_config"]
    assert out["is_causal"] is False
    with safe_open(str(result.path / "model.safetensors"), framework="numpy") as f:
        keys = set(f.keys())
    assert set(CODEBOOKS) <= keys and not any(k.endswith("codebook.weight") for k in keys)
    drafter = load_drafter(result.path)
    assert isinstance(drafter, DFlash2Drafter)
    want_cb = ref.candidate_selector.successor_codebook.weight.detach().numpy()
    assert np.abs(np.array(drafter.candidate_selector.successor_codebook.astype(mx.float32)) - want_cb).max() < tol
    torch.manual_seed(1)
    ctx, emb = torch.randn(1, CTX, 2 * 64), torch.randn(V, 64)
    want, noise = reference_logits(ref, cfg, ctx, emb)
    got = mlx_logits(drafter, ctx, noise, emb)
    assert np.abs(got - want).max() < tol * max(1.0, np.abs(want).max())


def test_dflash2_checkpoint_without_codebooks_is_refused(tmp_path):
    ref, cfg = dflash2_drafter()
    src = save_checkpoint(ref, cfg, tmp_path / "src", "safetensors")
    _rewrite(src, lambda w: w.pop(f"{CODEBOOKS[0]}.weight"))
    r = runner.invoke(app, ["convert", "--hf-path", str(src), "--mlx-path", str(tmp_path / "out")])
    assert r.exit_code == 1 and f"missing weight(s) {CODEBOOKS[0]}" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_quantized_dflash2_loads_and_keeps_its_codebooks_float(tmp_path):
    ref, cfg = dflash2_drafter()
    src = save_checkpoint(ref, cfg, tmp_path / "src", "safetensors")
    _publish(src)
    r = runner.invoke(app, ["convert", "--hf-path", str(src), "--mlx-path", str(tmp_path / "q"),
                            "-q", "--q-bits", "8", "--q-group-size", "32", "--dtype", "float32"])
    assert r.exit_code == 0, r.output
    drafter = load_drafter(tmp_path / "q")
    assert type(drafter.layers[0].mlp_conv.kernel_projection).__name__ == "QuantizedLinear"
    assert drafter.candidate_selector.predecessor_codebook.dtype == mx.float32
    torch.manual_seed(1)
    ctx, emb = torch.randn(1, CTX, 2 * 64), torch.randn(V, 64)
    want, noise = reference_logits(ref, cfg, ctx, emb)
    got = mlx_logits(drafter, ctx, noise, emb)
    assert np.abs(got - want).mean() / np.abs(want).mean() < 0.05


@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_reported_parameters_are_the_weights_the_model_holds(tmp_path, kind):
    """Packed quantized weights count as the weights they hold, and DFlash2's
    codebooks count too: the figures match the PyTorch model's."""
    if kind == "dflash2":
        ref, cfg = dflash2_drafter()
    else:
        cfg = tiny.drafter_config("old", V, 8, mask_token_id=3)
        ref = reference_drafter(cfg)
    want = sum(p.numel() for p in ref.parameters())
    src = save_checkpoint(ref, cfg, tmp_path / "src", "safetensors")
    full = convert_drafter(str(src), str(tmp_path / "f32"), dtype="float32")
    assert full.parameters == want and full.bits_per_weight == 32.0
    q = convert_drafter(str(src), str(tmp_path / "q4"), dtype="float32", quantize=True, q_bits=4, q_group_size=32)
    assert q.parameters == want
    assert 4 < q.bits_per_weight < 7  # float32 scales and biases add 2 bits; norms and codebooks stay float
    r = runner.invoke(app, ["convert", "--hf-path", str(src), "--mlx-path", str(tmp_path / "cli"),
                            "-q", "--q-group-size", "32"])
    assert r.exit_code == 0, r.output
    assert f"({want / 1e6:.1f}M parameters" in r.stderr
