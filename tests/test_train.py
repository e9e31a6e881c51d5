"""`dflash-mlx train`: the recipe, checkpoints and resume."""

import json

import mlx.core as mx
import numpy as np
import pytest

import dflash_mlx
from dflash_mlx.target import baseline
from dflash_mlx.target.adapter import TapedGatedDeltaNet, TappedLayer, VerifyQuantizedLinear, load_target
from dflash_mlx.config import DrafterConfig
from dflash_mlx.draft.drafter import DFlashDrafter, block_mask
from dflash_mlx.errors import DFlashError
from dflash_mlx.train import TrainConfig, default_gamma, read_prompts, save_zlab, train

PROMPTS = ["def add(a, b):", "The quick brown fox", "import math", "for i in range(10):",
           "Once upon a time", "A small model proposes,", "Apple silicon has", "print(math.sqrt(2))"]


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("data") / "prompts.jsonl"
    p.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in PROMPTS))
    return p


def small_config(**over):
    base = dict(block_size=4, layers=1, steps=12, blocks_per_seq=6, max_new_tokens=24, save_every=6,
                eval_every=6, lr=3e-3, heldout=0.2)
    base.update(over)
    return TrainConfig(**base)


def test_block_mask_sees_only_earlier_context_and_its_own_block():
    anchors = mx.array([3, 7, 12])
    T, L = 15, 4
    for causal, window in [(False, None), (True, None), (True, 5), (False, 5)]:
        m = np.array(block_mask(anchors, T, L, causal, window))[:, 0]
        assert m.shape == (3, L, T + L)
        for k, a in enumerate([3, 7, 12]):
            for q in range(L):
                qpos = a + q
                for pos in range(T):  # context: strictly before the anchor
                    want = pos < a and (window is None or qpos - pos < window)
                    assert m[k, q, pos] == want
                for j in range(L):  # own block: bidirectional, or causal
                    want = (not causal or j <= q) and (window is None or abs(q - j) < window)
                    assert m[k, q, T + j] == want
    # No key column stands for another block: blocks are separate batch rows.
    assert m.shape[-1] == T + L


def test_gamma_follows_the_paper():
    assert (default_gamma(16), default_gamma(10), default_gamma(8)) == (7.0, 5.0, 4.0)


def mean_acceptance(target, draft, prompts, max_tokens=24, block_size=4):
    """Tokens per cycle the runtime commits with the drafter in `draft`."""
    pair = dflash_mlx.load(str(target), str(draft))
    lengths = []
    for ids in prompts:
        _, stats = dflash_mlx.generate(pair, ids, max_tokens=max_tokens, block_size=block_size)
        lengths += stats.acceptance_lengths
    return sum(lengths) / len(lengths)


def test_training_lowers_the_loss_and_raises_acceptance(tmp_path, targets, prompts_file, monkeypatch):
    model, tok, _ = load_target(targets["qwen3"])
    wrapped_when_generating, real = [], baseline.generate

    def spy(m, *a, **k):
        wrapped_when_generating.append(any(isinstance(x, (TappedLayer, TapedGatedDeltaNet, VerifyQuantizedLinear))
                                           for _, x in m.named_modules()))
        return real(m, *a, **k)

    monkeypatch.setattr(baseline, "generate", spy)
    losses = []
    out = tmp_path / "out"
    summary = train(model, tok, read_prompts(prompts_file, tok), out,
                    small_config(steps=30, save_every=30, blocks_per_seq=20, lr=1e-3),
                    on_step=lambda s, t, loss, a: losses.append(loss))
    # The data is plain mlx-lm's output, generated before the adapter wraps the model.
    assert wrapped_when_generating == [False] * len(PROMPTS)
    assert len(losses) == 30
    assert np.mean(losses[-6:]) < np.mean(losses[:6]) - 0.2
    assert summary["heldout_examples"] == 2 and 1.0 <= summary["heldout_acceptance"] <= 4.0  # estimated (not NaN)
    data = [json.loads(l) for l in (out / "data.jsonl").read_text().splitlines()]
    assert len(data) == len(PROMPTS) and all(len(r["response"]) > 0 for r in data)

    # Acceptance counts the target's own token, so any drafter scores >= 1:
    # compare, in the runtime, with the same drafter before training. A random
    # tiny target leaves nothing to generalise from held-out text (trained or
    # not, held-out acceptance stays about 1.0), so this is the drafter fitting
    # the target's continuations of the training prompts (with the 2 held out):
    # 1.20 tokens/cycle after these 30 steps (every anchor of each sequence), 1.00 untrained.
    config = json.loads((out / "config.json").read_text())
    mx.random.seed(small_config().seed)  # the initialisation training started from
    (tmp_path / "untrained").mkdir()
    save_zlab(tmp_path / "untrained", DFlashDrafter(DrafterConfig.from_dict(config)), config)
    prompts = [r["prompt"] for r in data]
    trained = mean_acceptance(targets["qwen3"], out, prompts)
    untrained = mean_acceptance(targets["qwen3"], tmp_path / "untrained", prompts)
    assert trained > untrained + 0.1, (trained, untrained)


