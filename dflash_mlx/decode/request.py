"""One request, from its checks to what it leaves in the prompt cache: its
policy run and proposal scaler, the drafter's context it keeps (the taps of
committed tokens), its text stream and stop strings, and its stats. The loop
(`generate.py`) asks it for each cycle's plan, launches the cycle through it
and hands it each `Outcome`."""

import time
from dataclasses import dataclass
from typing import List, Optional, Sequence

import mlx.core as mx

from ..draft import tree as trees
from ..policy.sizer import BlockSizer
from ..policy.plan import PLAIN, FixedWidth, Outcome, Plan, Policy
from ..errors import DFlashError
from ..machine import peak_memory_gb
from ..cache.prompt_cache import can_trim, snapshot
from ..policy.proposal import FixedScale, ProposalScales, reached_gains
from ..sampling import Draws, Processed, SamplingParams, choose, pick
from .cycle import Block, LinearCycle, PlainStep, Rows, TreeCycle
from .events import GenerationEvent, GenerationStats
from .passes import caught_up, draft, draft_tree, joined, logprob_rows, prefill, token_logprobs
from .sequence import SequenceState

# Held taps of plain steps beyond this many are given to the drafter in one
# batched projection: a long run without the drafter must not hold them all.
HELD_TAPS = 256


class TextStream:
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


def block_policy(pair, source, block_size, tree: int = 0, params: Optional[SamplingParams] = None) -> Policy:
    """The policy that picks each cycle's plan: a size (with `tree` branches),
    'auto' (measured costs and acceptance, learnt per sampling settings
    `params`; needs `pair`) or an object that keeps the `policy.plan.Policy`
    protocol."""
    if not isinstance(block_size, (int, float, str, type(None))):
        return block_size
    if block_size == "auto":
        shared = pair.auto_sizer(params)  # the pair's drafter keeps acceptance across requests
        return shared if source is pair.draft_source else BlockSizer(shared.curve, source.block_size)
    block_size = block_size or source.block_size
    if not isinstance(block_size, int) or block_size < 1:
        raise DFlashError(f"--block-size must be a positive integer or 'auto' (got {block_size}).")
    return FixedWidth(block_size, tree)


def check_options(max_tokens: int, params: SamplingParams, tree: Optional[int], logprobs: Optional[int],
                  proposal_scale) -> None:
    if tree is not None and (not isinstance(tree, int) or tree < 0):
        raise DFlashError(f"tree must be a number of branches >= 0 (got {tree}).")
    if tree and not params.greedy:
        raise DFlashError("Tree verification is greedy only (temperature 0); use tree=0 to sample.")
    if logprobs is not None and logprobs < 0:
        raise DFlashError(f"logprobs must be >= 0 (got {logprobs}).")
    if (proposal_scale != "auto" if isinstance(proposal_scale, str)
            else isinstance(proposal_scale, (int, float)) and not proposal_scale > 0):
        raise DFlashError(f"--proposal-scale must be 'auto' or a number > 0 (got {proposal_scale}).")
    if proposal_scale != "auto" and params.seed is not None and not params.greedy:
        raise DFlashError("--proposal-scale shapes unseeded sampling; a seeded request draws its drafts with "
                          "its seed's noise. Drop --seed or --proposal-scale.")
    if max_tokens < 1:
        raise DFlashError(f"--max-tokens must be >= 1 (got {max_tokens}).")


def check_prompt(prompt: Sequence[int], target) -> None:
    if len(prompt) == 0:
        raise DFlashError("The prompt is empty; give some text with --prompt or on stdin.")
    window = getattr(target.args, "max_position_embeddings", None)
    if window and len(prompt) > window:
        raise DFlashError(f"The prompt has {len(prompt)} tokens but the model reads at most {window} "
                          "(max_position_embeddings); shorten the prompt.")


def proposal_scaler(pair, source, params: SamplingParams, proposal_scale):
    """The request's proposal scales (`policy/proposal.py`): an object's, a fixed number,
    or 'auto': the pair's learned ones for its own drafter, fresh ones otherwise."""
    if isinstance(proposal_scale, (int, float)):
        scaler = FixedScale(proposal_scale)
    elif proposal_scale != "auto":
        scaler = proposal_scale
    elif source is pair.draft_source:
        scaler = pair.proposal_scales(params)  # the pair's drafter keeps them across requests
    else:
        scaler = ProposalScales(source.block_size - 1)
    return scaler


