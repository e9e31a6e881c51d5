"""Tree verification (greedy): lossless output, the accepted branch's cache rows
kept and the others dropped, the tree's mask and RoPE positions, and linear
verification where a tree cannot run."""

import mlx.core as mx
import pytest
from conftest import greedy_ref, plain_greedy
from test_lossless import PROMPTS

import dflash_mlx
from dflash_mlx.draft import tree as trees
from dflash_mlx.decode.cycle import Rows, TreeCycle
from dflash_mlx.decode.sequence import SequenceState
from dflash_mlx.decode.passes import draft_tree
from dflash_mlx.decode.timing import cycle_parts
from dflash_mlx.draft.source import DraftSource
from dflash_mlx.errors import DFlashError
from dflash_mlx.policy import costs
from dflash_mlx.sampling import SamplingParams

real_tree_mask = trees.tree_mask


def tokens_of(pair, prompt, max_tokens, **kw):
    out, events = [], []
    for ev in dflash_mlx.stream_generate(pair, prompt, max_tokens=max_tokens, **kw):
        out += ev.tokens
        events.append(ev)
    return out, events[-1].stats


def fork_logits(truth, fork, V):
    """Drafter logits [W - 1, V] sure of `truth` (the drafts at depths 1..W-1)
    except at depth `fork`, where a wrong token leads and the true one is its
    second choice: the tree's one likely branch."""
    rows = mx.full((len(truth), V), -10.0)
    rows[mx.arange(len(truth)), mx.array(truth)] = 10.0
    if fork is not None:
        t = truth[fork - 1]
        rows[fork - 1, t] = 1.8
        rows[fork - 1, (t + 1) % V or 2] = 2.0
    return rows


class ForkOracle(DraftSource):
    """Drafts the target's greedy continuation `seq`, its best path wrong at the
    depth `fork(cycle, width)` (None: right everywhere) where the right token
    is the second choice. Checks at every draft that the taps it was handed
    are those of one target pass over the committed tokens."""

    def __init__(self, target, seq, fork):
        self.target, self.seq, self.fork = target, seq, fork
        self.vocab_size = target.vocab_size
        self.forks = []

    def new_state(self):
        return {"taps": [], "cycle": 0}

    def add_context(self, state, hidden):
        state["taps"].append(hidden)

    def propose(self, state, last, hidden, width):
        if hidden is not None:
            self.add_context(state, hidden)
        got = mx.concatenate(state["taps"], axis=1)
        P = got.shape[1]
        assert last.item() == self.seq[P]
        _, want = self.target(mx.array([self.seq[:P]]), self.target.make_cache())
        assert mx.allclose(got, want, atol=1e-4).item(), P
        truth = list(self.seq[P + 1 : P + width])
        truth += [1] * (width - 1 - len(truth))
        fork = self.fork(state["cycle"], width)
        state["cycle"] += 1
        self.forks.append(fork)
        return fork_logits(truth, fork, self.vocab_size)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_tree_is_lossless_with_the_random_drafter(pairs, baselines, family):
    pair = pairs[family]
    assert pair.target.supports_tree
    for text in PROMPTS[:2]:
        prompt = pair.tokenizer.encode(text)
        ref = greedy_ref(baselines[family], prompt, 32)
        for block_size, tree in [(2, 1), (3, 3), (4, 2), (8, 3), (16, 1)]:
            out, stats = tokens_of(pair, prompt, 32, block_size=block_size, tree=tree)
            assert out == ref, (family, text, block_size, tree)
            assert stats.tree_cycles == stats.draft_cycles > 0


