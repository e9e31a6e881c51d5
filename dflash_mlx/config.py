"""Drafter configuration: the published z-lab `config.json` layouts (DFlash 1 and 2)."""

import json
import math
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
# Inclusive ranges of a drafter config's integer fields: far beyond any published
# model, and small enough that nothing is allocated for a config that is damaged or
# hostile (a 10**5-layer or 10**9-wide block config) before its weights are compared with it.
LIMITS = {
    "hidden_size": (1, 2**16),
    "num_hidden_layers": (1, 256),
    "num_attention_heads": (1, 1024),
    "num_key_value_heads": (1, 1024),
    "head_dim": (1, 4096),
    "intermediate_size": (1, 2**20),
    "vocab_size": (2, 2**22),
    "block_size": (2, 256),
    "num_target_layers": (1, 4096),
    "target_layer_ids": (0, 4095),
    "max_position_embeddings": (1, 2**26),
    "sliding_window": (1, 2**26),
    "conv_kernel_size": (1, 64),
    "conv_group_size": (1, 2**16),
    "selector_rank": (1, 2**16),
    "selector_top_k": (1, 2**22),  # and at most the vocabulary
}
QUANT_BITS = (2, 3, 4, 5, 6, 8)
QUANT_GROUPS = (32, 64, 128)


def shown(value) -> str:
    """A config value in an error line: short, whatever it is."""
    text = json.dumps(value) if isinstance(value, (str, int, float, bool, type(None))) else type(value).__name__
    return text if len(text) <= 40 else text[:37] + "..."


