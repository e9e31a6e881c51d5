"""A sequence as the decoder holds it: what it asked for (`Asks`), its state between cycles
(`Running`) and what each cycle committed for it (`Committed`)."""

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence

import mlx.core as mx

from ..constrain.gate import AfterReasoning, Free
from ..draft import tree as trees
from ..policy.plan import PLAIN, Outcome, Plan
from ..sampling import Draws, Processed, SamplingParams, choose, pick
from .constrained import masked
from .cycle import Block
from .passes import logprob_rows, token_logprobs
from .request import block_policy, proposal_scaler
from .sequence import GREEDY, SequenceState

# Held taps of plain steps beyond this many are given to the drafter in one
# batched projection: a long run without the drafter must not hold them all.
HELD_TAPS = 256


@dataclass
class Asks:
    """How a sequence wants its tokens picked, and how it wants its cycles chosen while it
    decodes alone (beside others, the batch's policy chooses)."""

    params: SamplingParams = GREEDY
    processors: Sequence = ()  # mlx-lm logits processors (penalties, logit bias)
    logprobs: Optional[int] = None  # with each token its log probability and this many top tokens
    block_size: Any = None  # its policy alone: a width, 'auto' or a `policy.plan.Policy` (None: the decoder's)
    tree: Optional[int] = None  # tree branches its cycles may verify (None: as many as its policy weighs)
    lookup: bool = True  # its drafts may copy from its n-gram lookup, where its policy expects that to pay
    proposal_scale: Any = "auto"  # how an unseeded sampled sequence's drafts are drawn (`policy.proposal`)
    grammar: Any = None  # what its output keeps to (`constrain.Grammar`), or None
    reasoning: Any = None  # where a thinking model's reasoning ends (`constrain.gate.Reasoning`): the grammar follows it


@dataclass(kw_only=True)
class Running(SequenceState):
    """One sequence of the decoder."""

    uid: int
    run: Any  # its run of its policy (`policy.plan.Run`): the plans of the cycles it runs alone
    sizer: Any = None  # its run of the pair's sizer, where it copies lookup offers in a batch's cycles
    lookup: bool = False  # it asks its source for lookup offers
    tapped: bool = True  # its drafter's context is kept (the target's taps of its committed tokens)
    branches: int = 0  # tree branches its cycles may verify
    unseen: int = 0  # rows of `taps`: what its next drafted cycle catches the drafter up on
    chosen: Optional[Plan] = None  # its next plan, chosen while a plain step was in flight
    lesson: Optional[tuple] = None  # what its scales learn from its last drafted cycle (lazy)
    at_prompt: Optional[tuple] = None  # a recurrent state at the prompt's end, for the prompt cache
    keeps_rates: bool = False  # it learns into the pair's sizer, whose rates are written when it ends

    def pick(self, logits: mx.array, noise: Optional[mx.array]):
        """Its next token from its row of `logits` (and its log probabilities): greedy, its
        draws, or (unseeded) mlx-lm's sampler."""
        logits = masked([self], logits)
        if self.proc:
            logits = self.proc.row(logits)
        picks = pick(logits, self.params) if self.rejection else choose(logits, self.params, noise)
        return picks, None if self.top is None else token_logprobs(logits, picks, self.top)

    def commit(self, tokens: List[int]) -> None:
        self.history += tokens
        self.drawn(tokens)

    def first(self, prompt: Sequence[int], last: mx.array, lps, eos) -> "Committed":
        """Its first token `last` (evaluated, with its log probabilities) after `prompt`: its `Committed`."""
        self.last = last
        out = Committed(self.uid, last.tolist(), logprobs=lps and logprob_rows(lps, 1))
        out.finish = self.finish(out, eos)
        self.history = list(prompt)
        self.commit(out.tokens)
        if self.lookup or self.tapped:
            self.source.commit(self.dstate, self.history)
        return out

    def finish(self, c: "Committed", eos) -> Optional[str]:
        """Cut `c`'s tokens (and log probabilities) at its budget and at EOS (`eos`: the ids), and
        count them; the finish reason, if this ends it ("error" where its grammar's engine gave up)."""
        c.tokens = c.tokens[: self.max_tokens - self.generated]
        self.generated += len(c.tokens)
        finish = "length" if self.generated >= self.max_tokens else None
        for i, t in enumerate(c.tokens):
            if t in eos:
                c.tokens, finish = c.tokens[:i], "stop"
                break
        if self.constraint is not None and self.constraint.error is not None:  # its grammar ended it
            finish, c.error = "error", self.constraint.error
        if c.logprobs is not None:
            c.logprobs = c.logprobs[: len(c.tokens)]
        if finish is not None and self.scaler is not None:
            c.proposal_scales = self.scaler.describe()
        return finish

    def hold(self, taps) -> None:
        """Taps of committed rows its drafter will read (an array of rows, or a plain step's layers)."""
        self.taps.append(taps)
        self.unseen += (taps[0] if isinstance(taps, tuple) else taps).shape[1]

    def take_taps(self) -> list:
        """The taps its drafter has not read, handed over."""
        taps, self.taps, self.unseen = self.taps, [], 0
        return taps

    def advance(self, c: "Committed", o: Outcome) -> bool:
        """Past its committed tokens `c` (of the cycle's outcome `o`): its processors, draws,
        policy runs, lookup index and the taps its drafter will read (of the rows its caches
        keep); whether it now holds `HELD_TAPS` of them."""
        self.commit(c.tokens)
        self.run.update(c.plan, o)
        if self.sizer is not None and self.sizer is not self.run:
            self.sizer.update(c.plan, o)
        if self.tapped and c.tokens:
            self.hold(o.hidden if len(c.tokens) == o.accepted + 1 else o.hidden[:, : len(c.tokens)])
        if self.lookup or self.tapped:  # the lookup's index holds every committed token, a finished one's too
            self.source.commit(self.dstate, c.tokens)
        if c.finish is None:
            self.last = o.last
        return self.tapped and bool(c.tokens) and len(self.taps) == HELD_TAPS


