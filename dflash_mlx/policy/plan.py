"""A cycle's plan, what a cycle reports back, and the protocol every policy keeps.

A policy is handed to the loop once per request (`Policy.start`); the run it
returns is asked for each cycle's `Plan` and told each cycle's `Outcome`. It
never imports the loop: the loop depends on this module, not the other way.
"""

from dataclasses import dataclass
from typing import Any, List, NamedTuple, Optional, Protocol, Sequence, Tuple


class Plan(NamedTuple):
    """One cycle: its verify width, how many of its draft positions are copied from a lookup offer
    (the rest the drafter fills; with `copied == width - 1` no drafter pass runs), and how many
    branches are verified beside the drafter's best path in a tree (`draft/tree.py`; none copied then)."""

    width: int
    copied: int = 0
    branches: int = 0

    @property
    def drafts(self) -> bool:
        return self.width > self.copied + 1


PLAIN = Plan(1)


@dataclass
class Outcome:
    """What a settled cycle committed."""

    accepted: int  # draft tokens the target accepted
    tokens: List[int]  # committed: the accepted drafts, then the target's own token
    last: Any = None  # the last committed token as the next cycle's input (an mx.array)
    hidden: Any = None  # taps of the committed rows: an array, or a plain step's tuple of layers
    logprobs: Optional[list] = None  # per committed token, when asked for
    # The first draft depth at which the drafter's best guess was not the target's token, and
    # which of its alternatives was (2 or 3; 0 for neither): drafted cycles that fetched the
    # drafter's alternatives (`Run.learns_branches`) and trees; None where every best guess held.
    missed: Optional[Tuple[int, int]] = None
    branched: bool = False  # a tree cycle committed a branch's token


class Run(Protocol):
    """One request's side of a policy."""

    @property
    def learns_branches(self) -> bool:
        """Whether drafted cycles should fetch the drafter's 2nd and 3rd choices (`Outcome.missed`)."""

    def choose(self, context: int, offer: Sequence[int] = (), unseen: int = 0, left: int = 0) -> Plan:
        """The next cycle's plan at `context` tokens, given the lookup's `offer`, `unseen` rows of
        taps the drafter has not read and `left` tokens of budget. Asked once per cycle; after a
        plain step, while it is in flight (before its `update`, and without an offer)."""

    def update(self, plan: Plan, outcome: Outcome) -> None:
        """A cycle run as `plan` committed `outcome`."""

    def lookup_pays(self, context: int) -> bool:
        """Whether a lookup offer could be worth waiting for at `context` (else plain steps run ahead)."""

    def drafter_pays(self, first: int, last: int) -> bool:
        """False when no cycle between these contexts will run the drafter: the request then
        keeps no drafter context."""


class Policy(Protocol):
    """What `stream_generate(block_size=...)` takes besides a width or 'auto'."""

    @property
    def default_branches(self) -> int:
        """Tree branches a request weighs unless it says otherwise."""

    def start(self, branches: int = 0) -> Run:
        """A run for one request, whose cycles may verify trees of up to `branches` branches."""


class FixedWidth:
    """The policy of a fixed --block-size: the drafter at that width, every cycle (verified as a
    tree with `branches` where the loop can). It is its own run: it learns nothing."""

    learns_branches = False
    default_branches = 0

    def __init__(self, width: int, branches: int = 0):
        self.plan = Plan(width, 0, branches if width > 1 else 0)

    def start(self, branches: int = 0) -> "FixedWidth":
        return self

    def choose(self, context: int, offer: Sequence[int] = (), unseen: int = 0, left: int = 0) -> Plan:
        return self.plan

    def update(self, plan: Plan, outcome: Outcome) -> None:
        pass

    def lookup_pays(self, context: int) -> bool:
        return False

    def drafter_pays(self, first: int, last: int) -> bool:
        return self.plan.width > 1
