"""Whole loops at 4,200 tokens of context against z-lab's references.

The drafter attends to the context as its checkpoint defines: every committed
row for DFlash 1, each layer's sliding window for DFlash 2. Beyond 2,048 rows
(where a bound on the drafter's context would start to bite) every cycle must
compute the drafter states `dflash.model.dflash_generate` computes and accept
as many tokens, greedy, in float32.

z-lab's MLX loop (`dflash.model_mlx.stream_generate`) feeds the drafter the last
target layer's output before the final norm, where its PyTorch reference (the
transformers `hidden_states` it was trained on) feeds it after the norm. The demo
drafters tap every layer, the last one included, so that loop's logits differ
from the reference's at any context length; it is held to the tokens, the
acceptance and the drafts that decide each cycle.

The target is the demo target with a window of 8,192 and linear RoPE scaling
(factor 4, in every runtime), so that its drafts are still accepted now and then
at this length; the drafters are the shipped demo ones.
"""

import json
import shutil
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import dflash_mlx
from dflash_mlx.bench import context_prompt, load_prompts
from dflash_mlx.hub import builtin_path
from test_reference_loop import torch_weights

torch = pytest.importorskip("torch")
reference = pytest.importorskip("dflash.model")

CONTEXT = 4200  # prompt tokens: past 4,096, and twice a 2,048-row bound
MAX_NEW = 64  # one prompt, many cycles: each run's cost is mostly its 4,200-token prefill
BLOCK = 8
STATES_ATOL = 1e-4  # drafter states of size about 4 agree to about 2e-5 in float32 (summation order)


