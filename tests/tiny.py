"""Tiny offline models for tests: a locally trained tokenizer, random mlx-lm
targets of each supported family and random drafters in the z-lab layout."""

import json
import shutil
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

SPECIALS = ["<|end|>", "<|user|>", "<|assistant|>", "<|system|>", "<|mask|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% if enable_thinking is defined and "
    "not enable_thinking %}(no thinking){% endif %}{% endif %}"
)
CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog.",
    "Speculative decoding drafts a block of tokens and verifies them in one pass.",
    "for i in range(10):\n    print(i * i)\n",
    "Apple silicon has unified memory shared by the CPU and the GPU.",
    "import math\nprint(math.sqrt(2))\n",
    "A small model proposes, a large model disposes.",
    "Once upon a time there was a tiny language model that could count: one two three four five.",
]


def train_tokenizer(out: Path, vocab_size: int = 320) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS * 20, trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<|end|>",
                "chat_template": CHAT_TEMPLATE,
                "model_max_length": 4096,
            }
        )
    )


def target_config(family: str, vocab_size: int) -> dict:
    common = dict(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        vocab_size=vocab_size,
        max_position_embeddings=4096,
        tie_word_embeddings=family != "llama",
        eos_token_id=0,
    )
    if family == "qwen3":
        return dict(common, model_type="qwen3", num_hidden_layers=6, intermediate_size=128,
                    head_dim=16, rope_theta=10000.0)
    if family == "llama":
        return dict(common, model_type="llama", num_hidden_layers=6, intermediate_size=128,
                    rope_theta=500000.0,
                    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 1024})
    if family == "qwen3_5":
        return dict(common, model_type="qwen3_5", num_hidden_layers=6, intermediate_size=128,
                    head_dim=16, full_attention_interval=3, linear_num_value_heads=4,
                    linear_num_key_heads=2, linear_key_head_dim=32, linear_value_head_dim=16,
                    linear_conv_kernel_dim=4,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                     "partial_rotary_factor": 0.25, "mrope_section": [1, 1, 0]})
    if family == "qwen3_5_moe":
        # Qwen3.5/3.6-MoE: the hybrid qwen3_5 stack with a sparse MoE block
        # (routed SwitchGLU experts and a gated shared expert) in every layer.
        return dict(target_config("qwen3_5", vocab_size), model_type="qwen3_5_moe", num_experts=4,
                    num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64,
                    decoder_sparse_step=1, norm_topk_prob=True)
    if family == "qwen3_moe":
        # Qwen3-MoE (30B-A3B style): a routed SwitchGLU MoE block in every layer.
        return dict(common, model_type="qwen3_moe", num_hidden_layers=6, intermediate_size=128, head_dim=16,
                    rope_theta=10000.0, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                    decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)
    if family == "qwen3_next":
        # Qwen3-Next: Gated DeltaNet (in_proj_qkvz / in_proj_ba layout) + gated attention
        # every third layer, a sparse MoE with a shared expert, an untied head.
        return dict(common, model_type="qwen3_next", num_hidden_layers=6, intermediate_size=128, head_dim=16,
                    tie_word_embeddings=False, full_attention_interval=3, linear_num_value_heads=4,
                    linear_num_key_heads=2, linear_key_head_dim=32, linear_value_head_dim=16,
                    linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
                    shared_expert_intermediate_size=64, mlp_only_layers=[], moe_intermediate_size=64,
                    norm_topk_prob=True, rope_theta=10000.0, partial_rotary_factor=0.25)
    if family == "gemma4_text":
        # Gemma 4 (E2B/E4B style): sliding-window layers (window 8, so it wraps in a
        # test) with full-attention layers every third, the last two layers sharing
        # KV with earlier ones, per-layer input embeddings, a wider global head,
        # final logit soft-capping and a tied head.
        return dict(common, model_type="gemma4_text", num_hidden_layers=6, intermediate_size=128, head_dim=16,
                    global_head_dim=32, num_kv_shared_layers=2, hidden_size_per_layer_input=16,
                    vocab_size_per_layer_input=vocab_size, sliding_window=8, sliding_window_pattern=3,
                    final_logit_softcapping=30.0, use_double_wide_mlp=True, tie_word_embeddings=True)
    if family == "gemma4_text_moe":
        # Gemma 4 26B-A4B / 31B style: K = V on full-attention layers with their own
        # KV head count, a MoE block beside the dense MLP, no per-layer inputs or KV sharing.
        return dict(target_config("gemma4_text", vocab_size), num_kv_shared_layers=0,
                    hidden_size_per_layer_input=0, attention_k_eq_v=True, num_global_key_value_heads=1,
                    enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=64)
    if family == "gemma4":
        # Real Gemma 4 checkpoints: the multimodal wrapper (model_type "gemma4") around the text model.
        return dict(model_type="gemma4", vocab_size=vocab_size, eos_token_id=0,
                    text_config=target_config("gemma4_text", vocab_size))
    if family == "gpt_oss":
        # gpt-oss: alternating sliding (window 8) and full attention with attention
        # sinks, biased projections, a routed MoE (SwiGLU-OAI experts), YaRN RoPE, untied head.
        return dict(common, model_type="gpt_oss", num_hidden_layers=6, intermediate_size=64, head_dim=16,
                    num_local_experts=4, num_experts_per_tok=2, sliding_window=8, rope_theta=150000.0,
                    layer_types=["sliding_attention", "full_attention"] * 3,
                    rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                  "truncate": False, "original_max_position_embeddings": 4096})
    raise ValueError(family)