@pytest.mark.parametrize("family", ["qwen3", "llama"])
@pytest.mark.parametrize("tree", [1, 3])
def test_branch_accepted_at_every_fork_keeps_only_its_rows(pairs, baselines, family, tree):
    """One cycle whose accepted path leaves the best path at each depth in turn:
    the caches then hold exactly what decoding the accepted tokens alone
    leaves (same rows, offset, and next step), and the taps handed on are
    that pass's."""
    pair = pairs[family]
    target = pair.target
    prompt = pair.tokenizer.encode(PROMPTS[2])
    m, W = len(prompt), 8
    seq = prompt + greedy_ref(baselines[family], prompt, 24)
    L = trees.shape(W, tree, target.vocab_size)[1]

    class Forked(DraftSource):
        def propose(self, state, last, hidden, width):
            return fork_logits(seq[m + 1 : m + width], fork, target.vocab_size)

    for fork in range(1, W):
        cache = target.make_cache()
        target(mx.array([seq[:m]]), cache)
        last = mx.array(seq[m : m + 1])
        rows = Rows(target, cache, [SequenceState(source=Forked(), dstate=None)])
        cycle = TreeCycle(rows, draft_tree(Forked(), None, last, None, W, tree))
        out = cycle.settle()[0]
        cycle.cut([out.accepted + 1])
        accepted, tokens, hidden, branched, missed = out.accepted, out.tokens, out.hidden, out.branched, out.missed
        assert branched and accepted == min(fork + L - 1, W - 1), fork
        assert missed == (fork, 2)  # for the sizer: the best path failed there, the 2nd choice was right
        assert tokens == seq[m + 1 : m + accepted + 2]
        ref_cache = target.make_cache()
        _, ref_taps = target(mx.array([seq[: m + accepted + 1]]), ref_cache)
        for c, r in zip(cache, ref_cache):
            assert c.offset == r.offset == m + accepted + 1
            for a, b in ((c.keys, r.keys), (c.values, r.values)):
                assert mx.allclose(a[..., : c.offset, :], b[..., : r.offset, :], atol=1e-4).item(), fork
        assert mx.allclose(hidden[:, : accepted + 1], ref_taps[:, m:], atol=1e-4).item(), fork
        # The dropped rows are gone: the next step sees exactly the accepted context.
        nxt = mx.array([[tokens[-1]]])
        got, ref = target(nxt, cache)[0], target(nxt, ref_cache)[0]
        assert mx.allclose(got, ref, atol=1e-4).item(), fork


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_branches_through_the_loop_are_lossless(pairs, baselines, family):
    """The loop with a drafter wrong at a cycling depth (the right token its
    second choice): every such cycle accepts through a branch, the output is
    plain greedy and the drafter is handed exactly the committed tokens' taps."""
    pair = pairs[family]
    prompt = pair.tokenizer.encode(PROMPTS[0])
    n, W = 40, 6
    ref = greedy_ref(baselines[family], prompt, n)
    source = ForkOracle(pair.target, prompt + ref, lambda c, w: 1 + c % (w - 1) if c % W else None)
    out, stats = tokens_of(pair, prompt, n, block_size=W, tree=2, draft_source=source)
    assert out == ref
    drafted = source.forks[: stats.tree_cycles]
    assert stats.branch_cycles == sum(f is not None for f in drafted) >= 4
    assert set(f for f in drafted if f) == set(range(1, W))


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_auto_verifies_trees_where_they_pay(pairs, baselines, family, monkeypatch):
    """`auto` on a curve where extra verify rows are nearly free, with a drafter
    whose best guess fails at depth 2 where its second choice is right: the
    sizer, allowed 2 branches, learns that from its linear cycles (the
    drafter's alternatives come with each cycle's tokens) and verifies trees,
    losslessly. Unset, `tree` is as many branches as the curve timed: trees
    whose timings say they pay are verified, costly ones are not, and a curve
    that timed none weighs none. `tree=0` keeps it linear; a hybrid target
    (Gated DeltaNet) always verifies linearly."""
    from test_adaptive import cycle_curve, timed_trees

    from dflash_mlx.policy.sizer import BlockSizer

    pair = pairs[family]
    prompt = pair.tokenizer.encode(PROMPTS[0])
    n, W = 40, 16
    ref = greedy_ref(baselines[family], prompt, n)
    flat = [1.0 + 0.01 * (w - 1) for w in range(1, W + 1)]
    curves = {"untimed": cycle_curve([flat]), "cheap": timed_trees(flat, lambda w, b: 0.0),
              "costly": timed_trees(flat, lambda w, b: 10.0)}  # no tree commits enough to pay for that
    runs = {}
    for name, tree in (("untimed", 2), ("untimed", 0), ("untimed", None), ("cheap", None), ("costly", None)):
        monkeypatch.setattr(pair.learned, "greedy", BlockSizer(curves[name], W))
        source = ForkOracle(pair.target, prompt + ref, lambda c, w: min(2, w - 1))
        source.block_size = W
        out, stats = tokens_of(pair, prompt, n, block_size="auto", draft_source=source, tree=tree)
        assert out == ref, (name, tree)
        runs[name, tree] = stats
    if family == "qwen3":
        for key in (("untimed", 2), ("cheap", None)):
            assert runs[key].branch_cycles > 0 and runs[key].branch_cycles == runs[key].tree_cycles, key
            assert runs[key].cycles < runs["untimed", 0].cycles  # each tree cycle commits past the failed guess
    else:
        assert runs["untimed", 2].tree_cycles == runs["cheap", None].tree_cycles == 0
    for key in (("untimed", 0), ("untimed", None), ("costly", None)):
        assert runs[key].tree_cycles == 0, key
        assert runs[key].draft_cycles > 0, key


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_each_node_sees_its_path_at_its_position(pairs, family, batch):
    """The tree's mask and per-run RoPE: each node's logits equal those of its
    token decoded linearly after its root-to-node path; for one sequence on its
    own caches, and for a batch of three of different lengths on a batch's
    caches (each tree its own forks, written from its sequence's own end), whose
    kept rows then decode on as the path's would."""
    from dflash_mlx.target.ragged import add_to, batch_of

    target = pairs[family].target
    prompts = [pairs[family].tokenizer.encode(PROMPTS[i]) for i in (2, 0, 1)[:batch]]
    W, V = 8, target.vocab_size
    logits = mx.random.normal((batch, W - 1, V), key=mx.random.key(3)) * 3
    tree = trees.build(mx.array([p[-1] for p in prompts]), logits, 3)
    own = []
    for p in prompts:
        own.append(target.make_cache())
        target(mx.array([p[:-1]]), own[-1])
    cache = own[0] if batch == 1 else [batch_of(c) for c in own[0]]
    for c in own[1:]:
        for layer, one in zip(cache, c):
            add_to(layer, one)
    got = target(tree.tokens, cache, tree=(tree.mask, tree.runs()))[0]
    L = tree.length
    assert tree.size == W + 3 * L and target.can_verify_tree(cache)
    kept = []
    for b, prompt in enumerate(prompts):
        tokens, forks = tree.tokens[b].tolist(), tree.forks[b].tolist()
        assert len(set(forks)) > 1
        paths = [list(range(W))] + [list(range(j)) + list(range(W + i * L, W + (i + 1) * L))
                                    for i, j in enumerate(forks)]
        for path in paths:
            ref_cache = target.make_cache()
            target(mx.array([prompt[:-1]]), ref_cache)
            want = target(mx.array([[tokens[i] for i in path]]), ref_cache)[0][0]
            assert mx.allclose(got[b][mx.array(path)], want, atol=1e-4).item(), (b, path)
            if mx.default_device() == mx.cpu:
                # Bit for bit here (MLX's CPU kernels sum each element in an order that does
                # not depend on where the masked-out keys are): greedy picks cannot differ
                # even at near ties. A backend where this fails can differ at near ties.
                assert mx.array_equal(got[b][mx.array(path)], want).item(), (b, path)
        kept.append(paths[1 + b % 3][:-1])  # a branch's path, less its last node
    if batch == 1:
        target.keep_rows(cache, kept[0], tree.size)
    else:
        target.keep_rows_each(cache, kept, tree.size)
    # The kept rows are the caches of each sequence's prompt and its path: the next token decodes alike.
    nxt = mx.array([[7]] * batch)
    got = target(nxt, cache)[0][:, -1]
    for b, (prompt, path) in enumerate(zip(prompts, kept)):
        ref_cache = target.make_cache()
        target(mx.array([prompt[:-1] + [tree.tokens[b].tolist()[i] for i in path]]), ref_cache)
        assert mx.allclose(got[b], target(nxt[:1], ref_cache)[0][0, -1], atol=1e-4).item(), b


