"""Float32 copies of the demo pair, and a widened target whose greedy outputs equal the demo's.

`prepare(name, root)` writes a pair folder under `root`:

    <root>/<name>/target/          float32 mlx-lm target (config, weights, tokenizer)
    <root>/<name>/drafter/         the drafter in this repository's converted layout (float32)
    <root>/<name>/drafter-zlab/    the same weights under the original z-lab config layout
                                   (`block_size` and `rope_theta` at the top level), which the
                                   peer loaders read
    <root>/<name>/build.json       what was built and from what; a folder whose build.json
                                   matches is reused

`demo` is the shipped pair cast to float32. `widened` is built from it:

- every MLP's intermediate size is zero-padded (768 -> 8192): the new `gate_proj`/`up_proj`
  rows are random, the new `down_proj` columns are zero, so the layer adds exactly what it
  added before (up to the order a longer dot product is summed in);
- identity decoder layers are inserted before the last layer: random attention and MLP
  inputs, but `o_proj` and `down_proj` all zero, so each adds exactly 0 to the residual
  stream. The last layer stays last (the drafter taps it after the final norm, as HF
  reports `hidden_states[-1]`), and the drafter's `target_layer_ids` are renumbered
  ([0, 1, 2, 3] -> [0, 1, 2, 15]) so every tap still reads the same residual stream.

The result has ~104 M parameters (the demo target: 3.7 M; the drafter: 3.4 M), so a
target pass costs many drafter passes, as with a real pair. `check(...)` compares plain
mlx-lm greedy ids of a built target against the demo target's.

Run `python benchmarks/peers/widen.py [--root DIR] [--check]` to build (and check) both.
Needs this repository's environment (mlx, mlx-lm); the shipped files are never modified.
"""

import argparse
import hashlib
import json
import shutil
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

REPO = Path(__file__).resolve().parents[2]
DEMO_TARGET = REPO / "dflash_mlx" / "demo" / "target"
DEMO_DRAFTER = REPO / "dflash_mlx" / "demo" / "drafter"
DEFAULT_ROOT = Path.home() / ".cache" / "dflash-mlx" / "peers" / "pairs"

# Bump when what `prepare` writes changes, so cached folders are rebuilt.
BUILD_VERSION = 2
PAIRS = {
    "demo": {"intermediate_size": None, "extra_layers": 0},
    "widened": {"intermediate_size": 8192, "extra_layers": 12},
}


class WidenError(Exception):
    pass


def _source_stamp() -> str:
    h = hashlib.sha256()
    for d in (DEMO_TARGET, DEMO_DRAFTER):
        for f in sorted(d.iterdir()):
            if f.is_file():
                h.update(f"{d.name}/{f.name}:{f.stat().st_size}".encode())
                if f.suffix == ".json":
                    h.update(f.read_bytes())
    return h.hexdigest()[:16]


def _spec(name: str) -> dict:
    if name not in PAIRS:
        raise WidenError(f"unknown pair '{name}' (known: {', '.join(PAIRS)})")
    return {"pair": name, "build_version": BUILD_VERSION, "source": _source_stamp(), **PAIRS[name]}


def widen_weights(weights: dict, config: dict, intermediate_size, extra_layers: int, seed: int = 0):
    """Widened float32 weights and config for a qwen3 mlx-lm target (see the module docstring)."""
    rng = np.random.default_rng(seed)
    L = config["num_hidden_layers"]
    hidden = config["hidden_size"]
    old_i = config["intermediate_size"]
    new_i = intermediate_size or old_i
    if new_i < old_i:
        raise WidenError(f"intermediate_size {new_i} is smaller than the target's {old_i}")
    f32 = {k: np.array(v.astype(mx.float32)) for k, v in weights.items()}

    def rand(*shape):
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    def layer(i):
        p = f"model.layers.{i}."
        return {k[len(p):]: v for k, v in f32.items() if k.startswith(p)}

    layers = [layer(i) for i in range(L)]
    for lw in layers:
        extra = new_i - old_i
        if extra:
            lw["mlp.gate_proj.weight"] = np.concatenate([lw["mlp.gate_proj.weight"], rand(extra, hidden)], 0)
            lw["mlp.up_proj.weight"] = np.concatenate([lw["mlp.up_proj.weight"], rand(extra, hidden)], 0)
            lw["mlp.down_proj.weight"] = np.concatenate(
                [lw["mlp.down_proj.weight"], np.zeros((hidden, extra), np.float32)], 1)
    identity = []
    for _ in range(extra_layers):
        lw = {}
        for k, v in layers[0].items():
            if k.endswith("norm.weight"):
                lw[k] = np.ones_like(v)
            elif k in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
                lw[k] = np.zeros_like(v)  # adds exactly 0 to the residual stream
            else:
                lw[k] = rand(*v.shape)
        identity.append(lw)
    new_layers = layers[:-1] + identity + layers[-1:]
    out = {k: v for k, v in f32.items() if not k.startswith("model.layers.")}
    for i, lw in enumerate(new_layers):
        for k, v in lw.items():
            out[f"model.layers.{i}.{k}"] = v
    cfg = dict(config, num_hidden_layers=len(new_layers), intermediate_size=new_i, torch_dtype="float32")
    # old layer index -> new layer index (only the last one moves)
    remap = {i: (i if i < L - 1 else len(new_layers) - 1) for i in range(L)}
    return {k: mx.array(v) for k, v in out.items()}, cfg, remap


