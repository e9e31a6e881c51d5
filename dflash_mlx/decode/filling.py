"""Prompts that join sequences already decoding, prefilled a chunk per step of the batch
(`policy/join.py` sizes the chunks): each chunk rides in the step's cycle where the target can
carry it (`target.adapter.Rider`: its rows share the cycle's pass), else runs in a pass of its own."""

import time
from dataclasses import dataclass
from typing import Generator, List, Optional, Tuple

import mlx.core as mx

from ..target.adapter import Rider
from .passes import run_chunk
from .running import Running


@dataclass
class Filling:
    """A sequence whose prompt is prefilled a chunk at a time while the batch decodes."""

    seq: Running
    prompt: List[int]
    tcache: list
    steps: Generator  # `passes.prefill_steps`: yields each chunk to run
    reused: int  # prompt tokens the prompt cache held
    chunk: Optional[Rider] = None  # the chunk to run next, or the one that ran in the last step
    ran: bool = False

    @property
    def uid(self) -> int:
        return self.seq.uid


class Fillings:
    """The prompts being prefilled beside a batch; the chunk that rides in its next cycle."""

    def __init__(self):
        self.pending: List[Filling] = []
        self.rider: Optional[Filling] = None  # whose chunk rides in this step's cycle
        self.rode = 0  # prompt tokens that rode in the step's cycle (the decoder sets it back each step)

    def __len__(self) -> int:
        return len(self.pending)

    def add(self, f: Filling) -> None:
        self.pending.append(f)

    def remove(self, uid: int) -> None:
        self.pending = [f for f in self.pending if f.uid != uid]

    def step(self, target, decoding: bool, joins) -> List[Tuple[Filling, tuple]]:
        """One chunk of each prompt: the first whose caches `target` can carry (`can_carry`)
        rides in this step's cycle where there is one (`decoding`), the others run now (timed
        into `joins`, `policy.join.JoinChunks`). The prompts whose prefill is done, each with
        what its `prefill_steps` returned."""
        done, self.rider = [], None
        for f in list(self.pending):
            try:
                if f.chunk is None or f.ran:  # the chunk that ran is in: the next
                    f.chunk, f.ran = next(f.steps), False
                if self.rider is None and decoding and target.can_carry(f.tcache):
                    self.rider = f
                    continue
                tic, tokens = time.perf_counter(), f.chunk.tokens.shape[1]
                run_chunk(target, f.chunk)
                try:
                    f.chunk = next(f.steps)  # evaluates this chunk's caches
                finally:
                    joins.chunk(tokens, time.perf_counter() - tic)
            except StopIteration as end:
                self.pending.remove(f)
                done.append((f, end.value))
        return done

    def take(self) -> Optional[Rider]:
        """The chunk that rides in the cycle about to be made (once a step)."""
        f, self.rider = self.rider, None
        if f is None or f not in self.pending:
            return None
        f.ran, self.rode = True, f.chunk.tokens.shape[1]
        return f.chunk

    def unridden(self, target, joins) -> None:
        """A chunk that was to ride in this step but found no cycle to carry it (the step handed
        back what a cycle launched ahead had committed) runs in a pass of its own, so that its
        prompt goes on every step."""
        f, self.rider = self.rider, None
        if f is None or f not in self.pending:
            return
        tic = time.perf_counter()
        run_chunk(target, f.chunk)
        mx.eval([c.state for c in f.chunk.cache])
        f.ran = True
        joins.chunk(f.chunk.tokens.shape[1], time.perf_counter() - tic)
