"""A `Decoder`'s sequences as requests: each with its text stream, stop strings and
stats, handed back as `GenerationEvent`s (what `stream_generate` yields for a request alone)."""

import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..machine import peak_memory_gb
from ..policy.batch import BatchPolicy, BatchWidths
from .decoder import Decoder
from .drafting import expected_gains
from .events import GenerationEvent, GenerationStats
from .passes import PREFILL_STEP
from .request import TextStream, check_prompt
from .running import Asks, Committed


@dataclass
class Joining:
    """A request about to join the batch."""

    prompt: List[int]
    max_tokens: int
    stop: Sequence[str] = ()
    asks: Asks = field(default_factory=Asks)
    source: Any = None  # its own draft source (default: the pair's drafter)


@dataclass
class _Stream:
    text: TextStream
    stats: GenerationStats
    tic: float  # when its first token was committed


class Streams:
    """Requests decoded together (`Decoder`), each event tagged with its request's uid."""

    def __init__(self, pair, width: int, policy: Optional[BatchPolicy] = None, prompt_cache=None, lookup: bool = False,
                 block_size=None):
        """`width`: the widest cycle of several requests; `policy` (`policy.batch.BatchWidths`,
        default) picks each such cycle's; a request alone runs its own policy's plans
        (`block_size`: the decoder's default, `Decoder`); with a `prompt_cache`, requests
        start from it and are kept in it (`keep`); `lookup`: a batch's drafts may copy from each
        request's n-gram lookup."""
        self.pair = pair
        self.decoder = Decoder(pair, width, prompt_cache, lookup, block_size)
        self.policy: BatchPolicy = policy or BatchWidths(self.decoder.width)
        self.streams: Dict[int, _Stream] = {}
        self._then: Optional[Tuple[int, int]] = None  # (batch size, width) chosen for the next cycle

    def __len__(self) -> int:
        return len(self.decoder)

    def add(self, request: Joining, prefill_step: int = PREFILL_STEP) -> Tuple[int, GenerationEvent]:
        """Prefill one request (in chunks of `prefill_step` tokens) and let it join; its uid and
        first event (which may be its last)."""
        check_prompt(request.prompt, self.pair.target)
        tic = time.perf_counter()
        first = self.decoder.add(request.prompt, request.max_tokens, request.source, request.asks,
                                 prefill_step=prefill_step)
        return first.uid, self._started(request, first, tic)

    def add_many(self, requests: Sequence[Joining]) -> List[Tuple[int, Optional[GenerationEvent]]]:
        """Prefill the requests, together where short, and let them join; each one's uid and
        first event (which may be its last). A long prompt joining requests that decode is
        prefilled a chunk per `step` instead (`Decoder.fill`): its event is None, and its
        first comes from a later `step`."""
        for r in requests:
            check_prompt(r.prompt, self.pair.target)
        tic = time.perf_counter()
        firsts = self.decoder.add_many([r.prompt for r in requests], [r.max_tokens for r in requests],
                                       [r.source for r in requests], asks=[r.asks for r in requests], chunked=True)
        return [(first.uid, self._started(r, first, tic)) for r, first in zip(requests, firsts)]

    def _started(self, r: Joining, first: Committed, tic: float) -> Optional[GenerationEvent]:
        """A joined request's stream, and its first event (None while its prompt is prefilled)."""
        stats = GenerationStats(prompt_tokens=len(r.prompt), cached_tokens=first.cached)
        self.streams[first.uid] = _Stream(TextStream(self.pair.tokenizer, r.stop), stats, tic)
        return None if first.filling else self._first(first)

    def step(self) -> List[Tuple[int, GenerationEvent]]:
        """A prefill chunk of each request still prefilling (the first events of those done), then
        one cycle for every request decoding; those it ends (EOS, budget, a stop string) have left."""
        joining = bool(self.decoder.filling)  # a prompt fills, or joins in this step's cycle
        out = [(c.uid, self._first(c)) for c in self.decoder.fill()]
        B = len(self.decoder.seqs)
        if B == 0:
            return out
        if self.decoder.early:  # the cycle launched ahead, settled as requests joined
            committed = self.decoder.step()
        elif B == 1:  # a request alone: its own policy plans the cycle
            self._then = None
            committed = self.decoder.step()
        else:
            # Widths are chosen a cycle ahead, so that a plain step launches the next one only where
            # it will run; where the batch has changed, this cycle runs what is chosen now.
            then = self.policy.choose(B, expected_gains(self.decoder.seqs, self.policy.widths))
            # A policy weighing widths runs cycles cheap enough to leave a joining prompt's chunks, and its
            # first cycle, their share (a fixed one runs what it was given).
            fits, capped = self.decoder.joins.fits, joining and bool(self.policy.widths)
            if capped:
                then = max((w for w in self.policy.widths if w <= then and fits((B, w))),
                           default=min(self.policy.widths))
            width = self._then[1] if self._then is not None and self._then[0] == B else then
            self._then = (B, then)
            branches = self.policy.branches(B, width, self.decoder.branches)
            if capped and branches and not fits((B, width, branches)):
                branches = 0
            tic = time.perf_counter()
            committed = self.decoder.step(width, then, branches)
            if not self.decoder.filling.rode:  # a cycle that carried a joining prompt's chunk says nothing of its width
                tree = branches if committed and committed[0].plan.branches else 0
                self.policy.update(B, width, time.perf_counter() - tic, sum(c.accepted + 1 for c in committed), tree)
        for c in committed:
            stats = self.streams[c.uid].stats
            stats.cycles += 1
            stats.draft_cycles += c.plan.width > 1
            stats.lookup_cycles += c.plan.copied > c.forced
            stats.forced_tokens += c.forced
            stats.grammar_seconds += c.grammar_seconds
            stats.tree_cycles += c.plan.branches > 0
            stats.branch_cycles += c.branched
            stats.acceptance_lengths.append(c.accepted + 1)
            out.append((c.uid, self._event(c, c.accepted)))
        return out

    def keep(self) -> None:
        """Keep what the requests that finished computed in the prompt cache (call it once
        their last events are out: it takes a copy of their rows)."""
        self.decoder.keep()

    def remove(self, uid: int) -> None:
        """End a request early (its client left)."""
        self.decoder.remove(uid)
        self.streams.pop(uid, None)

    def _first(self, c: Committed) -> GenerationEvent:
        """A request's first event, once its prompt is prefilled."""
        s = self.streams[c.uid]
        now = time.perf_counter()
        s.stats.prompt_tps = s.stats.prompt_tokens / (now - s.tic)
        s.tic = now
        return self._event(c, 0, first=True)

    def _event(self, c: Committed, accepted: int, first: bool = False) -> GenerationEvent:
        s = self.streams[c.uid]
        tokens, finish, lps = c.tokens, c.finish, c.logprobs
        segment, kept, stopped = s.text.add(tokens, final=finish is not None)
        if stopped:
            tokens, finish = tokens[:kept], "stop"
            lps = lps and lps[:kept]
            s.stats.stop_sequence = s.text.matched
            c.proposal_scales = self.decoder.remove(c.uid) or c.proposal_scales
        stats = s.stats
        stats.generation_tokens += len(tokens)
        elapsed = time.perf_counter() - s.tic
        stats.generation_tps = stats.generation_tokens / elapsed if elapsed > 0 and not first else 0.0
        stats.peak_memory_gb = peak_memory_gb()
        stats.finish_reason = finish
        stats.error = c.error if finish == "error" else None
        if finish is not None:
            stats.proposal_scales = c.proposal_scales
            self.streams.pop(c.uid)
        return GenerationEvent(segment, tokens, accepted, stats, finish, lps)
