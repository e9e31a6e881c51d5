"""Drafter configuration: the published z-lab `config.json` layouts (DFlash 1 and 2)."""

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from .errors import DFlashError

# Bump when the converter's output changes, so cached conversions are redone
# (2: is_causal stays where the original config had it).
CONVERSION = 2

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
ARCHITECTURES = ("DFlashDraftModel", "DFlash2DraftModel")
# DFlash 2's convolutions and candidate selector, read from dflash_config first.
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> List[int]:
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [
        round(start + i * (end - start) / (num_draft_layers - 1))
        for i in range(num_draft_layers)
    ]


@dataclass
class DrafterConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    block_size: int
    mask_token_id: int
    target_layer_ids: List[int]
    num_target_layers: Optional[int] = None
    rope_theta: float = 10000.0
    rope_scaling: Optional[Dict[str, Any]] = None
    max_position_embeddings: int = 40960
    attention_bias: bool = False
    layer_types: List[str] = field(default_factory=list)
    sliding_window: Optional[int] = None
    is_causal: Optional[bool] = None
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: Optional[float] = None
    quantization: Optional[Dict[str, Any]] = None
    architecture: str = "DFlashDraftModel"
    conv_kernel_size: Optional[int] = None
    conv_group_size: Optional[int] = None
    selector_rank: Optional[int] = None
    selector_top_k: Optional[int] = None

    @property
    def is_dflash2(self) -> bool:
        return self.architecture == "DFlash2DraftModel"

    def layer_is_causal(self, i: int) -> bool:
        if self.is_causal is not None:
            return self.is_causal
        return self.layer_types[i] == "sliding_attention"

    def layer_window(self, i: int) -> Optional[int]:
        if self.layer_types[i] == "sliding_attention":
            return self.sliding_window
        return None

    @classmethod
    def from_dict(cls, cfg: Dict[str, Any], source: str = "config.json") -> "DrafterConfig":
        dflash = cfg.get("dflash_config") or {}

        def lookup(name, default=None):
            # The reference looks in dflash_config first, then the top level.
            if name in dflash and dflash[name] is not None:
                return dflash[name]
            value = cfg.get(name)
            return default if value is None else value

        architectures = cfg.get("architectures") or []
        if isinstance(architectures, str):
            architectures = [architectures]
        other = [a for a in architectures if a not in ARCHITECTURES]
        if other:
            raise DFlashError(
                f"{source} is a {other[0]} model, not a DFlash drafter (DFlashDraftModel or "
                "DFlash2DraftModel); pass a z-lab DFlash drafter with --draft."
            )
        architecture = "DFlash2DraftModel" if "DFlash2DraftModel" in architectures else "DFlashDraftModel"
        if "dflash_config" not in cfg and not architectures:
            raise DFlashError(
                f"{source} is not a DFlash drafter config (no 'dflash_config' and no "
                "DFlashDraftModel architecture); pass a z-lab DFlash drafter with --draft."
            )
        required = (
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "intermediate_size",
            "vocab_size",
            "rms_norm_eps",
        )
        missing = [k for k in required if cfg.get(k) is None]
        if missing:
            kind = f"{architecture} config" if architecture != "DFlashDraftModel" else "drafter config"
            raise DFlashError(f"{source} lacks {', '.join(missing)}; it is not a complete {kind}.")
        mask_token_id = lookup("mask_token_id")
        if mask_token_id is None:
            raise DFlashError(f"{source} has no mask_token_id in dflash_config; the drafter cannot build blocks.")

        n_layers = int(cfg["num_hidden_layers"])
        n_heads = int(cfg["num_attention_heads"])
        num_target_layers = lookup("num_target_layers")
        target_layer_ids = lookup("target_layer_ids")
        if target_layer_ids is None:
            if num_target_layers is None:
                raise DFlashError(
                    f"{source} has neither target_layer_ids nor num_target_layers; cannot tell which target layers to tap."
                )
            target_layer_ids = default_target_layer_ids(int(num_target_layers), n_layers)

        rope_theta = cfg.get("rope_theta")
        rope_scaling = cfg.get("rope_scaling")
        params = cfg.get("rope_parameters")
        if params:
            rope_theta = params.get("rope_theta", rope_theta)
            if rope_scaling is None:
                rope_scaling = dict(params)
        if rope_scaling is not None:
            rope_scaling = dict(rope_scaling)
            kind = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
            if kind not in ROPE_TYPES:
                raise DFlashError(
                    f"{source}: rope type '{kind}' is not supported (supported: {', '.join(ROPE_TYPES)})."
                )
            rope_scaling.pop("rope_theta", None)
            if kind == "default":
                rope_scaling = None
            else:
                rope_scaling["rope_type"] = kind

        layer_types = cfg.get("layer_types") or ["full_attention"] * n_layers
        if len(layer_types) != n_layers:
            raise DFlashError(
                f"{source}: layer_types has {len(layer_types)} entries for {n_layers} layers."
            )
        unknown = set(layer_types) - {"full_attention", "sliding_attention"}
        if unknown:
            raise DFlashError(f"{source}: unknown layer type(s) {sorted(unknown)}.")
        sliding_window = cfg.get("sliding_window")
        if "sliding_attention" in layer_types and not sliding_window:
            raise DFlashError(f"{source}: sliding_attention layers need a sliding_window size.")

        dflash2 = {}
        if architecture == "DFlash2DraftModel":
            dflash2 = _dflash2_fields(lookup, int(cfg["hidden_size"]), int(cfg["vocab_size"]), source)

        softcap = lookup("final_logit_softcapping")
        return cls(
            hidden_size=int(cfg["hidden_size"]),
            num_hidden_layers=n_layers,
            num_attention_heads=n_heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or n_heads),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // n_heads),
            intermediate_size=int(cfg["intermediate_size"]),
            vocab_size=int(cfg["vocab_size"]),
            rms_norm_eps=float(cfg["rms_norm_eps"]),
            block_size=int(lookup("block_size", 16)),
            mask_token_id=int(mask_token_id),
            target_layer_ids=[int(i) for i in target_layer_ids],
            num_target_layers=None if num_target_layers is None else int(num_target_layers),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings") or 40960),
            attention_bias=bool(cfg.get("attention_bias", False)),
            layer_types=list(layer_types),
            sliding_window=None if sliding_window is None else int(sliding_window),
            # Only the top level, as the reference reads it (not dflash_config).
            is_causal=cfg.get("is_causal"),
            input_embedding_scale=float(lookup("input_embedding_scale", 1.0)),
            output_multiplier=float(lookup("output_multiplier", 1.0)),
            final_logit_softcapping=None if not softcap else float(softcap),
            quantization=cfg.get("quantization"),
            architecture=architecture,
            **dflash2,
        )

    @classmethod
    def from_file(cls, path: Path) -> "DrafterConfig":
        path = Path(path)
        if not path.is_file():
            raise DFlashError(f"No config.json at {path}; point --draft at a DFlash drafter directory.")
        try:
            cfg = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise DFlashError(f"{path} is not valid JSON ({e.msg} at line {e.lineno}); re-download the drafter.")
        if not isinstance(cfg, dict):
            raise DFlashError(f"{path} does not hold a JSON object; re-download the drafter.")
        return cls.from_dict(cfg, source=str(path))


