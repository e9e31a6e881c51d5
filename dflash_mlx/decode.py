"""The DFlash decode loop: prefill -> draft -> verify -> accept -> crop.

Read top to bottom: `prefill`, `draft`, `verify`, `step` (a plain step, for
width 1), `draft_tree`/`verify_tree`/`accept_tree` (greedy tree
verification, `tree.py`), `launch` (one cycle started on the device), then
`stream_generate`, which strings them together under a block-size policy
(`adaptive.py`). Each cycle makes one host synchronisation (the accepted
count and tokens, fetched together).
"""

import time
from dataclasses import dataclass, field
from typing import Iterator, List, NamedTuple, Optional, Sequence, Tuple, Union

import mlx.core as mx

from . import tree as trees
from .adaptive import PLAIN, BlockSizer, FixedWidth, Plan
from .draft_source import DFlashDraftSource, DraftSource  # noqa: F401 (the loop's interface, re-exported)
from .errors import DFlashError
from .kernels import verify_accept
from .lookup import point_masses
from .prompt_cache import PromptCache, can_trim, snapshot
from .proposal import FixedScale, ProposalScales, reached_gains, rescale
from .sampling import Processed, SamplingParams, greedy_log_probs, log_probs, pick


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens taken from the prompt cache
    prompt_tps: float = 0.0
    generation_tokens: int = 0
    generation_tps: float = 0.0
    cycles: int = 0
    draft_cycles: int = 0  # cycles that verified a draft (width > 1)
    lookup_cycles: int = 0  # draft cycles whose first tokens came from the n-gram lookup
    proposal_scales: Optional[str] = None  # the learned scales when the request ended (sampling, 'auto')
    tree_cycles: int = 0  # draft cycles verified as a tree
    branch_cycles: int = 0  # tree cycles that accepted a branch's token
    acceptance_lengths: List[int] = field(default_factory=list)
    peak_memory_gb: float = 0.0
    finish_reason: Optional[str] = None
    stop_sequence: Optional[str] = None  # the stop string that ended the text, if one did

    @property
    def mean_acceptance(self) -> float:
        a = self.acceptance_lengths
        return sum(a) / len(a) if a else 0.0

    def line(self) -> str:
        drafting = (
            f"acceptance {self.mean_acceptance:.2f} tok/cycle"
            if self.draft_cycles or not self.cycles else "plain decoding (no cycle drafted)"
        )
        if self.lookup_cycles:
            drafting += f" ({self.lookup_cycles} of {self.draft_cycles} draft cycles from lookup)"
        if self.tree_cycles:
            drafting += f" ({self.branch_cycles} of {self.tree_cycles} tree cycles through a branch)"
        return (
            f"{self.generation_tokens} tokens, {self.generation_tps:.1f} tok/s, {drafting}, "
            f"prompt {self.prompt_tokens} tokens at {self.prompt_tps:.1f} tok/s, "
            f"peak memory {self.peak_memory_gb:.2f} GB"
        )


@dataclass
class GenerationEvent:
    text: str  # new text since the previous event
    tokens: List[int]  # tokens committed by this cycle
    accepted: int  # draft tokens the target accepted this cycle
    stats: GenerationStats
    finish_reason: Optional[str] = None
    # With `logprobs=k`: per token, (its log probability, the k most likely (token, log probability))
    logprobs: Optional[List[Tuple[float, List[Tuple[int, float]]]]] = None


def peak_memory_gb() -> float:
    peak = mx.get_peak_memory()
    if peak == 0:  # the CPU backend does not track it: use the process peak
        import resource
        import sys

        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        peak = rss if sys.platform == "darwin" else rss * 1024
    return peak / 1e9


PREFILL_STEP = 2048  # prompt tokens per prefill chunk: mlx-lm's prefill_step_size
# Bytes of a prompt's taps a prefill holds, lazy, for the first drafted cycle. Rows
# beyond are handed to the drafter chunk by chunk during prefill, which delays the
# first token by their projection (and by what only the taps need, e.g. a tapped
# last layer); held rows cost memory instead. 512 MiB holds about 20k rows of a
# 4B target's five bfloat16 taps, 130k of the demo target's.
PREFILL_HOLD_BYTES = 512 << 20


