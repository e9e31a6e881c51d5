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
from dflash_mlx.draft.drafter2 import DFlash2Drafter, DFlash2DraftSource, grouped_causal_conv
from dflash_mlx.pair import load_drafter
from dflash_mlx.sampling import SamplingParams
from test_reference_loop import HELDOUT, MAX_NEW, torch_weights

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


# --- The whole loop -----------------------------------------------------------

PROMPTS = ["def add(a, b):", "The quick brown fox", "Once upon a time there was a tiny language model"]


@pytest.fixture(scope="module")
def dflash2_pair(targets, vocab, tmp_path_factory):
    import dflash_mlx

    n_vocab, mask = vocab
    cfg = tiny.drafter_config("new", n_vocab, 6, mask_token_id=mask, block_size=8)
    cfg.update(architectures=["DFlash2DraftModel"], is_causal=False, sliding_window=8,
               layer_types=["sliding_attention"] * 2)
    cfg["dflash_config"].update(conv_kernel_size=2, conv_group_size=16, selector_rank=16, selector_top_k=8)
    src = save_published(reference_drafter(cfg), cfg, tmp_path_factory.mktemp("dflash2"))
    return dflash_mlx.load(str(targets["qwen3"]), str(src))


def generated(pair, prompt, **kw):
    import dflash_mlx

    out, events = [], []
    for ev in dflash_mlx.stream_generate(pair, prompt, **kw):
        out += ev.tokens
        events.append(ev)
    return out, events


class ProposeOnly(DFlash2DraftSource):
    """The selector's greedy path through `propose` alone: the loop samples each
    position from its rows independently (exact too, fewer acceptances)."""

    def propose_path(self, *args, **kwargs):
        return None


def source_for(pair, drafting, cls=None):
    """The pair's drafter behind the lookup wrapper, drafting through `propose_path`
    (the loop's default for DFlash 2, calls counted) or through `propose` alone."""
    from dflash_mlx.draft.lookup import WithLookup

    class Counted(WithLookup):
        calls = 0

        def propose_path(self, state, *args):
            path = super().propose_path(state, *args)
            Counted.calls += path is not None  # blocks drafted along a path
            return path

    inner = (cls or (ProposeOnly if drafting == "propose" else DFlash2DraftSource))(pair.drafter, pair.target)
    return Counted(inner)


def widths(block_size):
    from conftest import ScriptedWidths

    from dflash_mlx.policy.plan import Plan

    # Lookup tokens first where the n-gram index has some, the drafter after them.
    return block_size if block_size != "lookup" else ScriptedWidths([Plan(6, 2), 3, Plan(5, 1), 8])


@pytest.mark.parametrize("drafting, block_size", [("propose", 2), ("propose", 5), ("propose", "lookup"),
                                                 ("propose_path", 3), ("propose_path", "lookup")])
def test_greedy_dflash2_is_lossless(dflash2_pair, baselines, monkeypatch, block_size, drafting):
    from conftest import greedy_ref

    pair = dflash2_pair
    assert isinstance(pair.draft_source.inner, DFlash2DraftSource)
    source = source_for(pair, drafting)
    accepted = 0
    for text in PROMPTS:
        prompt = pair.tokenizer.encode(text)
        out, events = generated(pair, prompt, max_tokens=40, block_size=widths(block_size), draft_source=source)
        assert out == greedy_ref(baselines["qwen3"], prompt, 40), (text, block_size)
        assert len(prompt) + len(out) > 8  # beyond the drafter's sliding window
        accepted += sum(e.accepted for e in events)
    assert (type(source).calls > 0) == (drafting == "propose_path")
    print(f"{drafting} block {block_size}: {accepted} drafts accepted")


@pytest.mark.parametrize("drafting", ["propose", "propose_path"])
def test_sampling_runs_through_the_loop(dflash2_pair, monkeypatch, drafting):
    pair = dflash2_pair
    source = source_for(pair, drafting)
    params = SamplingParams(temp=0.8, top_p=0.95, seed=3)
    prompt = pair.tokenizer.encode(PROMPTS[0])
    out, events = generated(pair, prompt, max_tokens=30, block_size=6, sampling=params, draft_source=source)
    again, _ = generated(pair, prompt, max_tokens=30, block_size=6, sampling=params, draft_source=source)
    assert out == again and len(out) >= 1 and all(0 <= t < pair.target.vocab_size for t in out)
    assert events[-1].stats.draft_cycles >= 1