def _drafter_configs(remap: dict, num_target_layers: int):
    ours = json.loads((DEMO_DRAFTER / "config.json").read_text())
    orig = json.loads((DEMO_DRAFTER / "config.original.json").read_text())
    ids = [remap[i] for i in ours["dflash_config"]["target_layer_ids"]]
    ours["dflash_config"]["target_layer_ids"] = ids
    ours["num_target_layers"] = num_target_layers
    ours["dtype"] = "float32"
    # The older z-lab layout (Qwen3-4B-DFlash-b16 era) that every peer loader reads:
    # block_size and rope_theta at the top level, mask and taps in dflash_config.
    zl = {k: v for k, v in orig.items() if k not in ("rope_parameters",)}
    block = orig.get("dflash_config", {}).get("block_size", orig.get("block_size", 16))
    zl["block_size"] = block
    zl["rope_theta"] = orig.get("rope_theta", (orig.get("rope_parameters") or {}).get("rope_theta", 10000.0))
    zl["dflash_config"] = {"mask_token_id": orig["dflash_config"]["mask_token_id"], "target_layer_ids": ids,
                           "block_size": block}
    zl["num_target_layers"] = num_target_layers
    zl["dtype"] = "float32"
    zl["architectures"] = ["DFlashDraftModel"]
    return ours, zl


def count_parameters(weights: dict) -> int:
    return int(sum(v.size for v in weights.values()))


def prepare(name: str, root: Path = DEFAULT_ROOT, log=lambda msg: None) -> Path:
    """Build (or reuse) the pair folder `root/name`; returns it."""
    from dflash_mlx.convert.convert import FORMAT, file_digest

    spec = _spec(name)
    out = Path(root) / name
    manifest = out / "build.json"
    if manifest.is_file():
        try:
            built = json.loads(manifest.read_text())
        except json.JSONDecodeError:
            built = {}
        if built.get("spec") == spec:
            return out
    log(f"building the {name} pair in {out}")
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "target").mkdir(parents=True)
    (tmp / "drafter").mkdir()
    (tmp / "drafter-zlab").mkdir()
    config = json.loads((DEMO_TARGET / "config.json").read_text())
    weights = mx.load(str(DEMO_TARGET / "model.safetensors"))
    new_w, new_cfg, remap = widen_weights(weights, config, spec["intermediate_size"], spec["extra_layers"])
    mx.save_safetensors(str(tmp / "target" / "model.safetensors"), new_w, metadata={"format": "mlx"})
    (tmp / "target" / "config.json").write_text(json.dumps(new_cfg, indent=2))
    for f in DEMO_TARGET.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "generation_config.json"):
            shutil.copy2(f, tmp / "target" / f.name)
    dw = {k: v.astype(mx.float32) for k, v in mx.load(str(DEMO_DRAFTER / "model.safetensors")).items()}
    ours, zl = _drafter_configs(remap, new_cfg["num_hidden_layers"])
    for d, cfg in (("drafter", ours), ("drafter-zlab", zl)):
        mx.save_safetensors(str(tmp / d / "model.safetensors"), dw, metadata={"format": "mlx"})
        if FORMAT in cfg:  # the float32 copy is other bytes than the demo file the config's checksum names
            cfg[FORMAT] = {**cfg[FORMAT], "sha256": file_digest(tmp / d / "model.safetensors")}
        (tmp / d / "config.json").write_text(json.dumps(cfg, indent=2))
    info = {"spec": spec, "target_parameters": count_parameters(new_w), "drafter_parameters": count_parameters(dw),
            "target_layers": new_cfg["num_hidden_layers"], "intermediate_size": new_cfg["intermediate_size"],
            "target_layer_ids": zl["dflash_config"]["target_layer_ids"], "dtype": "float32"}
    (tmp / "build.json").write_text(json.dumps(info, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def greedy_ids(target_dir: Path, prompts, max_tokens: int = 32):
    """Plain mlx-lm greedy ids of the target at `target_dir`, float32, for each prompt (token ids)."""
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(target_dir))
    model.set_dtype(mx.float32)
    outs = []
    for ids in prompts:
        toks = []
        for tok, _ in generate_step(mx.array(ids), model, max_tokens=max_tokens):
            toks.append(int(tok))
        outs.append(toks)
    return outs


def default_prompt_ids(n: int = 4):
    sys.path.insert(0, str(REPO))
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from dflash_mlx.bench import load_prompts
    from dflash_mlx.prompt import build_prompt

    tok = load_tokenizer(DEMO_TARGET)
    return [build_prompt(tok, p) for p in load_prompts("code")["code"][:n]]


def check(pair_dir: Path, prompts=None, max_tokens: int = 32) -> dict:
    """Greedy ids of the pair's target equal the demo target's (float32) on `prompts`; raises if not."""
    prompts = prompts or default_prompt_ids()
    ref = greedy_ids(DEMO_TARGET, prompts, max_tokens)
    got = greedy_ids(Path(pair_dir) / "target", prompts, max_tokens)
    bad = [i for i, (a, b) in enumerate(zip(ref, got)) if a != b]
    if bad:
        raise WidenError(f"{pair_dir}: greedy ids differ from the demo target's on prompt(s) {bad}")
    return {"prompts": len(prompts), "max_tokens": max_tokens, "identical": True}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=str(DEFAULT_ROOT), help="cache folder for the pair folders")
    ap.add_argument("--pair", choices=list(PAIRS) + ["all"], default="all")
    ap.add_argument("--check", action="store_true", help="compare greedy ids with the demo target's")
    args = ap.parse_args(argv)
    names = list(PAIRS) if args.pair == "all" else [args.pair]
    try:
        for name in names:
            d = prepare(name, Path(args.root), log=lambda m: print(m, file=sys.stderr))
            info = json.loads((d / "build.json").read_text())
            print(f"{name}: {d} ({info['target_parameters'] / 1e6:.1f} M target parameters, "
                  f"{info['target_layers']} layers, taps {info['target_layer_ids']})")
            if args.check:
                print(f"  greedy ids equal the demo target's: {check(d)}")
    except WidenError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