@dataclass
class HandOver:
    """A request stopped at a cycle boundary, for another loop to go on with
    (`batch.BatchStreams.adopt`): its sequence, whose caches hold every committed token but
    its last, and its text stream and stats."""

    seq: SequenceState
    tcache: list  # the target's caches: every committed token but the last
    text: "TextStream"
    stats: GenerationStats
    tic: float  # when its first token was committed


class Request:
    """One generation's state between cycles. Made, it has checked every
    argument (before any model work) and started its policy run; the loop
    then calls `prefill`, and per cycle `commit`, `plan`, `launch`, `event`,
    `step_ahead` and `absorb`, and `finish` at the end."""

    def __init__(self, pair, prompt, max_tokens: int, params: SamplingParams, block_size, stop: Sequence[str],
                 source, lookup: bool, prompt_cache, logprobs: Optional[int], logits_processors: Sequence,
                 tree: Optional[int], proposal_scale):
        check_options(max_tokens, params, tree, logprobs, proposal_scale)
        target, tokenizer = pair.target, pair.tokenizer
        policy = block_policy(pair, source, block_size, tree or 0, params)
        if isinstance(prompt, str):
            prompt = tokenizer.encode(prompt)
        check_prompt(prompt, target)
        window = getattr(target.args, "max_position_embeddings", None)
        if window:  # every token fed to the target stays in its window (the last one generated is not fed)
            max_tokens = min(max_tokens, window - len(prompt) + 1)
        self.pair, self.prompt, self.max_tokens, self.params = pair, list(prompt), max_tokens, params
        self.source, self.prompt_cache, self.block_size = source, prompt_cache, block_size
        self.eos = set(tokenizer.eos_token_ids) if tokenizer is not None else set()
        # A request that never drafts and keeps nothing decodes as mlx-lm does:
        # no taps, no drafter context, no n-gram index.
        plain = isinstance(policy, FixedWidth) and policy.plan == PLAIN and prompt_cache is None
        self.lookup = lookup and not plain
        self.stats = GenerationStats(prompt_tokens=len(prompt))
        self.text = TextStream(tokenizer, stop)

        self.tic = time.perf_counter()
        if prompt_cache is None:
            tcache, dstate, self.reused = target.make_cache(), source.new_state(), 0
        else:
            tcache, dstate, self.reused = prompt_cache.fetch(target, source, prompt)
        self.at_prompt = None  # a recurrent state at the prompt's end, for the prompt cache
        can_tree = params.greedy and not logits_processors and target.can_verify_tree(tcache)
        # Unset, as many branches as the policy's cost curve timed (its trees passed `trees.works` then).
        branches = (policy.default_branches if tree is None else tree) if can_tree else 0
        if tree and branches and not trees.works(target):
            branches = 0
        self.branches = branches
        self.run = policy.start(branches=branches)
        self.learn = self.run.learns_branches
        # The drafter's context (the target's taps) is kept only where a drafted cycle could pay: a
        # sizer on a cost curve where even every draft accepted would not never drafts in this request.
        self.drafter = not plain and (prompt_cache is not None
                                      or self.run.drafter_pays(len(prompt), len(prompt) + max_tokens))
        # A seed fixes the text, whatever the widths (`sampling.Draws`); without one, rejection sampling.
        seeded = params.seed is not None and not params.greedy
        draws = Draws(params.seed, len(prompt), target.vocab_size) if seeded else None
        scaler = None
        if not params.greedy and self.drafter and draws is None:
            scaler = proposal_scaler(pair, source, params, proposal_scale)
        # Its taps: of committed tokens the drafter has not read; its history: the prompt and the
        # committed tokens, all but the last of which the target's caches hold.
        self.d = SequenceState(source=source, dstate=dstate, params=params, proc=Processed(logits_processors, prompt),
                               top=logprobs, draws=draws, scaler=scaler, max_tokens=max_tokens)
        self.rows = Rows(target, tcache, [self.d], taps=self.drafter)  # what its cycles decode
        self.unseen = 0  # rows of taps the drafter has not read (what its next drafted cycle catches up on)
        self.chosen: Optional[Plan] = None  # the next plan, chosen while a plain step was in flight
        self.offer: List[int] = []
        self.scales = None  # this cycle's proposal scales
        self.learned = None  # what the scales learn from the last linear cycle, still lazy
        self.tokens: List[int] = []  # the tokens the loop is committing

    def prefill(self, step: int) -> Outcome:
        """The prompt through the target (but the rows a prompt cache holds) and the first token."""
        d, prompt, rows = self.d, self.prompt, self.rows
        trimmable = self.prompt_cache is None or can_trim(rows.cache)
        logits, self.d.taps = prefill(rows.target, d.source, d.dstate, mx.array(prompt[self.reused :]), rows.cache, step,
                                    before_last=None if trimmable else self.keep_at_prompt, taps=self.drafter,
                                    skip=True, before=self.reused)
        logits = d.proc.row(logits[None])[0] if d.proc else logits
        last = pick(logits[None], self.params) if d.draws is None else choose(logits[None], self.params, d.noise(1))
        d.drawn(last, 1)
        lps = None if d.top is None else token_logprobs(logits[None], last, d.top)
        if lps is not None:
            mx.eval(last, lps)
            lps = logprob_rows(lps, 1)
        out = Outcome(0, [last.item()], last, logprobs=lps)
        self.d.last = last
        self.stats.cached_tokens = self.reused
        self.stats.prompt_tps = len(prompt) / (time.perf_counter() - self.tic)
        if self.lookup or self.drafter:
            d.source.commit(d.dstate, prompt + out.tokens)
        self.d.history = prompt + out.tokens
        self.unseen = sum(t.shape[1] for t in self.d.taps)
        self.tic = time.perf_counter()
        return out

    def keep_at_prompt(self, tcache) -> None:
        """A recurrent state cannot be trimmed back to the prompt later: keep it now (no copy)."""
        self.at_prompt = (len(self.prompt) - 1, snapshot(tcache))

    def commit(self, out: Outcome) -> Optional[str]:
        """The outcome's tokens up to EOS and the budget; the finish reason, if this ends the request."""
        tokens, finish = out.tokens, None
        for i, t in enumerate(tokens):
            if t in self.eos:
                tokens, finish = tokens[:i], "stop"
                break
        self.tokens, self.logprobs = tokens, out.logprobs and out.logprobs[: len(tokens)]
        self.left = self.max_tokens - self.stats.generation_tokens - len(tokens)
        if finish is None and self.left <= 0:
            finish = "length"
        return finish

    def plan(self) -> Plan:
        """This cycle's plan: the policy's, asked with the lookup's offer (unless it
        was chosen while a plain step was in flight), fitted to the budget left."""
        plan, self.offer, self.chosen = self.chosen, [], None
        if plan is None:
            self.offer = self.source.offer(self.d.dstate, self.source.block_size - 1) if self.lookup else []
            context = len(self.prompt) + self.stats.generation_tokens + len(self.tokens)
            plan = self.run.choose(context, self.offer, unseen=self.unseen, left=self.left)
        width = min(plan.width, self.left)
        copied = min(plan.copied, width - 1, len(self.offer))
        plan = Plan(width, copied, min(plan.branches, self.branches) if width > 1 and not copied else 0)
        self.scales = None
        if self.d.scaler is not None and plan.drafts and not plan.branches:
            self.scales = self.d.scaler.choose(plan.width - 1)
        return plan

    def launch(self, plan: Plan):
        """Start the cycle `plan` asks for; a drafted one first gives the drafter the taps it has not seen."""
        d = self.d
        if plan.width == 1:
            return PlainStep(self.rows, d.last)
        hidden = None
        if plan.drafts:
            hidden = joined(caught_up(d.source, d.dstate, d.taps)) if d.taps else None
            d.taps, self.unseen = [], 0
        if plan.branches:
            return TreeCycle(self.rows, draft_tree(d.source, d.dstate, d.last, hidden, plan.width, plan.branches))
        noise = d.noise(plan.width)
        proposal = draft(d.source, d.dstate, d.last, hidden, plan.width, self.params, self.offer[: plan.copied],
                         d.proc, self.learn, self.scales, None if noise is None else noise[:-1])
        return LinearCycle(self.rows, Block(d.last, proposal.tokens[None], [proposal.q_lp], [noise],
                                            proposal.alternatives))

    def step_ahead(self, cycle) -> Optional[PlainStep]:
        """While a plain step is in flight, the next cycle's plan; a plain step is
        launched at once from its token, before the host reads it (as mlx-lm's
        `generate_step`), unless a lookup draft might be worth waiting for that token."""
        self.chosen = None
        if not isinstance(cycle, PlainStep):
            return None
        context = len(self.prompt) + self.stats.generation_tokens + 1
        left = self.max_tokens - self.stats.generation_tokens
        if left > 1 and not (self.lookup and self.source.may_offer(self.d.dstate) and self.run.lookup_pays(context)):
            self.chosen = self.run.choose(context, unseen=self.unseen + 1, left=left - 1)
            if self.chosen == PLAIN:
                return PlainStep(self.rows, cycle.tokens, pending=True)
        return None

    def learning(self) -> tuple:
        """Arrays to evaluate with the next linear cycle's synchronisation: the last one's lessons."""
        return () if self.learned is None else (self.learned[1],)

    def absorb(self, cycle, done: Plan, out: Outcome) -> None:
        """A settled cycle (run as `done`): what the scales and the policy learn, the drafter's context, the stats."""
        d = self.d
        cycle.cut([out.accepted + 1])
        d.drawn(out.last if len(out.tokens) == 1 else mx.array(out.tokens), len(out.tokens))
        if isinstance(cycle, LinearCycle) and self.scales is not None:
            if self.learned is not None:  # an earlier cycle's, computed by now
                d.scaler.update(*self.learned)
                self.learned = None
            if d.scaler.learning() and out.accepted >= done.copied:
                # What each scale would have had accepted at the drafter's positions this verify
                # reached: left lazy, so it runs behind the next cycle, and read at its synchronisation.
                self.learned = reached_gains(cycle.processed[0], cycle.block.q_lps[0], done.copied, out.accepted,
                                             self.scales, self.params)
        elif isinstance(cycle, TreeCycle):
            self.stats.tree_cycles += 1
            self.stats.branch_cycles += out.branched
        self.d.history += out.tokens
        if self.drafter:
            self.d.taps.append(out.hidden)
            self.unseen += out.accepted + 1
        if self.lookup or self.drafter:
            d.source.commit(d.dstate, out.tokens)
        if len(self.d.taps) == HELD_TAPS:
            d.source.add_context(d.dstate, joined(self.d.taps))
            self.d.taps, self.unseen = [], 0
        self.run.update(done, out)
        stats = self.stats
        stats.cycles += 1
        stats.draft_cycles += done.width > 1
        stats.lookup_cycles += done.copied > 0
        stats.acceptance_lengths.append(out.accepted + 1)
        self.d.last = out.last

    def event(self, out: Outcome, finish: Optional[str]) -> GenerationEvent:
        """The committed tokens' text (held back where a stop string may start, cut where one ends it)."""
        tokens, lps, stats = self.tokens, self.logprobs, self.stats
        segment, kept, stopped = self.text.add(tokens, final=finish is not None)
        if stopped:  # later tokens, and the cycle in flight, are dropped
            tokens, finish = tokens[:kept], "stop"
            lps = lps and lps[:kept]
            stats.stop_sequence = self.text.matched
        stats.generation_tokens += len(tokens)
        elapsed = time.perf_counter() - self.tic
        stats.generation_tps = stats.generation_tokens / elapsed if elapsed > 0 else 0.0
        stats.peak_memory_gb = peak_memory_gb()
        stats.finish_reason = finish
        if finish is not None and self.d.scaler is not None:
            stats.proposal_scales = self.d.scaler.describe()
        return GenerationEvent(segment, tokens, out.accepted, stats, finish, lps)

    def finish(self, inflight) -> None:
        """Keep the caches in the prompt cache, and what the pair's sizers learnt."""
        if self.prompt_cache is not None:
            self.keep_caches(inflight)
        if self.block_size == "auto" and self.source is self.pair.draft_source:
            self.pair.keep_rates()  # what the pair's sizers learnt outlives the process, as its cost curve does

    def hand_over(self) -> HandOver:
        """Its state for another loop, with nothing in flight (the caches are not copied: the
        next loop copies their rows; the taps the drafter has not read go along, lazy). The
        other loop keeps what it computed in the prompt cache once it ends, so nothing here
        stands between the requests waiting for it and their first tokens."""
        self.d.generated = self.stats.generation_tokens
        return HandOver(self.d, self.rows.cache, self.text, self.stats, self.tic)

    def keep_caches(self, inflight) -> None:
        """Hand the caches to the prompt cache. A cycle still in flight has fed the
        last committed token: its row is kept (a verify is cropped to it) so the
        caches hold all of `history` but nothing beyond it; the drafter is given
        the taps it has not seen."""
        d, target, tcache = self.d, self.rows.target, self.rows.cache
        taps = d.taps
        rows = len(self.d.history) - 1
        if inflight is not None:
            if isinstance(inflight, PlainStep):
                hidden = inflight.hidden
            else:
                hidden = inflight.verified.hidden if isinstance(inflight, TreeCycle) else inflight.hidden
                target.crop(tcache, 1, hidden.shape[1])  # a tree pass is wider than its plan
                hidden = hidden[:, :1]
            taps.append(hidden)
            rows += 1
        if taps:
            d.source.add_context(d.dstate, joined(caught_up(d.source, d.dstate, taps)))
        mx.eval([c.state for c in tcache], d.source.arrays(d.dstate))
        self.prompt_cache.store(target, d.source, d.dstate, self.d.history[:rows], tcache, self.at_prompt)