class Oracle(DFlash2DraftSource):
    """The real drafter and selector, with the target's own greedy continuation
    (`greedy`: the prompt and plain decoding's tokens after it) added to the draft
    logits: the selector's codebooks still overrule it at some positions, so
    cycles accept all, some or none of their drafts."""

    def __init__(self, pair, greedy, boost):
        super().__init__(pair.drafter, pair.target)
        self.greedy, self.boost, self.seq = greedy, boost, []

    def new_state(self):
        self.seq = []
        return super().new_state()

    def commit(self, state, tokens):
        self.seq += tokens

    def draft_logits(self, state, last, hidden, width):
        assert self.seq[-1] == last.item()
        h, logits = super().draft_logits(state, last, hidden, width)
        n = len(self.seq)
        assert self.seq == self.greedy[:n]  # the loop committed plain decoding's tokens so far
        nxt = self.greedy[n : n + width - 1]
        assert len(nxt) == width - 1
        hit = mx.arange(logits.shape[-1])[None] == mx.array(nxt)[:, None]
        return h, logits + self.boost * hit


@pytest.mark.parametrize("drafting, block_size", [("propose", 3), ("propose", 8), ("propose_path", 5)])
def test_greedy_dflash2_is_lossless_when_drafts_are_accepted(dflash2_pair, baselines, monkeypatch, block_size,
                                                             drafting):
    from conftest import greedy_ref

    pair, model = dflash2_pair, baselines["qwen3"]
    lengths = []
    for text in PROMPTS:
        prompt = pair.tokenizer.encode(text)
        ref = greedy_ref(model, prompt, 40 + block_size)
        assert len(ref) == 40 + block_size  # drafts beyond the budget are the model's own too
        source = Oracle(pair, prompt + ref, boost=12.0)
        if drafting == "propose":
            source.propose_path = lambda *a, **k: None
        out, events = generated(pair, prompt, max_tokens=40, block_size=block_size, draft_source=source)
        assert out == ref[:40], (text, block_size)
        lengths += [(e.accepted, len(e.tokens)) for e in events[1:-1]]
    accepted = [a for a, _ in lengths]
    # Rollbacks after every kind of cycle: all drafts kept, some, none.
    assert block_size - 1 in accepted and 0 in accepted
    if block_size > 3:
        assert any(0 < a < block_size - 1 for a in accepted)
    print(f"{drafting} block {block_size}: accepted per cycle {accepted}")


# --- Exact sampling -----------------------------------------------------------


@pytest.fixture(scope="module")
def small_dflash2_pair():
    """test_sampling's 5-token target and a random DFlash 2 drafter choosing among 3 candidates."""
    import conftest
    from test_sampling import BLOCK

    return conftest.build_small_pair(DFlash2Drafter, DFlash2DraftSource, {
        "architectures": ["DFlash2DraftModel"], "is_causal": False, "layer_types": ["sliding_attention"],
        "sliding_window": 3,
        "dflash_config": {"block_size": BLOCK, "mask_token_id": 4, "target_layer_ids": [0, 1],
                          "conv_kernel_size": 2, "conv_group_size": 8, "selector_rank": 4, "selector_top_k": 3},
    }, init=lambda d: d.update(tree_unflatten_random(d, ("base_kernel", "codebook"))))


def tree_unflatten_random(model, names):
    from mlx.utils import tree_flatten, tree_unflatten

    return tree_unflatten([(k, mx.random.normal(v.shape)) for k, v in tree_flatten(model.parameters())
                           if any(n in k for n in names)])


SAMPLES = 600


