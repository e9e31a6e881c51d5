"""One cycle of the loop as an object, over the rows of every sequence decoded
together: made, it is launched on the device (`mx.async_eval`); `settle()`
makes its one host synchronisation and returns an `Outcome` per sequence; `cut`
then crops the caches to what each sequence keeps (no copy), and `drop` undoes a
cycle launched ahead that is not wanted after all.

Three kinds: a `PlainStep` (width 1, mlx-lm's step for each sequence), a
`LinearCycle` (each sequence's `Block` of drafts and one verify pass over the
[B, width] block) and a `TreeCycle` (each sequence's drafter's best path and
its branches in one verify pass, greedy). A cycle does not care where its
drafts came from (the drafter, the lookup's copies or both); which cycle runs
is the policy's plan (`policy`). A sequence alone and a batch's run the same
cycles: `Rows` holds the target's own caches for one sequence, batched ones
(`target/ragged.py`) for several.
"""

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence

import mlx.core as mx

from ..draft import tree as trees
from ..policy.plan import Outcome
from ..target.adapter import Rider
from ..sampling import agreeing, greedy_log_probs, gumbel_rows, log_probs, pick
from ..constrain.mask import allowed
from .constrained import constrained, masked
from .passes import TreeVerified, accept, logprob_rows, token_logprobs, verify_tree
from .sequence import SequenceState


@dataclass
class Rows:
    """What a cycle decodes: its sequences, in the caches' order, and the target's caches
    holding them (`batched`: a batch's, `target/ragged.py`; else one sequence's own)."""

    target: Any  # the adapter's target
    cache: list  # per layer
    seqs: List[SequenceState]
    taps: bool = True  # plain steps compute taps: a sequence's drafter will read them
    batched: bool = False
    rider: Optional[Rider] = None  # a joining prompt's chunk riding in the cycle's pass

    def carried(self) -> tuple:
        """What the rider's pass leaves (its caches, its taps), for the cycle's one synchronisation."""
        r = self.rider
        return () if r is None else ([c.state for c in r.cache], r.hidden)

    def crop(self, keeps: Sequence[int], width: int, before: Optional[dict] = None) -> None:
        """Sequence b keeps the first keeps[b] of the last `width` positions (`before`: the
        recurrent states from before a pass that was not recorded, to drop it)."""
        if self.batched:
            self.target.crop_each(self.cache, keeps, width, before)
        else:
            self.target.crop(self.cache, keeps[0], width, before)


def pick_next(seqs: Sequence[SequenceState], logits: mx.array, pending: Optional[mx.array] = None):
    """Each sequence's next token [B] from its row of `logits` [B, V] (greedy, its seed's draws,
    or mlx-lm's sampler), and per sequence its log probabilities (or None). Sequences drawing
    from the same distribution are picked in one op. `pending` [B]: tokens not committed yet
    that the rows follow (a step launched ahead): processors see them, draws are a position on.
    A sequence's grammar masks its row first (never with `pending`: its mask needs the token)."""
    B = len(seqs)
    logits = masked(seqs, logits)
    if any(s.proc for s in seqs):
        logits = mx.concatenate([
            s.proc.row(logits[b : b + 1], None if pending is None else pending[b : b + 1]) if s.proc
            else logits[b : b + 1] for b, s in enumerate(seqs)])
    groups = {}
    for b, s in enumerate(seqs):
        groups.setdefault((s.params.key, s.rejection), []).append(b)
    parts, order, skip = [], [], 0 if pending is None else 1
    for (_, unseeded), members in groups.items():
        params = seqs[members[0]].params
        rows = logits if len(members) == B else logits[mx.array(members)]
        if params.greedy or unseeded:
            parts.append(pick(rows, params))
        else:
            keys = mx.array([seqs[b].draws.key(skip) for b in members], dtype=mx.uint32)
            parts.append(mx.argmax(log_probs(rows, params) + gumbel_rows(keys, rows.shape[-1]), axis=-1))
        order += members
    tokens = parts[0] if len(parts) == 1 else mx.concatenate(parts)[mx.argsort(mx.array(order))]
    tokens = tokens.astype(mx.uint32)
    lps = [None if s.top is None else token_logprobs(logits[b : b + 1], tokens[b : b + 1], s.top)
           for b, s in enumerate(seqs)]
    return tokens, lps