def test_tree_layout_and_walk():
    forks = mx.array([[2, 1]], mx.int32)
    mask = trees.tree_mask(forks, 4, 2)[0].tolist()
    # Nodes: root 0, best path 1 2 3; branch 0 (depths 2, 3): 4 5; branch 1 (depths 1, 2): 6 7.
    sees = [[j for j, m in enumerate(row) if m] for row in mask]
    assert sees == [[0], [0, 1], [0, 1, 2], [0, 1, 2, 3], [0, 1, 4], [0, 1, 4, 5], [0, 6], [0, 6, 7]]
    tokens = [9, 10, 11, 12, 21, 22, 31, 32]
    # picks[i]: the target's token after node i
    assert trees.walk(4, 2, [2, 1], tokens, [10, 21, 0, 0, 22, 7, 0, 0]) == ([0, 1, 4, 5], 7)
    assert trees.walk(4, 2, [2, 1], tokens, [31, 0, 0, 0, 0, 0, 32, 5]) == ([0, 6, 7], 5)
    assert trees.walk(4, 2, [2, 1], tokens, [10, 11, 12, 8, 0, 0, 0, 0]) == ([0, 1, 2, 3], 8)
    assert trees.walk(4, 2, [2, 1], tokens, [5, 0, 0, 0, 0, 0, 0, 0]) == ([0], 5)
    # A branch node deeper than the best path is never accepted.
    assert trees.walk(3, 2, [2], [9, 10, 11, 21, 22], [10, 21, 0, 22, 0]) == ([0, 1, 3], 22)