@pytest.mark.parametrize("drafting", ["propose", "propose_path"])
def test_dflash2_samples_follow_the_target_distribution(small_dflash2_pair, monkeypatch, drafting):
    from test_sampling import ALPHA, exact_distribution, gof_pvalue, sample_counts

    pair, model = small_dflash2_pair
    params = SamplingParams(temp=1.0)
    seqs, probs = exact_distribution(model, params)
    source = pair.draft_source if drafting == "propose_path" else ProposeOnly(pair.drafter, pair.target)
    counts, accept_rate = sample_counts(pair, params, SAMPLES, source)
    assert sum(counts.values()) == SAMPLES
    assert gof_pvalue(counts, seqs, probs, SAMPLES) > ALPHA
    assert accept_rate > 0.1  # drafts were accepted: acceptance was tested, not only resampling
    print(f"{drafting}: first draft accepted in {accept_rate:.2f} of cycles")


def test_path_tokens_are_drawn_from_their_q(tmp_path):
    """Sequential draws: the second token's q depends on the first token drawn,
    and the pairs drawn follow q0(t0) q1(t1 | t0)."""
    from test_sampling import ALPHA, chi2_sf

    cfg = dflash2_config(top_k=3)
    drafter = load_drafter(save_published(reference_drafter(cfg), cfg, tmp_path / "src"))
    torch.manual_seed(2)
    source = DFlash2DraftSource(drafter, Target(torch.randn(V, D) * 0.3))
    state = source.new_state()
    source.add_context(state, mx.random.normal((1, 5, TAPS * D), key=mx.random.key(0)))
    params, last = SamplingParams(temp=1.5), mx.array([7], dtype=mx.uint32)
    drafted = source.draft_logits(state, last, None, 3)
    mx.eval(drafted)
    source.draft_logits = lambda *args: drafted  # the same drafter pass each time: only the draws vary
    mx.random.seed(0)
    n, counts, rows = 2000, {}, {}
    for _ in range(n):
        tokens, q_lp = source.propose_path(state, last, None, 3, params)
        t0, t1 = tokens.tolist()
        counts[t0, t1] = counts.get((t0, t1), 0) + 1
        q0, q1 = np.exp(np.array(q_lp))
        rows[t0] = ({t: p for t, p in enumerate(q0) if p > 0}, {t: p for t, p in enumerate(q1) if p > 0})
    assert len(rows) == 3 and all(len(q0) == len(q1) == 3 for q0, q1 in rows.values())
    assert len({tuple(sorted(q1.items())) for _, q1 in rows.values()}) == 3  # q1 differs with t0
    expected = {(t0, t1): n * q0[t0] * q1[t1] for t0, (q0, q1) in rows.items() for t1 in q1}
    assert set(counts) <= set(expected)
    stat = sum((counts.get(k, 0) - e) ** 2 / e for k, e in expected.items())
    assert chi2_sf(stat, len(expected) - 1) > ALPHA


def test_propose_path_applies_processors_after_the_drafts_before(tmp_path):
    cfg = dflash2_config()
    drafter = load_drafter(save_published(reference_drafter(cfg), cfg, tmp_path / "src"))
    torch.manual_seed(2)
    source = DFlash2DraftSource(drafter, Target(torch.randn(V, D)))
    state = source.new_state()
    source.add_context(state, mx.random.normal((1, 5, TAPS * D), key=mx.random.key(0)))
    last = mx.array([7], dtype=mx.uint32)
    greedy, _ = source.propose_path(state, last, None, 4, SamplingParams())
    seen = []

    def ban_greedy_first(row, before):
        # As a logit bias would: the greedy path's first token is never drafted.
        seen.append(None if before is None else before.tolist())
        return mx.where(mx.arange(row.shape[-1]) == greedy[0], -mx.inf, row)

    for prefix in ([], [9]):
        seen.clear()
        tokens, _ = source.propose_path(state, last, None, 4, SamplingParams(), prefix, ban_greedy_first)
        drafts = prefix + tokens.tolist()
        assert greedy[0].item() not in tokens.tolist()
        assert seen == [drafts[:i] or None for i in range(len(prefix), 3)]
        mx.random.seed(1)
        tokens, q_lp = source.propose_path(state, last, None, 4, SamplingParams(temp=1.0), prefix,
                                           ban_greedy_first)
        assert q_lp[:, greedy[0].item()].tolist() == [-np.inf] * tokens.shape[0]


