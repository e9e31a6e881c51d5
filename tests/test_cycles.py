"""The loop's seams: each cycle kind settles to what decoding its committed
tokens alone leaves, and a policy that keeps the `Policy` / `Run` protocol
drives the loop through every kind of plan, losslessly."""

import mlx.core as mx
import pytest
from conftest import greedy_ref
from test_lossless import PROMPTS
from test_tree import ForkOracle, fork_logits

import dflash_mlx
from dflash_mlx.decode.cycle import Block, LinearCycle, PlainStep, Rows, TreeCycle
from dflash_mlx.decode.passes import draft_tree
from dflash_mlx.decode.sequence import SequenceState
from dflash_mlx.draft.source import DraftSource
from dflash_mlx.policy.plan import PLAIN, Outcome, Plan, Run

W = 6


def after(target, seq, m, out: Outcome, cache):
    """The caches and taps a settled cycle left equal one pass over the committed tokens."""
    n = m + out.accepted + 1
    assert out.tokens == seq[m + 1 : n + 1]
    ref_cache = target.make_cache()
    _, ref_taps = target(mx.array([seq[:n]]), ref_cache)
    for c, r in zip(cache, ref_cache):
        assert c.offset == r.offset == n
    hidden = out.hidden if not isinstance(out.hidden, tuple) else mx.concatenate(out.hidden, axis=-1)
    assert mx.allclose(hidden, ref_taps[:, m:], atol=1e-4).item()
    nxt = mx.array([[out.tokens[-1]]])
    assert mx.allclose(target(nxt, cache)[0], target(nxt, ref_cache)[0], atol=1e-4).item()


@pytest.mark.parametrize("family", ["qwen3", "llama"])
@pytest.mark.parametrize("kind", ["plain", "linear", "linear-rejected", "tree"])
def test_a_settled_cycle_leaves_what_its_committed_tokens_alone_would(pairs, baselines, family, kind):
    pair = pairs[family]
    target = pair.target
    prompt = pair.tokenizer.encode(PROMPTS[1])
    m = len(prompt)
    seq = prompt + greedy_ref(baselines[family], prompt, 16)
    cache = target.make_cache()
    target(mx.array([seq[:m]]), cache)
    last = mx.array(seq[m : m + 1], dtype=mx.uint32)
    rows = Rows(target, cache, [SequenceState(source=None, dstate=None)])
    if kind == "plain":
        cycle = PlainStep(rows, last)
    elif kind.startswith("linear"):
        drafts = list(seq[m + 1 : m + W])
        if kind == "linear-rejected":
            drafts[2] = (drafts[2] + 1) % target.vocab_size  # the third draft is wrong
        cycle = LinearCycle(rows, Block(last, mx.array([drafts], dtype=mx.uint32), [None], [None]))
    else:
        class Forked(DraftSource):
            def propose(self, state, last, hidden, width):
                return fork_logits(seq[m + 1 : m + width], 2, target.vocab_size)

        cycle = TreeCycle(rows, draft_tree(Forked(), None, last, None, W, 1))
    out = cycle.settle()[0]
    cycle.cut([out.accepted + 1])
    assert out.accepted == {"plain": 0, "linear": W - 1, "linear-rejected": 2}.get(kind, out.accepted)
    if kind == "tree":
        assert out.branched and out.accepted >= 2
    after(target, seq, m, out, cache)


class Scripted:
    """A policy keeping the protocol (`policy.plan.Policy`, its run `Run`): each
    request's run plays `plans` in turn and records every outcome it is told."""

    default_branches = 2

    def __init__(self, plans):
        self.plans = plans

    def start(self, branches: int = 0) -> Run:
        return ScriptedRun(self.plans)


class ScriptedRun:
    learns_branches = True

    def __init__(self, plans):
        self.plans, self.told = plans, []

    def choose(self, context, offer=(), unseen=0, left=0):
        return self.plans[len(self.told) % len(self.plans)]

    def update(self, plan, outcome):
        self.told.append((plan, outcome))

    def lookup_pays(self, context):
        return True

    def drafter_pays(self, first, last):
        return True


class Offering(ForkOracle):
    """`ForkOracle` plus a lookup that offers the true continuation, wrong at its
    third token every other cycle."""

    def new_state(self):
        return {**super().new_state(), "committed": 0}

    def commit(self, state, tokens):
        state["committed"] += len(tokens)

    def offer(self, state, limit):
        out = list(self.seq[state["committed"] : state["committed"] + limit])
        if state["committed"] % 2 and len(out) > 2:
            out[2] = (out[2] + 1) % self.vocab_size or 2  # never EOS
        return out

    def may_offer(self, state):
        return True


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_a_protocol_policy_drives_plain_drafted_lookup_and_tree_cycles_losslessly(pairs, baselines, family):
    """Plans of every kind in turn (plain, drafted, tree, the lookup's copies
    with and without the drafter's), on a drafter right but at one depth of
    each cycle (its second choice right there): the output is the target's own."""
    pair = pairs[family]
    prompt = pair.tokenizer.encode(PROMPTS[2])
    seq = prompt + greedy_ref(baselines[family], prompt, 48)
    source = Offering(pair.target, seq + [1] * 16, lambda cycle, width: 1 + cycle % (width - 1))
    plans = [PLAIN, Plan(W), Plan(W, 0, 2), Plan(W, 3), Plan(4), PLAIN, Plan(W, 0, 1), Plan(W, W - 1)]
    policy = Scripted(plans)
    runs = []
    start = policy.start
    policy.start = lambda **kw: runs.append(start(**kw)) or runs[-1]
    events = list(dflash_mlx.stream_generate(pair, prompt, max_tokens=40, block_size=policy, draft_source=source,
                                             tree=2))
    assert [t for ev in events for t in ev.tokens] == seq[len(prompt) : len(prompt) + 40]
    told = runs[0].told
    kinds = {(p.width > 1, p.branches > 0, p.copied > 0, p.drafts) for p, _ in told}
    # plain, drafted, tree, the lookup's copies then the drafter's, the lookup's alone
    assert kinds == {(False, False, False, False), (True, False, False, True), (True, True, False, True),
                     (True, False, True, True), (True, False, True, False)}
    assert all(o.tokens and len(o.tokens) == o.accepted + 1 for _, o in told)
    assert any(o.branched for p, o in told if p.branches) and any(o.missed for p, o in told if p.width > 1)