@pytest.mark.parametrize("family", ["qwen3_5", "gpt_oss"])
def test_hybrid_and_sliding_window_targets_verify_linearly(pairs, baselines, root, tokenizer_dir, vocab, drafters,
                                                           family):
    """Gated DeltaNet and sliding-window targets cannot run a tree: tree=n
    verifies linearly and stays lossless."""
    import tiny
    from mlx_lm import load

    if family in pairs:
        pair, base = pairs[family], baselines[family]
    else:
        path = tiny.build_target(root / f"tree-{family}", family, tokenizer_dir, vocab[0])
        pair, base = dflash_mlx.load(str(path), str(drafters["new"])), load(str(path))[0]
    assert not pair.target.supports_tree
    prompt = pair.tokenizer.encode(PROMPTS[0])
    out, stats = tokens_of(pair, prompt, 24, block_size=4, tree=2)
    assert out == plain_greedy(base, prompt, 24)
    assert stats.tree_cycles == 0 and stats.draft_cycles > 0


def test_where_a_tree_is_refused_or_left_out(pairs, baselines):
    from mlx_lm.models.cache import KVCache, QuantizedKVCache
    from mlx_lm.sample_utils import make_logits_processors

    pair = pairs["qwen3"]
    prompt = pair.tokenizer.encode(PROMPTS[1])
    with pytest.raises(DFlashError, match="greedy only"):
        tokens_of(pair, prompt, 4, block_size=4, tree=1, sampling=SamplingParams(temp=0.7))
    with pytest.raises(DFlashError, match="branches"):
        tokens_of(pair, prompt, 4, block_size=4, tree=-1)
    assert pair.target.can_verify_tree([KVCache()]) and not pair.target.can_verify_tree([QuantizedKVCache()])
    # Logits processors see each position after the drafts before it: linear verification.
    procs = make_logits_processors(repetition_penalty=1.3)
    out, stats = tokens_of(pair, prompt, 16, block_size=4, tree=2, logits_processors=procs)
    assert stats.tree_cycles == 0
    assert out == tokens_of(pair, prompt, 16, block_size=4, logits_processors=procs)[0]


def test_tree_logprobs_are_those_of_linear_verification(pairs):
    pair = pairs["llama"]
    prompt = pair.tokenizer.encode(PROMPTS[0])
    runs = [list(dflash_mlx.stream_generate(pair, prompt, max_tokens=20, block_size=4, tree=t, logprobs=3))
            for t in (0, 2)]
    lin, tree = ([lp for e in r for lp in e.logprobs] for r in runs)
    assert len(lin) == len(tree) == 20
    for (a, top_a), (b, top_b) in zip(lin, tree):
        assert abs(a - b) < 1e-4 and [t for t, _ in top_a] == [t for t, _ in top_b]


