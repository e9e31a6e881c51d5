"""The cost curve's harness: the loop's own cycles (`cycle.py`) over a held
context, each cut back afterwards so that every timed call sees the same one."""

import time

import mlx.core as mx

from ..draft import tree as trees
from ..sampling import SamplingParams
from .cycle import Block, LinearCycle, PlainStep, Rows, TreeCycle
from .passes import PREFILL_STEP, draft, draft_tree
from .sequence import SequenceState

# Plain steps a width-1 timing runs back to back: the loop launches each step before
# the host reads the one before, and one step timed alone would pay for its own read.
PLAIN_STEPS = 4


class TimedTree(TreeCycle):
    """Always through a branch: its rows are the ones moved, the dearer case."""

    def walk(self, values):
        t = self.verified.tree
        W, L = t.width, t.length
        path, bonus = super().walk(values)
        if path[-1] < W:
            path = (list(range(values[2 * t.size])) + list(range(W, W + L)))[:W]
        return path, bonus


def cycle_parts(pair, n: int, branches: int = 0):
    """The two halves of a greedy cycle over n tokens of random context, for timing.

    `draft(w)` returns lazy draft tokens (a tree with branches), committing
    first the taps of about as many rows as a cycle of that width commits (as
    in the loop); `verify(w, proposal)` launches and settles the cycle (its one host synchronisation)
    and cuts the caches back. Width 1 is `PLAIN_STEPS` plain steps, each
    launched before the host reads the one before; it returns how many steps
    it ran, and trimmable caches are trimmed back (a recurrent state just goes
    on). With `branches` (a target that `supports_tree`), drafted cycles are
    trees with that many branches; `draft(w, b)` drafts a tree of b branches
    whatever `branches` says (0: a linear draft). The third item returned is
    the seconds per row the drafter took to catch up on the context once the
    target's caches were made (as after a prefill): the taps' own work (e.g. a
    tapped last layer) and the drafter's projection.
    """
    target, source = pair.target, pair.draft_source
    greedy = SamplingParams()
    prompt = mx.random.randint(0, target.vocab_size, (n,), key=mx.random.key(n))
    tcache, dstate = target.make_cache(), source.new_state()
    rows = Rows(target, tcache, [SequenceState(source=source, dstate=dstate)])
    chunks = []
    for s in range(0, n, PREFILL_STEP):  # in chunks, as a prefill runs: one pass over a long context would not fit
        _, t = target(prompt[None, s : s + PREFILL_STEP], tcache, last_only=True)
        mx.eval([c.state for c in tcache])
        chunks.append(t)
    taps = mx.concatenate(chunks, axis=1) if len(chunks) > 1 else chunks[0]
    tic = time.perf_counter()
    source.add_context(dstate, taps)
    mx.eval(source.arrays(dstate))
    catch_up = (time.perf_counter() - tic) / n
    last = prompt[-1:]

    def run_draft(w, b=branches):
        if w == 1:
            return None
        rows = min((w + 1) // 2, taps.shape[1])
        if b:
            proposal = draft_tree(source, dstate, last, taps[:, -rows:], w, b)
        else:
            proposal = draft(source, dstate, last, taps[:, -rows:], w, greedy).tokens
        source.rewind(dstate, rows)  # the lazy draft keeps what it read
        return proposal

    def run_verify(w, proposal):
        if w == 1:
            ahead = PlainStep(rows, last)
            for _ in range(PLAIN_STEPS - 1):
                nxt = PlainStep(rows, ahead.tokens, pending=True)
                ahead.settle()
                ahead = nxt
            ahead.settle()
            for c in tcache:
                if c.is_trimmable():
                    c.trim(PLAIN_STEPS)
            return PLAIN_STEPS
        if isinstance(proposal, trees.Tree):
            cycle = TimedTree(rows, proposal)
            cycle.cut([len(cycle.settle()[0].tokens)])
            target.crop(tcache, 0, len(cycle.paths[0]))
        else:  # draft tokens, the drafter's or copied ones
            LinearCycle(rows, Block(last, proposal[None], [None], [None])).settle()
            target.crop(tcache, 0, w)

    return run_draft, run_verify, catch_up
