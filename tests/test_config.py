"""Drafter config parsing (both published layouts) and pair checks."""

import json
from pathlib import Path

import pytest
import tiny

import dflash_mlx
from dflash_mlx.config import DrafterConfig, default_target_layer_ids
from dflash_mlx.errors import DFlashError

DATA = Path(__file__).parent / "data"


def test_original_layout():
    c = DrafterConfig.from_file(DATA / "qwen3-4b-dflash-b16.config.json")
    assert c.block_size == 16
    assert c.mask_token_id == 151669
    assert c.target_layer_ids == [1, 9, 17, 25, 33]
    assert c.rope_theta == 1000000 and c.rope_scaling is None
    assert c.layer_types == ["full_attention"] * 5
    assert not any(c.layer_is_causal(i) for i in range(5))
    assert all(c.layer_window(i) is None for i in range(5))
    assert (c.hidden_size, c.num_key_value_heads, c.head_dim) == (2560, 8, 128)


def test_newer_layout():
    c = DrafterConfig.from_file(DATA / "qwen3.5-4b-dflash-newer.config.json")
    assert c.block_size == 16
    assert c.mask_token_id == 248077
    assert c.target_layer_ids == [1, 5, 9, 13, 17, 21, 25, 29]
    assert c.rope_theta == 10000000 and c.rope_scaling is None
    assert [c.layer_is_causal(i) for i in range(6)] == [True] * 5 + [False]
    assert [c.layer_window(i) for i in range(6)] == [4096] * 5 + [None]


def _cfg(**over):
    cfg = json.loads((DATA / "qwen3.5-4b-dflash-newer.config.json").read_text())
    cfg.update(over)
    return cfg


def test_explicit_is_causal_overrides_layer_type_rule():
    cfg = _cfg(is_causal=False)
    c = DrafterConfig.from_dict(cfg)
    assert not any(c.layer_is_causal(i) for i in range(6))
    assert c.layer_window(0) == 4096


def test_is_causal_inside_dflash_config_is_ignored_like_the_reference():
    cfg = _cfg()
    cfg["dflash_config"]["is_causal"] = False
    c = DrafterConfig.from_dict(cfg)
    assert [c.layer_is_causal(i) for i in range(6)] == [True] * 5 + [False]


@pytest.mark.parametrize("where", [None, "top", "dflash_config"])
@pytest.mark.parametrize("value", [True, False])
def test_is_causal_matches_the_pytorch_reference(where, value):
    torch = pytest.importorskip("torch")
    reference = pytest.importorskip("dflash.model")
    from transformers import Qwen3Config

    cfg = tiny.drafter_config("new", 64, 8, mask_token_id=3, sliding=True)
    if where is not None:
        (cfg if where == "top" else cfg["dflash_config"])["is_causal"] = value
    torch.manual_seed(0)
    ref = reference.DFlashDraftModel(Qwen3Config(**cfg))
    want = [layer.self_attn.is_causal for layer in ref.layers]
    c = DrafterConfig.from_dict(cfg)
    assert [c.layer_is_causal(i) for i in range(2)] == want


def test_scalars_prefer_dflash_config_then_top_level():
    cfg = _cfg(input_embedding_scale=2.0, output_multiplier=0.5, final_logit_softcapping=30.0)
    c = DrafterConfig.from_dict(cfg)
    assert (c.input_embedding_scale, c.output_multiplier, c.final_logit_softcapping) == (2.0, 0.5, 30.0)
    cfg["dflash_config"]["output_multiplier"] = 0.25
    assert DrafterConfig.from_dict(cfg).output_multiplier == 0.25


def test_yarn_rope_scaling_is_kept():
    cfg = _cfg(rope_parameters={"rope_theta": 1e6, "rope_type": "yarn", "factor": 4.0,
                                "original_max_position_embeddings": 32768})
    c = DrafterConfig.from_dict(cfg)
    assert c.rope_theta == 1e6
    assert c.rope_scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    from dflash_mlx.draft.drafter import Attention

    attn = Attention(c, 0)
    assert type(attn.rope).__name__ == "YarnRoPE"


def test_default_target_layer_ids_rule():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(36, 1) == [18]
    cfg = _cfg(num_target_layers=32)
    del cfg["dflash_config"]["target_layer_ids"]
    assert DrafterConfig.from_dict(cfg).target_layer_ids == default_target_layer_ids(32, 6)


