"""The decoder: one sequence or several, decoded by the same cycles (`cycle.py`).

A sequence alone decodes on its own caches, each cycle as its policy's run plans it (the
adaptive sizer's width, lookup copies and tree branches), the next launched before the host
reads this one's tokens (a plain step from them on the device, where the next is plain too;
any other once this one is committed). Beside others, each cycle drafts every
sequence's block (in one drafter pass where their drafters allow) and verifies all of them in
one target pass over a [B, width] block, at the width the batch's policy picks
(`policy/batch.py`); each sequence keeps its own longest agreeing prefix plus the target's
token, and its caches are cropped on their own (`RaggedKVCache.crop`: no copy). One host
synchronisation per cycle reads every sequence's acceptance. A sequence joins after its own
prefill (its caches become a row of the batch's) and leaves when it finishes (its rows are
dropped); a batch down to one sequence goes on as that sequence alone.

Each sequence keeps its own sampling settings, logits processors and log probabilities. A
greedy one gets the tokens it gets alone; a seeded sampled one draws with its seed's
`sampling.Draws`, whose tokens do not depend on the widths, so it gets the text it gets alone;
an unseeded sampled one is verified by rejection sampling, as alone, with drafts drawn at the
pair's learned proposal scales (`policy/proposal.py`), which it teaches as it goes.
"""

import time
from dataclasses import dataclass
from itertools import count
from typing import Any, Generator, List, Optional, Sequence

import mlx.core as mx
from mlx.utils import tree_flatten

from ..cache.prompt_cache import can_trim, snapshot
from ..errors import DFlashError
from ..policy.batch import WIDTHS, BatchPolicy
from ..policy.join import JoinChunks
from ..policy.plan import PLAIN, Plan
from ..policy.planner import FORCED_RUN, CyclePlan, Planner
from ..target.ragged import add_to, batch_of
from .caches import Caches, one_part, waste
from .constrained import checked, tree_masks
from .cycle import LinearCycle, PlainStep, Rows, TreeCycle
from .drafting import Drafting
from .filling import Filling, Fillings
from .kept import Kept
from .passes import PREFILL_HOLD_BYTES, PREFILL_STEP, drained, prefill_steps
from .request import check_prompt
from .running import Asks, Committed, Proposal, Running, new_sequence

# Prompts joining together are prefilled in one padded pass up to this many tokens in all;
# beyond, each is prefilled alone in mlx-lm's chunks, so a long prompt holds memory as it does alone.
BATCH_PREFILL = 2048
# Where the joining sequences would share one part of a batch in parts anyway (`caches.one_part`),
# their rests run as one padded pass (one attention call per layer, their cached rows copied into one
# array once) instead of one attention call each per layer, while the padding adds at most this
# many times the rests' own rows: padding rows go through every projection, and the calls saved are
# worth a few rows each (fifteen prompts from the cache, a few tokens each, join in about two thirds
# of the time: `benchmarks/serving.md#many-clients-at-once`).
PAD_REST_WASTE = 2.0


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
class Launched:
    """A cycle on the device, as its sequences' plans made it."""

    cycle: Any  # decode.cycle's PlainStep, LinearCycle or TreeCycle
    plans: List[Plan]  # per sequence
    proposal: Optional[Proposal] = None  # a drafted cycle's drafts, which proposal scales learn from
    forced: Optional[List[int]] = None  # per sequence, the first drafts its grammar forced

    @property
    def plain(self) -> bool:
        return max(p.width for p in self.plans) == 1