# --- Against z-lab's decode loop ------------------------------------------------


@pytest.fixture(scope="module")
def demo_dflash2(tmp_path_factory):
    """The demo drafter's layers as a DFlash 2 drafter: near-identity convolutions
    (a unit first tap plus small random kernels) and a random selector that
    overrules the draft head now and then; sliding windows of 24."""
    from safetensors.numpy import load_file
    from safetensors.torch import save_file
    from transformers import Qwen3Config

    from dflash_mlx.hub import builtin_path

    src = Path(builtin_path("demo/drafter"))
    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("dflash_mlx")
    cfg.update(architectures=["DFlash2DraftModel"], is_causal=False, sliding_window=24, use_sliding_window=True,
               dtype="float32",
               layer_types=["sliding_attention"] * cfg["num_hidden_layers"])
    cfg["dflash_config"].update(conv_kernel_size=2, conv_group_size=16, selector_rank=16, selector_top_k=8)
    H, n_vocab, groups = cfg["hidden_size"], cfg["vocab_size"], cfg["hidden_size"] // 16
    w = {k: torch.tensor(v.astype(np.float32)) for k, v in load_file(str(src / "model.safetensors")).items()}
    g = torch.Generator().manual_seed(0)
    for i in range(cfg["num_hidden_layers"]):
        for conv in ("attention_conv", "mlp_conv"):
            base = 0.02 * torch.randn(2, 2, H, generator=g)
            base[:, 0] += 1
            w[f"layers.{i}.{conv}.base_kernel"] = base
            w[f"layers.{i}.{conv}.kernel_projection.weight"] = 0.002 * torch.randn(2 * 2 * groups, H, generator=g)
    w["candidate_selector.hidden_projection.weight"] = 0.1 * torch.randn(16, H, generator=g)
    for name in CODEBOOKS:
        w[f"candidate_selector.{name}"] = 0.5 * torch.randn(n_vocab, 16, generator=g)
    out = tmp_path_factory.mktemp("demo-dflash2")
    (out / "config.json").write_text(json.dumps(cfg))
    save_file(w, str(out / "model.safetensors"))
    ref = reference.DFlash2DraftModel(Qwen3Config(**cfg)).float().eval()
    ref.load_state_dict({k + (".weight" if k.endswith("codebook") else ""): v for k, v in w.items()}, strict=True)
    return out, ref