class PlainStep:
    """Width 1: one plain decoding step for every sequence. Its `tokens` [B] are on the
    device before the host reads them, so the next step can be launched from them first
    (`pending`), as mlx-lm's `generate_step` does; a step launched so and not wanted after
    all is undone with `drop`.

    Where a sequence keeps to a grammar, a step launched ahead runs its target pass only: its
    row's mask needs the token before, so its tokens are picked (`tokens`) once that is
    committed, while the pass runs, and the step after is launched from them in turn."""

    def __init__(self, rows: Rows, lasts: mx.array, pending: bool = False):
        self.rows = rows
        self.before = rows.target.states(rows.cache)  # references: what `drop` sets back
        alone = len(rows.seqs) == 1  # its taps as the tapped layers' outputs, joined later (`joined`)
        logits, self.hidden = rows.target(lasts[:, None], rows.cache, rider=rows.rider,
                                          taps=("layers" if alone else True) if rows.taps else False)
        self.logits, self._tokens, self.logprobs = logits[:, -1], None, []
        if pending and constrained(rows.seqs):
            mx.async_eval(self.logits)
        else:
            self._pick(lasts if pending else None)

    def _pick(self, pending: Optional[mx.array]) -> None:
        self._tokens, self.logprobs = pick_next(self.rows.seqs, self.logits, pending)
        mx.async_eval(self._tokens, [lp for lp in self.logprobs if lp is not None])

    @property
    def tokens(self) -> mx.array:
        """[B] the step's tokens (lazy); a step whose pick waited for the tokens before it picks now."""
        if self._tokens is None:
            self._pick(None)
        return self._tokens

    def settle(self, also: tuple = ()) -> List[Outcome]:
        """`also`: lazy arrays to evaluate in the same synchronisation."""
        tokens = self.tokens
        lps = [lp for lp in self.logprobs if lp is not None]
        if lps or also:
            mx.eval(tokens, lps, *also)
        picked = tokens.tolist()  # the cycle's one host synchronisation
        alone = len(picked) == 1
        return [Outcome(0, [t], tokens[b : b + 1],
                        None if self.hidden is None else self.hidden if alone else self.hidden[b : b + 1],
                        lp and logprob_rows(lp, 1)) for b, (t, lp) in enumerate(zip(picked, self.logprobs))]

    def cut(self, keeps: Sequence[int]) -> None:
        """Sequence b keeps its step's row where keeps[b] is 1 (a plain step is not recorded:
        its recurrent states go back to those before it where a row is dropped)."""
        if not all(keeps):
            self.rows.crop(keeps, 1, self.before)

    def drop(self) -> None:
        """Undo the step: every sequence's row of it is cropped."""
        self.rows.crop([0] * len(self.rows.seqs), 1, self.before)

    def narrow(self, keep: Sequence[int], rows: Rows) -> None:
        """The step for the sequences at indices `keep` only, now held by `rows`: the batch
        without those that left, whose rows of it were cropped first (`cut`)."""
        idx = mx.array(keep)
        self.rows = rows
        self.logits = self.logits[idx]
        if self._tokens is not None:
            self._tokens = self._tokens[idx]
        self.logprobs = [self.logprobs[b] for b in keep] if self.logprobs else []
        if self.hidden is not None:
            self.hidden = self.hidden[idx]
        if self.before is not None:
            self.before = {i: [None if a is None else a[idx] for a in s] for i, s in self.before.items()}


@dataclass
class Block:
    """What a drafted cycle verifies: each sequence's last token and its drafts."""

    lasts: mx.array  # [B]
    drafts: mx.array  # [B, width - 1]
    q_lps: list  # per sequence: the log probabilities its drafts were drawn from (rejection sampling), or None
    noises: list  # per sequence: its seed's draws' noise rows [width, V], or None
    alternatives: Optional[mx.array] = None  # one sequence: the drafter's 2nd and 3rd choices [width - 1, 2]
    masks: Any = None  # each row's grammar mask, filled once the verify pass is launched (`constrained.BlockMasks`)
    refused: Optional[list] = None  # per sequence, a forbidden draft cut off and its proposal row, or None
    widths: Optional[List[int]] = None  # per sequence, the rows it verifies (the rest pad its block), where some differ

    @property
    def width(self) -> int:
        return self.drafts.shape[1] + 1


