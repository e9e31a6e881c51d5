"""A target with a published model's shapes and random weights, and a drafter to match, built offline.

    python benchmarks/gpu/real_shapes.py --out DIR [--quantize]

Writes, without downloading anything:

    DIR/target/        Qwen3-4B's config (36 layers, hidden 2560, vocabulary 151936), bfloat16,
                       random weights, the demo target's tokenizer
    DIR/target-4bit/   the same target quantized by mlx-lm's own converter (4 bits, group 64)
    DIR/drafter/       a drafter with z-lab's Qwen3-4B-DFlash-b16 layout (5 layers, block 16,
                       taps 1, 9, 17, 25, 33), bfloat16, random weights

Random weights accept nothing from a drafter, so these are for costs: the verify cost curve at
real shapes, and the runtime's ceiling with `bench --oracle` (the target's own continuation as
drafts). The tokenizer only turns prompts into ids; the model may emit ids it cannot decode.
"""

import argparse
import json
import shutil
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

REPO = Path(__file__).resolve().parents[2]
DEMO_TARGET = REPO / "dflash_mlx" / "demo" / "target"

# Qwen/Qwen3-4B's config.json, as published.
QWEN3_4B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False,
    "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 2560, "initializer_range": 0.02, "intermediate_size": 9728,
    "max_position_embeddings": 40960, "max_window_layers": 36, "num_attention_heads": 32,
    "num_hidden_layers": 36, "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def build_target(out: Path, seed: int = 0) -> Path:
    from mlx_lm.utils import _get_classes, save_config, save_model

    model_cls, args_cls = _get_classes(QWEN3_4B)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(QWEN3_4B))
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    out.mkdir(parents=True, exist_ok=True)
    save_model(out, model)
    save_config(dict(QWEN3_4B), config_path=out / "config.json")
    for name in TOKENIZER_FILES:
        if (DEMO_TARGET / name).exists():
            shutil.copy(DEMO_TARGET / name, out / name)
    return out


def build_drafter(out: Path, config: Path, seed: int = 1) -> Path:
    from dflash_mlx.config import DrafterConfig
    from dflash_mlx.draft.drafter import DFlashDrafter

    cfg = json.loads(config.read_text())
    mx.random.seed(seed)
    model = DFlashDrafter(DrafterConfig.from_dict(cfg))
    out.mkdir(parents=True, exist_ok=True)
    weights = {k: v.astype(mx.bfloat16) for k, v in tree_flatten(model.parameters())}
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--drafter-config", default=str(REPO.parent / "shared" / "drafter-configs"
                                                     / "qwen3-4b-dflash-b16.config.json"))
    ap.add_argument("--quantize", action="store_true", help="also write target-4bit with mlx-lm's converter")
    args = ap.parse_args(argv)
    out = Path(args.out)
    if not (out / "target" / "config.json").exists():
        build_target(out / "target")
    if not (out / "drafter" / "config.json").exists():
        build_drafter(out / "drafter", Path(args.drafter_config))
    if args.quantize and not (out / "target-4bit" / "config.json").exists():
        from mlx_lm.convert import convert

        convert(str(out / "target"), str(out / "target-4bit"), quantize=True, q_bits=4, q_group_size=64)
    print(out)


if __name__ == "__main__":
    main()
