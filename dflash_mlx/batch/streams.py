"""A `BatchDecoder`'s sequences as requests: each with its text stream, stop strings and
stats, handed back as the same `GenerationEvent`s `stream_generate` gives."""

import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

from ..decode.events import GenerationEvent, GenerationStats
from ..decode.request import HandOver, TextStream, check_prompt
from ..machine import peak_memory_gb
from ..policy.batch import BatchWidths
from .engine import Asks, BatchDecoder, Committed


@dataclass
class Joining:
    """A request about to join the batch."""

    prompt: List[int]
    max_tokens: int
    stop: Sequence[str] = ()
    asks: Asks = field(default_factory=Asks)


@dataclass
class _Stream:
    text: TextStream
    stats: GenerationStats
    tic: float  # when its first token was committed


class BatchStreams:
    """Requests decoded together (`BatchDecoder`), each event tagged with its request's uid."""

    def __init__(self, pair, width: int, policy=None, prompt_cache=None, lookup: bool = False):
        """`width`: the widest cycle; `policy` (`policy.batch.BatchWidths`, default) picks each
        cycle's; with a `prompt_cache`, requests start from it and are kept in it (`keep`);
        `lookup`: drafts may copy from each request's n-gram lookup (`BatchDecoder`)."""
        self.pair = pair
        self.decoder = BatchDecoder(pair, width, prompt_cache, lookup)
        self.policy = policy or BatchWidths(self.decoder.width)
        self.streams: Dict[int, _Stream] = {}
        self._then: Optional[Tuple[int, int]] = None  # (batch size, width) chosen for the next cycle

    def __len__(self) -> int:
        return len(self.decoder)

    def add_many(self, requests: Sequence[Joining]) -> List[Tuple[int, Optional[GenerationEvent]]]:
        """Prefill the requests, together where short, and let them join; each one's uid and
        first event (which may be its last). A long prompt joining requests that decode is
        prefilled a chunk per `step` instead (`BatchDecoder.fill`): its event is None, and its
        first comes from a later `step`."""
        for r in requests:
            check_prompt(r.prompt, self.pair.target)
        tic = time.perf_counter()
        firsts = self.decoder.add_many([r.prompt for r in requests], [r.max_tokens for r in requests],
                                       asks=[r.asks for r in requests], chunked=True)
        now = time.perf_counter()
        prompt_tps = sum(len(r.prompt) for r, f in zip(requests, firsts) if not f.filling) / (now - tic)
        out = []
        for r, first in zip(requests, firsts):
            stats = GenerationStats(prompt_tokens=len(r.prompt), prompt_tps=0.0 if first.filling else prompt_tps)
            self.streams[first.uid] = _Stream(TextStream(self.pair.tokenizer, r.stop), stats, tic if first.filling
                                              else now)
            out.append((first.uid, None if first.filling else self._event(first, 0, first=True)))
        return out

    def adopt(self, h: HandOver) -> int:
        """Go on with a request another loop started (`stream_generate(hand_over=...)`); its uid."""
        uid = self.decoder.adopt(h.seq, h.tcache)
        self.streams[uid] = _Stream(h.text, h.stats, h.tic)
        return uid

    def step(self) -> List[Tuple[int, GenerationEvent]]:
        """A prefill chunk of each request still prefilling (the first events of those done), then
        one cycle for every request decoding; those it ends (EOS, budget, a stop string) have left."""
        out = [(c.uid, self._first(c)) for c in self.decoder.fill()]
        B = len(self.decoder.seqs)
        if B == 0:
            return out
        # Widths are chosen a cycle ahead, so that a plain step launches the next one only where
        # it will run; where the batch has changed, this cycle runs what is chosen now.
        then = self.policy.choose(B, self.decoder.gains(self.policy.widths))
        width = self._then[1] if self._then is not None and self._then[0] == B else then
        self._then = (B, then)
        tic = time.perf_counter()
        committed = self.decoder.step(width, then)
        self.policy.update(B, width, time.perf_counter() - tic, sum(c.accepted + 1 for c in committed))
        for c in committed:
            stats = self.streams[c.uid].stats
            stats.cycles += 1
            stats.draft_cycles += width > 1
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
        """The first event of a request whose prompt was prefilled chunk by chunk."""
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
            self.decoder.remove(c.uid)
        stats = s.stats
        stats.generation_tokens += len(tokens)
        elapsed = time.perf_counter() - s.tic
        stats.generation_tps = stats.generation_tokens / elapsed if elapsed > 0 and not first else 0.0
        stats.peak_memory_gb = peak_memory_gb()
        stats.finish_reason = finish
        if finish is not None:
            self.streams.pop(c.uid)
        return GenerationEvent(segment, tokens, accepted, stats, finish, lps)
