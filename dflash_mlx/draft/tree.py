"""Tree verification (greedy): several candidate continuations in one target pass.

DFlash drafts every block position at once from the anchor, so its guess at
depth j + 1 does not depend on the token at depth j. The tree is the
drafter's best path plus a few branches, each taking the drafter's second or
third choice at one depth j and going on with the best path's tokens after
j. Branches are the (depth, choice) pairs most likely to be needed: the
drafter's probability that its best path holds up to j, times that of the
choice at j.

Several sequences' trees have one shape and are verified in one pass, a
row each. Layout of a sequence's N nodes: node 0 is the last committed token (depth 0), nodes
1 .. W-1 the best path (depth = index), then each branch as a run of
`length` nodes (depths j .. j + length - 1). Nodes deeper than W - 1 have no
draft behind them and are never accepted. The shape depends only on (W,
branches, length), so the loop builds the tree on the device without a host
read; the forks, the tokens and the mask are arrays. Within a run depth =
index - constant, so the adapter rotates each run with the model's own RoPE.

After the pass, the host walks the tree from the root, at each node taking
the child whose token is the target's greedy pick there; the K/V rows of the
accepted nodes are moved into place and the rest dropped
(`TargetAdapter.keep_rows`). Only for targets whose caches are all KV caches
(`TargetAdapter.supports_tree`); Gated DeltaNet and sliding-window targets
keep linear verification.
"""

import functools
import logging
import weakref
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx

from ..kernels.guard import failure

log = logging.getLogger("dflash_mlx")

BRANCH_LENGTH = 4  # nodes per branch: acceptance past a fork decays fast
CHOICES = 2  # the drafter's second and third choices may start a branch


@dataclass
class Tree:
    """The trees of B sequences, one per row, all of the same shape."""

    tokens: mx.array  # [B, N] node tokens, node 0 the sequence's last committed token
    forks: mx.array  # [B, branches] depth at which each branch leaves the best path
    mask: mx.array  # [B, N, N] bool: node i attends to node j (its ancestors and itself)
    width: int  # W: the best path's nodes, the root included
    length: int  # nodes per branch
    alternatives: mx.array  # [B, W - 1, CHOICES] the drafter's 2nd and 3rd choices at each depth

    @property
    def branches(self) -> int:
        return self.forks.shape[1]

    @property
    def size(self) -> int:
        return self.width + self.branches * self.length

    def runs(self) -> List[Tuple[int, int, object]]:
        """(first node, end, depth of the first node) of each run of consecutive depths; a
        branch's depth is an array [B], each sequence's own."""
        W, L = self.width, self.length
        return [(0, W, 0)] + [(W + b * L, W + (b + 1) * L, self.forks[:, b]) for b in range(self.branches)]


def shape(width: int, branches: int, vocab_size: int) -> Tuple[int, int]:
    """(branches, length) a tree of this width can have."""
    branches = min(branches, (width - 1) * min(CHOICES, vocab_size - 1))
    return branches, min(BRANCH_LENGTH, width - 1)


def ranked(logits: mx.array, k: int) -> Tuple[mx.array, mx.array]:
    """Each row's k most likely tokens [..., k], best first, and their log probabilities (lazy)."""
    lp = logits.astype(mx.float32)
    lp = lp - mx.logsumexp(lp, axis=-1, keepdims=True)
    top = mx.argpartition(-lp, k - 1, axis=-1)[..., :k]
    order = mx.argsort(-mx.take_along_axis(lp, top, axis=-1), axis=-1)
    top = mx.take_along_axis(top, order, axis=-1)
    return top, mx.take_along_axis(lp, top, axis=-1)


