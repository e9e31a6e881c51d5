"""The model passes of a cycle, arrays in and arrays out: prefill, a draft and its
acceptance, and a tree's draft and verify. No policy and no host
synchronisation here: each returns lazy arrays for a cycle (`cycle.py`) to
launch and settle."""

from typing import Callable, NamedTuple, Optional, Sequence, Tuple, Union

import mlx.core as mx

from ..constrain.mask import allowed
from ..draft import tree as trees
from ..kernels import verify_accept
from ..draft.lookup import point_masses
from ..policy.proposal import rescale_rows
from ..target.adapter import Rider
from ..sampling import Processed, SamplingParams, agreeing, choose, greedy_log_probs, log_probs, pick


PREFILL_STEP = 2048  # prompt tokens per prefill chunk: mlx-lm's prefill_step_size
# Bytes of a prompt's taps a prefill holds, lazy, for the first drafted cycle. Rows
# beyond are handed to the drafter chunk by chunk during prefill, which delays the
# first token by their projection (and by what only the taps need, e.g. a tapped
# last layer); held rows cost memory instead. 512 MiB holds about 20k rows of a
# 4B target's five bfloat16 taps, 130k of the demo target's.
PREFILL_HOLD_BYTES = 512 << 20


def prefill_chunks(n: int, step: Union[int, Callable[[], int]], horizon: Optional[Tuple[int, int]] = None,
                   prompt_rows: int = 0, before: int = 0):
    """(start, end, read) chunks of `n` prompt tokens, `step` at most: mlx-lm's
    chunks, unless a `horizon` (first, last) leaves rows no draft will read
    (after the first `first` context rows, `before` of which the drafter holds
    already, and behind the last `last` of the `prompt_rows` to come), which get
    chunks of their own with `read` False. `step` may be a callable asked for
    each chunk's size as it is reached; the chunks then come one by one."""
    a = b = n
    if horizon is not None:
        first, last = horizon
        a = min(max(first - before, 0), n)
        b = max(a, min(n, prompt_rows - last))
    if b == a:
        a = b = n
    chunks = _chunks(((0, a, True), (a, b, False), (b, n, True)), step)
    return chunks if callable(step) else list(chunks)


def _chunks(regions, step):
    for lo, hi, read in regions:
        start = lo
        while start < hi:
            end = min(start + max(1, step() if callable(step) else step), hi)
            yield start, end, read
            start = end


def prefill(target, source, dstate, prompt: mx.array, tcache, step: int = PREFILL_STEP, hold: int = PREFILL_HOLD_BYTES,
            before_last=None, taps: bool = True, skip: bool = False, before: int = 0):
    """`prefill_steps` run to the end: (the last position's logits, the held taps)."""
    return drained(target, prefill_steps(target, source, dstate, prompt, tcache, step, hold, before_last, taps, skip,
                                         before))


def run_chunk(target, chunk: Rider) -> None:
    """A prefill chunk through the target in a pass of its own (only its caches and taps are wanted)."""
    _, chunk.hidden = target(chunk.tokens, chunk.cache, last_only=True, taps=chunk.taps)


def drained(target, steps):
    """What a generator (`prefill_steps`) returns once run to its end, each chunk in a pass of its own."""
    while True:
        try:
            run_chunk(target, next(steps))
        except StopIteration as done:
            return done.value


