"""What the loop hands its caller: one `GenerationEvent` per cycle, with the request's `GenerationStats`."""

from dataclasses import dataclass, field
from typing import List, Optional, Tuple


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
    forced_tokens: int = 0  # drafts a grammar forced (certain: no model made them)
    grammar_seconds: float = 0.0  # host seconds in the grammar engine (masks, forced tokens)
    branch_cycles: int = 0  # tree cycles that accepted a branch's token
    acceptance_lengths: List[int] = field(default_factory=list)
    peak_memory_gb: float = 0.0
    finish_reason: Optional[str] = None  # "stop", "length", or "error" (see `error`)
    stop_sequence: Optional[str] = None  # the stop string that ended the text, if one did
    error: Optional[str] = None  # with finish reason "error": why the request could not go on

    @property
    def mean_acceptance(self) -> float:
        a = self.acceptance_lengths
        return sum(a) / len(a) if a else 0.0

    def line(self) -> str:
        def count(n: int, noun: str) -> str:
            return f"{n} {noun}{'' if n == 1 else 's'}"

        drafting = (
            f"acceptance {self.mean_acceptance:.2f} tok/cycle"
            if self.draft_cycles or not self.cycles else "plain decoding (no cycle drafted)"
        )
        if self.lookup_cycles:
            drafting += f" ({self.lookup_cycles} of {count(self.draft_cycles, 'draft cycle')} from lookup)"
        if self.forced_tokens:
            drafting += f" ({count(self.forced_tokens, 'token')} forced by the grammar)"
        if self.tree_cycles:
            drafting += f" ({self.branch_cycles} of {count(self.tree_cycles, 'tree cycle')} through a branch)"
        return (
            f"{count(self.generation_tokens, 'token')}, {self.generation_tps:.1f} tok/s, {drafting}, "
            f"prompt {count(self.prompt_tokens, 'token')} at {self.prompt_tps:.1f} tok/s, "
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
