"""Speculative decoding of several sequences at once.

Each cycle drafts every active sequence's block (the drafter, per sequence) and
verifies all of them in one target pass over a [B, width] block; each sequence
keeps its own longest agreeing prefix plus the target's token, and its caches
are cropped on their own (`RaggedKVCache.crop`: no copy). One host
synchronisation per cycle reads every sequence's acceptance. A sequence joins
after its own prefill (its caches are merged into the batch's) and leaves when
it finishes (its rows are dropped).

Each sequence keeps its own sampling settings, logits processors and log
probabilities. A greedy one gets the tokens it gets alone; a seeded sampled one
draws with its seed's `sampling.Draws`, whose tokens do not depend on the
widths, so it gets the text it gets alone; an unseeded sampled one is verified
by rejection sampling, as alone, with drafts drawn at the pair's learned
proposal scales (`policy/proposal.py`), which it teaches as it goes.
"""

import time
from dataclasses import dataclass, fields
from itertools import count
from typing import Any, Generator, List, Optional, Sequence

import mlx.core as mx

from ..errors import DFlashError
from ..policy.batch import WIDTHS
from ..policy.join import JoinChunks
from ..policy.plan import Plan
from ..draft.lookup import point_masses
from ..policy.proposal import reached_gains
from ..sampling import Draws, Processed, SamplingParams, choose, pick
from ..decode.cycle import Block, LinearCycle, PlainStep, Rows
from ..decode.passes import (PREFILL_STEP, Draft, caught_up, draft, drained, joined, logprob_rows, pick_drafts,
                             prefill_steps, token_logprobs)
from ..decode.request import HELD_TAPS, proposal_scaler
from ..decode.sequence import GREEDY, SequenceState
from .cache import add_to, batch_of
from .drafts import DraftBatch

# Prompts joining together are prefilled in one padded pass up to this many tokens in all;
# beyond, each is prefilled alone in mlx-lm's chunks, so a long prompt holds memory as it does alone.
BATCH_PREFILL = 2048


def can_batch(target) -> bool:
    """Whether the target's caches can be batched here (the adapter's `batchable`)."""
    return target.batchable


def batch_width(pair, block_size) -> Optional[int]:
    """The widest cycle a batch of this pair runs (`block_size`, or for 'auto' the widest
    candidate of `policy.batch.WIDTHS`), None where the target cannot be batched."""
    if not can_batch(pair.target):
        return None
    width = block_size if isinstance(block_size, int) else max(WIDTHS)
    return max(1, min(width, pair.draft_source.block_size))


@dataclass
class Asks:
    """How a sequence wants its tokens picked."""

    params: SamplingParams = GREEDY
    processors: Sequence = ()  # mlx-lm logits processors (penalties, logit bias)
    logprobs: Optional[int] = None  # with each token its log probability and this many top tokens


@dataclass(kw_only=True)
class Running(SequenceState):
    """One sequence of the batch."""

    uid: int
    run: Any = None  # its run of the pair's sizer (`policy.sizer.SizerRun`): how much of a lookup offer to copy
    lesson: Optional[tuple] = None  # what its scales learn from its last drafted cycle (lazy)

    def pick(self, logits: mx.array, noise: Optional[mx.array]):
        """Its next token from its row of `logits` (and its log probabilities): greedy, its
        draws, or (unseeded) mlx-lm's sampler."""
        if self.proc:
            logits = self.proc.row(logits)
        picks = pick(logits, self.params) if self.rejection else choose(logits, self.params, noise)
        return picks, None if self.top is None else token_logprobs(logits, picks, self.top)

    def commit(self, tokens: List[int]) -> None:
        self.history += tokens
        self.drawn(mx.array(tokens), len(tokens))


@dataclass
class Committed:
    """What a cycle committed for one sequence, and why it ended, if it did."""

    uid: int
    tokens: List[int]
    finish: Optional[str] = None  # "stop" (EOS) or "length"
    accepted: int = 0  # draft tokens the target accepted
    logprobs: Optional[list] = None  # per token (log probability, [(token, log probability)] best first)
    first: bool = False  # the sequence's first token (its prompt is prefilled)
    filling: bool = False  # no token yet: the prompt is prefilled a chunk per cycle (`fill`)