class Decoder:
    """Sequences decoded together, each cycle at a width of at most `width` (1: plain batched
    decoding); a sequence alone runs the cycles its own policy plans."""

    def __init__(self, pair, width: int, prompt_cache=None, lookup: bool = False, block_size=None,
                 policy: Optional[BatchPolicy] = None, forced_run: int = FORCED_RUN):
        """With a `prompt_cache`, each sequence starts from the longest prefix it holds and
        what a finished sequence computed is kept there (`keep`). With `lookup`, a batch's
        drafted cycle's first positions may be copied from each sequence's n-gram lookup, as
        much as the pair's sizer (`pair.auto_sizer`, at the sequence's settings) expects to pay.
        `block_size`: the policy a sequence alone decodes by, unless it asks for its own
        (`Asks.block_size`): a width, 'auto' or a `policy.plan.Policy` (default: `width`).
        `policy` (`policy.batch`) chooses each cycle of several sequences (default: `width`);
        `forced_run`: the most tokens a grammar forces that one cycle copies as drafts
        (`policy.planner.Planner`). A target whose caches cannot be batched decodes one
        sequence at a time."""
        self.pair, self.target, self.source = pair, pair.target, pair.draft_source
        self.prompt_cache, self.lookup = prompt_cache, lookup
        self.kept = Kept(pair, prompt_cache)  # what finished sequences computed, for `keep`
        if width < 1:
            raise DFlashError(f"The batch's block width must be >= 1 (got {width}).")
        self.width = min(width, self.source.block_size)
        self.block_size = width if block_size is None else block_size
        self.eos = set(pair.tokenizer.eos_token_ids) if pair.tokenizer is not None else set()
        self.window = getattr(self.target.args, "max_position_embeddings", None)
        self.caches = Caches(split=pair.target.splits)
        self.drafting = Drafting(self.source.pooled() if self.width > 1 else None)
        self.planner = Planner(self.width, policy, forced_run)
        self._weight_bytes = max(1, sum(v.nbytes for _, v in tree_flatten(self.target.model.parameters())))
        self.seqs: List[Running] = []
        self.filling = Fillings()  # prompts prefilled a chunk per step while others decode
        # The next cycle, launched before the host read the last one's tokens.
        self._ahead: Optional[Launched] = None
        self.early: List[Committed] = []  # what the cycle ahead committed, settled as the batch changed
        self._uids = count()
        self.joins = JoinChunks()  # how much of a joining prompt to prefill with each cycle
        self._shape = None  # (sequences, width) of the last cycle run: its cost sizes join chunks
        self._joining = False  # a prompt was prefilling at the last `fill`: it joins in the next cycle, or is still to

    def __len__(self) -> int:
        """Sequences in the batch: decoding, or still prefilling (`fill`)."""
        return len(self.seqs) + len(self.filling)

    def add(self, prompt: Sequence[int], max_tokens: int, source=None, asks: Optional[Asks] = None,
            chunked: bool = False, prefill_step: int = PREFILL_STEP) -> Committed:
        """Prefill `prompt`, then join the batch; its first token (and whether it already ended).
        `source`: the sequence's own draft source (default: the pair's drafter); `asks`: how its
        tokens are picked and its cycles chosen (default: greedy, the decoder's block size).
        `chunked`: a prompt longer than a chunk (`policy.join`: sized by time; while nothing else
        decodes, a slice of about a second) is prefilled a chunk per `step` (`fill`), and its
        `Committed` says `filling`: a request that comes meanwhile starts within about a chunk, and
        one that is cancelled stops at the next."""
        check_room(prompt, self.target, busy=len(self) > 0)
        self._settle_ahead()
        source = source or self.source
        tcache, dstate, reused = fetch(self.prompt_cache, self.target, prompt, source)
        seq = self._running(prompt, max_tokens, source, dstate, tcache, asks or Asks())
        later = chunked and len(prompt) - reused > self._chunk()
        # A prompt prefilled between others' cycles gives its taps to its drafter chunk by chunk: held
        # for its first drafted cycle, they would stall everyone's first cycle beside it.
        steps = prefill(self.target, seq, prompt, tcache, reused, self._chunk if later else prefill_step,
                        self.prompt_cache is not None, 0 if later else PREFILL_HOLD_BYTES)
        f = Filling(seq, list(prompt), tcache, steps, reused)
        if later:
            self.filling.add(f)
            return Committed(f.uid, [], filling=True)
        tic = time.perf_counter()
        out = self._filled(f, *drained(self.target, steps))
        self.joins.chunk(len(prompt) - reused, time.perf_counter() - tic)  # what a prefill row costs here
        return out

    def _chunk(self) -> int:
        """Tokens of a prefilling prompt's next chunk: beside sequences decoding, a join's; alone, a slice."""
        return self.joins.size() if self.seqs else self.joins.slice()

    def fill(self) -> List[Committed]:
        """One prefill chunk of each sequence still prefilling (`Fillings.step`: riding in the next
        `step`'s cycle where it can); those done join the batch (their first tokens, `first` set)."""
        out, self._joining = [], bool(self.filling)
        for f, done in self.filling.step(self.target, bool(self.seqs), self.joins):
            out.append(self._filled(f, *done))
            out[-1].first = True
        return out

    def _filled(self, f: Filling, logits: mx.array, taps: list) -> Committed:
        """A prefilled sequence's first token; unless that ends it, it joins the batch."""
        seq = f.seq
        for t in taps:
            seq.hold(t)
        last, lps = seq.pick(logits[None], seq.noise(1))
        mx.eval(last, lps, [c.state for c in f.tcache])
        out = seq.first(f.prompt, last, lps, self.eos)
        out.cached = f.reused
        if out.finish is None:
            self._join(seq, f.tcache)
        else:  # its caches hold the prompt
            self.kept.ended(seq, f.tcache, len(f.prompt))
        return out

    def add_many(self, prompts: Sequence[Sequence[int]], max_tokens: Sequence[int],
                 sources: Optional[Sequence] = None, asks: Optional[Sequence[Asks]] = None,
                 chunked: bool = False) -> List[Committed]:
        """`add` for several prompts, prefilled in one target pass where what the prompt cache
        does not hold of them is short (`BATCH_PREFILL` tokens in all): each from its cached
        prefix, the rests right-padded to the longest, each sequence's padding cropped after.
        Long prompts go one at a time, in chunks (with `chunked`, between the cycles of the
        sequences decoding)."""
        for i, p in enumerate(prompts):
            check_room(p, self.target, busy=len(self) + i > 0)
        self._settle_ahead()
        sources = [s or self.source for s in (sources or [None] * len(prompts))]
        asks = [a or Asks() for a in (asks or [None] * len(prompts))]
        lens = [len(p) for p in prompts]
        # A recurrent state would run through the padding: such prompts are prefilled alone.
        alone = len(prompts) < 2 or min(lens) == 0 or self.target.recurrent or not can_batch(self.target)
        if not alone and self.prompt_cache is not None:
            lens = [n - self.prompt_cache.reach(self.target, s, p) for n, p, s in zip(lens, prompts, sources)]
        if alone or sum(lens) > BATCH_PREFILL:
            return [self.add(*a, chunked=chunked) for a in zip(prompts, max_tokens, sources, asks)]
        starts = [fetch(self.prompt_cache, self.target, p, s) for p, s in zip(prompts, sources)]
        seqs = [self._running(p, m, s, dstate, tcache, a)
                for p, m, s, (tcache, dstate, _), a in zip(prompts, max_tokens, sources, starts, asks)]
        tic = time.perf_counter()
        cache, out = prefill_together(self.target, prompts, starts, seqs, self.eos)
        self.joins.chunk(sum(len(p) - reused for p, (_, _, reused) in zip(prompts, starts)), time.perf_counter() - tic)
        keep = [b for b, c in enumerate(out) if c.finish is None]
        for b in (b for b, c in enumerate(out) if c.finish is not None):
            self.kept.ended(seqs[b], None if self.prompt_cache is None else [layer.extract(b) for layer in cache],
                            len(prompts[b]))
        if keep:
            for c in cache:
                c.filter(keep)
            self.caches.join(cache)
            self.seqs += [seqs[b] for b in keep]
            self.caches.fit(len(self.seqs))
            self._price_columns()
        return out

    def _running(self, prompt, max_tokens: int, source, dstate, tcache: list, asks: Asks) -> Running:
        """A sequence about to be prefilled; its budget stops at the model's window."""
        if self.window:  # every token fed to the target stays in its window (the last one generated is not fed)
            max_tokens = min(max_tokens, self.window - len(prompt) + 1)
        return new_sequence(self.pair, next(self._uids), prompt, max_tokens, source, dstate, tcache, asks,
                            self.block_size, self.prompt_cache is not None, self.lookup and self.width > 1)

    def _join(self, seq: Running, tcache: list) -> None:
        """A sequence alone decodes on its own caches; beside others, the batch holds them
        (`Caches.add`: its own side by side with the others', or its rows copied into a padded batch)."""
        self._settle_ahead()
        self.caches.add(tcache)
        self.seqs.append(seq)
        self._price_columns()

    def _price_columns(self) -> None:
        """Once the batch holds K/V: what a column of it costs beside the weights (`planner.narrow`)."""
        if not self.planner.column_share:
            self.planner.column_share = self.caches.kv_bytes_per_token() / self._weight_bytes

    def step(self, width: Optional[int] = None, then: Optional[int] = None, branches: int = 0) -> List[Committed]:
        """One cycle for every sequence in the batch, as the planner plans it (`policy.planner`: a
        sequence alone, its own policy's plan; several, the batch policy's width), or at `width`
        (at most the decoder's), a drafted one verifying trees of `branches` branches where every
        sequence allows that many, and `then`: the width of the cycle after it (default: the same;
        a plain step launches the next before the host reads its tokens only where that is plain
        too, so no step is computed to be dropped). Finished sequences leave the batch. A sequence
        alone has its next cycle launched before this one's tokens are handed back. Its seconds size
        join chunks and teach the batch's policy. Where a cycle launched ahead was settled when the
        batch changed (`early`), this step hands back what it committed instead, and runs nothing."""
        self.filling.rode = 0
        joining, self._joining = self._joining, False
        if self.early:
            out, self.early = self.early, []
        elif self.seqs:
            plan = None
            if width is not None or len(self.seqs) > 1:
                plan = (self.planner.batch(self.seqs, joining, self.joins.fits, self.caches.columns(),
                                           self.caches.alone()) if width is None
                        else self.planner.fixed(self.seqs, width, then, branches))
            was_ahead, tic = self._ahead is not None, time.perf_counter()
            out = self._alone(self.seqs[0]) if plan is None else self._cycle(plan)
            seconds = time.perf_counter() - tic
            if self.filling.rode:  # a cycle that carried a prompt's chunk says nothing of its width
                self.joins.rode(self.filling.rode, seconds, self._shape)
            else:
                self.joins.cycle(seconds, self._shape)
                # A plain step's seconds are one pass's where it was launched ahead as it launches the
                # next (or neither): where the device does not overlap them (a CPU), a run's first step
                # also computes the one it launches, and its last finds its pass done.
                steady = plan is not None and (plan.width > 1 or was_ahead == (self._ahead is not None))
                if width is None and steady:
                    self.planner.update(plan, seconds, sum(c.accepted + 1 for c in out), out[0].plan.branches > 0)
        else:
            out = []
        self.filling.unridden(self.target, self.joins)
        return out

    def _cycle(self, plan: CyclePlan) -> List[Committed]:
        """A planned cycle of several sequences, launched and committed."""
        if plan.width == 1:
            return self._plain_step(plan.then is None or plan.then <= 1)
        self._drop_ahead()
        if plan.branches:
            return self._run(self._tree(plan.plans[0]))
        return self._run(self._linear(plan))

    def _alone(self, seq: Running) -> List[Committed]:
        """A cycle of a sequence alone, as its policy plans it; unless a prompt is joining, the next
        is launched before the host reads this one's tokens (a plain step's from them on the device,
        a drafted cycle's once this one is committed)."""
        launched, self._ahead = self._ahead or self._launch_alone(seq), None
        out = self._run(launched, ahead=lambda: self.planner.plain_next(seq))
        if len(self.seqs) == 1 and not self.filling and self._ahead is None:
            self._ahead = self._launch_alone(self.seqs[0])
        return out

    def _launch_alone(self, seq: Running) -> "Launched":
        """A sequence alone's next cycle, as the planner plans it, launched."""
        plan = self.planner.alone(seq)
        if plan.width == 1:
            return Launched(PlainStep(self._rows(), seq.last), [PLAIN])
        if plan.branches:
            return self._tree(plan.plans[0])
        return self._linear(plan)

    def _linear(self, plan: CyclePlan) -> "Launched":
        """A drafted cycle of the plan's width for every sequence, its copies first, launched; cut
        where the sequences' grammars forbid every draft after (`checked`)."""
        p = self.drafting.propose(self.seqs, plan.width, plan.copies, plan.alternatives, [x.width for x in plan.plans])
        p.block = checked(self.seqs, p.block)
        width = p.block.width
        widths = [min(x.width, width) for x in plan.plans]
        if min(widths) < width:  # some sequences verify fewer rows (`policy.planner.fixed`)
            p.block.widths = widths
        p.copies = [c[: x - 1] for c, x in zip(p.copies, widths)]
        return Launched(LinearCycle(self._rows(), p.block), [Plan(x, len(c)) for x, c in zip(widths, p.copies)], p,
                        [min(f, x - 1) for f, x in zip(plan.forced, widths)])

    def _tree(self, plan: Plan) -> "Launched":
        """A tree cycle of the plan's width and branches for every sequence, launched."""
        tree = self.drafting.tree(self.seqs, plan.width, plan.branches)
        return Launched(TreeCycle(self._rows(), tree, tree_masks(self.seqs, tree)), [plan] * len(self.seqs))

    def _rows(self) -> Rows:
        """The batch's sequences and caches, as its cycles decode them; the chunk of a prompt
        joining rides in the cycle's pass (`fill`)."""
        return Rows(self.target, self.caches.layers, self.seqs, taps=any(s.tapped for s in self.seqs),
                    batched=self.caches.batched, rider=self.filling.take())

    def _plain_step(self, ahead) -> List[Committed]:
        """A plain batched step, as mlx-lm's, the next one launched ahead with `ahead` (`_run`)."""
        if self._ahead is not None and not self._ahead.plain:
            self._drop_ahead()
        launched, self._ahead = self._ahead, None
        if launched is None:
            launched = Launched(PlainStep(self._rows(), mx.concatenate([s.last for s in self.seqs])),
                                [PLAIN] * len(self.seqs))
        return self._run(launched, ahead)

    def _run(self, launched: "Launched", ahead=False) -> List[Committed]:
        """Settle a launched cycle and commit it. A plain step with `ahead` (or where `ahead()` says
        so, asked while the step is in flight) first launches the next one from its tokens on the
        device, before the host reads them; that one is dropped (its row cropped, no copy; recurrent
        states set back to those before it) where a sequence ends or leaves before it runs, or the
        next cycle drafts after all."""
        cycle, p = launched.cycle, launched.proposal
        # A tree's shape is timed apart from the linear cycles of its width.
        plan = max(launched.plans)
        self._shape = (len(launched.plans), plan.width) + ((plan.branches,) if plan.branches else ())
        # While a prompt joins, its next chunk rides in the next step, made once this one is read.
        if launched.plain and not self.filling and (ahead() if callable(ahead) else ahead):
            self._ahead = Launched(PlainStep(self._rows(), cycle.tokens, pending=True), [PLAIN] * len(self.seqs))
        rider = cycle.rows.carried()
        if p is None:
            return self._commit(cycle, launched, cycle.settle(also=rider))
        outcomes = cycle.settle(also=rider + tuple(s.lesson[1] for s in self.seqs if s.lesson is not None))
        self.drafting.learn(self.seqs, p, cycle, [o.accepted for o in outcomes])
        return self._commit(cycle, launched, outcomes)

    def _commit(self, cycle, launched: Launched, outcomes) -> List[Committed]:
        """What a settled cycle committed for each sequence, cut at EOS and budgets; each
        sequence's caches keep a row per committed token but the newest (for a finished one, a row
        per token it committed: its history but the last); finished sequences leave."""
        out = []
        forced = launched.forced or [0] * len(self.seqs)
        for seq, o, plan, f in zip(self.seqs, outcomes, launched.plans, forced):
            c = Committed(seq.uid, o.tokens, accepted=o.accepted, logprobs=o.logprobs, plan=plan,
                          branched=o.branched, forced=f,
                          grammar_seconds=0.0 if seq.constraint is None else seq.constraint.take_seconds())
            c.finish = seq.finish(c, self.eos)
            out.append(c)
        self._let_go([c.finish is not None for c in out])
        cycle.cut([len(c.tokens) for c in out])
        for b, (seq, c, o) in enumerate(zip(self.seqs, out, outcomes)):
            if seq.advance(c, o):  # a long plain run: its drafter reads the taps it holds in one pass
                self.drafting.read_held(self.seqs, b)
        self._leave([b for b, c in enumerate(out) if c.finish is None])
        return out

    def _let_go(self, gone: List[bool]) -> None:
        """Sequences `gone` are about to leave the batch (`_leave`): their rows of the plain step
        launched ahead are cropped, and the others' kept to run as it is (`_keep_only` narrows it).
        Where one sequence would be left, it decodes alone: the step is dropped."""
        if self._ahead is None or not any(gone):
            return
        if len(gone) - sum(gone) < 2 or not self._ahead.plain:
            self._drop_ahead()
        else:
            self._ahead.cycle.cut([0 if g else 1 for g in gone])

    def _drop_ahead(self) -> None:
        """Undo the cycle launched ahead, if any: every sequence's rows of it are cropped."""
        if self._ahead is not None:
            self._ahead.cycle.drop()
            self._ahead = None
            for s in self.seqs:
                s.chosen = None  # a plan chosen for the dropped step's successor

    def _settle_ahead(self) -> None:
        """Before the batch changes, the cycle launched ahead (if any) runs to its end: what it
        commits is handed back by the next `step` (`early`)."""
        if self._ahead is not None:
            launched, self._ahead = self._ahead, None
            self.early += self._run(launched)

    def _leave(self, keep: List[int]) -> None:
        """The sequences not in `keep` leave; with a prompt cache, what they computed is held
        for `keep` (its drafter context handed back from the pool first)."""
        kept = set(keep)
        for b, s in enumerate(self.seqs):
            if b not in kept:
                self.drafting.unpool(b, s)
                self.kept.ended(s, None if self.prompt_cache is None else self.caches.of(b), len(s.history) - 1)
        self._keep_only(keep)

    def keep(self) -> None:
        """Hand what finished sequences computed to the prompt cache (after their answers are out)."""
        self.kept.keep()

    def remove(self, uid: int) -> Optional[str]:
        """Drop a sequence before it finished (nothing if it is not in the batch); with a prompt
        cache, what it computed is kept there as a finished one's is (`keep`). The proposal scales
        it learnt, as its last `Committed` would have said them."""
        seq = next((s for s in self.seqs if s.uid == uid), None)
        self.filling.remove(uid)
        self.early = [c for c in self.early if c.uid != uid]
        self._let_go([s.uid == uid for s in self.seqs])  # its caches then hold every committed token but the last
        self._leave([b for b, s in enumerate(self.seqs) if s.uid != uid])
        return None if seq is None or seq.scaler is None else seq.scaler.describe()

    def _keep_only(self, keep: List[int]) -> None:
        """Keep the sequences at indices `keep`; the others' rows are dropped. Those leaving were let
        go first (`_let_go`): a plain step still launched ahead runs on for those kept."""
        shrinks = len(keep) < len(self.seqs)
        self.drafting.keep_only(keep)
        self.caches.keep_only(keep, len(self.seqs))
        self.seqs = [self.seqs[b] for b in keep]
        ahead = self._ahead
        if ahead is not None and shrinks:
            ahead.cycle.narrow(keep, Rows(self.target, self.caches.layers, self.seqs, taps=ahead.cycle.rows.taps,
                                          batched=self.caches.batched))
            ahead.plans = [PLAIN] * len(keep)


