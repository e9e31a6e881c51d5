"""Whole decode loops against z-lab's PyTorch reference on the trained demo pair.

Identical output alone does not prove the drafter sees the right context: the
per-cycle acceptance lengths at temperature 0 must equal those of
`dflash.model.dflash_generate`, both in float32.
"""

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import dflash_mlx
from dflash_mlx.hub import builtin_path

torch = pytest.importorskip("torch")
reference = pytest.importorskip("dflash.model")

HELDOUT = Path(__file__).parents[1] / "benchmarks" / "demo" / "heldout_prompts.jsonl"
MAX_NEW = 48


def torch_weights(path: Path):
    from safetensors.numpy import load_file

    return {k: torch.tensor(v.astype(np.float32)) for k, v in load_file(str(path)).items()}


@pytest.fixture(scope="module")
def reference_pair():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    target_dir, draft_dir = Path(builtin_path("demo/target")), Path(builtin_path("demo/drafter"))
    cfg = json.loads((target_dir / "config.json").read_text())
    target = Qwen3ForCausalLM(Qwen3Config(**cfg)).float().eval()
    missing, unexpected = target.load_state_dict(torch_weights(target_dir / "model.safetensors"), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    target.tie_weights()
    dcfg = json.loads((draft_dir / "config.json").read_text())
    drafter = reference.DFlashDraftModel(Qwen3Config(**dcfg)).float().eval()
    drafter.load_state_dict(torch_weights(draft_dir / "model.safetensors"), strict=True)
    return target, drafter


@pytest.fixture(scope="module")
def demo_pair():
    pair = dflash_mlx.load("demo")
    pair.target.model.set_dtype(mx.float32)
    pair.drafter.set_dtype(mx.float32)
    return pair


# Six held-out prompts, three at each block size.
@pytest.mark.parametrize("block_size, first", [(8, 0), (16, 3)])
def test_acceptance_lengths_match_the_reference(reference_pair, demo_pair, block_size, first, monkeypatch):
    import time

    # The reference times itself with torch.cuda.synchronize; on CPU, a plain clock.
    monkeypatch.setattr(reference, "_cuda_time", time.perf_counter)
    # The reference drafts a block of the verified width (narrowed at the end of the budget, and
    # below the trained block size): so do we, here.
    source = demo_pair.draft_source
    monkeypatch.setattr(getattr(source, "inner", source), "block_rows", lambda width: width)
    target, drafter = reference_pair
    prompts = [json.loads(l)["prompt"] for l in HELDOUT.read_text().splitlines()][first : first + 3]
    eos = sorted(demo_pair.tokenizer.eos_token_ids)
    compared = 0
    for text in prompts:
        ids = demo_pair.tokenizer.encode(text)
        with torch.no_grad():
            ref = reference.dflash_generate(
                drafter, target, torch.tensor([ids]), MAX_NEW, eos, temperature=0.0,
                block_size=block_size, return_stats=True,
            )
        ref_tokens = ref.output_ids[0, len(ids):].tolist()
        ref_tokens = ref_tokens[: next((i for i, t in enumerate(ref_tokens) if t in eos), len(ref_tokens))]
        ours, events = [], []
        for ev in dflash_mlx.stream_generate(demo_pair, ids, max_tokens=MAX_NEW, block_size=block_size):
            ours += ev.tokens
            events.append(ev)
        lengths = events[-1].stats.acceptance_lengths
        assert ours == ref_tokens
        # The final cycle is cut to the budget differently; all others match.
        assert lengths[:-1] == ref.acceptance_lengths[: len(lengths) - 1]
        compared += len(lengths) - 1
    assert compared >= 10