@dataclass
class Proposal:
    """What a drafted cycle verifies (`block`), and how each sequence's drafts were made."""

    block: Block
    scales: list  # per sequence, the proposal scales of its drafter's positions (unseeded sampling)
    copies: List[List[int]]  # per sequence, the lookup tokens in its first draft positions


@dataclass
class Filling:
    """A sequence whose prompt is prefilled a chunk at a time, between the batch's cycles."""

    uid: int
    prompt: List[int]
    max_tokens: int
    source: Any
    asks: Optional["Asks"]
    tcache: list
    dstate: Any
    steps: Generator  # `passes.prefill_steps`: one chunk per `next`


class BatchDecoder:
    """Sequences decoded together, each cycle at a width of at most `width` (1: plain batched
    decoding). Above 1 the target's taps of every committed token reach each sequence's
    drafter, so any cycle may draft."""

    def __init__(self, pair, width: int, prompt_cache=None, lookup: bool = False):
        """With a `prompt_cache`, each sequence starts from the longest prefix it holds and
        what a finished sequence computed is kept there (`keep`). With `lookup`, a drafted
        cycle's first positions may be copied from each sequence's n-gram lookup, as much
        as the pair's sizer (`pair.auto_sizer`, at the sequence's settings) expects to pay."""
        self.pair, self.target, self.source = pair, pair.target, pair.draft_source
        self.prompt_cache, self.lookup = prompt_cache, lookup
        self.finished: list = []  # (sequence, its caches) of finished sequences, for `keep`
        if not can_batch(self.target):
            raise DFlashError(f"'{self.target.model_type}' has caches batched decoding cannot hold together.")
        if width < 1:
            raise DFlashError(f"The batch's block width must be >= 1 (got {width}).")
        self.width = min(width, self.source.block_size)
        self.eos = set(pair.tokenizer.eos_token_ids) if pair.tokenizer is not None else set()
        self.window = getattr(self.target.args, "max_position_embeddings", None)
        # Per layer: one sequence's own cache (the target's kinds), or for several a `RaggedKVCache`
        # or an `ArraysCache` of recurrent states (`batched`).
        self.cache: list = []
        self.batched = False
        # The drafter's contexts of the first len(pool) sequences, drafted in one pass (`batch.drafts`);
        # a sequence joins it at its first drafted cycle. None: each sequence drafts on its own.
        self.pool: Optional[DraftBatch] = None
        self.poolable = self.source.pooled() if self.width > 1 else None
        self.seqs: List[Running] = []
        self.filling: List[Filling] = []
        # A plain step launched from the last one's tokens before the host read them.
        self._ahead: Optional[PlainStep] = None
        self._uids = count()
        self.joins = JoinChunks()  # how much of a joining prompt to prefill between cycles

    def __len__(self) -> int:
        """Sequences in the batch: decoding, or still prefilling (`fill`)."""
        return len(self.seqs) + len(self.filling)

    def add(self, prompt: Sequence[int], max_tokens: int, source=None, asks: Optional[Asks] = None,
            chunked: bool = False) -> Committed:
        """Prefill `prompt`, then join the batch; its first token (and whether it already ended).
        `source`: the sequence's own draft source (default: the pair's drafter); `asks`: how its
        tokens are picked (default: greedy). `chunked`, while others decode: a prompt longer than
        a join chunk (`policy.join`: sized by time) is prefilled a chunk per cycle (`fill`), and its
        `Committed` says `filling`."""
        if not prompt:
            raise DFlashError("The prompt is empty.")
        if self.window and len(prompt) > self.window:
            raise DFlashError(f"The prompt has {len(prompt)} tokens but the model reads at most {self.window}.")
        source = source or self.source
        tcache, dstate, reused = self._fetch(prompt, source)
        later = chunked and bool(self.seqs) and len(prompt) - reused > self.joins.size()
        steps = prefill_steps(self.target, source, dstate, mx.array(prompt[reused:]), tcache,
                              self.joins.size if later else PREFILL_STEP, taps=self.width > 1, skip=True,
                              before=reused)
        f = Filling(next(self._uids), list(prompt), max_tokens, source, asks, tcache, dstate, steps)
        if later:
            self.filling.append(f)
            return Committed(f.uid, [], filling=True)
        tic = time.perf_counter()
        out = self._filled(f, *drained(steps))
        self.joins.chunk(len(prompt) - reused, time.perf_counter() - tic)  # what a prefill row costs here
        return out

    def _fetch(self, prompt: Sequence[int], source):
        """(target caches, draft state, tokens reused): from the prompt cache's longest prefix, or fresh."""
        if self.prompt_cache is None:
            return self.target.make_cache(), source.new_state(), 0
        return self.prompt_cache.fetch(self.target, source, prompt)

    def fill(self) -> List[Committed]:
        """One prefill chunk of each sequence still prefilling; those done join the batch
        (their first tokens, `first` set)."""
        out = []
        for f in list(self.filling):
            tic = time.perf_counter()
            try:
                self.joins.chunk(next(f.steps), time.perf_counter() - tic)
            except StopIteration as done:
                self.filling.remove(f)
                out.append(self._filled(f, *done.value))
                out[-1].first = True
        return out

    def _filled(self, f: Filling, logits: mx.array, taps: list) -> Committed:
        """A prefilled sequence's first token; unless that ends it, it joins the batch."""
        seq = self._running(f.prompt, f.max_tokens, f.source, f.dstate, taps, f.asks, f.uid)
        last, lps = seq.pick(logits[None], seq.noise(1))
        mx.eval(last, lps, [c.state for c in f.tcache])
        out = self._start(seq, f.prompt, last, lps)
        if out.finish is None:
            self._join(seq, f.tcache)
        return out

    def add_many(self, prompts: Sequence[Sequence[int]], max_tokens: Sequence[int],
                 sources: Optional[Sequence] = None, asks: Optional[Sequence[Asks]] = None,
                 chunked: bool = False) -> List[Committed]:
        """`add` for several prompts, prefilled in one target pass where what the prompt cache
        does not hold of them is short (`BATCH_PREFILL` tokens in all): each from its cached
        prefix, the rests right-padded to the longest, each sequence's padding cropped after.
        Long prompts go one at a time, in chunks (with `chunked`, between the cycles of the
        sequences decoding)."""
        sources = [s or self.source for s in (sources or [None] * len(prompts))]
        asks = list(asks or [None] * len(prompts))
        lens = [len(p) for p in prompts]
        held = [0] * len(prompts)
        if self.prompt_cache is not None:
            held = [self.prompt_cache.reach(self.target, s, p) for p, s in zip(prompts, sources)]
        # A recurrent state would run through the padding: such prompts are prefilled alone.
        if (len(prompts) < 2 or sum(lens) - sum(held) > BATCH_PREFILL or min(lens) == 0
                or self.target.recurrent):
            return [self.add(*a, chunked=chunked) for a in zip(prompts, max_tokens, sources, asks)]
        if self.window and max(lens) > self.window:
            raise DFlashError(f"A prompt has {max(lens)} tokens but the model reads at most {self.window}.")
        # Each starts from its cached prefix (rows of its own in the ragged caches); the rest of
        # every prompt goes through in one right-padded pass.
        starts = [self._fetch(p, s) for p, s in zip(prompts, sources)]
        rest = [n - reused for n, (_, _, reused) in zip(lens, starts)]
        L = max(rest)
        block = mx.array([list(p[len(p) - r :]) + [0] * (L - r) for p, r in zip(prompts, rest)])
        cache = [batch_of(c) for c in starts[0][0]]
        for tcache, _, _ in starts[1:]:
            for batch, c in zip(cache, tcache):
                add_to(batch, c)
        tic = time.perf_counter()
        logits, hidden = self.target(block, cache, taps=self.width > 1, rows=mx.array(rest) - 1)
        for c in cache:
            c.crop([L - r for r in rest])
        seqs, picked = [], []
        for b, (p, m, source, a) in enumerate(zip(prompts, max_tokens, sources, asks)):
            taps = [hidden[b : b + 1, : rest[b]]] if self.width > 1 else []
            seqs.append(self._running(p, m, source, starts[b][1], taps, a))
            picked.append(seqs[-1].pick(logits[b], seqs[-1].noise(1)))
        mx.eval(picked, [c.state for c in cache])
        self.joins.chunk(sum(rest), time.perf_counter() - tic)
        out, keep, joined_seqs = [], [], []
        for b, (p, seq) in enumerate(zip(prompts, seqs)):
            c = self._start(seq, p, *picked[b])
            out.append(c)
            if c.finish is None:
                keep.append(b)
                joined_seqs.append(seq)
        if keep:
            for c in cache:
                c.filter(keep)
            self._drop_ahead()
            if self.cache:
                self._batch_caches()
                for batch, c in zip(self.cache, cache):
                    batch.join(c)
            else:
                self.cache, self.batched = cache, True
            self.seqs += joined_seqs
            self._alone_if_one()
        return out

    def _running(self, prompt, max_tokens: int, source, dstate, taps: list, asks: Optional[Asks],
                 uid: Optional[int] = None) -> Running:
        """A sequence about to draw its first token; its budget stops at the model's window."""
        asks = asks or Asks()
        if self.window:
            max_tokens = min(max_tokens, self.window - len(prompt) + 1)
        params = asks.params
        seeded = not params.greedy and params.seed is not None
        draws = Draws(params.seed, len(prompt), self.target.vocab_size) if seeded else None
        uid = next(self._uids) if uid is None else uid
        return Running(uid=uid, max_tokens=max_tokens, source=source, dstate=dstate, taps=taps, params=params,
                       proc=Processed(asks.processors, prompt), draws=draws, top=asks.logprobs,
                       run=self._run(params), scaler=self._scaler(source, params, draws))

    def _scaler(self, source, params: SamplingParams, draws: Optional[Draws]):
        """An unseeded sampled sequence's proposal scales (the pair's learned ones for its drafter)."""
        if params.greedy or draws is not None or self.width == 1:
            return None
        return proposal_scaler(self.pair, source, params, "auto")

    def _run(self, params: SamplingParams):
        """A sequence's sizer run, where lookups are used."""
        return self.pair.auto_sizer(params).start() if self.lookup and self.width > 1 else None

    def _start(self, seq: Running, prompt, last: mx.array, lps) -> Committed:
        """The sequence's first token `last` (evaluated, and its log probabilities): its `Committed`."""
        seq.last = last
        out = Committed(seq.uid, last.tolist(), logprobs=lps and logprob_rows(lps, 1))
        out.finish = self._finish(seq, out)
        seq.history = list(prompt)
        seq.commit(out.tokens)
        seq.source.commit(seq.dstate, seq.history)
        return out

    def adopt(self, seq: SequenceState, tcache: list) -> int:
        """Take in a sequence another loop decoded so far, as it is (its caches `tcache` hold
        every committed token but its last); its uid."""
        kept = {f.name: getattr(seq, f.name) for f in fields(SequenceState)}
        kept.update(taps=list(seq.taps), history=list(seq.history),
                    scaler=self._scaler(seq.source, seq.params, seq.draws))
        running = Running(uid=next(self._uids), run=self._run(seq.params), **kept)
        self._join(running, tcache)
        return running.uid

    def _join(self, seq: "Running", tcache: list) -> None:
        """A sequence alone decodes on its own caches; beside others, its caches' rows are
        copied into the batch's."""
        self._drop_ahead()
        if self.cache:
            self._batch_caches()
            for batch, c in zip(self.cache, tcache):
                add_to(batch, c)
        else:
            self.cache, self.batched = list(tcache), False
        self.seqs.append(seq)

    def _batch_caches(self) -> None:
        """A sequence alone's caches made the first of a batch's (its rows copied once)."""
        if not self.batched:
            self.cache, self.batched = [batch_of(c) for c in self.cache], True

    def _alone_if_one(self) -> None:
        """A batch down to one sequence: its rows become caches of its own (copied once), on which
        it decodes as a request alone does (the target's own cache kinds, trees where they run)."""
        if self.batched and len(self.seqs) == 1:
            self.cache, self.batched = [c.extract(0) for c in self.cache], False

    def step(self, width: Optional[int] = None, then: Optional[int] = None) -> List[Committed]:
        """One cycle for every sequence in the batch at `width` (default: the largest);
        finished sequences leave it. `then`: the width of the cycle after it (default: the
        same); a plain step launches the next before the host reads its tokens only where that
        is plain too, so no step is computed to be dropped. Its seconds size join chunks."""
        tic = time.perf_counter()
        out = self._cycle(width, then)
        if out:
            self.joins.cycle(time.perf_counter() - tic)
        return out

    def _cycle(self, width: Optional[int], then: Optional[int]) -> List[Committed]:
        if not self.seqs:
            return []
        w = self.width if width is None else max(1, min(width, self.width))
        if w == 1:
            return self._plain_step(ahead=then is None or then <= 1)
        self._drop_ahead()
        p = self._propose(w)
        cycle = LinearCycle(self._rows(), p.block)
        outcomes = cycle.settle(also=tuple(s.lesson[1] for s in self.seqs if s.lesson is not None))
        self._learn(p, cycle, [o.accepted for o in outcomes])
        out = []
        for b, (seq, o) in enumerate(zip(self.seqs, outcomes)):
            c = Committed(seq.uid, o.tokens, accepted=o.accepted, logprobs=o.logprobs)
            c.finish = self._finish(seq, c)
            out.append(c)
            # The caches keep a row per committed token but the newest: [last, accepted drafts], or
            # for a finished sequence, the rows of the tokens it committed (its history but the last).
            self._advance(b, seq, c, Plan(w, len(p.copies[b])), o.hidden[:, : len(c.tokens)])
        cycle.cut([len(c.tokens) for c in out])
        self._leave([b for b, c in enumerate(out) if c.finish is None])
        return out

    def _rows(self) -> Rows:
        """The batch's sequences and caches, as its cycles decode them."""
        return Rows(self.target, self.cache, self.seqs, taps=self.width > 1, batched=self.batched)

    def _plain_step(self, ahead: bool) -> List[Committed]:
        """A plain batched step, as mlx-lm's: with `ahead`, the next one is launched from this
        one's tokens on the device before the host reads them. It is dropped (its row cropped,
        no copy; recurrent states set back to those before it) where the batch changes before
        it runs (a sequence ends, joins or leaves) or the next cycle drafts after all."""
        if self._ahead is None:
            self._ahead = PlainStep(self._rows(), mx.concatenate([s.last for s in self.seqs]))
        step = self._ahead
        self._ahead = PlainStep(self._rows(), step.tokens, pending=True) if ahead else None
        outcomes = step.settle()
        out = []
        for seq, o in zip(self.seqs, outcomes):
            c = Committed(seq.uid, o.tokens, logprobs=o.logprobs)
            c.finish = self._finish(seq, c)
            out.append(c)
        if any(c.finish for c in out):
            self._drop_ahead()
            step.cut([len(c.tokens) for c in out])
        for b, (seq, c, o) in enumerate(zip(self.seqs, out, outcomes)):
            self._advance(b, seq, c, Plan(1), o.hidden if c.tokens else None)
        self._leave([b for b, c in enumerate(out) if c.finish is None])
        return out

    def _drop_ahead(self) -> None:
        """Undo the plain step launched ahead, if any: every sequence's row of it is cropped."""
        if self._ahead is not None:
            self._ahead.drop()
            self._ahead = None

    def _propose(self, width: int) -> "Proposal":
        """Every sequence's block for a cycle of `width`: its last token, then its drafts."""
        lasts = mx.concatenate([s.last for s in self.seqs])
        noises = [s.noise(width) for s in self.seqs]
        copies = [self._copies(s, width) for s in self.seqs]
        scales = [None if s.scaler is None else s.scaler.choose(width - 1) for s in self.seqs]
        if self._pooling():
            drawn = self._draft_pooled(lasts, width, noises, copies, scales)
        else:
            drawn = [self._draft(s, width, n, c, sc) for s, n, c, sc in zip(self.seqs, noises, copies, scales)]
        return Proposal(Block(lasts, mx.stack([d.tokens for d in drawn]), [d.q_lp for d in drawn], noises),
                        scales, copies)

    def _advance(self, b: int, seq: Running, c: Committed, plan: Plan, taps: Optional[mx.array]) -> None:
        """Sequence b past its committed tokens: its processors, draws, sizer run, lookup
        index and the taps its drafter will read (`taps`: its rows the caches keep; None
        where no cycle drafts)."""
        seq.commit(c.tokens)
        if seq.run is not None:
            seq.run.record(plan, c.accepted, c.tokens)
        if taps is not None and (isinstance(taps, tuple) or taps.shape[1]):
            seq.taps.append(taps)
            if len(seq.taps) == HELD_TAPS:  # a long plain run: the drafter reads them in one pass
                if self.pool is not None and b < len(self.pool):
                    pooled = self.seqs[: len(self.pool)]
                    self.pool.add_context([joined(s.taps) if s.taps else None for s in pooled])
                    for s in pooled:
                        s.taps = []
                else:
                    seq.source.add_context(seq.dstate, joined(seq.taps))
                    seq.taps = []
        if c.finish is None:
            seq.last = mx.array([c.tokens[-1]], mx.uint32)
            seq.source.commit(seq.dstate, c.tokens)

    def _leave(self, keep: List[int]) -> None:
        """The sequences not in `keep` leave; with a prompt cache, what they computed is held
        for `keep` (its drafter context handed back from the pool first)."""
        if self.prompt_cache is not None:
            kept = set(keep)
            for b, s in enumerate(self.seqs):
                if b not in kept:
                    self._unpool_one(b, s)
                    self.finished.append((s, [c.extract(b) for c in self.cache] if self.batched else self.cache))
        self._keep_only(keep)

    def gains(self, widths: Sequence[int]) -> Optional[dict]:
        """The tokens the sequences expect a cycle of each width to commit, in all, from their
        sizer runs' acceptance statistics and their lookup offers, copied as `_copies` would
        (None unless every sequence has a run)."""
        if not widths or not self.seqs or any(s.run is None for s in self.seqs):
            return None
        gains = dict.fromkeys(widths, 0.0)
        for s in self.seqs:
            offer = s.source.offer(s.dstate, max(widths) - 1)
            order = getattr(offer, "order", 0)
            alphas = s.run.alphas()
            look = s.run.lookup_alphas(order) if offer else None
            for w in widths:
                gains[w] += 1 + s.run.best_copies(len(offer), order, min(w, s.run.max_width), alphas, look)[1]
        return gains

    def keep(self) -> None:
        """Hand what finished sequences computed to the prompt cache (after their answers are out):
        the caches hold every committed token but the last, the drafter has read their taps."""
        for seq, tcache in self.finished:
            if seq.taps:
                seq.source.add_context(seq.dstate, joined(caught_up(seq.source, seq.dstate, seq.taps)))
                seq.taps = []
            mx.eval([c.state for c in tcache], seq.source.arrays(seq.dstate))
            self.prompt_cache.store(self.target, seq.source, seq.dstate, seq.history[:-1], tcache)
        self.finished = []

    def remove(self, uid: int) -> None:
        """Drop a sequence before it finished (nothing if it is not in the batch); with a prompt
        cache, what it computed is kept there as a finished one's is (`keep`)."""
        self.filling = [f for f in self.filling if f.uid != uid]
        self._drop_ahead()  # its caches then hold every committed token but the last
        self._leave([b for b, s in enumerate(self.seqs) if s.uid != uid])

    def _keep_only(self, keep: List[int]) -> None:
        """Keep the sequences at indices `keep`; the others' rows are dropped."""
        if len(keep) < len(self.seqs):
            self._drop_ahead()
        if not keep:
            self.cache, self.seqs, self.pool, self.batched = [], [], None, False
        elif len(keep) < len(self.seqs):
            for c in self.cache:
                c.filter(keep)
            if self.pool is not None:
                self.pool.filter([b for b in keep if b < len(self.pool)])
            self.seqs = [self.seqs[b] for b in keep]
            self._alone_if_one()

    def _pooling(self) -> bool:
        """Whether this cycle drafts every sequence in one pass: every sequence drafts with the
        pair's poolable source. Sequences not pooled yet join the pool (their held taps read
        into their own context first, which is then copied in); where one cannot, the pool's
        contexts go back to their sequences."""
        if self.poolable is None or any(s.source.pooled() is not self.poolable for s in self.seqs):
            if self.pool is not None:
                for b, s in enumerate(self.seqs[: len(self.pool)]):
                    self._unpool_one(b, s)
                self.pool = None
            return False
        if self.pool is None:
            self.pool = DraftBatch(self.poolable)
        joining = self.seqs[len(self.pool) :]
        for s in joining:
            if s.taps:
                s.source.add_context(s.dstate, joined(caught_up(s.source, s.dstate, s.taps)))
                s.taps = []
        if joining:
            self.pool.join([s.source.context(s.dstate) for s in joining])
        return True

    def _unpool_one(self, b: int, seq: Running) -> None:
        """Sequence b's drafter context, if the pool holds it, back into its own state."""
        if self.pool is not None and b < len(self.pool):
            seq.source.context(seq.dstate)[:] = self.pool.extract(b)

    def _copies(self, seq: Running, width: int) -> List[int]:
        """The lookup tokens a drafted cycle of `width` copies for `seq` (first positions)."""
        if seq.run is None:
            return []
        offer = seq.source.offer(seq.dstate, width - 1)
        return list(offer[: seq.run.copies(offer, width)])

    def _draft_pooled(self, lasts: mx.array, width: int, noises: list, copies: List[List[int]],
                      scales: list) -> List[Draft]:
        """Every sequence's drafts from one drafter pass, each sequence's `copies` in its first
        positions (point masses, for rejection sampling)."""
        hiddens = [joined(s.taps) if s.taps else None for s in self.seqs]
        for s in self.seqs:
            s.taps = []
        logits = self.pool.propose(lasts, hiddens, width)
        if all(s.params.greedy and not s.proc for s in self.seqs):
            tokens = mx.argmax(logits, axis=-1).astype(mx.uint32)
            drawn = [Draft(tokens[b], None, None) for b in range(len(self.seqs))]
        else:
            drawn = [pick_drafts(logits[b], s.params, s.proc or None, None if n is None else n[:-1], sc)
                     for b, (s, n, sc) in enumerate(zip(self.seqs, noises, scales))]
        return [d if not c else self._copied(d, c) for d, c in zip(drawn, copies)]

    def _copied(self, d: Draft, copies: List[int]) -> Draft:
        """`d` with a lookup's `copies` in its first positions."""
        k, n = len(copies), d.tokens.shape[0]
        copied = mx.array(copies, dtype=mx.uint32)
        tokens = mx.concatenate([copied, d.tokens[k:]]) if k < n else copied
        if d.q_lp is None:
            return Draft(tokens, None, None)
        masses = point_masses(copied, d.q_lp.shape[-1])
        return Draft(tokens, mx.concatenate([masses, d.q_lp[k:]]) if k < n else masses, None)

    def _draft(self, seq: Running, width: int, noise: Optional[mx.array], copies: Sequence[int] = (),
               scales: Optional[List[float]] = None) -> Draft:
        if len(copies) == width - 1:  # no drafter pass: its taps wait for the next one
            tokens = mx.array(copies, dtype=mx.uint32)
            return Draft(tokens, point_masses(tokens, seq.source.vocab_size) if seq.rejection else None, None)
        hidden = joined(caught_up(seq.source, seq.dstate, seq.taps)) if seq.taps else None
        seq.taps = []
        return draft(seq.source, seq.dstate, seq.last, hidden, width, seq.params, copies, proc=seq.proc or None,
                     scales=scales, noise=None if noise is None else noise[:-1])

    def _learn(self, p: Proposal, cycle: LinearCycle, accepted: List[int]) -> None:
        """Unseeded sampled sequences' proposal scales learn from the last cycle's lessons (read at
        this cycle's synchronisation); this cycle's are left lazy, to be read at the next one's."""
        for b, s in enumerate(self.seqs):
            if s.lesson is not None:
                s.scaler.update(*s.lesson)
                s.lesson = None
            copied, rows = len(p.copies[b]), cycle.processed[b]
            if rows is not None and accepted[b] >= copied and s.scaler.learning():
                s.lesson = reached_gains(rows, p.block.q_lps[b], copied, accepted[b], p.scales[b], s.params)

    def _finish(self, seq: "Running", c: Committed) -> Optional[str]:
        """Cut `c`'s tokens (and log probabilities) at the budget and at EOS; the finish
        reason, if this ends the sequence."""
        c.tokens = c.tokens[: seq.max_tokens - seq.generated]
        seq.generated += len(c.tokens)
        finish = "length" if seq.generated >= seq.max_tokens else None
        for i, t in enumerate(c.tokens):
            if t in self.eos:
                c.tokens, finish = c.tokens[:i], "stop"
                break
        if c.logprobs is not None:
            c.logprobs = c.logprobs[: len(c.tokens)]
        return finish