def test_cycle_parts_time_trees(pairs):
    """The cost measurement's halves of a tree cycle (for a sizer): a tree of
    the width's shape is drafted and verified as the loop's `accept_tree` does,
    through a branch whose rows are moved into place, and each call starts
    again: the target's caches and the drafter's context are left as they were
    found, for trees and linear cycles alike."""
    pair = pairs["qwen3"]
    target = pair.target
    moved, real_keep = [], target.keep_rows

    def watched(cache, rows, width):
        moved.append((cache, list(rows)))
        return real_keep(cache, rows, width)

    target.keep_rows = watched
    try:
        run_draft, run_verify, _ = cycle_parts(pair, 40)
        linear = {w: run_draft(w) for w in (4, 6)}
        run_verify(6, run_draft(6, 2))
        cache = moved[0][0]
        kept = [(c.offset, mx.array(c.keys[..., : c.offset, :]), mx.array(c.values[..., : c.offset, :]))
                for c in cache]
        for w, b in ((6, 2), (4, 1), (0, 0), (3, 2)):
            if w == 0:
                run_verify(4, run_draft(4))
                continue
            tree = run_draft(w, b)
            B, L = trees.shape(w, b, target.vocab_size)
            assert tree.size == w + B * L and tree.branches == b
            run_verify(w, tree)
            assert moved[-1][1][-1] >= w  # through a branch
        for lw, tokens in linear.items():
            assert mx.array_equal(run_draft(lw), tokens)  # the drafter's context as it was
        for c, (offset, keys, values) in zip(cache, kept):
            assert c.offset == offset
            assert mx.array_equal(c.keys[..., :offset, :], keys) and mx.array_equal(c.values[..., :offset, :], values)
        by_default, _, _ = cycle_parts(pair, 40, branches=2)
        assert by_default(6).branches == 2 and by_default(6, 0).ndim == 1  # a linear draft when asked
    finally:
        target.keep_rows = real_keep


def test_tree_with_the_prompt_cache(pairs, baselines):
    """A request ending with a tree pass in flight leaves the prompt cache what
    a linear one leaves: the next turn, warm, is still plain greedy."""
    pair = pairs["qwen3"]
    cache = dflash_mlx.PromptCache(pair)
    history = pair.tokenizer.encode(PROMPTS[0])
    reused = 0
    for turn in range(2):
        out, stats = tokens_of(pair, history, 12, block_size=4, tree=2, prompt_cache=cache)
        assert out == plain_greedy(baselines["qwen3"], history, 12), turn
        assert stats.tree_cycles > 0 and stats.cached_tokens >= reused, turn
        reused = len(history) + len(out) - 1  # the answer's rows, kept from tree passes, are reused
        history = history + out + pair.tokenizer.encode(" and")


def test_generate_takes_tree_from_the_command_line(targets, drafters, baselines):
    from typer.testing import CliRunner

    from conftest import DRAFTER_LAYOUT
    from dflash_mlx.cli.main import app

    args = ["generate", "--model", str(targets["qwen3"]), "--draft", str(drafters[DRAFTER_LAYOUT["qwen3"]]),
            "--prompt", PROMPTS[0], "--max-tokens", "24", "--no-chat-template"]
    tree = CliRunner().invoke(app, args + ["--block-size", "8", "--tree", "2"])
    linear = CliRunner().invoke(app, args + ["--block-size", "8"])
    assert tree.exit_code == 0 and linear.exit_code == 0, tree.output + linear.output
    assert tree.stdout == linear.stdout and "tree cycles" in tree.output  # same text, verified as trees
    refused = CliRunner().invoke(app, args + ["--block-size", "8", "--tree", "2", "--temp", "0.7"])
    assert refused.exit_code == 1 and "greedy only" in refused.output


@pytest.mark.parametrize("dtype, V", [(mx.float32, 50), (mx.bfloat16, 200), (mx.float32, 2)])
def test_alternatives_are_the_drafters_second_and_third_choices(dtype, V):
    """What the sizer learns from (fetched with every drafted cycle that weighs trees):
    each row's 2nd and 3rd most likely tokens, in that order (one with a 2-token vocabulary)."""
    ranks = mx.argsort(mx.random.uniform(shape=(7, V), key=mx.random.key(V)), axis=-1)  # no ties, exact in bfloat16
    logits = (ranks.astype(mx.float32) - V / 2).astype(dtype)
    got = trees.alternatives(logits)
    order = mx.argsort(-logits.astype(mx.float32), axis=-1)
    assert got.dtype == mx.uint32 and got.shape == (7, min(2, V - 1))
    assert mx.array_equal(got, order[:, 1 : 1 + got.shape[1]].astype(mx.uint32))