@pytest.mark.parametrize(
    "change, words",
    [
        (lambda c: c.pop("dflash_config") and c.pop("architectures"), "not a DFlash drafter"),
        (lambda c: c["dflash_config"].pop("mask_token_id"), "mask_token_id"),
        (lambda c: c.update(rope_parameters={"rope_type": "dynamic", "factor": 2.0}), "not supported"),
        (lambda c: c.update(layer_types=["full_attention"]), "layer_types"),
        (lambda c: c.update(sliding_window=None), "sliding_window"),
        (lambda c: c.pop("hidden_size"), "hidden_size"),
    ],
)
def test_bad_configs_fail_with_one_line(change, words):
    cfg = _cfg()
    change(cfg)
    with pytest.raises(DFlashError) as e:
        DrafterConfig.from_dict(cfg)
    assert words in str(e.value) and "\n" not in str(e.value)


def _dflash2_cfg():
    # The field layout of z-lab's DFlash 2 drafter configs (dflash==0.1.0).
    cfg = _cfg(architectures=["DFlash2DraftModel"], is_causal=False, sliding_window=2048,
               layer_types=["sliding_attention"] * 6)
    cfg["dflash_config"].update(block_size=8, conv_kernel_size=2, conv_group_size=16,
                                selector_rank=256, selector_top_k=16)
    return cfg


@pytest.mark.parametrize(
    "architectures, words",
    [
        (["EagleDraftModel"], "is a EagleDraftModel model, not a DFlash drafter"),
        (["Qwen3ForCausalLM"], "is a Qwen3ForCausalLM model, not a DFlash drafter"),
        (["DFlash2DraftModel", "Qwen3ForCausalLM"], "is a Qwen3ForCausalLM model, not a DFlash drafter"),
    ],
)
def test_unknown_architectures_are_refused_up_front(tmp_path, architectures, words):
    cfg = _dflash2_cfg()
    cfg["architectures"] = architectures
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DFlashError) as e:
        DrafterConfig.from_file(tmp_path / "config.json")
    assert words in str(e.value) and "\n" not in str(e.value)
    assert str(tmp_path / "config.json") in str(e.value)


@pytest.mark.parametrize("architectures", [["DFlash2DraftModel"], "DFlash2DraftModel"])
def test_dflash2_layout(architectures):
    cfg = _dflash2_cfg()
    cfg["architectures"] = architectures
    c = DrafterConfig.from_dict(cfg)
    assert c.is_dflash2 and c.architecture == "DFlash2DraftModel"
    assert (c.conv_kernel_size, c.conv_group_size, c.selector_rank, c.selector_top_k) == (2, 16, 256, 16)
    assert c.block_size == 8 and c.mask_token_id == 248077
    # All layers sliding and, with is_causal false at the top level, bidirectional.
    assert [c.layer_is_causal(i) for i in range(6)] == [False] * 6
    assert [c.layer_window(i) for i in range(6)] == [2048] * 6


def test_dflash1_layouts_have_no_dflash2_fields():
    for name in ("qwen3-4b-dflash-b16.config.json", "qwen3.5-4b-dflash-newer.config.json"):
        c = DrafterConfig.from_file(DATA / name)
        assert not c.is_dflash2 and c.architecture == "DFlashDraftModel"
        assert (c.conv_kernel_size, c.conv_group_size, c.selector_rank, c.selector_top_k) == (None,) * 4


@pytest.mark.parametrize("where", ["dflash_config", "top", "both"])
def test_dflash2_fields_are_read_as_the_reference_reads_them(where):
    pytest.importorskip("torch")
    reference = pytest.importorskip("dflash.model")
    from transformers import Qwen3Config

    cfg = tiny.drafter_config("new", 64, 8, mask_token_id=3, sliding=True)
    cfg.update(architectures=["DFlash2DraftModel"], is_causal=False, layer_types=["sliding_attention"] * 2)
    fields = dict(conv_kernel_size=3, conv_group_size=8, selector_rank=6, selector_top_k=5)
    if where in ("top", "both"):
        cfg.update(fields)
    if where in ("dflash_config", "both"):
        inner = fields if where == "dflash_config" else dict(conv_kernel_size=2, conv_group_size=16,
                                                             selector_rank=4, selector_top_k=7)
        cfg["dflash_config"].update(inner)
    ref = reference.DFlash2DraftModel(Qwen3Config(**cfg))
    conv, selector = ref.layers[0].attention_conv, ref.candidate_selector
    want = (conv.kernel_size, conv.group_size, selector.hidden_projection.out_features, selector.top_k)
    c = DrafterConfig.from_dict(cfg)
    assert (c.conv_kernel_size, c.conv_group_size, c.selector_rank, c.selector_top_k) == want
    assert [c.layer_is_causal(i) for i in range(2)] == [l.self_attn.is_causal for l in ref.layers]