class Fields:
    """Typed reads of a config's fields, each failing with one line that names the
    file, the field and the range it must be in."""

    def __init__(self, source: str):
        self.source = source

    def fail(self, name: str, what: str, value) -> None:
        raise DFlashError(f"{self.source}: {name} must be {what} (got {shown(value)}); "
                          "fix the config or download the model again.")

    def integer(self, name: str, value, lo: Optional[int] = None, hi: Optional[int] = None) -> int:
        lo, hi = (lo, hi) if lo is not None else LIMITS[name]
        ok = isinstance(value, int) and not isinstance(value, bool) or \
            isinstance(value, float) and math.isfinite(value) and value == int(value)
        if not ok or not lo <= value <= hi:
            self.fail(name, f"an integer from {lo} to {hi}", value)
        return int(value)

    def number(self, name: str, value, lo: float = -math.inf, hi: float = math.inf, above: bool = False) -> float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not ok or not (lo < value if above else lo <= value) or value > hi:
            bound = f"above {lo}" if above else f"at least {lo}" if lo != -math.inf else "finite"
            self.fail(name, f"a number {bound}" + (f" and at most {hi}" if hi != math.inf else ""), value)
        return float(value)

    def mapping(self, name: str, value) -> dict:
        if value is None:
            return {}
        if not isinstance(value, dict):
            self.fail(name, "an object", value)
        return value

    def strings(self, name: str, value) -> List[str]:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            self.fail(name, "a list of strings", value)
        return value

    def integers(self, name: str, value, limit: str) -> List[int]:
        if not isinstance(value, list) or not value or len(value) > LIMITS["num_target_layers"][1]:
            self.fail(name, "a non-empty list of integers", value)
        return [self.integer(name, v, *LIMITS[limit]) for v in value]

    def rope(self, name: str, value) -> dict:
        """RoPE settings: strings for their type, finite numbers (or lists of them) otherwise."""
        value = self.mapping(name, value)
        for key, v in value.items():
            if key in ("rope_type", "type"):
                if not isinstance(v, str):
                    self.fail(f"{name}.{key}", "a string", v)
            elif isinstance(v, list):
                for x in v:
                    self.number(f"{name}.{key}", x)
            elif v is not None and not isinstance(v, bool):
                self.number(f"{name}.{key}", v)
        return value


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
        """Every field checked for type and range, and against the others, before
        anything is built from it: one line naming the field where one is wrong."""
        f = Fields(source)
        if not isinstance(cfg, dict):
            f.fail("the config", "a JSON object", cfg)
        dflash = f.mapping("dflash_config", cfg.get("dflash_config"))

        def lookup(name, default=None):
            # The reference looks in dflash_config first, then the top level.
            if name in dflash and dflash[name] is not None:
                return dflash[name]
            value = cfg.get(name)
            return default if value is None else value

        architecture = _architecture(f, cfg, source)
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

        hidden = f.integer("hidden_size", cfg["hidden_size"])
        vocab = f.integer("vocab_size", cfg["vocab_size"])
        n_layers = f.integer("num_hidden_layers", cfg["num_hidden_layers"])
        n_heads = f.integer("num_attention_heads", cfg["num_attention_heads"])
        n_kv = f.integer("num_key_value_heads", cfg.get("num_key_value_heads") or n_heads)
        if n_heads % n_kv:
            f.fail("num_key_value_heads", f"a divisor of num_attention_heads ({n_heads})", n_kv)
        head_dim = f.integer("head_dim", cfg.get("head_dim") or max(1, hidden // n_heads))
        num_target_layers, target_layer_ids = _target_layers(f, lookup, n_layers, source)
        rope_theta, rope_scaling = _rope(f, cfg, source)
        layer_types, sliding_window = _layer_types(f, cfg, n_layers, source)
        is_causal = cfg.get("is_causal")
        if is_causal is not None and not isinstance(is_causal, bool):
            f.fail("is_causal", "true or false", is_causal)
        quantization = _quantization(f, cfg)

        dflash2 = {}
        if architecture == "DFlash2DraftModel":
            dflash2 = _dflash2_fields(lookup, hidden, vocab, source)

        softcap = lookup("final_logit_softcapping")
        return cls(
            hidden_size=hidden,
            num_hidden_layers=n_layers,
            num_attention_heads=n_heads,
            num_key_value_heads=n_kv,
            head_dim=head_dim,
            intermediate_size=f.integer("intermediate_size", cfg["intermediate_size"]),
            vocab_size=vocab,
            rms_norm_eps=f.number("rms_norm_eps", cfg["rms_norm_eps"], 0.0, 1.0, above=True),
            block_size=f.integer("block_size", lookup("block_size", 16)),
            mask_token_id=f.integer("mask_token_id", mask_token_id, 0, vocab - 1),
            target_layer_ids=target_layer_ids,
            num_target_layers=num_target_layers,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=f.integer("max_position_embeddings", cfg.get("max_position_embeddings") or 40960),
            attention_bias=bool(cfg.get("attention_bias", False)),
            layer_types=list(layer_types),
            sliding_window=sliding_window,
            # Only the top level, as the reference reads it (not dflash_config).
            is_causal=is_causal,
            input_embedding_scale=f.number("input_embedding_scale", lookup("input_embedding_scale", 1.0)),
            output_multiplier=f.number("output_multiplier", lookup("output_multiplier", 1.0)),
            final_logit_softcapping=None if not softcap else f.number("final_logit_softcapping", softcap, 0.0,
                                                                       above=True),
            quantization=quantization,
            architecture=architecture,
            **dflash2,
        )

    @classmethod
    def from_file(cls, path: Path) -> "DrafterConfig":
        path = Path(path)
        if not path.is_file():
            raise DFlashError(f"No config.json at {path}; point --draft at a DFlash drafter directory.")
        cfg = read_json(path, "re-download the drafter")
        if not isinstance(cfg, dict):
            raise DFlashError(f"{path} does not hold a JSON object; re-download the drafter.")
        return cls.from_dict(cfg, source=str(path))


# A config file larger than this is not a config (published ones are a few kilobytes).
MAX_CONFIG_BYTES = 2**20


def read_json(path: Path, what_to_do: str) -> Any:
    """A config file's JSON: one line (ending in `what_to_do`) if it is too large, not UTF-8,
    not JSON or nested beyond what the parser takes."""
    path = Path(path)
    try:
        if path.stat().st_size > MAX_CONFIG_BYTES:
            raise DFlashError(f"{path} is larger than {MAX_CONFIG_BYTES} bytes, so it is not a config; {what_to_do}.")
        with open(path, "rb") as fh:
            return json.loads(fh.read(MAX_CONFIG_BYTES + 1).decode("utf-8"))
    except json.JSONDecodeError as e:
        raise DFlashError(f"{path} is not valid JSON ({e.msg} at line {e.lineno}); {what_to_do}.")
    except UnicodeDecodeError:
        raise DFlashError(f"{path} is not UTF-8 text; {what_to_do}.")
    except RecursionError:
        raise DFlashError(f"{path} is nested too deeply to be a config; {what_to_do}.")
    except OSError as e:
        raise DFlashError(f"Cannot read {path} ({e.strerror or e}); {what_to_do}.")


def _architecture(f: "Fields", cfg: Dict[str, Any], source: str) -> str:
    """DFlashDraftModel or DFlash2DraftModel; another model's config is refused."""
    architectures = f.strings("architectures", cfg.get("architectures") or [])
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
    return architecture


def _target_layers(f: "Fields", lookup, n_layers: int, source: str):
    """(num_target_layers or None, the target layers tapped)."""
    num_target_layers = lookup("num_target_layers")
    if num_target_layers is not None:
        num_target_layers = f.integer("num_target_layers", num_target_layers)
    target_layer_ids = lookup("target_layer_ids")
    if target_layer_ids is None:
        if num_target_layers is None:
            raise DFlashError(
                f"{source} has neither target_layer_ids nor num_target_layers; cannot tell which target layers to tap."
            )
        target_layer_ids = default_target_layer_ids(num_target_layers, n_layers)
    target_layer_ids = f.integers("target_layer_ids", target_layer_ids, "target_layer_ids")
    return num_target_layers, target_layer_ids


def _rope(f: "Fields", cfg: Dict[str, Any], source: str):
    """(rope_theta, rope_scaling or None) from either layout (`rope_scaling` or `rope_parameters`)."""
    rope_theta = cfg.get("rope_theta")
    rope_scaling = f.rope("rope_scaling", cfg.get("rope_scaling")) or None
    params = f.rope("rope_parameters", cfg.get("rope_parameters"))
    if params:
        rope_theta = params.get("rope_theta", rope_theta)
        if rope_scaling is None:
            rope_scaling = dict(params)
    rope_theta = f.number("rope_theta", 10000.0 if rope_theta is None else rope_theta, 0.0, above=True)
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
            if "factor" in rope_scaling:
                f.number("rope_scaling.factor", rope_scaling["factor"], 0.0, above=True)
    return rope_theta, rope_scaling


def _layer_types(f: "Fields", cfg: Dict[str, Any], n_layers: int, source: str):
    """(each layer's attention type, the sliding window or None)."""
    layer_types = f.strings("layer_types", cfg.get("layer_types") or ["full_attention"] * n_layers)
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
    if sliding_window is not None:
        sliding_window = f.integer("sliding_window", sliding_window)
    return layer_types, sliding_window


def _quantization(f: "Fields", cfg: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    quantization = cfg.get("quantization")
    if quantization is not None:
        q = f.mapping("quantization", quantization)
        f.integer("quantization.bits", q.get("bits", 4), 2, 8)
        if q.get("bits", 4) not in QUANT_BITS or q.get("group_size", 64) not in QUANT_GROUPS:
            f.fail("quantization", f"bits in {QUANT_BITS} and group_size in {QUANT_GROUPS}", q)
    return quantization


def _dflash2_fields(lookup, hidden_size: int, vocab_size: int, source: str) -> Dict[str, int]:
    missing = [k for k in DFLASH2_FIELDS if lookup(k) is None]
    if missing:
        raise DFlashError(
            f"{source} is a DFlash2DraftModel drafter without {', '.join(missing)} in dflash_config; "
            "it is not a complete DFlash 2 config."
        )
    f = Fields(source)
    out = {k: f.integer(k, lookup(k)) for k in DFLASH2_FIELDS}
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
