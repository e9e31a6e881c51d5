"""Sequences that keep to a grammar (`constrain/`), in the decoder's cycles: every row a token is
picked from is masked by the grammar at that row's position (a tree's nodes each after its own
path), a drafted block is cut at its first draft the grammar forbids before the target verifies
it, and the tokens the grammar forces next are drafted as copies no model need make."""

import dataclasses
from typing import List, Optional, Sequence

import mlx.core as mx
import numpy as np

from ..constrain.mask import allowed, upload

def constrained(seqs: Sequence) -> bool:
    return any(s.constraint is not None for s in seqs)


def masked(seqs: Sequence, logits: mx.array) -> mx.array:
    """Each sequence's row of `logits` [B, V] masked by its grammar now (free sequences' rows as
    they are). The rows are launched on the device first, so the host fills the masks while they
    are computed."""
    if not constrained(seqs):
        return logits
    mx.async_eval(logits)
    return allowed(logits, filled(seqs, 1, lambda b, c: c.masks().bits)[:, 0])


def filled(seqs: Sequence, rows: int, masks) -> mx.array:
    """Masks [B, rows, words] on the device: `masks(b, constraint)` [rows, words] for each sequence
    b that keeps to a grammar, every token allowed in a free sequence's rows."""
    words = next(s.constraint.words for s in seqs if s.constraint is not None)
    bits = np.full((len(seqs), rows, words), -1, dtype=np.int32)
    for b, s in enumerate(seqs):
        if s.constraint is not None:
            bits[b] = masks(b, s.constraint)
    return upload(bits)


def checked(seqs: Sequence, block):
    """A drafted `cycle.Block` read against each sequence's grammar (one host synchronisation: the
    engine is on the host): cut after the last position any sequence's grammar allows its drafts to
    reach, with the masks of every row it keeps (`Block.masks`). A free sequence keeps every draft.

    A sequence verified by rejection sampling whose first forbidden draft is cut off keeps it aside
    with its proposal row (`Block.refused`): its row is a rejection, and the token drawn there comes
    from the residual of the target's and the drafter's distributions, as for any rejected draft.
    Drawn from the target's row alone instead, the text would not follow the target's distribution."""
    if not constrained(seqs):
        return block
    drafts = block.drafts.tolist()
    valid = [len(d) if s.constraint is None else s.constraint.allows(d) for s, d in zip(seqs, drafts)]
    width = max(valid) + 1
    refused = [None if q is None or v != width - 1 or v == len(d)
               else (mx.array(d[v : v + 1], dtype=block.drafts.dtype), q[v : v + 1])
               for d, v, q in zip(drafts, valid, block.q_lps)]
    return dataclasses.replace(block, drafts=block.drafts[:, : width - 1],
                               q_lps=[_cut(q, width - 1) for q in block.q_lps], noises=[_cut(n, width) for n in block.noises],
                               alternatives=_cut(block.alternatives, width - 1),
                               masks=BlockMasks(seqs, [d[: width - 1] for d in drafts], valid), refused=refused)


class BlockMasks:
    """A checked block's masks [B, width, words], filled on the host when asked for: once the
    verify pass is launched, so that the device computes while the host fills them."""

    def __init__(self, seqs: Sequence, drafts: List[List[int]], valid: List[int]):
        self.seqs, self.drafts, self.valid = seqs, drafts, valid

    def fill(self) -> mx.array:
        d, v = self.drafts, self.valid
        return filled(self.seqs, len(d[0]) + 1, lambda b, c: c.masks(d[b], min(v[b], len(d[b]))).bits)


def tree_masks(seqs: Sequence, tree) -> Optional["TreeMasks"]:
    """A drafted `draft.tree.Tree`'s masks where a sequence keeps to a grammar (None where none
    does): its nodes and forks read on the host (one host synchronisation, as `checked`'s)."""
    if not constrained(seqs):
        return None
    mx.eval(tree.tokens, tree.forks)
    return TreeMasks(seqs, tree.tokens.tolist(), tree.forks.tolist(), tree.width, tree.length)


class TreeMasks:
    """Each tree node's mask [B, N, words], the grammar's after the tokens on the node's path from
    the root (its own included), filled on the host once the verify pass is launched. A node below
    a draft the grammar forbids is never reached (no masked pick equals that draft): its row is
    left open."""

    def __init__(self, seqs: Sequence, tokens: List[List[int]], forks: List[List[int]], width: int, length: int):
        self.seqs, self.tokens, self.forks, self.width, self.length = seqs, tokens, forks, width, length

    def fill(self) -> mx.array:
        return filled(self.seqs, len(self.tokens[0]), self._rows)

    def _rows(self, b: int, constraint) -> np.ndarray:
        """Sequence b's node masks: the best path's as a block's, then each branch's."""
        W, L, tokens = self.width, self.length, self.tokens[b]
        best = tokens[1:W]
        rows = [constraint.masks(best).bits]
        for k, depth in enumerate(self.forks[b]):  # branch k leaves the best path at `depth` (1-based)
            branch = tokens[W + k * L : W + (k + 1) * L]
            rows.append(constraint.masks(best[: depth - 1] + branch).bits[depth:])
        return np.concatenate(rows)


def _cut(rows: Optional[mx.array], n: int) -> Optional[mx.array]:
    return rows if rows is None or rows.shape[0] == n else rows[:n]
