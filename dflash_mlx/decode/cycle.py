"""One cycle of the loop as an object: made, it is launched on the device
(`mx.async_eval`); `settle()` makes its one host synchronisation, cuts the
caches to what it committed and returns an `Outcome`.

Three kinds: a `PlainStep` (width 1, mlx-lm's step), a `LinearCycle` (a
`Draft` of width - 1 tokens and the verify pass over them) and a `TreeCycle`
(the drafter's best path and its branches in one verify pass, greedy). A
cycle does not care where its proposal came from (the drafter, the lookup's
copies or both); which cycle runs is the policy's plan (`policy`).
"""

from dataclasses import dataclass
from typing import Any, List, Optional

import mlx.core as mx

from ..draft import tree as trees
from ..policy.plan import Outcome
from .passes import Draft, TreeVerified, logprob_rows, step, verify, verify_tree
from .sequence import SequenceState


@dataclass(kw_only=True)
class Decoding(SequenceState):
    """A request alone: its sequence, and the target and caches every cycle works on."""

    target: Any  # the adapter's target
    tcache: list  # the target's caches
    tapped: bool = True  # plain steps compute taps: the request keeps the drafter's context


class PlainStep:
    """Width 1: one plain decoding step. Its `token` is on the device before the
    host reads it, so the next step can be launched first, as mlx-lm's
    `generate_step` does."""

    def __init__(self, d: Decoding, last: mx.array):
        self.pending = step(d.target, d.tcache, last, d.params, top=d.top, proc=d.proc, taps=d.tapped,
                            noise=d.noise(1))
        mx.async_eval(self.pending)
        d.drawn(self.pending.token, 1)
        self.token = self.pending.token

    def settle(self, also: tuple = ()) -> Outcome:
        token, hidden, lps = self.pending
        if lps is not None:
            mx.eval(token, lps)
            lps = logprob_rows(lps, 1)
        return Outcome(0, [token.item()], token, hidden, lps)  # the cycle's one host synchronisation


class LinearCycle:
    """A draft and one verify pass over [last, draft]: the longest agreeing
    prefix (greedy) or the rejection sampler's (sampling) and one token of the
    target's own. With `keep`, the block's logits stay for the proposal scales."""

    def __init__(self, d: Decoding, last: mx.array, proposal: Draft, width: int, keep: bool = False,
                 noise: Optional[mx.array] = None):
        """`noise`: with a seeded request's draws, the rows [width, V] the proposal was drawn with."""
        self.d, self.width, self.dtype = d, width, last.dtype
        self.verified = verify(d.target, d.tcache, last, proposal.tokens, proposal.q_lp, d.params, top=d.top,
                               proc=d.proc, keep=keep, noise=noise)._replace(alternatives=proposal.alternatives)
        mx.async_eval(self.verified)

    def settle(self, also: tuple = ()) -> Outcome:
        """`also`: lazy arrays to evaluate in the same synchronisation."""
        v = self.verified
        n, dt = v.drafts.shape[0], v.drafts.dtype
        out = mx.concatenate([v.accepted.reshape(1).astype(dt), v.drafts, v.token.reshape(1).astype(dt)]
                             + ([] if v.alternatives is None else [v.alternatives.reshape(-1).astype(dt)]))
        mx.eval(out, v.logprobs, *also)  # the cycle's one host synchronisation
        values = out.tolist()
        accepted = values[0]
        tokens = values[1 : 1 + accepted] + [values[n + 1]]
        missed = None
        if v.alternatives is not None and accepted < n:
            missed = trees.missed(values[n + 2 :], v.alternatives.shape[1], accepted + 1, tokens[-1])
        self.d.drawn(mx.array(tokens), len(tokens))
        self.cut(accepted)
        hidden = v.hidden if v.hidden.shape[1] == accepted + 1 else v.hidden[:, : accepted + 1]
        return Outcome(accepted, tokens, v.token.reshape(1).astype(self.dtype), hidden,
                       v.logprobs and logprob_rows(v.logprobs, accepted + 1), missed)

    def cut(self, accepted: int) -> None:
        """The caches keep [last, accepted drafts] of the block (no copy)."""
        self.d.target.crop(self.d.tcache, accepted + 1, self.width)


class TreeCycle:
    """The drafter's best path and its branches (`draft/tree.py`) in one verify pass,
    greedy; the walk keeps the longest path the target agrees with, and the
    caches keep that path's rows."""

    def __init__(self, d: Decoding, last: mx.array, tree: trees.Tree):
        self.d, self.dtype = d, last.dtype
        self.verified = verify_tree(d.target, d.tcache, tree, d.top)
        mx.async_eval(self.verified)

    def path(self, values: List[int]):
        """The accepted path's nodes and the target's token after it."""
        t = self.verified.tree
        N, B, W = t.size, t.branches, t.width
        return trees.walk(W, t.length, values[2 * N : 2 * N + B], values[:N], values[N : 2 * N])

    def cut(self, path: List[int]) -> None:
        """The caches keep the path's rows, moved to the front of the pass's."""
        self.d.target.keep_rows(self.d.tcache, path, self.verified.tree.size)

    def settle(self, also: tuple = ()) -> Outcome:
        v: TreeVerified = self.verified
        t = v.tree
        N, B, W = t.size, t.branches, t.width
        out = mx.concatenate([t.tokens, v.picks.astype(mx.uint32), t.forks.astype(mx.uint32),
                              t.alternatives.reshape(-1)])
        mx.eval(out, v.logprobs, *also)  # the cycle's one host synchronisation
        values = out.tolist()
        path, bonus = self.path(values)
        self.cut(path)
        accepted = len(path) - 1
        hidden = mx.take(v.hidden, mx.array(path), axis=1) if path[-1] >= W else v.hidden[:, : accepted + 1]
        lps = v.logprobs and [logprob_rows(v.logprobs, N)[i] for i in path]
        held = sum(1 for i in path[1:] if i < W)  # depth the best path held to
        alts = values[2 * N + B :]
        missed = None if held == W - 1 else trees.missed(alts, len(alts) // (W - 1), held + 1, values[N + held])
        tokens = [values[i] for i in path[1:]] + [bonus]
        return Outcome(accepted, tokens, mx.array(tokens[-1]).reshape(1).astype(self.dtype), hidden, lps, missed,
                       branched=path[-1] >= W)