class LinearCycle:
    """Each sequence's drafts and one verify pass over the [B, width] block [last, drafts]: per
    sequence the longest agreeing prefix (greedy), its draws' (seeded) or the rejection sampler's
    (`passes.accept`), and one token of the target's own."""

    def __init__(self, rows: Rows, block: Block):
        self.rows, self.block = rows, block
        self.width = block.width
        tokens = mx.concatenate([block.lasts[:, None], block.drafts], axis=1)
        narrow = {"narrow": block.widths} if block.widths is not None else {}
        logits, self.hidden = rows.target(tokens, rows.cache, record=True, rider=rows.rider, **narrow)
        if block.masks is not None:
            mx.async_eval(logits)  # the pass runs while the host fills the grammars' masks
            logits = allowed(logits, block.masks.fill())
        seqs = rows.seqs
        self.processed = [None] * len(seqs)  # per sequence, the rows rejection sampling verified on
        if len(seqs) > 1 and all(s.params.greedy and not s.proc and s.top is None for s in seqs):
            self.picks = mx.argmax(greedy_log_probs(logits), axis=-1).astype(mx.uint32)  # one op for all
            self.accepted, self.logprobs = agreeing(block.drafts, self.picks), [None] * len(seqs)
            if block.widths is not None:  # a narrow sequence accepts none of the drafts it did not verify
                self.accepted = mx.minimum(self.accepted, mx.array([w - 1 for w in block.widths], dtype=mx.uint32))
        else:
            W = self.width
            each = [accept(block.drafts[b, : w - 1], logits[b, :w], s.params, _cut(block.q_lps[b], w - 1), s.top,
                           s.proc or None, _cut(block.noises[b], w), block.refused and block.refused[b])
                    for b, (s, w) in enumerate(zip(seqs, block.widths or [W] * len(seqs)))]
            self.picks = mx.stack([_padded(a.picks.astype(mx.uint32), W) for a in each])
            self.accepted = mx.stack([a.accepted for a in each]).astype(mx.uint32)
            self.logprobs = [a.logprobs for a in each]
            self.processed = [a.logits if s.rejection else None for a, s in zip(each, seqs)]
        mx.async_eval(self.picks, self.accepted)

    def settle(self, also: tuple = ()) -> List[Outcome]:
        """`also`: lazy arrays to evaluate in the same synchronisation."""
        B, W = len(self.rows.seqs), self.width
        alts = self.block.alternatives
        out = mx.concatenate([self.accepted.reshape(-1), self.picks.reshape(-1), self.block.drafts.reshape(-1)]
                             + ([] if alts is None else [alts.reshape(-1).astype(mx.uint32)]))
        mx.eval(out, [lp for lp in self.logprobs if lp is not None], *also)  # the cycle's one host synchronisation
        values = out.tolist()
        accepted, picks = values[:B], values[B : B + B * W]
        drafts = values[B + B * W : B + B * W + B * (W - 1)]
        outcomes = []
        for b, a in enumerate(accepted):
            tokens = drafts[b * (W - 1) : b * (W - 1) + a] + [picks[b * W + a]]
            missed = None
            if alts is not None and a < W - 1:
                missed = trees.missed(values[B + B * W + B * (W - 1) :], alts.shape[1], a + 1, tokens[-1])
            hidden = self.hidden if B == 1 else self.hidden[b : b + 1]
            hidden = hidden if hidden.shape[1] == a + 1 else hidden[:, : a + 1]
            lps = self.logprobs[b]
            outcomes.append(Outcome(a, tokens, self.picks[b, a : a + 1], hidden, lps and logprob_rows(lps, a + 1),
                                    missed))
        return outcomes

    def cut(self, keeps: Sequence[int]) -> None:
        """Sequence b's caches keep the first keeps[b] rows of its block (no copy)."""
        self.rows.crop(keeps, self.block.widths or self.width)

    def drop(self) -> None:
        """Undo the cycle, launched and not wanted after all: every row of its block is cropped."""
        self.cut([0] * len(self.rows.seqs))


