"""How much of a joining prompt to prefill with each of a batch's cycles: sized by time.

A prompt that joins sequences already decoding is prefilled a chunk at a time, one chunk per
cycle of the batch, so that their tokens keep flowing while it goes in (as vLLM's chunked
prefill shares each step's token budget between decoding and prefill). Where the target can
carry it, the chunk rides in the cycle's own target pass (`target.adapter.Rider`: its rows share
each layer's weights with the cycle's rows, so the pass reads them once); elsewhere it runs in a
pass of its own before the cycle. A fixed number of tokens per chunk takes a different time on
every target and context; here a chunk is sized from what a prefill row was measured to cost
(the chunks before it: the seconds of a chunk run alone, or what a cycle that carried one took
beyond cycles of its shape alone) so that it and the batch's cycle take 1 + JOIN_CYCLES
typical cycles. The sequences decoding then wait about that between two tokens while a prompt
joins. Each chunk shares a step with one cycle, so the joiner's first token comes after its
prefill rows' own time and one cycle per chunk (a chunk in a pass of its own also pays the
pass's fixed cost, the weights' read, which a chunk that rides does not); the batch's cycles
while it joins are kept cheap enough (`fits`) that this stays within about JOIN_TTFT times
the rows' time.
"""

import statistics
from collections import deque
from typing import Deque, Dict, Hashable, Optional

# A chunk's seconds in typical cycles: 1.5 keeps a step of the decoding sequences while a prompt
# joins near 2.5 typical cycles (their median gap), within 3 with room for a step's own jitter
# (about 20% on a 2-core machine that also runs the server and its clients).
JOIN_CYCLES = 1.5
# While a prompt joins, the batch's cycles take at most 1 - 1 / JOIN_TTFT of each step: where rows
# cost by their number (a CPU) the joiner's first token then comes within about JOIN_TTFT times its
# prefill rows' own time, which is about its prefill alone.
JOIN_TTFT = 1.4
# Tokens of a join's chunk before a prefill row or a cycle has been timed (every prefill the batch
# runs is timed, so this is the first join of a fresh decoder's): small, since a large one stalls.
FIRST_CHUNK = 32
MIN_CHUNK = 16  # below this a chunk's fixed cost (a pass through every layer) is most of its time
MAX_CHUNK = 2048  # mlx-lm's prefill_step_size: a chunk holds no more memory than a prefill alone
# A long prompt prefilled while nothing else decodes is still cut into slices of about this many
# seconds, so that a request that comes meanwhile starts within about one slice (an agent's 20k-token
# prompt takes tens of seconds on a laptop) and a cancelled one stops within one.
PREFILL_SLICE = 1.0
# The least a slice holds: a pass's fixed cost stays a small share of its time, so slicing costs the
# prefill next to nothing.
MIN_SLICE = 512
# Each new prefill row measurement's weight: a row costs more as the context grows; a half-life
# of a measurement or two follows it.
NEWEST = 0.5
# Cycles whose median is a typical cycle (the streams' median gap), and per cycle shape: medians of
# the last few, so that one slow cycle (a policy's retry, a drafter catching up) moves neither, and
# the typical cycle is the one the batch's policy settled on, not the ones it tried on its way.
TYPICAL = 8
SHAPE_CYCLES = 8
# The least share of a cycle that carried a chunk counted as the chunk's: a cycle's own seconds
# vary, and rows that seem free would make the next chunk as large as MAX_CHUNK at once.
RIDE_FLOOR = 0.1


def _mean(old: Optional[float], new: float) -> float:
    return new if old is None else (1 - NEWEST) * old + NEWEST * new


class JoinChunks:
    """Seconds per prefill row and per batch cycle, measured; the next join chunk's size.

    A cycle's shape is (sequences, width), and a tree's branches after them: cycles of one shape
    cost alike, and a batch's widths change while a prompt joins, so a cycle that carried a chunk
    is compared with cycles of its own shape, and the next chunk fills what the last shape's cycle
    leaves of 1 + JOIN_CYCLES typical cycles (the gap the sequences decoding wait while a prompt
    joins)."""

    def __init__(self):
        self.row_seconds: Optional[float] = None
        self.cycles: Deque[float] = deque(maxlen=TYPICAL)  # the last cycles that carried no chunk
        self.shapes: Dict[Hashable, Deque[float]] = {}  # the same per shape, the last SHAPE_CYCLES
        self.shape: Optional[Hashable] = None  # the last cycle's

    @property
    def cycle_seconds(self) -> Optional[float]:
        """A typical cycle's seconds: the median of the last ones (the streams' median gap)."""
        return statistics.median(self.cycles) if self.cycles else None

    def _own(self, shape: Optional[Hashable]) -> Optional[float]:
        own = self.shapes.get(shape)
        return statistics.median(own) if own else self.cycle_seconds

    def cycle(self, seconds: float, shape: Optional[Hashable] = None) -> None:
        """A batch cycle (of `shape`) took `seconds`."""
        self.cycles.append(seconds)
        if shape is not None:
            self.shapes.setdefault(shape, deque(maxlen=SHAPE_CYCLES)).append(seconds)
        self.shape = shape

    def chunk(self, tokens: int, seconds: float) -> None:
        """A prefill chunk (or a whole prefill) of `tokens` took `seconds`."""
        if tokens > 0:
            self.row_seconds = _mean(self.row_seconds, seconds / tokens)

    def rode(self, tokens: int, seconds: float, shape: Optional[Hashable] = None) -> None:
        """A cycle (of `shape`) that carried a prefill chunk of `tokens` in its pass took `seconds`:
        the rows cost what it took beyond cycles of its shape alone (at least RIDE_FLOOR of it)."""
        self.shape = shape
        own = self._own(shape)
        if tokens > 0 and own is not None:
            self.row_seconds = _mean(self.row_seconds, max(seconds - own, RIDE_FLOOR * seconds) / tokens)

    def fits(self, shape: Hashable) -> bool:
        """Whether a cycle of `shape` may run while a prompt joins: its seconds within
        1 - 1 / JOIN_TTFT of a step of 1 + JOIN_CYCLES typical cycles, so that the chunk sized
        beside it takes the rest. A shape not timed without a chunk does not (a cycle that
        carries one never times it); before any cycle is timed, every shape does."""
        own, typical = self.shapes.get(shape), self.cycle_seconds
        if typical is None:
            return True
        return bool(own) and statistics.median(own) <= (1 + JOIN_CYCLES) * typical * (1 - 1 / JOIN_TTFT)

    def size(self) -> int:
        """Tokens of the next chunk: the prefill rows that take what a cycle of the last shape
        leaves of 1 + JOIN_CYCLES typical cycles (JOIN_CYCLES of them where it is typical)."""
        if self.row_seconds is None or self.cycle_seconds is None or self.row_seconds <= 0:
            return FIRST_CHUNK
        budget = (1 + JOIN_CYCLES) * self.cycle_seconds - self._own(self.shape)
        return int(min(MAX_CHUNK, max(MIN_CHUNK, budget / self.row_seconds)))

    def slice(self) -> int:
        """Tokens of a prefill slice while nothing else decodes: the rows that take about
        PREFILL_SLICE seconds (MAX_CHUNK before a row has been timed)."""
        if self.row_seconds is None or self.row_seconds <= 0:
            return MAX_CHUNK
        return int(min(MAX_CHUNK, max(MIN_SLICE, PREFILL_SLICE / self.row_seconds)))