def build_target(out: Path, family: str, tokenizer_dir: Path, vocab_size: int, seed: int = 0) -> Path:
    from mlx_lm.utils import _get_classes

    cfg = target_config(family, vocab_size)
    model_cls, args_cls = _get_classes(cfg)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(cfg))
    # Scaled-up projections keep a random model from collapsing into repeats.
    params = {
        k: v * 3.0 if k.endswith("weight") and "embed" not in k and (v.ndim == 2 or "switch_mlp" in k) else v
        for k, v in tree_flatten(model.parameters())
    }
    if family.startswith("gemma4"):
        # Gemma scales embeddings by sqrt(hidden) and soft-caps the tied head's logits:
        # with the default init they saturate into ties and the model repeats itself.
        params.update({k: v * 0.1 for k, v in params.items() if "embed" in k})
    # Attention sinks (gpt-oss) start at zero: make them matter.
    params.update({k: mx.random.normal(v.shape) for k, v in params.items() if k.endswith("sinks")})
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), {k: v.astype(mx.float32) for k, v in params.items()})
    (out / "config.json").write_text(json.dumps(cfg))
    for f in tokenizer_dir.iterdir():
        shutil.copy(f, out / f.name)
    return out


def drafter_config(layout: str, vocab_size: int, target_layers: int, *, mask_token_id: int,
                   block_size: int = 8, layer_ids=(1, 3), sliding: bool = False, **extra) -> dict:
    cfg = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "attention_bias": False,
        "head_dim": 16,
        "hidden_act": "silu",
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "num_target_layers": target_layers,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab_size,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": True,
        "dtype": "float32",
    }
    dflash = {"mask_token_id": mask_token_id, "target_layer_ids": list(layer_ids)}
    if layout == "old":
        cfg.update(block_size=block_size, rope_theta=1000000, rope_scaling=None, sliding_window=None,
                   layer_types=["full_attention"] * 2, use_sliding_window=False)
    else:
        dflash["block_size"] = block_size
        cfg.update(rope_parameters={"rope_theta": 10000000, "rope_type": "default"},
                   layer_types=["sliding_attention", "full_attention"] if sliding else ["full_attention"] * 2,
                   sliding_window=6 if sliding else None, use_sliding_window=sliding)
    cfg["dflash_config"] = dflash
    cfg.update(extra)
    return cfg


def build_drafter(out: Path, cfg: dict, seed: int = 1) -> Path:
    from dflash_mlx.config import DrafterConfig
    from dflash_mlx.draft.drafter import DFlashDrafter

    mx.random.seed(seed)
    model = DFlashDrafter(DrafterConfig.from_dict(cfg))
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def convert_target(src: Path, out: Path, dtype: str = None, quantize: bool = False, q_bits: int = 4,
                   q_group_size: int = 64) -> Path:
    """A copy of the target at `src` cast and/or quantized by mlx-lm's own converter
    (`mlx_lm.convert`, offline from a local directory), as `mlx_lm.convert
    --dtype ... -q` would write it."""
    import contextlib
    import io

    from mlx_lm.convert import convert

    if not out.exists():
        with contextlib.redirect_stdout(io.StringIO()):
            convert(str(src), str(out), quantize=quantize, q_bits=q_bits if quantize else None,
                    q_group_size=q_group_size if quantize else None, dtype=dtype)
    return out