@pytest.fixture(scope="module")
def demo_target():
    """The demo target in PyTorch (as test_reference_loop builds it)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dflash_mlx.hub import builtin_path

    src = Path(builtin_path("demo/target"))
    target = Qwen3ForCausalLM(Qwen3Config(**json.loads((src / "config.json").read_text()))).float().eval()
    missing, unexpected = target.load_state_dict(torch_weights(src / "model.safetensors"), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    target.tie_weights()
    return target


def full_cycles_match_zlab(pair, ref, target, ids, block_size):
    """Greedy DFlash on `ids` equals `dflash.model.dflash_generate` with `ref`: the
    same tokens and the same acceptance length in every full-width cycle (cycles
    the budget narrows are cut differently: ours never overshoots it); returns those lengths."""
    eos = sorted(pair.tokenizer.eos_token_ids)
    with torch.no_grad():
        want = reference.dflash_generate(ref, target, torch.tensor([ids]), MAX_NEW, eos, temperature=0.0,
                                         block_size=block_size, return_stats=True)
    want_tokens = want.output_ids[0, len(ids):].tolist()
    want_tokens = want_tokens[: next((i for i, t in enumerate(want_tokens) if t in eos), len(want_tokens))]
    out, events = generated(pair, ids, max_tokens=MAX_NEW, block_size=block_size, lookup=False)
    lengths = events[-1].stats.acceptance_lengths
    assert out == want_tokens
    full = [i for i in range(len(lengths) - 1) if MAX_NEW - 1 - sum(lengths[:i]) >= block_size]
    assert [lengths[i] for i in full] == [want.acceptance_lengths[i] for i in full]
    return [lengths[i] for i in full]


@pytest.mark.parametrize("block_size", [8, 16])
def test_acceptance_lengths_match_zlab_dflash_generate(demo_target, demo_dflash2, block_size, monkeypatch):
    """Greedy whole loops on the demo target: tokens and per-cycle acceptance
    lengths equal `dflash.model.dflash_generate` with z-lab's DFlash2DraftModel
    (which drafts a block of the verified width: so does ours here)."""
    import time

    import dflash_mlx

    monkeypatch.setattr(reference, "_cuda_time", time.perf_counter)
    target, (path, ref) = demo_target, demo_dflash2
    pair = dflash_mlx.load("demo", str(path))
    monkeypatch.setattr(pair.draft_source.inner, "block_rows", lambda width: width)
    pair.target.model.set_dtype(mx.float32)
    pair.drafter.set_dtype(mx.float32)
    assert isinstance(pair.drafter, DFlash2Drafter)
    compared = []
    for text in [json.loads(l)["prompt"] for l in HELDOUT.read_text().splitlines()][:3]:
        ids = pair.tokenizer.encode(text)
        assert len(ids) > 24  # past the sliding window
        compared += full_cycles_match_zlab(pair, ref, target, ids, block_size)
    lengths_seen = set(compared)
    assert len(compared) >= 10 and len(lengths_seen) >= 3


@pytest.fixture(scope="module")
def trained_dflash2():
    """The shipped DFlash 2 demo drafter (`demo-dflash2`, trained by `train --arch
    dflash2`) in z-lab's PyTorch class, from the same float16 weights."""
    from safetensors.numpy import load_file
    from transformers import Qwen3Config

    from dflash_mlx.hub import builtin_path

    src = Path(builtin_path("demo/drafter2"))
    cfg = json.loads((src / "config.original.json").read_text())
    w = {k + (".weight" if k.endswith("codebook") else ""): torch.tensor(v.astype(np.float32))
         for k, v in load_file(str(src / "model.safetensors")).items()}
    ref = reference.DFlash2DraftModel(Qwen3Config(**cfg)).float().eval()
    ref.load_state_dict(w, strict=True)
    return ref


def test_trained_pair_acceptance_matches_zlab_dflash_generate(demo_target, trained_dflash2, monkeypatch):
    """The whole loop on a trained DFlash 2 pair, where drafts are mostly accepted:
    tokens and per-cycle acceptance lengths equal z-lab's `dflash_generate`."""
    import time

    import dflash_mlx

    monkeypatch.setattr(reference, "_cuda_time", time.perf_counter)
    pair = dflash_mlx.load("demo-dflash2")
    pair.target.model.set_dtype(mx.float32)
    pair.drafter.set_dtype(mx.float32)
    assert isinstance(pair.drafter, DFlash2Drafter)
    compared = []
    for text in [json.loads(l)["prompt"] for l in HELDOUT.read_text().splitlines()][3:6]:
        compared += full_cycles_match_zlab(pair, trained_dflash2, demo_target, pair.tokenizer.encode(text), 16)
    assert len(compared) >= 6 and sum(compared) / len(compared) > 2.5  # drafts mostly accepted


@pytest.mark.parametrize("over, words", [
    (dict(vocab_size=999), "vocabulary"),
    (dict(hidden_size=32, head_dim=8), "hidden size"),
    ({"dflash_config": dict(target_layer_ids=[1, 6])}, "taps target layer"),
])
def test_a_dflash2_drafter_for_another_target_is_refused(tmp_path, targets, vocab, over, words):
    import dflash_mlx
    from dflash_mlx.errors import DFlashError

    cfg = dflash2_config()
    cfg.update({"vocab_size": vocab[0], **{k: v for k, v in over.items() if k != "dflash_config"}})
    cfg["dflash_config"].update(mask_token_id=vocab[1], **over.get("dflash_config", {}))
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DFlashError) as e:
        dflash_mlx.load(str(targets["qwen3"]), str(tmp_path))
    assert words in str(e.value) and "\n" not in str(e.value)
