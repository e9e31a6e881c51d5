"""`dflash-mlx train --arch dflash2`: DFlash 2 drafters (convolutions, sliding
windows and the candidate selector) trained with the same recipe."""

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from test_train import PROMPTS, prompts_file, small_config  # noqa: F401 (a fixture)

import dflash_mlx
from dflash_mlx.target.adapter import load_target
from dflash_mlx.config import DrafterConfig
from dflash_mlx.draft.drafter import DFlashDrafter
from dflash_mlx.draft.drafter2 import DFlash2Drafter
from dflash_mlx.errors import DFlashError
from dflash_mlx.train import drafter_config_for, read_prompts, train

from conftest import plain_greedy


def dflash2_config(targets, family="qwen3", **over):
    model, tok, _ = load_target(targets[family])
    return drafter_config_for(model, tok, small_config(arch="dflash2", **over))


def test_training_lowers_the_loss_and_the_checkpoint_loads_everywhere(tmp_path, targets, prompts_file):  # noqa: F811
    model, tok, _ = load_target(targets["qwen3"])
    losses, out = [], tmp_path / "out"
    summary = train(model, tok, read_prompts(prompts_file, tok), out,
                    small_config(arch="dflash2", steps=30, save_every=30, blocks_per_seq=20, lr=1e-3),
                    on_step=lambda s, t, loss, a: losses.append(loss))
    assert np.mean(losses[-6:]) < np.mean(losses[:6]) - 0.2
    assert 1.0 <= summary["heldout_acceptance"] <= 4.0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"] and set(cfg["layer_types"]) == {"sliding_attention"}
    saved = mx.load(str(out / "model.safetensors"))
    assert "candidate_selector.successor_codebook" in saved  # published names: no `.weight`
    assert float(mx.abs(saved["candidate_selector.successor_codebook"]).max()) > 0  # the selector learnt

    # The runtime takes the z-lab layout and the MLX form, and stays lossless.
    plain, _, _ = load_target(targets["qwen3"])
    ids = tok.encode(PROMPTS[0])
    for draft in (out, out / "mlx"):
        pair = dflash_mlx.load(str(targets["qwen3"]), str(draft))
        assert isinstance(pair.drafter, DFlash2Drafter)
        got = [t for ev in dflash_mlx.stream_generate(pair, ids, max_tokens=16, block_size=4, lookup=False)
               for t in ev.tokens]
        assert got == plain_greedy(plain, ids, 16)

    # z-lab's own class loads it as published (PyTorch's state_dict names the codebooks with `.weight`).
    pytest.importorskip("torch")
    reference = pytest.importorskip("dflash.model")
    from safetensors.torch import load_file
    from transformers import Qwen3Config

    ref = reference.DFlash2DraftModel(Qwen3Config(**cfg)).float().eval()
    state = {k + (".weight" if k.endswith("_codebook") else ""): v
             for k, v in load_file(str(out / "model.safetensors")).items()}
    ref.load_state_dict(state, strict=True)


def test_a_new_dflash2_drafter_starts_as_its_dflash1_body(targets):
    """With the dynamic kernels at 0, `init_for_training` leaves identity convolutions
    and a selector that keeps the draft head's argmax: the same outputs as a DFlash 1
    drafter with the same weights, so training starts from a working drafter."""
    cfg = dflash2_config(targets, sliding_window=4096)
    d2 = DFlash2Drafter(DrafterConfig.from_dict(cfg))
    d2.init_for_training(scale=0.0)
    one = dict(cfg, architectures=["DFlashDraftModel"], layer_types=["full_attention"] * cfg["num_hidden_layers"],
               sliding_window=None)
    one["dflash_config"] = {k: v for k, v in cfg["dflash_config"].items()
                            if k in ("block_size", "mask_token_id", "target_layer_ids")}
    d1 = DFlashDrafter(DrafterConfig.from_dict(one))
    shared = [(k, v) for k, v in tree_flatten(d2.parameters()) if "conv" not in k and "selector" not in k]
    d1.load_weights(shared, strict=True)
    F = len(cfg["dflash_config"]["target_layer_ids"]) * cfg["hidden_size"]
    ctx = mx.random.normal((1, 9, F), key=mx.random.key(0))
    noise = mx.random.normal((1, 4, cfg["hidden_size"]), key=mx.random.key(1))
    a, b = d1(noise, ctx, d1.make_cache()), d2(noise, ctx, d2.make_cache())
    assert mx.allclose(a, b, atol=1e-5)
    logits = mx.random.normal((3, 5, cfg["vocab_size"]), key=mx.random.key(2))
    hidden = mx.random.normal((3, 5, cfg["hidden_size"]), key=mx.random.key(3))
    path = d2.candidate_selector.greedy_paths(hidden, logits, mx.array([1, 2, 3]))
    assert mx.array_equal(path, mx.argmax(logits, axis=-1))