def test_resume_equals_an_uninterrupted_run(tmp_path, targets, prompts_file):
    model, tok, _ = load_target(targets["llama"])
    prompts = read_prompts(prompts_file, tok)
    train(model, tok, prompts, tmp_path / "a", small_config())

    class Stop(Exception):
        pass

    def interrupt(step, total, loss, acc):
        if step == 6:
            raise Stop

    model, tok, _ = load_target(targets["llama"])
    with pytest.raises(Stop):
        train(model, tok, prompts, tmp_path / "b", small_config(), on_step=interrupt)
    with pytest.raises(DFlashError, match="--resume"):
        train(model, tok, prompts, tmp_path / "b", small_config())
    model, tok, _ = load_target(targets["llama"])
    train(model, tok, prompts, tmp_path / "b", small_config(), resume=True)
    a = mx.load(str(tmp_path / "a" / "model.safetensors"))
    b = mx.load(str(tmp_path / "b" / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert mx.array_equal(a[k], b[k]), k


def test_init_starts_from_a_drafters_weights_and_refuses_another_shape(tmp_path, targets, prompts_file):
    model, tok, _ = load_target(targets["llama"])
    prompts = read_prompts(prompts_file, tok)
    train(model, tok, prompts, tmp_path / "a", small_config(steps=6))
    start = tmp_path / "a" / "mlx"  # the converted (float16) drafter, as `--init` is given one
    model, tok, _ = load_target(targets["llama"])
    # With a zero learning rate the run ends where it started: the weights are the ones given.
    train(model, tok, prompts, tmp_path / "b", small_config(steps=2, lr=0.0, init=str(start)))
    a = mx.load(str(start / "model.safetensors"))
    b = mx.load(str(tmp_path / "b" / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert mx.array_equal(a[k].astype(mx.float32), b[k]), k
    # A drafter of another shape is refused before the target answers any prompt.
    model, tok, _ = load_target(targets["llama"])
    with pytest.raises(DFlashError, match="--init .* num_hidden_layers=1 but this run trains num_hidden_layers=2"):
        train(model, tok, prompts, tmp_path / "c", small_config(layers=2, init=str(start)))
    assert not (tmp_path / "c" / "data.jsonl").exists()


def test_checkpoint_loads_in_runtime_and_reference(tmp_path, targets, prompts_file):
    model, tok, _ = load_target(targets["qwen3_5"])
    train(model, tok, read_prompts(prompts_file, tok), tmp_path / "out", small_config(steps=6))
    out = tmp_path / "out"
    # The runtime takes both the z-lab layout and the MLX form.
    for draft in (out, out / "mlx"):
        pair = dflash_mlx.load(str(targets["qwen3_5"]), str(draft))
        _, stats = dflash_mlx.generate(pair, PROMPTS[0], max_tokens=10)
        assert stats.generation_tokens == 10

    torch = pytest.importorskip("torch")
    reference = pytest.importorskip("dflash.model")
    from safetensors.torch import load_file
    from transformers import Qwen3Config

    cfg = json.loads((out / "config.json").read_text())
    ref = reference.DFlashDraftModel(Qwen3Config(**cfg)).float().eval()
    ref.load_state_dict(load_file(str(out / "model.safetensors")), strict=True)
    pair = dflash_mlx.load(str(targets["qwen3_5"]), str(out))
    pair.drafter.set_dtype(mx.float32)
    F = len(cfg["dflash_config"]["target_layer_ids"]) * cfg["hidden_size"]
    ctx = np.random.default_rng(0).normal(size=(1, 9, F)).astype(np.float32)
    noise = np.random.default_rng(1).normal(size=(1, 4, cfg["hidden_size"])).astype(np.float32)
    with torch.no_grad():
        want = ref(target_hidden=torch.tensor(ctx), noise_embedding=torch.tensor(noise),
                   position_ids=torch.arange(13)[None], past_key_values=None, use_cache=False).numpy()
    got = np.array(pair.drafter(mx.array(noise), mx.array(ctx), pair.drafter.make_cache()))
    assert np.abs(got - want).max() < 1e-4


def test_bad_prompt_files(tmp_path, targets):
    _, tok, _ = load_target(targets["qwen3"])
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"prompt": "a"}\nnot json\n')
    with pytest.raises(DFlashError, match="p.jsonl:2 is not valid JSON"):
        read_prompts(bad, tok)
    bad.write_text('{"question": "a"}\n')
    with pytest.raises(DFlashError, match="no 'prompt'"):
        read_prompts(bad, tok)
    with pytest.raises(DFlashError, match="does not exist"):
        read_prompts(tmp_path / "missing.jsonl", tok)
    d = tmp_path / "texts"
    d.mkdir()
    (d / "a.txt").write_text("line of text number one\n" * 40)
    assert len(read_prompts(d, tok)) >= 2
