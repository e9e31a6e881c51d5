"""A `Decoder`'s sequences as requests: each with its text stream, stop strings and
stats, handed back as `GenerationEvent`s (what `stream_generate` yields for a request alone)."""

import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..machine import peak_memory_gb
from ..policy.batch import BatchPolicy, BatchWidths
from ..policy.planner import FORCED_RUN
from .decoder import Decoder
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
                 block_size=None, forced_run: int = FORCED_RUN):
        """`width`: the widest cycle of several requests; `policy` (`policy.batch.BatchWidths`,
        default) picks each such cycle's; a request alone runs its own policy's plans
        (`block_size`: the decoder's default, `Decoder`); with a `prompt_cache`, requests
        start from it and are kept in it (`keep`); `lookup`: a batch's drafts may copy from each
        request's n-gram lookup; `forced_run`: the most tokens a grammar forces that one cycle
        copies as drafts (`policy.planner`)."""
        self.pair = pair
        self.decoder = Decoder(pair, width, prompt_cache, lookup, block_size,
                               policy or BatchWidths(min(width, pair.draft_source.block_size)), forced_run)
        self.streams: Dict[int, _Stream] = {}

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
        out = [(c.uid, self._first(c)) for c in self.decoder.fill()]
        committed = self.decoder.step()
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