def prefill_steps(target, source, dstate, prompt: mx.array, tcache, step: Union[int, Callable[[], int]] = PREFILL_STEP,
                  hold: int = PREFILL_HOLD_BYTES, before_last=None, taps: bool = True, skip: bool = False,
                  before: int = 0):
    """Run the prompt through the target: the first token waits for nothing else.
    A generator that yields each chunk (a `Rider`) for its driver to run before it goes on: in a
    pass of its own (`run_chunk`), or riding in a batch's (a batch runs its cycles between chunks,
    and sizes the next through a callable `step`); it returns what `prefill` does.

    As mlx-lm does, all but the last prompt token go through in chunks that
    evaluate only the caches, and the last token is one plain step; the taps
    of the prompt are left lazy and returned (the last `hold` bytes of them)
    for the loop to hand to the drafter with its first drafted cycle, so
    neither the drafter's projection nor what only the drafter needs (e.g.
    the last layer's output over the prompt) is in the time to first token.
    Rows beyond `hold` bytes are given to the drafter chunk by chunk, so memory
    stays bounded for long prompts. Returns the last position's logits (lazy)
    and those taps (none with `taps=False`: no drafter will read them).
    `before_last(tcache)` is called when only the last token is left. With
    `skip`, prompt rows no draft will read (`DraftSource.horizon`; `before`:
    the context rows the drafter holds already, a prompt cache's) are skipped:
    their taps, and what only they need, are never computed.
    """
    held = []
    body = prompt[:-1]
    horizon = source.horizon(dstate) if skip and taps else None
    for s, e, read in prefill_chunks(body.shape[0], step, horizon, prompt.shape[0], before):
        chunk = Rider(body[None, s:e], tcache, taps=taps and read)
        yield chunk  # run by the driver
        hidden = chunk.hidden
        given = []
        if not read:  # the rows before these first, in order
            for h in held:
                source.add_context(dstate, h)
            source.skip(dstate, e - s)
            held, given = [], source.arrays(dstate)
        elif taps:
            held.append(hidden)
        while sum(h.nbytes for h in held) > hold:
            source.add_context(dstate, held.pop(0))
            given = source.arrays(dstate)
        # Evaluate the caches per chunk; the held taps stay lazy (at most `hold` bytes of them).
        mx.eval([c.state for c in tcache], given)
        mx.clear_cache()
    if before_last is not None:
        before_last(tcache)
    logits, hidden = target(prompt[None, -1:], tcache, taps=taps)
    return logits[0, -1], (held + [hidden] if taps else [])


class Draft(NamedTuple):
    tokens: mx.array  # [width - 1]
    q_lp: Optional[mx.array]  # their proposal's log probabilities [width - 1, V] when sampling
    alternatives: Optional[mx.array]  # the drafter's 2nd and 3rd choices [width - 1, 2], when asked for


def draft(source, dstate, last, hidden, width: int, params: SamplingParams, copied: Sequence[int] = (),
          proc: Optional[Processed] = None, alternatives: bool = False,
          scales: Optional[Sequence[float]] = None, noise: Optional[mx.array] = None) -> Draft:
    """Draft tokens for a cycle of `width`, their log probabilities when
    sampling and, with `alternatives` (greedy, nothing copied), the drafter's
    2nd and 3rd choices at each position. With `noise` (a seeded request's
    `sampling.Draws` rows [width - 1, V]) a sampled draft is drawn with its
    position's noise, and no log probabilities are kept (verifying compares tokens).

    `copied` tokens (a lookup's) take the first positions, each a certain
    draft (a point mass); the drafter fills the rest, and is not run when
    nothing is left to fill. With logits processors (`proc`), each drafter
    position is processed after the drafts before it, so they go one by one.
    When sampling, drafter position i is drawn at `scales[i]` (`policy/proposal.py`).
    """
    alts = None
    tokens, qs, n = [], [], len(copied)
    kept = not params.greedy and noise is None  # the proposal's log probabilities, for rejection sampling
    if n:
        tokens.append(mx.array(copied, dtype=mx.uint32))
        if kept:
            qs.append(point_masses(tokens[0], source.vocab_size))
    path = None
    if n < width - 1:
        path = source.propose_path(dstate, last, hidden, width, params, copied, proc.row if proc else None,
                                   scales, noise)
    if path is not None:  # the source drew each position after the ones before it
        tokens.append(path[0])
        if kept:
            qs.append(path[1])
    elif n < width - 1:
        logits = source.propose(dstate, last, hidden, width)[n:]
        if alternatives and params.greedy and not proc and n == 0:
            alts = trees.alternatives(logits)
        drawn = pick_drafts(logits, params, proc, None if noise is None else noise[n:],
                            None if scales is None else scales[n:], before=tokens[0] if n else None)
        tokens.append(drawn.tokens)
        if kept:
            qs.append(drawn.q_lp)
    tokens = tokens[0] if len(tokens) == 1 else mx.concatenate(tokens)
    if not kept:
        return Draft(tokens, None, alts)
    return Draft(tokens, qs[0] if len(qs) == 1 else mx.concatenate(qs), alts)