def _cut(rows: Optional[mx.array], n: int) -> Optional[mx.array]:
    """The first n rows (None stays None)."""
    return rows if rows is None or rows.shape[0] == n else rows[:n]


def _padded(picks: mx.array, n: int) -> mx.array:
    """A narrow sequence's picks, padded to the block's n rows (never read past its own)."""
    return picks if picks.shape[0] == n else mx.concatenate([picks, mx.zeros((n - picks.shape[0],), picks.dtype)])


class TreeCycle:
    """Each sequence's tree (`draft/tree.py`: its drafter's best path and branches, one shape
    for all) in one verify pass, greedy; per sequence, the walk keeps the longest path the
    target agrees with, and `cut` keeps that path's rows."""

    def __init__(self, rows: Rows, tree: trees.Tree, masks=None):
        """`masks`: the grammars' masks of the tree's nodes (`constrained.TreeMasks`), if any."""
        self.rows = rows
        self.verified = verify_tree(rows.target, rows.cache, tree, [s.top for s in rows.seqs], rows.rider, masks)
        mx.async_eval(self.verified)
        self.paths: List[List[int]] = []

    def walk(self, values: List[int]):
        """One sequence's accepted path's nodes and the target's token after it, from its row of
        `settle`'s values (nodes' tokens, picks, forks, alternatives)."""
        t = self.verified.tree
        N, B, W = t.size, t.branches, t.width
        return trees.walk(W, t.length, values[2 * N : 2 * N + B], values[:N], values[N : 2 * N])

    def settle(self, also: tuple = ()) -> List[Outcome]:
        v: TreeVerified = self.verified
        t = v.tree
        out = mx.concatenate([t.tokens, v.picks.astype(mx.uint32), t.forks.astype(mx.uint32),
                              t.alternatives.reshape(t.tokens.shape[0], -1)], axis=1)
        mx.eval(out, [lp for lp in v.logprobs if lp is not None], *also)  # the cycle's one host synchronisation
        outcomes = [self._outcome(b, row) for b, row in enumerate(out.tolist())]
        self.paths = [o[1] for o in outcomes]
        return [o[0] for o in outcomes]

    def _outcome(self, b: int, values: List[int]):
        """Sequence b's `Outcome` and its accepted path, from its row of `settle`'s values."""
        v, t = self.verified, self.verified.tree
        N, K, W = t.size, t.branches, t.width
        path, bonus = self.walk(values)
        accepted = len(path) - 1
        hidden = v.hidden[b : b + 1]
        hidden = mx.take(hidden, mx.array(path), axis=1) if path[-1] >= W else hidden[:, : accepted + 1]
        lps = v.logprobs[b] and [logprob_rows(v.logprobs[b], N)[i] for i in path]
        held = sum(1 for i in path[1:] if i < W)  # depth the best path held to
        alts = values[2 * N + K :]
        missed = None if held == W - 1 else trees.missed(alts, len(alts) // (W - 1), held + 1, values[N + held])
        tokens = [values[i] for i in path[1:]] + [bonus]
        last = mx.array(tokens[-1]).reshape(1).astype(t.tokens.dtype)
        return Outcome(accepted, tokens, last, hidden, lps, missed, branched=path[-1] >= W), path

    def cut(self, keeps: Sequence[int]) -> None:
        """Sequence b's caches keep the first keeps[b] rows of its accepted path, moved to the front of the pass's."""
        rows, size = self.rows, self.verified.tree.size
        kept = [path[:k] for path, k in zip(self.paths or [[]] * len(keeps), keeps)]
        if rows.batched:
            rows.target.keep_rows_each(rows.cache, kept, size)
        else:
            rows.target.keep_rows(rows.cache, kept[0], size)

    def drop(self) -> None:
        """Undo the cycle, launched and not wanted after all: every row of its pass is cropped."""
        self.paths = []
        self.cut([0] * len(self.rows.seqs))