def prefill(target, seq: Running, prompt: Sequence[int], tcache: list, reused: int, step, kept: bool,
            hold: int = PREFILL_HOLD_BYTES) -> Generator:
    """`passes.prefill_steps` of a sequence's prompt past the `reused` tokens its caches hold, in
    chunks of `step` tokens (a callable: asked before each), holding at most `hold` bytes of its
    taps for its first drafted cycle. Where the prompt cache keeps it (`kept`) and its state
    cannot be trimmed back later (recurrent), its state at the prompt's end is kept now
    (`Running.at_prompt`)."""
    before_last = None
    if kept and not can_trim(tcache):
        def before_last(tc):
            seq.at_prompt = (len(prompt) - 1, snapshot(tc))
    return prefill_steps(target, seq.source, seq.dstate, mx.array(prompt[reused:]), tcache, step, hold,
                         before_last=before_last, taps=seq.tapped, skip=True, before=reused)


def prefill_together(target, prompts: Sequence[Sequence[int]], starts: list, seqs: List[Running], eos):
    """Several prompts in one target pass, each from its cached prefix (`starts`: its caches,
    draft state and tokens reused): the batch's caches and each sequence's first token (its
    `Committed`, ended by a token of `eos` or its budget); each tapped sequence holds its prompt's
    taps. The rests are right-padded to the longest in one padded batch and each sequence's padding
    is cropped after; a target that `splits` runs each rest on its own caches, unpadded
    (`TargetAdapter.apart`), where the sequences' lengths would not share one part of its batch or
    the padding would cost more than `PAD_REST_WASTE`."""
    rest = [len(p) - reused for p, (_, _, reused) in zip(prompts, starts)]
    tapped = any(s.tapped for s in seqs)
    apart = target.splits and (not one_part([len(p) for p in prompts]) or waste(rest) > PAD_REST_WASTE)
    if apart:
        logits, hiddens = target.apart([mx.array(p[len(p) - r :]) for p, r in zip(prompts, rest)],
                                       [tcache for tcache, _, _ in starts], taps=tapped)
    else:
        L = max(rest)
        block = mx.array([list(p[len(p) - r :]) + [0] * (L - r) for p, r in zip(prompts, rest)])
    cache = [batch_of(c, apart) for c in starts[0][0]]
    for i, batch in enumerate(cache):
        add_to(batch, *(tcache[i] for tcache, _, _ in starts[1:]))
    if not apart:
        logits, hidden = target(block, cache, taps=tapped, rows=mx.array(rest) - 1)
        for c in cache:
            c.crop([L - r for r in rest])
        hiddens = [hidden[b : b + 1, :r] for b, r in enumerate(rest)] if tapped else None
    picked = []
    for b, seq in enumerate(seqs):
        if seq.tapped:
            seq.hold(hiddens[b])
        picked.append(seq.pick(logits[b], seq.noise(1)))
    mx.eval(picked, [c.state for c in cache])
    firsts = [seq.first(p, *pick, eos) for p, seq, pick in zip(prompts, seqs, picked)]
    for c, (_, _, reused) in zip(firsts, starts):
        c.cached = reused
    return cache, firsts


def fetch(prompt_cache, target, prompt: Sequence[int], source):
    """(target caches, draft state, tokens reused): from the prompt cache's longest prefix, or fresh."""
    if prompt_cache is None:
        return target.make_cache(), source.new_state(), 0
    return prompt_cache.fetch(target, source, prompt)


def check_room(prompt: Sequence[int], target, busy: bool) -> None:
    """A prompt the decoder can take: one `check_prompt` takes, and (where the target's caches
    cannot be batched) while no other sequence decodes."""
    check_prompt(prompt, target)
    if busy and not can_batch(target):
        raise DFlashError(f"'{target.model_type}' has caches batched decoding cannot hold together: "
                          "its sequences are decoded one at a time.")