def alternatives(logits: mx.array) -> mx.array:
    """The drafter's 2nd and 3rd choices [n, CHOICES] at each position (fewer with a tiny vocabulary).

    Ordered by the logits themselves: only the order is needed, and a
    log-sum-exp over the vocabulary (an exp per logit) is most of `ranked`'s cost."""
    V = logits.shape[-1]
    k = min(CHOICES, V - 1) + 1
    top = mx.argpartition(logits, V - k, axis=-1)[..., V - k :]
    order = mx.argsort(-mx.take_along_axis(logits, top, axis=-1).astype(mx.float32), axis=-1)
    return mx.take_along_axis(top, order, axis=-1)[..., 1:].astype(mx.uint32)


def build(lasts: mx.array, logits: mx.array, branches: int) -> Tree:
    """The trees after `lasts` [B] from the drafter's logits [B, W - 1, V] (lazy)."""
    B, n, V = logits.shape
    W = n + 1
    K, L = shape(W, branches, V)
    k = min(CHOICES, V - 1) + 1
    top, top_lp = ranked(logits, k)
    best = top[..., 0].astype(mx.uint32)
    alts = top[..., 1:].astype(mx.uint32)
    lasts = lasts.reshape(B, 1).astype(mx.uint32)
    if K == 0:
        mask = mx.broadcast_to(mx.tril(mx.ones((W, W), dtype=mx.bool_)), (B, W, W))
        return Tree(mx.concatenate([lasts, best], axis=1), mx.zeros((B, 0), mx.int32), mask, W, L, alts)
    # log P(the best path holds before depth d) + log P(choice c at d), per (d, c).
    holds = mx.cumsum(top_lp[..., 0], axis=-1) - top_lp[..., 0]
    score = (holds[..., None] + top_lp[..., 1:]).reshape(B, -1)
    if K < score.shape[1]:
        picked = mx.argpartition(-score, K - 1, axis=-1)[:, :K]
    else:
        picked = mx.broadcast_to(mx.arange(K), (B, K))
    row, choice = picked // (k - 1), picked % (k - 1) + 1
    forks = (row + 1).astype(mx.int32)
    # Branch b: its choice at depth forks[b], then the best path's tokens after it.
    first = mx.take_along_axis(top.reshape(B, -1), row * k + choice, axis=1).astype(mx.uint32)
    after = mx.minimum(row[..., None] + mx.arange(1, L), n - 1).reshape(B, -1)
    rest = mx.take_along_axis(best, after, axis=1).reshape(B, K, L - 1)
    branch = mx.concatenate([first[..., None], rest], axis=2)
    tokens = mx.concatenate([lasts, best, branch.reshape(B, -1)], axis=1)
    return Tree(tokens, forks, tree_mask(forks, W, L), W, L, alts)


@functools.lru_cache(maxsize=64)
def _within_runs(width: int, branches: int, length: int) -> mx.array:
    """[N, N] bool: node j is node i or before it in the same run (evaluated, kept)."""
    run = mx.array([-1] * width + [b for b in range(branches) for _ in range(length)])
    pos = mx.array(list(range(width)) + list(range(length)) * branches)
    same = (run[:, None] == run[None]) & (pos[None] <= pos[:, None])
    mx.eval(same)
    return same


def tree_mask(forks: mx.array, width: int, length: int) -> mx.array:
    """[B, N, N] bool, per sequence's `forks` [B, branches]: within the best path or one branch,
    the nodes at or before a node; and for a branch node, the best path's nodes above its fork."""
    B, K = forks.shape
    same = _within_runs(width, K, length)
    limit = mx.concatenate([mx.zeros((B, width), mx.int32), mx.repeat(forks, length, axis=1)], axis=1)
    return same[None] | (mx.arange(same.shape[0])[None, None] < limit[..., None])


def walk(width: int, length: int, forks: Sequence[int], tokens: Sequence[int],
         picks: Sequence[int]) -> Tuple[List[int], int]:
    """Host side: the accepted nodes from the root (ascending), and the target's token after the last.

    `tokens` are the nodes' tokens and `picks` the target's greedy token
    after each node; a child is taken when its token is its parent's pick.
    """
    path, node = [0], 0
    while len(path) < width:
        depth, want = len(path), picks[node]
        if node < width:  # on the best path
            children = [depth] + [width + b * length for b, j in enumerate(forks) if j == depth]
        else:
            children = [node + 1] if (node - width) % length + 1 < length else []
        node = next((c for c in children if tokens[c] == want), None)
        if node is None:
            node = path[-1]
            break
        path.append(node)
    return path, picks[node]