@pytest.fixture(scope="module")
def long_target(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("long-target") / "target"
    shutil.copytree(builtin_path("demo/target"), out)
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(max_position_embeddings=8192, rope_scaling={"type": "linear", "factor": 4.0})
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.fixture(scope="module")
def torch_target(long_target):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = json.loads((long_target / "config.json").read_text())
    cfg["rope_scaling"] = {"rope_type": "linear", "factor": 4.0}
    target = Qwen3ForCausalLM(Qwen3Config(**cfg)).float().eval()
    missing, unexpected = target.load_state_dict(torch_weights(long_target / "model.safetensors"), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    target.tie_weights()
    return target


def float32_pair(target: Path, drafter: str, draft_context=None):
    pair = dflash_mlx.load(str(target), builtin_path(drafter), draft_context=draft_context)
    pair.target.model.set_dtype(mx.float32)
    pair.drafter.set_dtype(mx.float32)
    return pair


@pytest.fixture(scope="module")
def prompts(long_target):
    pair = float32_pair(long_target, "demo/drafter")
    texts = load_prompts("code", None)["code"][:1]
    ids = [context_prompt(pair.tokenizer, t, CONTEXT) for t in texts]
    assert all(4096 < len(p) <= CONTEXT + 64 for p in ids)
    return ids


def recorded(source_class):
    class Recorded(source_class):
        """Our drafter's greedy draft tokens and its block outputs, cycle by cycle."""

        def propose(self, state, last, hidden, width):
            logits = super().propose(state, last, hidden, width)
            self.drafts.append(mx.argmax(logits, axis=-1).reshape(-1).tolist())
            return logits

        def draft_states(self, state, last, hidden, width):
            h = super().draft_states(state, last, hidden, width)
            self.outputs.append(np.array(h.astype(mx.float32)))
            return h

    return Recorded


def ours(pair, ids):
    source = recorded(type(pair.draft_source.inner))(pair.drafter, pair.target)
    source.block_rows = lambda width: width  # draft the verified width, as both references do
    source.drafts, source.outputs = [], []
    tokens, events = [], []
    for ev in dflash_mlx.stream_generate(pair, ids, max_tokens=MAX_NEW, block_size=BLOCK, lookup=False,
                                         draft_source=source):
        tokens += ev.tokens
        events.append(ev)
    return tokens, events[-1].stats.acceptance_lengths, source.drafts, source.outputs


def full_width(lengths, n=MAX_NEW):
    """Cycles the token budget did not narrow (ours never overshoots it; the references cut differently)."""
    return [i for i in range(len(lengths) - 1) if n - 1 - sum(lengths[:i]) >= BLOCK]


def zlab_torch(drafter, target, ids, eos, monkeypatch):
    """`dflash_generate`: tokens, each cycle's committed count and its drafter's
    output states (what its LM head reads)."""
    monkeypatch.setattr(reference, "_cuda_time", time.perf_counter)  # it times itself with torch.cuda
    states, compute = [], type(drafter).compute_logits

    def recorded(self, hidden, *args, **kw):
        states.append(hidden.float().numpy())
        return compute(self, hidden, *args, **kw)

    monkeypatch.setattr(type(drafter), "compute_logits", recorded)
    with torch.no_grad():
        ref = reference.dflash_generate(drafter, target, torch.tensor([ids]), MAX_NEW, eos, temperature=0.0,
                                        block_size=BLOCK, return_stats=True)
    tokens = ref.output_ids[0, len(ids):].tolist()
    return tokens[: next((i for i, t in enumerate(tokens) if t in eos), len(tokens))], ref.acceptance_lengths, states


def matches_dflash_generate(pair, drafter, torch_target, ids, monkeypatch):
    """Our greedy run on `ids` against `dflash_generate`: the same tokens, the same
    acceptance and the same drafter output states (float32 rounding apart) in
    every full-width cycle. Returns (tokens, lengths, drafts, full cycles)."""
    tokens, lengths, drafts, states = ours(pair, ids)
    eos = sorted(pair.tokenizer.eos_token_ids)
    want, want_lengths, want_states = zlab_torch(drafter, torch_target, ids, eos, monkeypatch)
    assert tokens == want[: len(tokens)] and len(tokens) == min(len(want), MAX_NEW)
    full = full_width(lengths)
    assert [lengths[i] for i in full] == [want_lengths[i] for i in full]
    for i in full:
        np.testing.assert_allclose(states[i], want_states[i], atol=STATES_ATOL, err_msg=f"cycle {i}")
    return tokens, lengths, drafts, full


def reference_drafter(path: Path, cls):
    from transformers import Qwen3Config

    cfg = json.loads((path / "config.original.json").read_text())
    w = {k + (".weight" if k.endswith("codebook") else ""): v for k, v in torch_weights(path / "model.safetensors").items()}
    drafter = cls(Qwen3Config(**cfg)).float().eval()
    drafter.load_state_dict(w, strict=True)
    return drafter


def zlab_mlx(target: Path, drafter: Path, ids, monkeypatch, tmp_path):
    """z-lab's MLX loop (`dflash.model_mlx.stream_generate`): tokens, each cycle's
    committed count, and its drafter's greedy draft tokens."""
    zl = pytest.importorskip("dflash.model_mlx")
    folder = tmp_path / "zlab-drafter"
    folder.mkdir(parents=True)
    shutil.copy(drafter / "model.safetensors", folder)
    shutil.copy(drafter / "config.original.json", folder / "config.json")
    monkeypatch.setattr(zl, "snapshot_download", lambda repo_id, **kw: repo_id)  # a local folder, no hub
    model, tokenizer = zl.load(str(target))
    draft = zl.load_draft(str(folder))
    model.set_dtype(mx.float32)
    draft.set_dtype(mx.float32)
    drafts, call = [], zl.DFlashDraftModel.__call__

    def recorded(self, *args, **kw):
        logits = call(self, *args, **kw)
        drafts.append(mx.argmax(logits, axis=-1).reshape(-1).tolist())
        return logits

    monkeypatch.setattr(zl.DFlashDraftModel, "__call__", recorded)
    tokens, accepted = [], []
    for r in zl.stream_generate(model, draft, tokenizer, ids, block_size=BLOCK, max_tokens=MAX_NEW):
        tokens += r.tokens
        if r.accepted is not None:
            accepted.append(r.accepted)
    return tokens, accepted, drafts


def test_dflash1_drafts_and_accepts_as_the_references_at_long_context(long_target, torch_target, prompts,
                                                                       monkeypatch, tmp_path):
    """Every cycle at 4,200 tokens of context computes the drafter states of
    `dflash_generate` and accepts as many tokens; z-lab's MLX loop commits the same
    tokens and drafts the same accepted and first rejected tokens. A 2,048-row
    bound on the drafter's context changes the drafts here, so a bound left on would fail."""
    pair = float32_pair(long_target, "demo/drafter")
    assert pair.draft_context is None and pair.drafter.horizon is None
    bounded = float32_pair(long_target, "demo/drafter", draft_context=2048)
    assert bounded.drafter.context_bound == (4, 2048)
    drafter = reference_drafter(Path(builtin_path("demo/drafter")), reference.DFlashDraftModel)
    accepted, differing = [], 0
    for ids in prompts:
        tokens, lengths, drafts, full = matches_dflash_generate(pair, drafter, torch_target, ids, monkeypatch)
        accepted += [lengths[i] for i in full]
        z_tokens, z_accepted, z_drafts = zlab_mlx(long_target, Path(builtin_path("demo/drafter")), ids,
                                                  monkeypatch, tmp_path)
        assert z_tokens[: len(tokens)] == tokens
        assert [lengths[i] for i in full] == [z_accepted[i] for i in full]
        # The drafts that decide each cycle (the accepted ones and the first rejected one); its
        # logits differ from the reference's (see the module's docstring), so later ones may too.
        assert [drafts[i][: lengths[i]] for i in full] == [z_drafts[i][: lengths[i]] for i in full]
        b_tokens, _, b_drafts, _ = ours(bounded, ids)
        assert b_tokens == tokens  # exact either way
        differing += sum(b != d for b, d in zip(b_drafts, drafts))
    assert len(accepted) >= 40 and max(accepted) > 1  # cycles compared, some drafts accepted
    assert differing > 0  # the bound reads other rows here


def test_dflash2_accepts_as_the_reference_at_long_context(long_target, torch_target, prompts, monkeypatch):
    """A DFlash 2 drafter reads its sliding windows (512 rows) at 4,200 tokens of
    context, and prefill skips only the rows no window reaches: tokens and each
    cycle's acceptance equal `dflash_generate` with z-lab's DFlash2DraftModel."""
    pair = float32_pair(long_target, "demo/drafter2")
    assert pair.drafter.horizon == (0, 512)
    drafter = reference_drafter(Path(builtin_path("demo/drafter2")), reference.DFlash2DraftModel)
    accepted = []
    for ids in prompts:
        _, lengths, _, full = matches_dflash_generate(pair, drafter, torch_target, ids, monkeypatch)
        accepted += [lengths[i] for i in full]
    assert len(accepted) >= 40 and max(accepted) > 1


def test_a_draft_context_is_refused_where_the_checkpoint_defines_windows(long_target):
    from dflash_mlx.errors import DFlashError

    with pytest.raises(DFlashError, match="declares its own windows"):
        dflash_mlx.load(str(long_target), builtin_path("demo/drafter2"), draft_context=1024)
    with pytest.raises(DFlashError, match="positive number of rows"):
        dflash_mlx.load(str(long_target), builtin_path("demo/drafter"), draft_context=0)


@pytest.mark.parametrize("drafter, case", [("demo/drafter", "more"), ("demo/drafter2", "branch")])
def test_prompt_cache_hits_at_long_context_draft_as_cold_runs(long_target, prompts, drafter, case):
    """With a prompt cache at 4,200 tokens of context, a request that continues the
    conversation (DFlash 1: the whole context cached) or one that branches 1,200
    tokens back (DFlash 2: inside the rows its windows let prefill skip) reuses the
    cache and drafts (the same drafter outputs), accepts and outputs what a cold
    run without a cache does."""
    from dflash_mlx.cache.prompt_cache import PromptCache

    pair = float32_pair(long_target, drafter)
    Source = recorded(type(pair.draft_source.inner))
    kept = Source(pair.drafter, pair.target)

    def run(ids, source, cache=None):
        source.drafts, source.outputs = [], []
        events = list(dflash_mlx.stream_generate(pair, ids, max_tokens=12, block_size=BLOCK, lookup=False,
                                                 prompt_cache=cache, draft_source=source))
        return [(e.tokens, e.accepted) for e in events], source.outputs, events[-1].stats.cached_tokens

    cache = PromptCache(pair)
    first, _, _ = run(prompts[0], kept, cache)
    answer = [t for ts, _ in first for t in ts]
    if case == "more":
        ids = prompts[0] + answer + pair.tokenizer.encode("\n\ndef helper(x):")
    else:
        ids = prompts[0][:3000] + pair.tokenizer.encode("    # and then")
    warm, drafts, reused = run(ids, kept, cache)
    cold, cold_drafts, none = run(ids, Source(pair.drafter, pair.target))
    assert warm == cold and none == 0 and reused > 2048
    assert len(drafts) == len(cold_drafts) > 2
    assert all(np.allclose(d, c, atol=1e-4) for d, c in zip(drafts, cold_drafts))
    if case == "more":
        assert reused == len(prompts[0]) + len(answer) - 1  # the whole entry
