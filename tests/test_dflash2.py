"""DFlash 2 drafters against z-lab's PyTorch `DFlash2DraftModel`: draft logits,
the candidate selector's path and its q per position, cycle after cycle
through the caches (contexts beyond the sliding window included)."""

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import tiny

from dflash_mlx.config import DrafterConfig
from dflash_mlx.drafter2 import DFlash2Drafter, DFlash2DraftSource, grouped_causal_conv
from dflash_mlx.load import load_drafter
from dflash_mlx.sampling import SamplingParams

torch = pytest.importorskip("torch")
reference = pytest.importorskip("dflash.model")

V, D, TAPS = 96, 64, 2
CODEBOOKS = ("predecessor_codebook", "successor_codebook")


def dflash2_config(window=10, block_size=8, kernel=3, group=8, rank=12, top_k=10, layer_types=None):
    cfg = tiny.drafter_config("new", V, 8, mask_token_id=3, block_size=block_size, sliding=True)
    cfg.update(architectures=["DFlash2DraftModel"], is_causal=False, sliding_window=window,
               layer_types=layer_types or ["sliding_attention"] * 2)
    cfg["dflash_config"].update(conv_kernel_size=kernel, conv_group_size=group, selector_rank=rank,
                                selector_top_k=top_k)
    return cfg


def reference_drafter(cfg, seed=0):
    from transformers import Qwen3Config

    torch.manual_seed(seed)
    model = reference.DFlash2DraftModel(Qwen3Config(**cfg)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:  # base_kernel is created uninitialised (torch.empty)
                p.normal_(0, 1.0 if "codebook" in name else 0.2)
    return model


def published_state_dict(model):
    """The state dict as published checkpoints store it: codebooks without `.weight`."""
    sd = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    for name in CODEBOOKS:
        sd[f"candidate_selector.{name}"] = sd.pop(f"candidate_selector.{name}.weight")
    return sd


def save_published(model, cfg, out: Path) -> Path:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg))
    save_file(published_state_dict(model), str(out / "model.safetensors"))
    return out


class Target:
    """Embedding and head borrowed from a target: here a random shared matrix."""

    vocab_size = V

    def __init__(self, emb):
        self.emb = mx.array(emb.numpy())

    def embed(self, ids):
        return self.emb[ids]

    def head(self, h):
        return h @ self.emb.T


def forced(monkeypatch, path):
    """Make the reference's selector draw `path` (ids [L]) when sampling, so its q rows are those along it."""
    step = iter(range(len(path)))

    def sample(q):
        i = next(step)
        cand = state["candidates"][0, i]
        return (cand == int(path[i])).nonzero()[0]

    state = {}
    original = reference.CandidateSelector.select

    def select(self, hidden, logits, anchor_ids, temperature):
        state["candidates"] = torch.topk(logits, self.top_k, dim=-1, sorted=False)[1]
        return original(self, hidden, logits, anchor_ids, temperature)

    monkeypatch.setattr(reference, "_sample_probs", sample)
    monkeypatch.setattr(reference.CandidateSelector, "select", select)


def q_by_token(cand, q):
    return {int(t): float(p) for t, p in zip(cand, q)}


# (sliding window, block size, prompt context, accepted drafts per cycle)
SCENARIOS = [
    (10, 8, 23, [2, 0, 7, 3]),  # the prompt alone is longer than the window
    (10, 8, 3, [1, 4, 0, 7, 2, 5]),  # a short prompt grows past the window
    (6, 8, 9, [3, 7, 0]),  # blocks wider than the window
    (10, 4, 12, [3, 1, 0, 2, 3]),
]