def prefill_chunks(n: int, step: int, horizon: Optional[Tuple[int, int]] = None, prompt_rows: int = 0,
                   before: int = 0):
    """(start, end, read) chunks of `n` prompt tokens, `step` at most: mlx-lm's
    chunks, unless a `horizon` (first, last) leaves rows no draft will read
    (after the first `first` context rows, `before` of which the drafter holds
    already, and behind the last `last` of the `prompt_rows` to come), which get
    chunks of their own with `read` False."""
    a = b = n
    if horizon is not None:
        first, last = horizon
        a = min(max(first - before, 0), n)
        b = max(a, min(n, prompt_rows - last))
    if b == a:
        a = b = n
    out = []
    for lo, hi, read in ((0, a, True), (a, b, False), (b, n, True)):
        out += [(s, min(s + step, hi), read) for s in range(lo, hi, step)]
    return out


def prefill(target, source, dstate, prompt: mx.array, tcache, step: int = PREFILL_STEP, hold: int = PREFILL_HOLD_BYTES,
            before_last=None, taps: bool = True, skip: bool = False, before: int = 0):
    """Run the prompt through the target: the first token waits for nothing else.

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
        _, hidden = target(body[None, s:e], tcache, last_only=True, taps=taps and read)
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


def draft(source, dstate, last, hidden, width: int, params: SamplingParams, copied: Sequence[int] = (),
          proc: Optional[Processed] = None, alternatives: bool = False, scales: Optional[Sequence[float]] = None):
    """Draft tokens [width - 1], their log probabilities when sampling (else
    None) and, with `alternatives` (greedy, nothing copied), the drafter's 2nd
    and 3rd choices at each position [width - 1, 2] (else None).

    `copied` tokens (a lookup's) take the first positions, each a certain
    draft (a point mass); the drafter fills the rest, and is not run when
    nothing is left to fill. With logits processors (`proc`), each drafter
    position is processed after the drafts before it, so they go one by one.
    When sampling, drafter position i is drawn at `scales[i]` (`proposal.py`).
    """
    alts = None
    tokens, qs, n = [], [], len(copied)
    if n:
        tokens.append(mx.array(copied, dtype=mx.uint32))
        if not params.greedy:
            qs.append(point_masses(tokens[0], source.vocab_size))
    path = None
    if n < width - 1:
        path = source.propose_path(dstate, last, hidden, width, params, copied, proc.row if proc else None,
                                   scales)
    if path is not None:  # the source drew each position after the ones before it
        tokens.append(path[0])
        if not params.greedy:
            qs.append(path[1])
    elif n < width - 1:
        logits = source.propose(dstate, last, hidden, width)[n:]
        if alternatives and params.greedy and not proc and n == 0:
            alts = trees.alternatives(logits)
        rows = [logits] if not proc else [None] * logits.shape[0]
        for i, row in enumerate(rows):
            if proc:
                before = mx.concatenate(tokens) if len(tokens) > 1 else (tokens or [None])[0]
                row = proc.row(logits[i : i + 1], before)
            if params.greedy:
                tokens.append(mx.argmax(row, axis=-1).astype(mx.uint32))
            else:
                lp = log_probs(row, params)
                qs.append(lp if scales is None else rescale(lp, scales[n + i]))
                tokens.append(mx.random.categorical(qs[-1]).astype(mx.uint32))
    tokens = tokens[0] if len(tokens) == 1 else mx.concatenate(tokens)
    if params.greedy:
        return tokens, None, alts
    return tokens, qs[0] if len(qs) == 1 else mx.concatenate(qs), alts


class Verified(NamedTuple):
    drafts: mx.array  # the tokens verified after `last`
    accepted: mx.array
    token: mx.array  # the target's token after the accepted drafts
    hidden: mx.array  # taps of the block
    logprobs: Optional[tuple]  # `token_logprobs` of the block's rows, when asked for
    alternatives: Optional[mx.array] = None  # the drafter's 2nd and 3rd choices, for the sizer
    logits: Optional[mx.array] = None  # the block's rows and what the drafts were drawn from, kept
    q_lp: Optional[mx.array] = None  # when the proposal scales learn from this cycle (`proposal.py`)


class Stepped(NamedTuple):
    token: mx.array  # [1]: it is the next step's input as it is
    hidden: Optional[tuple]  # the tapped layers' outputs [1, 1, D] each, joined later (`joined`)
    logprobs: Optional[tuple]


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


def verify(target, tcache, last, tokens, q_lp, params: SamplingParams, top: Optional[int] = None,
           proc: Optional[Processed] = None, keep: bool = False) -> Verified:
    """One target pass over [last, tokens]: accepted count, next token, taps
    (and with `top`, the log probabilities of the tokens it commits; with
    `keep`, the block's logits and `q_lp`)."""
    block = mx.concatenate([last, tokens])
    logits, hidden = target(block[None], tcache, record=True)
    logits = logits[None, 0] if not proc else proc(logits[0], tokens)[None]
    accepted, nxt = verify_accept(tokens, logits[0], params, q_lp)
    lps = None
    if top is not None:
        rows = mx.arange(block.shape[0])
        ahead = mx.concatenate([tokens, nxt.reshape(1).astype(tokens.dtype)])
        lps = token_logprobs(logits[0], mx.where(rows == accepted, nxt.astype(tokens.dtype), ahead), top)
    if keep:
        return Verified(tokens, accepted, nxt, hidden, lps, logits=logits[0], q_lp=q_lp)
    return Verified(tokens, accepted, nxt, hidden, lps)


def step(target, tcache, last, params: SamplingParams, record: bool = False, top: Optional[int] = None,
         proc: Optional[Processed] = None, taps: bool = True) -> Stepped:
    """One plain decoding step, as mlx-lm's: the token after `last`, and the
    taps as a tuple of the tapped layers' outputs (None with `taps=False`):
    `joined` concatenates a run of steps' taps at once when the drafter reads them.

    The loop records nothing for a rollback: a plain step is never cropped.
    """
    logits, hidden = target(last[None], tcache, record=record, taps="layers" if taps else False)
    logits = logits[0, -1:] if not proc else proc.row(logits[0, -1:])
    token = pick(logits, params)
    return Stepped(token, hidden, None if top is None else token_logprobs(logits, token, top))


class TreeVerified(NamedTuple):
    tree: trees.Tree
    picks: mx.array  # the target's greedy token after each node
    hidden: mx.array  # taps of every node
    logprobs: Optional[tuple]  # `token_logprobs` of every node's pick, when asked for


def draft_tree(source, dstate, last, hidden, width: int, branches: int) -> trees.Tree:
    """The drafter's best path over `width` positions and `branches` branches (`tree.build`)."""
    return trees.build(last, source.propose(dstate, last, hidden, width), branches)


def verify_tree(target, tcache, tree: trees.Tree, top: Optional[int] = None) -> TreeVerified:
    """One target pass over every node of `tree`: each node's greedy pick, and the taps."""
    logits, taps = target(tree.tokens[None], tcache, tree=(tree.mask, tree.runs()))
    picks = mx.argmax(greedy_log_probs(logits[0]), axis=-1)
    return TreeVerified(tree, picks, taps, None if top is None else token_logprobs(logits[0], picks, top))


def accept_tree(target, tcache, v: TreeVerified):
    """The cycle's one host synchronisation for a tree, the walk, and the
    caches cut to the accepted branch: (accepted, tokens, taps of the accepted
    nodes, logprob rows, whether a branch was taken, where the best path
    failed: `tree.missed`, None if it held)."""
    t = v.tree
    N, B, W = t.size, t.branches, t.width
    out = mx.concatenate([t.tokens, v.picks.astype(mx.uint32), t.forks.astype(mx.uint32),
                          t.alternatives.reshape(-1)])
    mx.eval(out, v.logprobs)
    values = out.tolist()
    path, bonus = trees.walk(W, t.length, values[2 * N : 2 * N + B], values[:N], values[N : 2 * N])
    target.keep_rows(tcache, path, N)
    hidden = v.hidden if path[-1] < W else mx.take(v.hidden, mx.array(path), axis=1)
    lps = v.logprobs and [logprob_rows(v.logprobs, N)[i] for i in path]
    held = sum(1 for i in path[1:] if i < W)  # depth the best path held to
    alts = values[2 * N + B :]
    missed = None if held == W - 1 else trees.missed(alts, len(alts) // (W - 1), held + 1, values[N + held])
    return len(path) - 1, [values[i] for i in path[1:]] + [bonus], hidden, lps, path[-1] >= W, missed


PLAIN_STEPS = 4  # plain steps a width-1 timing runs back to back


def cycle_parts(pair, n: int, branches: int = 0):
    """The two halves of a greedy cycle over n tokens of random context, for timing.

    `draft(w)` returns lazy draft tokens, committing first the taps of about
    as many rows as a cycle of that width commits (as in the loop); `verify(w,
    tokens)` runs the verify pass, fetches its result (the cycle's one host
    synchronisation) and crops the caches back, so every call sees the same
    context. Width 1 is timed as the loop runs plain steps: `PLAIN_STEPS`
    steps, each launched before the host reads the one before (a step that
    waited for its own read would cost more than the loop pays, and make
    drafting look cheaper than it is); it returns how many steps it ran, and
    trimmable caches are trimmed back (a recurrent state just goes on). With
    `branches` (a target that `supports_tree`), drafted cycles are trees with
    that many branches. The third item returned is the seconds per row the
    drafter took to catch up on the context once the target's caches were
    made (as after a prefill): the taps' own work (e.g. a tapped last layer)
    and the drafter's projection. `draft(w, b)` drafts a tree of b branches
    whatever `branches` says (0: a linear draft).
    """
    target, source = pair.target, pair.draft_source
    greedy = SamplingParams()
    prompt = mx.random.randint(0, target.vocab_size, (n,), key=mx.random.key(n))
    tcache, dstate = target.make_cache(), source.new_state()
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
            tokens = draft_tree(source, dstate, last, taps[:, -rows:], w, b)
        else:
            tokens = draft(source, dstate, last, taps[:, -rows:], w, greedy)[0]
        source.rewind(dstate, rows)  # the lazy draft keeps what it read
        return tokens

    def run_verify(w, tokens):
        if w == 1:
            ahead = step(target, tcache, last, greedy)
            mx.async_eval(ahead)
            for _ in range(PLAIN_STEPS - 1):
                nxt = step(target, tcache, ahead.token, greedy)
                mx.async_eval(nxt)
                ahead.token.item()
                ahead = nxt
            ahead.token.item()
            for c in tcache:
                if c.is_trimmable():
                    c.trim(PLAIN_STEPS)
            return PLAIN_STEPS
        if isinstance(tokens, trees.Tree):  # as `accept_tree`, always through a branch (its rows moved)
            t = tokens
            N, W, L = t.size, t.width, t.length
            v = verify_tree(target, tcache, t)
            out = mx.concatenate([t.tokens, v.picks.astype(mx.uint32), t.forks.astype(mx.uint32),
                                  t.alternatives.reshape(-1)])
            values = out.tolist()
            forks = values[2 * N : 2 * N + t.branches]
            path = trees.walk(W, L, forks, values[:N], values[N : 2 * N])[0]
            if path[-1] < W:
                path = (list(range(forks[0])) + list(range(W, W + L)))[:W]
            target.keep_rows(tcache, path, N)
            target.crop(tcache, 0, len(path))
            return
        n_acc, nxt = verify(target, tcache, last, tokens, None, greedy)[1:3]
        mx.concatenate([n_acc.reshape(1).astype(tokens.dtype), tokens, nxt.reshape(1).astype(tokens.dtype)]).tolist()
        target.crop(tcache, 0, w)

    return run_draft, run_verify, catch_up


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
    (an array of rows) or a plain step's (`Stepped.hidden`, a tuple of the
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


def launch(target, source, dstate, tcache, last, taps, plan: Plan, offer, params: SamplingParams,
           top: Optional[int] = None, proc: Optional[Processed] = None, tapped: bool = True,
           alternatives: bool = False, scales: Optional[Sequence[float]] = None, keep: bool = False):
    """Start one cycle on the device (`mx.async_eval`): a plain step, or a
    draft (the drafter first given `taps`, the taps of committed tokens it has
    not seen) and its verify pass, linear or as a tree (`plan.branches`).
    Returns the cycle in flight and the taps still held back (all of them
    when the plan does not run the drafter); a plain step computes taps only
    when `tapped` (the request keeps the drafter's context). With `alternatives`, a linear
    cycle also brings the drafter's 2nd and 3rd choices (for the sizer). When
    sampling, drafter position i draws at `scales[i]`, and with `keep` the
    cycle keeps what the proposal scales learn from (`Verified.logits`)."""
    if plan.width == 1:
        pending = step(target, tcache, last, params, top=top, proc=proc, taps=tapped)
    else:
        hidden = None
        if plan.drafts:
            hidden = joined(caught_up(source, dstate, taps)) if taps else None
            taps = []
        if plan.branches:
            pending = verify_tree(target, tcache, draft_tree(source, dstate, last, hidden, plan.width, plan.branches),
                                  top)
        else:
            tokens, q_lp, alts = draft(source, dstate, last, hidden, plan.width, params, offer[: plan.copied], proc,
                                       alternatives, scales)
            pending = verify(target, tcache, last, tokens, q_lp, params, top=top, proc=proc,
                             keep=keep and scales is not None)._replace(alternatives=alts)
    mx.async_eval(pending)
    return pending, taps


class _TextStream:
    """Detokenizes committed tokens and holds back text that may start a stop string."""

    def __init__(self, tokenizer, stop: Sequence[str]):
        self.tokenizer = tokenizer
        self.detok = tokenizer.detokenizer if tokenizer is not None else None
        if self.detok is not None:
            self.detok.reset()
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.ids: List[int] = []  # committed so far (kept only when there are stop strings)
        self.text = ""
        self.emitted = 0
        self.matched: Optional[str] = None  # the stop string found

    def add(self, tokens: List[int], final: bool):
        """Returns (new text, how many of `tokens` to keep, whether a stop string ended the text)."""
        if self.detok is None:
            return "", len(tokens), False
        for t in tokens:
            self.detok.add_token(t)
        if final:
            self.detok.finalize()
        self.text = self.detok.text
        if self.stop:
            for s in self.stop:
                i = self.text.find(s, max(0, self.emitted - len(s)))
                if i >= 0:
                    self.text, self.matched = self.text[:i], s
                    return self._flush(i), self._needed(tokens, s), True
            self.ids += tokens
        end = len(self.text) if final else max(self.emitted, len(self.text) - self.hold)
        return self._flush(end), len(tokens), False

    def _needed(self, tokens: List[int], stop: str) -> int:
        """How many of `tokens` it took to complete `stop` (the detokenizer may show text a few tokens late)."""
        for n in range(1, len(tokens)):
            if stop in self.tokenizer.decode(self.ids + tokens[:n]):
                return n
        return len(tokens)

    def _flush(self, end):
        out = self.text[self.emitted : end]
        self.emitted = max(self.emitted, end)
        return out


def block_policy(pair, source, block_size, tree: int = 0, params: Optional[SamplingParams] = None):
    """The policy that picks each cycle's plan (`adaptive.Plan`: width, draft
    positions copied from the source's lookup offer, tree branches): a size
    (with `tree` branches), 'auto' (measured costs and acceptance; needs
    `pair`) or a policy object (`start(seeded, branches)` returning a run
    with `choose(context, offer)`, `update(plan, accepted, tokens)` and
    `lookup_pays(context)`, and optionally `drafter_pays(first, last)`: False
    when no cycle of the request between those context lengths will run the
    drafter, so it needs no drafter context; a run whose `learns_branches` is true is also
    given `update(..., missed)`, see `BlockSizer.update`). `choose` is asked
    once per cycle; after a plain cycle, before that cycle's `update`
    (without an offer: the token it needs is not read yet). 'auto' learns
    per sampling settings (`params`)."""
    if hasattr(block_size, "start"):
        return block_size
    if block_size == "auto":
        shared = pair.auto_sizer(params)  # the pair's drafter keeps acceptance across requests
        return shared if source is pair.draft_source else BlockSizer(shared.curve, source.block_size)
    block_size = block_size or source.block_size
    if not isinstance(block_size, int) or block_size < 1:
        raise DFlashError(f"--block-size must be a positive integer or 'auto' (got {block_size}).")
    return FixedWidth(block_size, tree)


def stream_generate(
    pair,
    prompt: Union[str, Sequence[int]],
    max_tokens: int = 256,
    sampling: Optional[SamplingParams] = None,
    block_size: Union[int, str, None, object] = None,
    stop: Sequence[str] = (),
    prefill_step: int = PREFILL_STEP,
    draft_source: Optional[DraftSource] = None,
    lookup: bool = True,
    prompt_cache: Optional[PromptCache] = None,
    logprobs: Optional[int] = None,
    logits_processors: Sequence = (),
    tree: Optional[int] = None,
    proposal_scale: Union[str, float, object] = "auto",
) -> Iterator[GenerationEvent]:
    """Generate with DFlash, yielding one event per verify cycle.

    With `lookup`, the policy may draft from the source's free offers (an
    n-gram lookup over the prompt and the text so far) as well as from the
    drafter; a fixed block size always drafts with the drafter alone. With a
    `prompt_cache`, the longest prefix of the prompt it holds is not computed
    again, and this request's caches are kept there when it ends. With
    `logprobs=k`, each event has the log probability of each token and the
    k most likely tokens at its position (mlx-lm's: from the target's logits).
    `logits_processors` (mlx-lm's, e.g. `make_logits_processors` penalties and
    logit bias) apply at every position, drafts included, as in mlx-lm.

    Tree verification (`tree.py`, greedy): with a fixed block size and
    `tree=n`, each drafted cycle verifies the drafter's best path and n
    branches in one target pass; with 'auto' and `tree=n`, the sizer verifies
    trees of up to n branches in the cycles where its costs and acceptance
    say they pay (unset: as many as its cost curve timed, `BlockSizer.default_branches`:
    so trees are weighed by default where the target can verify them, at this machine's
    measured tree costs). Verification stays linear,
    silently, where a tree cannot run: sampling (with `tree` unset), a target
    with other caches than KV caches (Gated DeltaNet, sliding windows),
    logits processors, a prompt cache that handed over other caches.

    When sampling, the drafter's drafts are drawn from its distribution made
    flatter or sharper by `proposal_scale` (`proposal.py`; any proposal is
    exact): 'auto' learns the best scale per draft position from the
    acceptance each would have had; a number fixes it (1: the drafter's own q);
    a `ProposalScales` object learns into that object.
    """
    params = sampling or SamplingParams()
    if tree is not None and (not isinstance(tree, int) or tree < 0):
        raise DFlashError(f"tree must be a number of branches >= 0 (got {tree}).")
    if tree and not params.greedy:
        raise DFlashError("Tree verification is greedy only (temperature 0); use tree=0 to sample.")
    if logprobs is not None and logprobs < 0:
        raise DFlashError(f"logprobs must be >= 0 (got {logprobs}).")
    if not (proposal_scale == "auto" or hasattr(proposal_scale, "start")
            or isinstance(proposal_scale, (int, float)) and proposal_scale > 0):
        raise DFlashError(f"--proposal-scale must be 'auto' or a number > 0 (got {proposal_scale}).")
    target, tokenizer = pair.target, pair.tokenizer
    source = draft_source or pair.draft_source
    policy = block_policy(pair, source, block_size, tree or 0, params)
    if max_tokens < 1:
        raise DFlashError(f"--max-tokens must be >= 1 (got {max_tokens}).")
    if isinstance(prompt, str):
        prompt = tokenizer.encode(prompt)
    if len(prompt) == 0:
        raise DFlashError("The prompt is empty; give some text with --prompt or on stdin.")
    window = getattr(target.args, "max_position_embeddings", None)
    if window and len(prompt) > window:
        raise DFlashError(f"The prompt has {len(prompt)} tokens but the model reads at most {window} "
                          "(max_position_embeddings); shorten the prompt.")
    eos = set(tokenizer.eos_token_ids) if tokenizer is not None else set()
    # A request that never drafts and keeps nothing decodes as mlx-lm does:
    # no taps, no drafter context, no n-gram index.
    plain = isinstance(policy, FixedWidth) and policy.plan == PLAIN and prompt_cache is None
    lookup = lookup and not plain
    if params.seed is not None:
        mx.random.seed(params.seed)

    stats = GenerationStats(prompt_tokens=len(prompt))
    text = _TextStream(tokenizer, stop)

    tic = time.perf_counter()
    if prompt_cache is None:
        tcache, dstate, reused = target.make_cache(), source.new_state(), 0
    else:
        tcache, dstate, reused = prompt_cache.fetch(target, source, prompt)
    at_prompt = None

    def keep(cache):  # a recurrent state cannot be trimmed back to the prompt later: keep it now (no copy)
        nonlocal at_prompt
        at_prompt = (len(prompt) - 1, snapshot(cache))

    can_tree = params.greedy and not logits_processors and target.can_verify_tree(tcache)
    # Unset, as many branches as the policy's cost curve timed (its trees passed `trees.works` then).
    branches = (getattr(policy, "default_branches", 0) if tree is None else tree) if can_tree else 0
    if tree and branches and not trees.works(target):
        branches = 0
    # A seeded sampled request's widths (and so its random draws) depend on nothing
    # earlier requests left behind; a greedy one's text does not depend on its widths.
    seeded = params.seed is not None and not params.greedy
    sizer = policy.start(seeded=seeded, branches=branches)
    learn = getattr(sizer, "learns_branches", False)
    # The drafter's context (the target's taps) is kept only where a drafted cycle could pay: a
    # sizer on a cost curve where even every draft accepted would not never drafts in this request.
    drafter = not plain and (prompt_cache is not None or not hasattr(sizer, "drafter_pays")
                             or sizer.drafter_pays(len(prompt), len(prompt) + max_tokens))
    scaler = None
    if not params.greedy and drafter:
        if hasattr(proposal_scale, "start"):
            scaler = proposal_scale
        elif proposal_scale != "auto":
            scaler = FixedScale(proposal_scale)
        elif source is pair.draft_source:
            scaler = pair.proposal_scales(params)  # the pair's drafter keeps them across requests
        else:
            scaler = ProposalScales(source.block_size - 1)
        scaler = scaler.start(seeded=seeded)
    trimmable = prompt_cache is None or can_trim(tcache)
    logits, taps = prefill(target, source, dstate, mx.array(prompt[reused:]), tcache, prefill_step,
                           before_last=None if trimmable else keep, taps=drafter, skip=True, before=reused)
    proc = Processed(logits_processors, prompt)
    logits = proc.row(logits[None])[0] if proc else logits
    last = pick(logits[None], params)
    proc.commit(last)
    lps = None if logprobs is None else token_logprobs(logits[None], last, logprobs)
    if lps is not None:
        mx.eval(last, lps)
        lps = logprob_rows(lps, 1)
    tokens = [last.item()]
    stats.cached_tokens = reused
    stats.prompt_tps = len(prompt) / (time.perf_counter() - tic)
    if lookup or drafter:
        source.commit(dstate, list(prompt) + tokens)
    history = list(prompt) + tokens  # the target's cache holds all but the last of these
    tic = time.perf_counter()

    # `taps`: target taps of committed tokens not yet given to the drafter (the prompt's first),
    # `unseen` rows of them (what the drafter's first drafted cycle catches up on)
    unseen = sum(t.shape[1] for t in taps)
    accepted, ahead, plan, scales, learned = 0, None, None, None, None
    while True:
        # Commit this cycle's tokens: stop on EOS or the budget.
        finish = None
        for i, t in enumerate(tokens):
            if t in eos:
                tokens, finish = tokens[:i], "stop"
                break
        lps = lps and lps[: len(tokens)]
        left = max_tokens - stats.generation_tokens - len(tokens)
        if finish is None and left <= 0:
            finish = "length"

        # Launch the next cycle before the host detokenizes and hands text
        # over; but the prompt's token first: the first drafted cycle may
        # make the drafter catch up on the whole prompt.
        pending, deferred = None, False
        if finish is None and ahead is not None:
            pending, plan = ahead, PLAIN  # a plain step already under way
        elif finish is None:
            offer = []
            if plan is None:
                offer = source.offer(dstate, source.block_size - 1) if lookup else []
                plan = sizer.choose(len(prompt) + stats.generation_tokens + len(tokens), offer,
                                    unseen=unseen, left=left)
            width = min(plan.width, left)
            copied = min(plan.copied, width - 1, len(offer))
            plan = Plan(width, copied, min(plan.branches, branches) if width > 1 and not copied else 0)
            scales = None
            if scaler is not None and plan.drafts and not plan.branches:
                scales = scaler.choose(plan.width - 1)
            cycle = (target, source, dstate, tcache, last, taps, plan, offer, params, logprobs, proc, drafter, learn,
                     scales, scales is not None and scaler.learning())
            deferred = stats.cycles == 0 and plan.width > 1
            if not deferred:
                pending, taps = launch(*cycle)
                unseen = unseen if taps else 0

        segment, kept, stopped = text.add(tokens, final=finish is not None)
        if stopped:  # later tokens, and the cycle in flight, are dropped
            tokens, finish = tokens[:kept], "stop"
            lps = lps and lps[:kept]
            stats.stop_sequence = text.matched
        stats.generation_tokens += len(tokens)

        elapsed = time.perf_counter() - tic
        stats.generation_tps = stats.generation_tokens / elapsed if elapsed > 0 else 0.0
        stats.peak_memory_gb = peak_memory_gb()
        stats.finish_reason = finish
        if finish is not None and scaler is not None:
            stats.proposal_scales = scaler.describe()
        yield GenerationEvent(segment, tokens, accepted, stats, finish, lps)
        if finish is not None:
            if prompt_cache is not None:
                keep_caches(prompt_cache, target, source, dstate, tcache, history, taps,
                            pending or ahead, plan, at_prompt)
            if block_size == "auto" and source is pair.draft_source:
                pair.keep_rates()  # what the pair's sizers learnt outlives the process, as its cost curve does
            return
        if deferred:
            pending, taps = launch(*cycle)
            unseen = unseen if taps else 0

        done, ahead, nxt_plan, missed = plan, None, None, None
        if plan.width == 1:
            # Plain decoding runs one step ahead, as mlx-lm's generate_step
            # does: the next step is launched before the host reads this token,
            # unless a lookup draft might be worth waiting for it.
            nxt, hidden, lps = pending
            proc.commit(nxt)
            context = len(prompt) + stats.generation_tokens + 1
            if max_tokens - stats.generation_tokens > 1 and not (
                    lookup and source.may_offer(dstate) and sizer.lookup_pays(context)):
                nxt_plan = sizer.choose(context, unseen=unseen + 1,
                                        left=max_tokens - stats.generation_tokens - 1)
                if nxt_plan == PLAIN:
                    ahead = step(target, tcache, nxt, params, top=logprobs, proc=proc, taps=drafter)
                    mx.async_eval(ahead)
            if lps is not None:
                mx.eval(nxt, lps)
                lps = logprob_rows(lps, 1)
            accepted, tokens = 0, [nxt.item()]  # the cycle's one host synchronisation
            history += tokens
        elif isinstance(pending, TreeVerified):
            accepted, tokens, hidden, lps, branched, missed = accept_tree(target, tcache, pending)
            nxt = mx.array(tokens[-1])
            history += tokens
            stats.tree_cycles += 1
            stats.branch_cycles += branched
        else:
            d_tokens, n_acc, nxt, hidden, lps, alts = pending[:6]
            n, dt = d_tokens.shape[0], d_tokens.dtype
            out = mx.concatenate([n_acc.reshape(1).astype(dt), d_tokens, nxt.reshape(1).astype(dt)]
                                 + ([] if alts is None else [alts.reshape(-1).astype(dt)]))
            mx.eval(out, lps, None if learned is None else learned[1])  # the cycle's one host synchronisation
            values = out.tolist()
            accepted = values[0]
            if learned is not None:  # an earlier cycle's, computed by now
                scaler.update(*learned)
                learned = None
            if pending.logits is not None and accepted >= plan.copied:
                # What each scale would have had accepted at the drafter's positions this verify
                # reached: left lazy, so it runs behind the next cycle, and read at its synchronisation.
                learned = reached_gains(pending, plan.copied, accepted, scales, params)
            lps = lps and logprob_rows(lps, accepted + 1)
            tokens = values[1 : 1 + accepted] + [values[n + 1]]
            if alts is not None and accepted < n:
                missed = trees.missed(values[n + 2 :], alts.shape[1], accepted + 1, tokens[-1])
            history += tokens
            proc.commit(mx.array(tokens))
            target.crop(tcache, accepted + 1, plan.width)
        if drafter:
            taps.append(hidden if isinstance(hidden, tuple) or hidden.shape[1] == accepted + 1
                        else hidden[:, : accepted + 1])
            unseen += accepted + 1
        if lookup or drafter:
            source.commit(dstate, tokens)
        if len(taps) == 256:  # a long run without the drafter: bound what is held, in one batched projection
            source.add_context(dstate, joined(taps))
            taps, unseen = [], 0
        last = nxt if done.width == 1 else nxt.reshape(1).astype(last.dtype)
        if learn:
            sizer.update(done, accepted, tokens, missed)
        else:
            sizer.update(done, accepted, tokens)
        plan = nxt_plan
        stats.cycles += 1
        stats.draft_cycles += done.width > 1
        stats.lookup_cycles += done.copied > 0
        stats.acceptance_lengths.append(accepted + 1)


def keep_caches(prompt_cache, target, source, dstate, tcache, history, taps, inflight, plan, at_prompt):
    """Hand a finished request's caches to the prompt cache.

    A cycle still in flight has fed the last committed token: its row is
    kept (a verify is cropped to it) so the caches hold all of `history`
    but nothing beyond it; the drafter is given the taps it has not seen.
    """
    rows = len(history) - 1
    if inflight is not None:
        hidden = inflight.hidden
        if plan.width > 1:
            target.crop(tcache, 1, hidden.shape[1])  # a tree pass is wider than its plan
            hidden = hidden[:, :1]
        taps.append(hidden)
        rows += 1
    if taps:
        source.add_context(dstate, joined(caught_up(source, dstate, taps)))
    mx.eval([c.state for c in tcache], source.arrays(dstate))
    prompt_cache.store(target, source, dstate, history[:rows], tcache, at_prompt)


def generate(pair, prompt, **kwargs):
    """Returns (text, stats)."""
    pieces = []
    stats = None
    for event in stream_generate(pair, prompt, **kwargs):
        pieces.append(event.text)
        stats = event.stats
    return "".join(pieces), stats