def pick_drafts(logits: mx.array, params: SamplingParams, proc: Optional[Processed] = None,
                noise: Optional[mx.array] = None, scales: Optional[Sequence[float]] = None,
                before: Optional[mx.array] = None) -> Draft:
    """Drafts [n] from a drafter's logits [n, V]: the greedy argmax, a seeded request's draws
    (`noise`, `sampling.Draws` rows [n, V]), or else draws from the drafter's distribution at
    `scales` (one per row, `policy/proposal.py`; default 1) with their log probabilities, for
    rejection sampling. With logits processors, each row is processed after the drafts before it
    (`before`: tokens drafted ahead of these rows, a lookup's copies)."""
    kept = not params.greedy and noise is None
    if not proc:  # every row at once
        if not kept:
            tokens = mx.argmax(logits, axis=-1).astype(mx.uint32) if params.greedy else choose(logits, params, noise)
            return Draft(tokens, None, None)
        q_lp = rescale_rows(log_probs(logits, params), scales)
        return Draft(mx.random.categorical(q_lp).astype(mx.uint32), q_lp, None)
    tokens, qs = [], []
    for i in range(logits.shape[0]):
        row = logits[i : i + 1]
        if proc:
            ahead = ([before] if before is not None else []) + tokens
            row = proc.row(row, mx.concatenate(ahead) if ahead else None)
        if params.greedy:
            tokens.append(mx.argmax(row, axis=-1).astype(mx.uint32))
        elif noise is not None:
            tokens.append(choose(row, params, noise[i : i + 1]))
        else:
            lp = log_probs(row, params)
            qs.append(rescale_rows(lp, None if scales is None else scales[i : i + 1]))
            tokens.append(mx.random.categorical(qs[-1]).astype(mx.uint32))
    return Draft(mx.concatenate(tokens), mx.concatenate(qs) if kept else None, None)


class Accepted(NamedTuple):
    """What the target's rows of a block [last, drafts] accept: one place for greedy, seeded and
    rejection sampling, logits processors and log probabilities."""

    accepted: mx.array  # drafts accepted
    token: mx.array  # [1] the target's token after them
    picks: mx.array  # [n + 1] the accepted drafts, then `token` (rows past it: the drafts after)
    logprobs: Optional[tuple]  # `token_logprobs` of the picks, when asked for
    logits: mx.array  # the rows, processed


def accept(tokens: mx.array, logits: mx.array, params: SamplingParams, q_lp: Optional[mx.array] = None,
           top: Optional[int] = None, proc: Optional[Processed] = None, noise: Optional[mx.array] = None,
           refused: Optional[tuple] = None) -> Accepted:
    """Verify drafts `tokens` [n] against the target's rows `logits` [n + 1, V] of [last, tokens]:
    the greedy rule, or with `noise` (a seeded request's `sampling.Draws` rows) the drafts checked
    against the target's draws, or else rejection sampling against `q_lp`, the log probabilities
    the drafts were drawn from; with `top`, the picks' log probabilities. `refused` (rejection
    sampling): the draft after `tokens`, which the last row's mask forbids, and its proposal row
    [1, V]: that row rejects it (the token comes from the residual), with no target row of its own."""
    if proc:
        logits = proc(logits, tokens)
    if noise is None and refused is not None and not params.greedy:
        # Its target row is never read: the draft has probability 0 there, so it is rejected first.
        accepted, token = verify_accept(mx.concatenate([tokens, refused[0]]), mx.concatenate([logits, logits[-1:]]),
                                        params, mx.concatenate([q_lp, refused[1]]))
    elif noise is None and tokens.shape[0] == 0:  # nothing to verify: the target's own token, a plain step's
        accepted, token = mx.array(0, dtype=mx.uint32), pick(logits, params)
    elif noise is None:
        accepted, token = verify_accept(tokens, logits, params, q_lp)
    else:
        drawn = choose(logits, params, noise)
        accepted = agreeing(tokens, drawn)
        token = drawn[accepted]
    token = token.reshape(1).astype(tokens.dtype)
    picks = mx.where(mx.arange(logits.shape[0]) == accepted, token, mx.concatenate([tokens, token]))
    return Accepted(accepted, token, picks, None if top is None else token_logprobs(logits, picks, top), logits)