@pytest.mark.parametrize("window, block, prompt, accepts", SCENARIOS)
def test_cycles_match_the_reference(tmp_path, monkeypatch, window, block, prompt, accepts):
    cfg = dflash2_config(window=window, block_size=block)
    ref = reference_drafter(cfg)
    drafter = load_drafter(save_published(ref, cfg, tmp_path / "src"))
    assert isinstance(drafter, DFlash2Drafter)
    torch.manual_seed(1)
    emb = torch.randn(V, D)
    head = torch.nn.Linear(D, V, bias=False)
    head.weight.data = emb
    source = DFlash2DraftSource(drafter, Target(emb))
    temp = 0.7
    params = SamplingParams(temp=temp)
    # One state per way of drafting; each sees the same cycles.
    ours, via_propose, via_path, via_sampled, via_prefix = (source.new_state() for _ in range(5))
    cache = reference._make_cache(ref.config)
    ctx = torch.randn(1, prompt, TAPS * D)
    start, anchor = prompt, 5
    diffs, qdiffs, selector_mattered = [], [], False
    for cycle, accepted in enumerate(accepts + [0]):
        ids = torch.tensor([[anchor] + [cfg["dflash_config"]["mask_token_id"]] * (block - 1)])
        with torch.no_grad():
            h_ref = ref(target_hidden=ctx, noise_embedding=torch.nn.functional.embedding(ids, emb),
                        position_ids=torch.arange(start - ctx.shape[1], start + block)[None],
                        past_key_values=cache, use_cache=True)[:, 1:]
            reference._crop_to(cache, start)
            logits_ref = ref.compute_logits(h_ref, head)
            path_ref, cand_ref, _ = ref.propose(h_ref, ids[:, 0], head, 0.0)
        last, hidden = mx.array([anchor], dtype=mx.uint32), mx.array(ctx.numpy())

        # Draft logits through the caches.
        h, logits = source.draft_logits(ours, last, hidden, block)
        diffs.append(np.abs(np.array(logits) - logits_ref[0].numpy()).max())
        assert diffs[-1] < 2e-5 * max(1.0, np.abs(logits_ref.numpy()).max()), (cycle, diffs[-1])

        # The greedy path, and the candidates it chose among.
        selector = drafter.candidate_selector
        path, cand, scores = selector.walk(h, logits, last)
        assert path.tolist() == path_ref[0].tolist(), cycle
        assert cand.tolist() == np.sort(cand_ref[0].numpy(), axis=-1).tolist()
        selector_mattered |= path.tolist() != np.argmax(logits_ref[0].numpy(), -1).tolist()

        # propose: argmax is the greedy path, softmax(. / T) the reference's q along it.
        proposed = source.propose(via_propose, last, hidden, block)
        assert mx.argmax(proposed, axis=-1).tolist() == path.tolist()
        with monkeypatch.context() as m:
            forced(m, path.tolist())
            with torch.no_grad():
                _, cand_q, q_ref = ref.propose(h_ref, ids[:, 0], head, temp)
        q = np.array(mx.softmax(proposed / temp, axis=-1))
        for i in range(path.shape[0]):
            want = q_by_token(cand_q[0, i], q_ref[0, i])
            got = {t: float(q[i, t]) for t in want}
            qdiffs.append(max(abs(got[t] - want[t]) for t in want))
            assert qdiffs[-1] < 1e-4, (cycle, i)
            assert abs(sum(got.values()) - 1) < 1e-5  # nothing outside the candidates

        # propose_path, greedy: the same path and no q.
        tokens, q_lp = source.propose_path(via_path, last, hidden, block, SamplingParams())
        assert tokens.tolist() == path.tolist() and q_lp is None

        # After tokens copied into the first positions (a lookup's), the walk starts from the last of them.
        prefix = [17, 29][: block - 2]
        tokens, _ = source.propose_path(via_prefix, last, hidden, block, SamplingParams(), prefix)
        with torch.no_grad():
            want, _, _ = ref.candidate_selector.select(h_ref[:, len(prefix):], logits_ref[:, len(prefix):],
                                                       torch.tensor([prefix[-1]]), 0.0)
        assert tokens.tolist() == want[0].tolist()

        # propose_path, sampling: each token drawn from its row, and the rows are the
        # reference's q along the drawn path.
        mx.random.seed(cycle)
        tokens, q_lp = source.propose_path(via_sampled, last, hidden, block, params)
        with monkeypatch.context() as m:
            forced(m, tokens.tolist())
            with torch.no_grad():
                path_s, cand_q, q_ref = ref.propose(h_ref, ids[:, 0], head, temp)
        assert path_s[0].tolist() == tokens.tolist()
        q = np.exp(np.array(q_lp))
        for i in range(tokens.shape[0]):
            want = q_by_token(cand_q[0, i], q_ref[0, i])
            assert q[i, tokens[i].item()] > 0
            qdiffs.append(max(abs(float(q[i, t]) - want[t]) for t in want))
            assert qdiffs[-1] < 1e-4, (cycle, i)
            assert abs(sum(float(q[i, t]) for t in want) - 1) < 1e-5

        # Commit: the anchor plus the accepted drafts become context.
        n = accepted + 1
        ctx = torch.randn(1, n, TAPS * D)
        anchor = int(path[accepted].item()) if accepted < path.shape[0] else 11
        start += n
    assert start > window + block
    assert selector_mattered  # the codebooks changed some pick: the walk was tested, not only the argmax
    print(f"max abs diff: logits {max(diffs):.2e} (of {np.abs(logits_ref.numpy()).max():.1f}), q {max(qdiffs):.2e}")