def test_batched_greedy_paths_equal_the_selectors_walk(targets):
    cfg = dflash2_config(targets)
    sel = DFlash2Drafter(DrafterConfig.from_dict(cfg)).candidate_selector
    sel.predecessor_codebook = mx.random.normal(sel.predecessor_codebook.shape, key=mx.random.key(0))
    sel.successor_codebook = mx.random.normal(sel.successor_codebook.shape, key=mx.random.key(1))
    logits = mx.random.normal((4, 6, cfg["vocab_size"]), key=mx.random.key(2))
    hidden = mx.random.normal((4, 6, cfg["hidden_size"]), key=mx.random.key(3))
    anchors = mx.array([5, 6, 7, 8])
    paths = sel.greedy_paths(hidden, logits, anchors)
    assert not mx.array_equal(paths, mx.argmax(logits, axis=-1))  # the codebooks overrule the head somewhere
    for n in range(4):
        assert mx.array_equal(paths[n], sel.walk(hidden[n], logits[n], anchors[n])[0])


def test_the_selector_objective_trains_the_selector_only(targets):
    """Its cross-entropy is over the candidates, with the true predecessors; labels
    outside the candidates are skipped; no gradient reaches the drafter body."""
    cfg = dflash2_config(targets)
    d2 = DFlash2Drafter(DrafterConfig.from_dict(cfg))
    d2.init_for_training()
    sel = d2.candidate_selector
    V, L = cfg["vocab_size"], 3
    logits = mx.random.normal((2, L, V), key=mx.random.key(0))
    hidden = mx.random.normal((2, L, cfg["hidden_size"]), key=mx.random.key(1))
    cand, _ = sel.candidates(logits)
    labels = cand[:, :, 2]  # a candidate everywhere ...
    outside = mx.array(labels)
    outside[1, 1] = int(mx.argmin(logits[1, 1]).item())  # ... but one label that is not
    prev = mx.array([[4, 9, 11], [3, 7, 1]])
    w = mx.ones((L,))
    # With the successor codebook at 0 the scores are the head's logits: plain CE over the candidates.
    want = nn.losses.cross_entropy(mx.take_along_axis(logits, cand, -1), mx.full((2, L), 2), reduction="none")
    assert sel.loss(hidden, logits, prev, labels, w).item() == pytest.approx(want.mean().item(), rel=1e-5)
    keep = mx.ones((2, L)).at[1, 1].add(-1)
    assert sel.loss(hidden, logits, prev, outside, w).item() == pytest.approx(
        (want * keep).sum().item() / 5, rel=1e-5)

    def loss(model):
        return model.candidate_selector.loss(mx.stop_gradient(hidden), mx.stop_gradient(logits), prev, labels, w)

    _, grads = nn.value_and_grad(d2, loss)(d2)
    flat = dict(tree_flatten(grads))
    assert float(mx.abs(flat["candidate_selector.successor_codebook"]).max()) > 0
    assert all(float(mx.abs(g).max()) == 0 for k, g in flat.items() if not k.startswith("candidate_selector."))


def test_unknown_arch_is_refused(targets):
    model, tok, _ = load_target(targets["qwen3"])
    with pytest.raises(DFlashError, match="--arch must be dflash or dflash2"):
        drafter_config_for(model, tok, small_config(arch="dflash3"))


def test_cli_takes_the_arch_and_refuses_an_unknown_one(tmp_path, targets, prompts_file):  # noqa: F811
    from typer.testing import CliRunner

    from dflash_mlx.cli.main import app

    out = tmp_path / "bad"
    r = CliRunner().invoke(app, ["train", "--model", str(targets["qwen3"]), "--data", str(prompts_file),
                                 "--out", str(out), "--arch", "dflash3"])
    assert r.exit_code != 0 and "--arch must be dflash or dflash2" in r.output and not out.exists()
    out = tmp_path / "ok"
    r = CliRunner().invoke(app, ["train", "--model", str(targets["qwen3"]), "--data", str(prompts_file),
                                 "--out", str(out), "--arch", "dflash2", "--sliding-window", "32",
                                 "--block-size", "4", "--layers", "1", "--steps", "2", "--max-new-tokens", "8"])
    assert r.exit_code == 0, r.output
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"] and cfg["sliding_window"] == 32