def token_logprobs(logits: mx.array, chosen: mx.array, k: int):
    """mlx-lm's log probabilities (`logits - logsumexp`) of `chosen` [n] in each
    row of `logits` [n, V], and each row's k most likely tokens (unordered)."""
    lp = greedy_log_probs(logits)
    mine = mx.take_along_axis(lp, chosen[:, None].astype(mx.uint32), axis=-1)[:, 0]
    if k == 0:
        return (mine.astype(mx.float32),)
    top = mx.argpartition(-lp, k - 1, axis=-1)[:, :k]
    return mine.astype(mx.float32), top, mx.take_along_axis(lp, top, axis=-1).astype(mx.float32)


def logprob_rows(values, n: int):
    """`token_logprobs` results (evaluated) -> n rows of (log probability, [(token, log probability)] best first)."""
    lists = [v.tolist() for v in values]
    tops = [sorted(zip(*row), key=lambda t: -t[1]) for row in zip(*lists[1:])] if len(lists) > 1 else [[]] * n
    return list(zip(lists[0][:n], tops[:n]))


class TreeVerified(NamedTuple):
    tree: trees.Tree
    picks: mx.array  # [B, N] the target's greedy token after each node
    hidden: mx.array  # [B, N, D] taps of every node
    logprobs: list  # per sequence: `token_logprobs` of every node's pick, where asked for (else None)


def draft_tree(source, dstate, last, hidden, width: int, branches: int) -> trees.Tree:
    """A sequence's tree: the drafter's best path over `width` positions and `branches` branches
    (`tree.build`)."""
    return trees.build(last, source.propose(dstate, last, hidden, width)[None], branches)


def verify_tree(target, tcache, tree: trees.Tree, tops: Sequence[Optional[int]], rider: Optional[Rider] = None,
                masks=None) -> TreeVerified:
    """One target pass over every node of each sequence's tree (carrying `rider`): each node's
    greedy pick, and the taps; with sequence b's `tops[b]`, its picks' log probabilities. `masks`:
    the grammars' per node (`constrained.TreeMasks`), filled while the pass runs."""
    logits, taps = target(tree.tokens, tcache, tree=(tree.mask, tree.runs()), rider=rider)
    if masks is not None:
        mx.async_eval(logits)
        logits = allowed(logits, masks.fill())
    picks = mx.argmax(greedy_log_probs(logits), axis=-1)
    return TreeVerified(tree, picks, taps, [None if top is None else token_logprobs(logits[b], picks[b], top)
                                            for b, top in enumerate(tops)])


def caught_up(source, dstate, taps: list) -> list:
    """Give the drafter a long backlog of held taps (a long prompt's, at its first
    drafted cycle) in pieces of `PREFILL_STEP` rows, each evaluated before the
    next, so the work only those taps need (e.g. a tapped last layer over the
    prompt) holds one piece's intermediates at a time rather than the whole
    prompt's. Returns the taps left for the cycle itself (lazy). Once a request,
    where the backlog is long: the only host synchronisations outside a cycle's one."""
    def rows(t):
        return (t[0] if isinstance(t, tuple) else t).shape[1]

    while len(taps) > 1 and sum(rows(t) for t in taps) > PREFILL_STEP:
        source.add_context(dstate, joined(taps[:1]))
        mx.eval(source.arrays(dstate))
        taps = taps[1:]
    return taps


def joined(taps: list) -> mx.array:
    """Held taps as one array [1, rows, D * taps]. An entry is a pass's taps
    (an array of rows) or a plain step's (`cycle.PlainStep.hidden`, a tuple of the
    tapped layers' outputs); a run of steps is joined layer by layer, a few ops
    for the whole run rather than one per step."""
    parts, run = [], []
    for t in taps + [None]:
        if isinstance(t, tuple):
            run.append(t)
            continue
        if run:
            layers = [mx.concatenate(rows, axis=1) if len(rows) > 1 else rows[0] for rows in zip(*run)]
            parts.append(mx.concatenate(layers, axis=-1))
            run = []
        if t is not None:
            parts.append(t)
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=1)