@pytest.mark.parametrize("variant", ["float32", "bfloat16", "4bit"])
def test_tree_self_check_passes_where_tree_passes_are_exact(zoo, variant):
    """The backend check a tree pass must pass before it verifies anything: every
    node's logits are its path's, decoded linearly (here: qwen3 in each dtype)."""
    assert trees.self_check(zoo.pair("qwen3", variant).target) is None


def test_a_tree_pass_that_fails_its_self_check_is_never_used(pairs, baselines, monkeypatch, caplog, tmp_path):
    """Where a tree pass is not exact on the backend (here: a mask that lets every
    node see every other), trees are off: one warning, an explicit `tree=2`
    verifies linearly and stays lossless, and the cost curve times no trees, so
    `auto` weighs none. Trees are an optimisation: a failure is never fatal."""
    import logging
    import weakref

    pair = pairs["qwen3"]
    prompt = pair.tokenizer.encode(PROMPTS[0])
    ref = greedy_ref(baselines["qwen3"], prompt, 24)
    assert trees.self_check(pair.target) is None
    monkeypatch.setattr(trees, "_verdicts", weakref.WeakKeyDictionary())  # the other tests' verdicts stay
    monkeypatch.setattr(trees, "tree_mask", lambda forks, W, L: mx.ones((forks.shape[0],) + (W + forks.shape[1] * L,) * 2, mx.bool_))
    assert "differ" in trees.self_check(pair.target)
    with caplog.at_level(logging.WARNING, logger="dflash_mlx"):
        out, stats = tokens_of(pair, prompt, 24, block_size=8, tree=2)
        tokens_of(pair, prompt, 8, block_size=8, tree=2)
    assert out == ref and stats.tree_cycles == 0 and stats.draft_cycles > 0
    assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1
    assert "tree verification disabled" in caplog.records[0].message
    monkeypatch.setenv("DFLASH_MLX_CACHE", str(tmp_path))
    curve = pair.cost_curve(budget=0.5)
    assert curve.tree is None and curve.tree_branches == 0
    monkeypatch.setattr(trees, "tree_mask", real_tree_mask)
    monkeypatch.setattr(trees, "_verdicts", weakref.WeakKeyDictionary())
    monkeypatch.setenv("DFLASH_MLX_CACHE", str(tmp_path / "healthy"))
    curve = pair.cost_curve(budget=0.5)
    assert curve.tree_shapes == costs.tree_shapes(pair.draft_source.block_size) and curve.tree_branches == 2


@pytest.mark.parametrize("family", ["qwen3", "llama"])
@pytest.mark.parametrize("part_rows", [None, 0, 6])
def test_trees_in_a_batch_are_lossless_and_keep_each_sequences_branch(pairs, baselines, monkeypatch, family,
                                                                      part_rows):
    """Three sequences decoded together, each drafting with a drafter wrong at its own cycling depth
    (the right token its second choice): each batched drafted cycle verifies the three trees in one
    pass, each sequence accepts through its own branch and keeps its own path's rows, its drafter
    is handed exactly its committed tokens' taps, and every output is plain greedy. So in each
    layout: one padded array (None), each sequence apart (0), a group beside one apart (6)."""
    from dflash_mlx.decode import caches
    from dflash_mlx.decode.decoder import Asks, Decoder

    if part_rows is not None:
        monkeypatch.setattr(caches, "PART_ROWS", part_rows)
        monkeypatch.setattr(caches, "REGROUP_ROWS", 0)

    pair = pairs[family]
    prompts = [pair.tokenizer.encode(PROMPTS[i]) for i in (0, 2, 1)]  # a group of the first and last
    n, W = 30, 6
    refs = [greedy_ref(baselines[family], p, n) for p in prompts]
    sources = [ForkOracle(pair.target, p + r, lambda c, w, k=k: 1 + (c + k) % (w - 1) if (c + k) % W else None)
               for k, (p, r) in enumerate(zip(prompts, refs))]
    dec = Decoder(pair, W, block_size=W)
    firsts = dec.add_many(prompts, [n] * 3, sources, [Asks(tree=2)] * 3)
    out = {c.uid: list(c.tokens) for c in firsts}
    assert [s.branches for s in dec.seqs] == [2, 2, 2]
    if part_rows is not None:
        assert dec.caches.groups() == ([[0], [1], [2]] if part_rows == 0 else [[0, 2], [1]]), dec.caches.lengths()
    together, branched = 0, set()
    while len(dec):
        got = dec.step(W, branches=2)
        for c in got:
            out[c.uid] += c.tokens
            if len(got) > 1:
                together += c.plan.branches == 2
                if c.branched:
                    branched.add(c.uid)
    assert [out[c.uid] for c in firsts] == refs
    assert together >= 3 * 4 and branched == {c.uid for c in firsts}


