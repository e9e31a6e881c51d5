"""Converting PyTorch/z-lab DFlash drafter checkpoints into the MLX layout."""

import contextlib
import hashlib
import io
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.utils import quantize_model, save_config

from dflash_mlx.config import DFLASH2_FIELDS, DrafterConfig, check_pair
from dflash_mlx.draft.drafter2 import drafter_class, published_keys
from dflash_mlx.errors import DFlashError, printable
from dflash_mlx.hub import TORCH_SUFFIXES, fetch

from .readers import read_safetensors, read_sharded_safetensors, read_torch

log = logging.getLogger("dflash_mlx")
FORMAT = "dflash_mlx"
FORMAT_VERSION = 1
DTYPES = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}
PREFIXES = ("model.", "module.", "draft_model.")
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass
class ConvertResult:
    path: Path
    dtype: str
    bits_per_weight: float
    parameters: int
    quantization: Optional[dict]


def is_converted(path: Path) -> bool:
    try:
        cfg = json.loads((Path(path) / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return isinstance(cfg.get(FORMAT), dict) and cfg[FORMAT].get("format_version") == FORMAT_VERSION


def file_digest(path: Path) -> str:
    """sha256 of a file's bytes, read in pieces."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for piece in iter(lambda: f.read(1 << 24), b""):
            h.update(piece)
    return h.hexdigest()


def read_checkpoint(path: Path) -> Dict[str, mx.array]:
    """Weights from a drafter directory or a single checkpoint file. A directory's
    safetensors weights are read in preference to PyTorch checkpoints beside them."""
    path = Path(path)
    if path.is_file():
        return _read_files([path])
    unread = sorted(p.name for p in path.iterdir() if p.suffix in TORCH_SUFFIXES)
    try:
        weights = _read_safetensors_folder(path)
    except DFlashError as e:
        if not unread:
            raise
        raise DFlashError(f"{str(e).rstrip('.')}, or move the safetensors files out of {path} "
                          f"to use {', '.join(unread)} instead.") from e
    if weights is None:
        if not unread:
            raise DFlashError(
                f"No weights in {path}: expected model.safetensors, a sharded index, "
                "pytorch_model.bin or a *.pt/*.pth checkpoint."
            )
        return _read_files([path / name for name in unread])
    if unread:
        log.warning(printable(f"{path} holds both safetensors weights and {', '.join(unread)}; "
                              "the safetensors weights are converted, the others are not read."))
    return weights


def _read_safetensors_folder(path: Path) -> Optional[Dict[str, mx.array]]:
    """A directory's safetensors weights (sharded, one file or several), or None if it has none."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return read_sharded_safetensors(index)
    if (path / "model.safetensors").is_file():
        return read_safetensors(path / "model.safetensors")
    files = sorted(path.glob("*.safetensors"))
    return _read_files(files) if files else None


def _read_files(files) -> Dict[str, mx.array]:
    weights = {}
    for f in files:
        weights.update(read_safetensors(f) if f.suffix == ".safetensors" else read_torch(f))
    return weights


def _strip_prefixes(weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
    out = {}
    for key, value in weights.items():
        changed = True
        while changed:
            changed = False
            for p in PREFIXES:
                if key.startswith(p):
                    key, changed = key[len(p) :], True
        if not key.endswith(IGNORED_SUFFIXES):
            out[key] = value
    return out


def check_weights(weights: Dict[str, mx.array], model: nn.Module, source: str) -> None:
    expected = dict(tree_flatten(model.parameters()))
    unknown = sorted(set(weights) - set(expected))
    if unknown:
        raise DFlashError(
            f"{source}: unknown weight(s) {', '.join(unknown[:3])}{' …' if len(unknown) > 3 else ''}; "
            "it is not a DFlash drafter checkpoint or does not match its config."
        )
    missing = sorted(set(expected) - set(weights))
    if missing:
        raise DFlashError(
            f"{source}: missing weight(s) {', '.join(missing[:3])}{' …' if len(missing) > 3 else ''}; "
            "the checkpoint is incomplete or its config has more layers."
        )
    for key, value in weights.items():
        if tuple(value.shape) != tuple(expected[key].shape):
            raise DFlashError(
                f"{source}: weight {key} has shape {tuple(value.shape)} but the config implies "
                f"{tuple(expected[key].shape)}."
            )
        if value.dtype not in DTYPES.values():
            raise DFlashError(f"{source}: weight {key} has dtype {value.dtype}; only float weights are supported.")


def normalized_config(original: dict, cfg: DrafterConfig, dtype: str, source: str) -> dict:
    """One layout for every drafter: the newer z-lab layout plus our marker."""
    dflash = {
        "block_size": cfg.block_size,
        "mask_token_id": cfg.mask_token_id,
        "target_layer_ids": cfg.target_layer_ids,
        "input_embedding_scale": cfg.input_embedding_scale,
        "output_multiplier": cfg.output_multiplier,
    }
    if cfg.final_logit_softcapping:
        dflash["final_logit_softcapping"] = cfg.final_logit_softcapping
    if cfg.is_dflash2:
        dflash.update({k: getattr(cfg, k) for k in DFLASH2_FIELDS})
    # is_causal stays where it was: the reference reads only the top level.
    if "is_causal" in (original.get("dflash_config") or {}):
        dflash["is_causal"] = original["dflash_config"]["is_causal"]
    rope = {"rope_theta": cfg.rope_theta, "rope_type": "default"}
    if cfg.rope_scaling:
        rope.update(cfg.rope_scaling)
    out = {
        "architectures": [cfg.architecture],
        "model_type": original.get("model_type", "qwen3"),
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size,
        "vocab_size": cfg.vocab_size,
        "rms_norm_eps": cfg.rms_norm_eps,
        "attention_bias": cfg.attention_bias,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rope_parameters": rope,
        "layer_types": cfg.layer_types,
        "sliding_window": cfg.sliding_window,
        "num_target_layers": cfg.num_target_layers,
        "tie_word_embeddings": original.get("tie_word_embeddings", True),
        "dtype": dtype,
        "dflash_config": dflash,
        FORMAT: {"format_version": FORMAT_VERSION, "source": source},
    }
    for key in ("is_causal", "bos_token_id", "eos_token_id"):
        if key in original:
            out[key] = original[key]
    return out


def target_dims(name: str):
    """(hidden size, vocabulary, layers) of a target, from its config.json only."""
    path = fetch(name, "config")
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        raise DFlashError(f"No readable config.json for target {name}.")
    text = cfg.get("text_config") or cfg
    try:
        return int(text["hidden_size"]), int(text["vocab_size"]), int(text["num_hidden_layers"])
    except KeyError as e:
        raise DFlashError(f"Target {name}'s config.json lacks {e.args[0]}.")


def write_atomic(out: Path, force: bool, write: Callable[[Path], None]) -> None:
    """Write into a temporary sibling directory, then rename it into place. A
    symlink is followed: the link stays and points at the new folder."""
    out = Path(out).absolute()
    if out.is_symlink():
        out = out.resolve()
    if out.exists() and not force:
        raise DFlashError(f"{out} already exists; pass --force to replace it.")
    if out.exists() and not out.is_dir():
        raise DFlashError(f"{out} is a file; choose a directory for --mlx-path.")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    except OSError as e:
        raise DFlashError(f"Cannot write {out} ({e.strerror or e}); choose a writable folder.")
    try:
        write(tmp)
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            os.rename(out, old)
            os.rename(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def output_folder(mlx_path: str, force: int) -> Path:
    """The folder a conversion goes to, checked before any work. An existing
    one is replaced only with `force`, and one that is not a previous
    conversion (no marker in its config.json) only with `force` 2 (--force
    twice). A symlink is followed."""
    out = Path(mlx_path).absolute()
    if out.is_symlink():
        out = out.resolve()
    if out.exists():
        if not out.is_dir():
            raise DFlashError(f"{out} is a file; choose a directory for --mlx-path.")
        if not force:
            raise DFlashError(f"{out} already exists; pass --force to replace it.")
        if force < 2 and not is_converted(out):
            raise DFlashError(f"{out} is not a previous conversion (its config.json has no {FORMAT} marker); "
                              "pass --force twice to replace it and everything in it.")
    parent = out.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise DFlashError(f"Cannot write {out}: {parent} is not a writable folder; choose another --mlx-path.")
    return out


def check_apart(out: Path, source: Path) -> None:
    """An output that is the input's folder, holds it or lies inside it is refused:
    replacing it would delete the checkpoint or what lies beside it."""
    src, dst = Path(source).resolve(), Path(out).resolve()
    if dst == src or src.is_relative_to(dst) or dst.is_relative_to(src):
        where = "is" if dst == src else "holds" if src.is_relative_to(dst) else "is inside"
        raise DFlashError(f"--mlx-path {out} {where} the input folder {src}; choose a folder outside it.")


def convert_drafter(
    hf_path: str,
    mlx_path: str,
    dtype: Optional[str] = None,
    quantize: bool = False,
    q_bits: int = 4,
    q_group_size: int = 64,
    target: Optional[str] = None,
    force: int = 0,
    progress: Callable[[str], None] = lambda step: None,
) -> ConvertResult:
    """Convert a DFlash drafter (repo id, directory or checkpoint file) to MLX.
    `force` 1 replaces a previous conversion at `mlx_path`, 2 any folder there."""
    if dtype is not None and dtype not in DTYPES:
        raise DFlashError(f"--dtype must be one of {', '.join(DTYPES)} (got {dtype}).")
    if quantize and q_bits not in (4, 8):
        raise DFlashError(f"--q-bits must be 4 or 8 (got {q_bits}).")
    if quantize and q_group_size not in (32, 64, 128):
        raise DFlashError(f"--q-group-size must be 32, 64 or 128 (got {q_group_size}).")
    out = output_folder(mlx_path, int(force))
    src = Path(hf_path)
    if src.exists():
        check_apart(out, src if src.is_dir() else src.parent)

    progress("reading")
    src = src if src.exists() else fetch(hf_path, "draft")
    cfg_dir = src if src.is_dir() else src.parent
    check_apart(out, cfg_dir)
    config_path = cfg_dir / "config.json"
    config = DrafterConfig.from_file(config_path)
    original = json.loads(config_path.read_text())
    if target is not None:
        progress("checking target")
        hidden, vocab, layers = target_dims(target)
        check_pair(config, hidden, vocab, layers)
    weights = _strip_prefixes(read_checkpoint(src))
    if config.is_dflash2:
        weights = published_keys(weights)

    progress("checking weights")
    model = drafter_class(config)(config)
    check_weights(weights, model, str(src))
    broken = next((k for k, v in weights.items() if not mx.all(mx.isfinite(v)).item()), None)
    if broken:
        raise DFlashError(f"{src}: weight {broken} holds NaN or infinite values; the checkpoint is damaged, "
                          "download it again.")
    source_dtypes = {v.dtype for v in weights.values()}
    if dtype is None:
        dtype = next((k for k, v in DTYPES.items() if {v} == source_dtypes), "bfloat16")
    model.load_weights(list(weights.items()))
    model.set_dtype(DTYPES[dtype])

    new_cfg = normalized_config(original, config, dtype, str(hf_path))
    # Counted before quantizing, where each array holds one weight per element
    # (packed quantized weights hold several, and mlx-lm's count misses arrays
    # of modules that also hold modules, such as DFlash2's codebooks).
    parameters = sum(v.size for _, v in tree_flatten(model.parameters()))
    if quantize:
        progress("quantizing")
        # quantize_model prints its own bits-per-weight line; the caller reports it.
        with contextlib.redirect_stdout(io.StringIO()):
            model, new_cfg = quantize_model(model, new_cfg, q_group_size, q_bits)
    mx.eval(model.parameters())
    params = dict(tree_flatten(model.parameters()))

    def write(tmp: Path):
        mx.save_safetensors(str(tmp / "model.safetensors"), params, metadata={"format": "mlx"})
        new_cfg[FORMAT]["sha256"] = file_digest(tmp / "model.safetensors")  # checked on every load
        save_config(new_cfg, tmp / "config.json")
        (tmp / "config.original.json").write_text(json.dumps(original, indent=2))

    progress("writing")
    write_atomic(out, True, write)
    return ConvertResult(
        path=out,
        dtype=dtype,
        bits_per_weight=sum(v.nbytes for v in params.values()) * 8 / parameters,
        parameters=parameters,
        quantization=new_cfg.get("quantization"),
    )