@pytest.mark.parametrize(
    "change, words",
    [
        (lambda d: d.pop("conv_kernel_size"), "without conv_kernel_size in dflash_config"),
        (lambda d: d.pop("selector_top_k") and d.pop("selector_rank"), "without selector_rank, selector_top_k"),
        (lambda d: d.update(conv_group_size=48), "conv_group_size 48 does not divide hidden_size 2560"),
        (lambda d: d.update(selector_top_k=300000), "selector_top_k 300000 exceeds the vocabulary"),
        (lambda d: d.update(conv_kernel_size=0), "conv_kernel_size must be an integer from 1"),
        (lambda d: d.update(selector_rank="wide"), 'selector_rank must be an integer from 1 to 65536 (got "wide")'),
    ],
)
def test_bad_dflash2_configs_fail_with_one_line(change, words):
    cfg = _dflash2_cfg()
    change(cfg["dflash_config"])
    with pytest.raises(DFlashError) as e:
        DrafterConfig.from_dict(cfg, source="d/config.json")
    assert words in str(e.value) and "\n" not in str(e.value) and "d/config.json" in str(e.value)


def test_incomplete_dflash2_config_names_its_architecture():
    with pytest.raises(DFlashError) as e:
        DrafterConfig.from_dict({"architectures": ["DFlash2DraftModel"], "dflash_config": {}})
    assert "DFlash2DraftModel" in str(e.value) and "hidden_size" in str(e.value)


def test_bad_json_file(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(DFlashError, match="not valid JSON"):
        DrafterConfig.from_file(tmp_path / "config.json")
    with pytest.raises(DFlashError, match="No config.json"):
        DrafterConfig.from_file(tmp_path / "missing" / "config.json")


@pytest.mark.parametrize(
    "over, words",
    [
        ({"hidden_size": 48, "head_dim": 12}, "hidden size"),
        ({"vocab_size": 999}, "vocabulary"),
        ({"dflash_config": {"mask_token_id": 4, "target_layer_ids": [1, 6]}}, "taps target layer"),
        ({"dflash_config": {"mask_token_id": 5000, "target_layer_ids": [1, 3]}}, "mask_token_id"),
    ],
)
def test_mismatched_pair_is_refused(tmp_path, targets, vocab, over, words):
    V, mask = vocab
    cfg = tiny.drafter_config("old", V, 6, mask_token_id=mask)
    cfg.update(over)
    with pytest.raises(DFlashError) as e:  # a mask token outside its own vocabulary: the config alone is refused
        tiny.build_drafter(tmp_path / "d", cfg)
        dflash_mlx.load(str(targets["qwen3"]), str(tmp_path / "d"))
    assert words in str(e.value) and "\n" not in str(e.value)


def test_unsupported_family_is_refused(tmp_path, targets, drafters):
    d = tmp_path / "phi"
    d.mkdir()
    cfg = json.loads((targets["qwen3"] / "config.json").read_text())
    cfg["model_type"] = "mamba"  # recurrent layers without a rollback rule
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DFlashError, match="family 'mamba' is not supported"):
        dflash_mlx.load(str(d), str(drafters["old"]))


def test_corrupt_drafter_weights(tmp_path, targets, drafters):
    d = tmp_path / "d"
    d.mkdir()
    (d / "config.json").write_text((drafters["old"] / "config.json").read_text())
    data = (drafters["old"] / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(DFlashError, match="truncated"):
        dflash_mlx.load(str(targets["qwen3"]), str(d))


def test_two_models_in_one_process_do_not_interfere(targets, drafters, baselines):
    from conftest import plain_greedy

    a = dflash_mlx.load(str(targets["qwen3"]), str(drafters["old"]))
    b = dflash_mlx.load(str(targets["llama"]), str(drafters["new"]))
    prompt = a.tokenizer.encode("def add(a, b):")
    ta, _ = dflash_mlx.generate(a, prompt, max_tokens=12, block_size=4)
    tb, _ = dflash_mlx.generate(b, prompt, max_tokens=12, block_size=4)
    assert ta == a.tokenizer.decode(plain_greedy(baselines["qwen3"], prompt, 12))
    assert tb == b.tokenizer.decode(plain_greedy(baselines["llama"], prompt, 12))


def test_cached_conversions_are_redone_when_the_converter_changes(tmp_path, monkeypatch):
    import importlib

    load = importlib.import_module("dflash_mlx.pair")
    (tmp_path / "config.json").write_text("{}")
    before = load.converted_path(tmp_path)
    assert load.converted_path(tmp_path) == before
    monkeypatch.setattr(load, "CONVERSION", load.CONVERSION + 1)
    assert load.converted_path(tmp_path) != before