def test_a_lone_tree_request_joined_by_another_goes_on_in_a_batch_of_trees(pairs, baselines, monkeypatch):
    """Through the streams: a request verifying trees alone (`tree=2`, a fixed size) is joined by
    another that allows trees, its prompt prefilled a chunk per cycle; every drafted cycle,
    those carrying its chunks too, verifies trees, together in one pass once it has joined, and
    each gets plain greedy text."""
    from dflash_mlx.decode.decoder import Asks
    from dflash_mlx.decode.streams import Joining, Streams
    from dflash_mlx.policy import join
    from dflash_mlx.policy.batch import FixedBatchWidth

    for name in ("FIRST_CHUNK", "MIN_CHUNK", "MAX_CHUNK"):
        monkeypatch.setattr(join, name, 16)
    pair = pairs["qwen3"]
    prompts = [pair.tokenizer.encode(PROMPTS[0]), pair.tokenizer.encode(" ".join(PROMPTS) * 2)]
    refs = [greedy_ref(baselines["qwen3"], p, 24) for p in prompts]
    streams = Streams(pair, 4, FixedBatchWidth(4), block_size=4)
    uid, first = streams.add(Joining(prompts[0], 24, asks=Asks(tree=2)))
    out = {uid: list(first.tokens)}
    for u, ev in streams.step():
        out[u] += ev.tokens
    (uid2, first2), = streams.add_many([Joining(prompts[1], 24, asks=Asks(tree=2))])
    assert first2 is None  # its prompt is prefilled a chunk per step
    out[uid2] = []
    stats = {}
    while len(streams):
        for u, ev in streams.step():
            out[u] += ev.tokens
            stats[u] = ev.stats
    assert [out[uid], out[uid2]] == refs
    assert all(s.tree_cycles == s.draft_cycles > 0 for s in stats.values())


def test_a_batch_verifies_trees_where_they_commit_more_per_second():
    """Where the batch's measured widths say its rows are nearly free, a width's trees are tried
    once its linear cycle has been, then the faster of the two runs and the other is retried
    rarely; where rows cost (the extra rows' share of the cycle above `TREE_GAIN`), no tree is
    tried. Per batch size and width."""
    from dflash_mlx.policy.batch import TREE_RETRY, TRIES, BatchWidths, FixedBatchWidth

    p = BatchWidths(8)
    speed = {0: 10.0, 2: 14.0}

    def run(batch, width, cycles, seconds=1.0):
        chosen = []
        for _ in range(cycles):
            p.cycle += 1
            k = p.branches(batch, width, 2)
            chosen.append(k)
            p.update(batch, width, seconds, speed[k], k)
        return chosen

    assert p.branches(2, 1, 2) == 0 and p.branches(2, 4, 0) == 0  # plain steps, sequences without trees
    for _ in range(TRIES):
        p.update(2, 2, 0.98, 8.0)  # width 2 nearly as dear as width 4: rows are nearly free
        p.update(8, 2, 0.5, 30.0)  # at 8 sequences, width 4 costs twice width 2: rows cost
    assert run(2, 4, 2 * TRIES) == [0] * TRIES + [2] * TRIES
    later = run(2, 4, 2 * TREE_RETRY)
    assert later.count(2) > 0.95 * len(later) and 0 in later  # the faster, the other retried
    speed[2] = 5.0  # trees lose after all
    later = run(2, 4, 4 * TREE_RETRY)
    assert later[-TREE_RETRY:].count(0) >= TREE_RETRY - 1
    assert run(8, 4, 4 * TRIES) == [0] * 4 * TRIES  # another batch size, whose rows cost: never tried
    assert FixedBatchWidth(4).branches(2, 4, 2) == 2 and FixedBatchWidth(4).branches(2, 1, 2) == 0