def _dflash2_fields(lookup, hidden_size: int, vocab_size: int, source: str) -> Dict[str, int]:
    missing = [k for k in DFLASH2_FIELDS if lookup(k) is None]
    if missing:
        raise DFlashError(
            f"{source} is a DFlash2DraftModel drafter without {', '.join(missing)} in dflash_config; "
            "it is not a complete DFlash 2 config."
        )
    try:
        out = {k: int(lookup(k)) for k in DFLASH2_FIELDS}
    except (TypeError, ValueError):
        raise DFlashError(f"{source}: {', '.join(DFLASH2_FIELDS)} must be integers.")
    small = [k for k, v in out.items() if v < 1]
    if small:
        raise DFlashError(f"{source}: {', '.join(small)} must be at least 1.")
    if hidden_size % out["conv_group_size"]:
        raise DFlashError(
            f"{source}: conv_group_size {out['conv_group_size']} does not divide hidden_size {hidden_size}."
        )
    if out["selector_top_k"] > vocab_size:
        raise DFlashError(
            f"{source}: selector_top_k {out['selector_top_k']} exceeds the vocabulary ({vocab_size})."
        )
    return out


def check_pair(config: DrafterConfig, hidden_size: int, vocab_size: int, num_layers: int) -> None:
    """One clear line for each way a drafter can fail to fit a target."""
    if config.hidden_size != hidden_size:
        raise DFlashError(
            f"Drafter hidden size {config.hidden_size} != target hidden size {hidden_size}; "
            "this drafter was trained for another target."
        )
    if config.vocab_size != vocab_size:
        raise DFlashError(
            f"Drafter vocabulary {config.vocab_size} != target vocabulary {vocab_size}; "
            "this drafter was trained for another target."
        )
    deep = [i for i in config.target_layer_ids if not 0 <= i < num_layers]
    if deep:
        raise DFlashError(
            f"Drafter taps target layer(s) {deep} but the target has {num_layers} layers; "
            "this drafter was trained for another target."
        )
    if not 0 <= config.mask_token_id < vocab_size:
        raise DFlashError(
            f"Drafter mask_token_id {config.mask_token_id} is outside the target vocabulary "
            f"(size {vocab_size}); this drafter was trained for another target."
        )