def missed(alternatives: Sequence[int], k: int, depth: int, token: int) -> Tuple[int, int]:
    """(depth, which alternative was `token` there: 2 or 3, 0 for neither), for a
    best guess that failed at draft `depth` (1-based) where the target chose `token`;
    `alternatives` are the drafter's k alternatives per depth, row after row."""
    alts = list(alternatives[(depth - 1) * k : depth * k])
    return depth, (alts.index(token) + 2 if token in alts else 0)


# The self-check's tree: small enough to run in milliseconds at load, with a branch
# at every depth a default tree uses; fixed keys, so every run checks the same tree.
CHECK_KEYS = (7, 8)  # the random context's and the drafter logits'
CHECK_LOGIT_SCALE = 3.0  # random logits this wide give distinct best and 2nd/3rd choices
# Logits of a node and of its path decoded linearly agree to the dtype's rounding:
# relative to the largest logit, 1e-3 in float32 and 3e-2 in half precision.
CHECK_TOLERANCE = {mx.float32: 1e-3}
CHECK_TOLERANCE_HALF = 3e-2


def self_check(target, width: int = 5, branches: int = 2, context: int = 12) -> Optional[str]:
    """None where a tree pass over a small random context gives every node the
    logits of its root-to-node path decoded linearly (to the dtype's rounding);
    else what differed. Tree verification is lossless only where this holds,
    so it is checked on the backend before a tree is verified (`works`)."""
    V = target.vocab_size
    prompt = mx.random.randint(0, V, (context,), key=mx.random.key(CHECK_KEYS[0]))
    logits = mx.random.normal((width - 1, V), key=mx.random.key(CHECK_KEYS[1])) * CHECK_LOGIT_SCALE
    tree = build(prompt[-1:], logits[None], branches)
    cache = target.make_cache()
    target(prompt[None, :-1], cache, last_only=True, taps=False)
    got = target(tree.tokens, cache, tree=(tree.mask, tree.runs()), taps=False)[0][0].astype(mx.float32)
    tokens, forks, L = tree.tokens[0].tolist(), tree.forks[0].tolist(), tree.length
    paths = [list(range(width))] + [list(range(j)) + list(range(width + b * L, width + (b + 1) * L))
                                    for b, j in enumerate(forks)]
    tol = CHECK_TOLERANCE.get(target.dtype, CHECK_TOLERANCE_HALF)
    for path in paths:
        ref = target.make_cache()
        target(prompt[None, :-1], ref, last_only=True, taps=False)
        want = target(mx.array([[tokens[i] for i in path]]), ref, taps=False)[0][0].astype(mx.float32)
        err = mx.max(mx.abs(got[mx.array(path)] - want)).item()
        scale = max(mx.max(mx.abs(want)).item(), 1.0)
        if not err <= tol * scale:
            return f"a tree node's logits differ from its path decoded linearly by {err:.3g} (logits up to {scale:.3g})"
    return None


_verdicts: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # target -> {device: passed}


def works(target) -> bool:
    """Whether trees can be verified losslessly on this target and backend:
    `supports_tree`, and `self_check` passed (run once per target and device;
    a failure is logged once, and verification stays linear)."""
    if not target.supports_tree:
        return False
    seen, device = _verdicts.setdefault(target, {}), str(mx.default_device())
    if device not in seen:
        try:
            why = self_check(target)
        except Exception as e:  # an op the backend lacks: never fatal, trees are an optimisation
            why = failure(e)
        if why:
            log.warning("dflash-mlx: tree verification disabled on %s, verifying linearly (%s)", device, why)
        seen[device] = why is None
    return seen[device]