@dataclass
class Committed:
    """What a cycle committed for one sequence, and why it ended, if it did."""

    uid: int
    tokens: List[int]
    finish: Optional[str] = None  # "stop" (EOS), "length", or "error" (its grammar's engine gave up)
    error: Optional[str] = None  # with finish "error": why
    accepted: int = 0  # draft tokens the target accepted
    logprobs: Optional[list] = None  # per token (log probability, [(token, log probability)] best first)
    first: bool = False  # the sequence's first token (its prompt is prefilled)
    filling: bool = False  # no token yet: the prompt is prefilled a chunk per cycle (`fill`)
    plan: Plan = PLAIN  # how the cycle ran for it
    branched: bool = False  # a tree cycle committed a branch's token
    cached: int = 0  # with its first token: the prompt tokens the prompt cache held
    forced: int = 0  # its first drafts were tokens its grammar forced
    grammar_seconds: float = 0.0  # host seconds its grammar's masks and forced tokens took since the last
    proposal_scales: Optional[str] = None  # with its last: the proposal scales it learnt (unseeded sampling)


@dataclass
class Proposal:
    """What a drafted cycle verifies (`block`), and how each sequence's drafts were made."""

    block: Block
    scales: list  # per sequence, the proposal scales of its drafter's positions (unseeded sampling)
    copies: List[List[int]]  # per sequence, the lookup tokens in its first draft positions


def new_sequence(pair, uid: int, prompt: Sequence[int], max_tokens: int, source, dstate, tcache: list, asks: Asks,
                 block_size, keeps_cache: bool, batch_lookup: bool) -> Running:
    """A sequence about to be prefilled (on caches `tcache`): its policy's run (`asks.block_size`,
    else the decoder's `block_size`), whether it keeps a drafter's context (`keeps_cache`: a
    prompt cache will keep it) and an n-gram lookup (`batch_lookup`: a batch's cycles copy from
    it), its tree branches, its seed's draws or its proposal scales."""
    target, params = pair.target, asks.params
    block_size = block_size if asks.block_size is None else asks.block_size
    auto = block_size == "auto"
    policy = block_policy(pair, source, block_size, asks.tree or 0, params)
    can_tree = params.greedy and not asks.processors and target.can_verify_tree(tcache)
    # Unset, as many branches as the policy's cost curve timed (its trees passed `trees.works` then).
    branches = (policy.default_branches if asks.tree is None else asks.tree) if can_tree else 0
    if asks.tree and branches and not trees.works(target):
        branches = 0
    run = policy.start(branches=branches)
    n = len(prompt)
    drafts = run.drafter_pays(n, n + max_tokens)
    # A sequence that can never draft and keeps nothing decodes as mlx-lm does: no taps, no
    # drafter context, no n-gram index.
    plain = not keeps_cache and not drafts and not run.lookup_pays(n)
    tapped = not plain and (keeps_cache or drafts)
    lookup = asks.lookup and not plain
    sizer = run if auto else None
    if sizer is None and batch_lookup and lookup:
        sizer = pair.auto_sizer(params).start()
    # A seed fixes the text, whatever the widths (`sampling.Draws`); without one, rejection sampling.
    seeded = params.seed is not None and not params.greedy
    draws = Draws(params.seed, n, target.vocab_size) if seeded else None
    scaler = None
    if not params.greedy and tapped and draws is None:
        scaler = proposal_scaler(pair, source, params, asks.proposal_scale)
    constraint = None if asks.grammar is None else pair.grammars.constraint(asks.grammar)
    if asks.reasoning is not None and (constraint is not None or asks.reasoning.budget is not None):
        # the grammar (or, for a budget alone, nothing) applies from the end of the reasoning
        inner = constraint or Free(pair.grammars.tokenizer.vocab_size, pair.tokenizer.eos_token_ids)
        constraint = AfterReasoning(inner, asks.reasoning)
    return Running(uid=uid, max_tokens=max_tokens, source=source, dstate=dstate, params=params,
                   proc=Processed(asks.processors, prompt), draws=draws, top=asks.logprobs, scaler=scaler,
                   constraint=constraint,
                   run=run, sizer=sizer, lookup=lookup, tapped=tapped, branches=branches,
                   keeps_rates=auto and source is pair.draft_source)