def test_published_and_state_dict_keys_load_alike(tmp_path):
    cfg = dflash2_config()
    ref = reference_drafter(cfg)
    a = load_drafter(save_published(ref, cfg, tmp_path / "published"))
    from safetensors.torch import save_file

    (tmp_path / "sd").mkdir()
    (tmp_path / "sd" / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, str(tmp_path / "sd" / "model.safetensors"))
    b = load_drafter(tmp_path / "sd")
    want = ref.candidate_selector.predecessor_codebook.weight.detach().numpy()
    for m in (a, b):
        assert np.array_equal(np.array(m.candidate_selector.predecessor_codebook), want)
        assert "predecessor_codebook" in dict(m.candidate_selector.parameters())


@pytest.mark.parametrize("L", [1, 2, 5])
@pytest.mark.parametrize("kernel", [1, 2, 3])
def test_convolution_matches_the_reference_and_stays_in_the_block(L, kernel):
    torch.manual_seed(L * 10 + kernel)
    x, dyn, base = torch.randn(2, L, 32), torch.randn(2, L, kernel, 4), torch.randn(kernel, 32)
    got = np.array(grouped_causal_conv(mx.array(x.numpy()), mx.array(dyn.numpy()), mx.array(base.numpy()), 8))
    if L >= kernel - 1:  # the reference pads a block shorter than that to the wrong length
        want = reference._grouped_dynamic_convolve(x, dyn, base, 8).numpy()
        assert np.abs(got - want).max() < 1e-5
    # Position t reads positions t - kernel + 1 .. t of its own block only.
    x2 = x.clone()
    x2[:, -1] += 100
    moved = np.array(grouped_causal_conv(mx.array(x2.numpy()), mx.array(dyn.numpy()), mx.array(base.numpy()), 8))
    assert np.array_equal(moved[:, :-1], got[:, :-1])


def test_forward_blocks_equals_the_cached_pass(tmp_path):
    cfg = dflash2_config(window=6)
    drafter = load_drafter(save_published(reference_drafter(cfg), cfg, tmp_path / "src"))
    mx.random.seed(0)
    T, L = 9, 8
    ctx, blocks = mx.random.normal((1, T, TAPS * D)), mx.random.normal((2, L, D))
    anchors = mx.array([4, 9])
    together = drafter.forward_blocks(blocks, ctx, anchors)
    for k, a in enumerate(anchors.tolist()):
        alone = drafter(blocks[k : k + 1], ctx[:, :a], drafter.make_cache())
        assert np.abs(np.array(together[k] - alone[0])).max() < 1e-4


def test_config_fields():
    c = DrafterConfig.from_dict(dflash2_config())
    assert c.is_dflash2 and (c.conv_kernel_size, c.conv_group_size, c.selector_rank, c.selector_top_k) == (3, 8, 12, 10)
    assert not any(c.layer_is_causal(i) for i in range(2)) and [c.layer_window(i) for i in range(2)] == [10, 10]
