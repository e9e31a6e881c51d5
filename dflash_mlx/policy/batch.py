"""The width of a batched cycle: measured, per batch size (and span of the K/V rows it reads).

How many rows a target pass can verify for the price of one grows with the
hardware's spare compute, and a batch of B sequences already fills B rows, so
the width that commits the most tokens per second falls as the batch grows (on
a 2-core CPU: width 4 pays up to 4 sequences and loses at 8, where plain
batched decoding is best). `BatchWidths` learns it online: per batch size it
keeps each candidate width's seconds and committed tokens per cycle, averaged
over the batch's own cycles, tries the candidates from the narrowest up while
each beats the one below it, then runs the best, retrying its neighbours now
and then as the text and the contexts change: often where a retry costs little,
rarely where it costs several plain steps; a figure counts less the older it
is, so one retry is enough to show a large change. Where the batch's sequences
carry acceptance statistics (their sizer runs), a width is worth the tokens
they expect it to commit over its measured seconds per cycle: the cost is
measured, the acceptance is each sequence's own, and one cycle's luck moves
neither much. Output does not depend on the widths, so trying costs speed only.

A drafted width's cycle may also verify each sequence's tree (`draft/tree.py`:
its best path and a few branches, more rows in the same pass) where every
sequence allows it. Trees pay only where a pass's rows are nearly free (a small
batch on a GPU): the batch's own measured seconds per width say what a row
costs at its size, and a tree whose extra rows would cost more than
`TREE_GAIN` of the cycle is never tried (on a CPU, none is). Otherwise a tree at
a width is weighed as a width is, by its own measured tokens per second at
that batch size against the linear cycle's: tried once the width has been,
kept where it commits more per second, and the other retried rarely (every
`TREE_RETRY` cycles at most).
"""

from typing import Dict, List, Optional, Protocol, Sequence, Tuple

from .costs import tree_rows

WIDTHS = (1, 2, 4, 8)  # the candidates: a few, so that each is measured often enough
TRIES = 3  # cycles each candidate runs at a batch size before the best is chosen on the figures
# Each new cycle's rate counts this much against what came before: a few dozen cycles of memory,
# so the choice follows a batch whose texts or contexts change.
DECAY = 0.9
# A neighbour of the best width is retried every RETRY cycles, or where one retry loses more than
# 1/RETRY_BUDGET of a best cycle (its seconds less the time the best takes for the tokens it commits),
# RETRY_BUDGET times that loss: retries cost at most about 1/RETRY_BUDGET of the time. A drafted width
# 4x slower per token in a large batch of a weak pair (demo pair, 8 sequences: a cycle 4.7x a plain
# step) is retried every 200 cycles; one a few percent behind (widened pair) every 32, often enough
# that its acceptance statistics, which only a try can show, stay current.
RETRY = 32
RETRY_BUDGET = 64
MAX_RETRY = 1024  # at least this often, however far behind: the text may come to repeat
# A width's trees and its linear cycle, whichever is behind, are retried at most every TREE_RETRY cycles:
# what a tree's extra rows cost is the machine's and stays, only its branches' acceptance follows the text
# (on a CPU a batch's tree commits about 0.7x the linear cycle's tokens per second, so each retry there
# costs a third of a cycle).
TREE_RETRY = 256
# Branches add 13-17% tokens per cycle, alone and in batches (`benchmarks/tree.py`): a tree whose extra rows
# would cost more than this share of the linear cycle's seconds cannot pay, and is not tried.
TREE_GAIN = 0.25
STALE_KEEP = 0.5  # what a figure keeps, at least, of itself when a retry after a long pause updates it
# A drafting width must beat plain batched decoding (width 1) by this much to be chosen: drafted
# cycles make a batch's sequences finish apart, so a wave of requests leaves smaller, slower
# batches behind, a cost a cycle's own rate does not show (widened pair, 8 clients: widths 1-4
# within a few percent per cycle, width 1 about 10% faster over the whole wave).
DRAFT_MARGIN = 1.1
# Batches whose attention reads up to this many K/V rows per row of the block (over all their
# sequences, padding included: `decode.caches.Caches.columns`) are measured together, then each
# doubling apart: a drafted row over a 16k-token prompt costs what its weights do many times over on
# a CPU, so figures taken beside a long prompt say little of the batch without it, and the batch
# goes back to its own figures when the long prompt leaves instead of learning them again.
COLUMN_SPAN = 8192


class BatchPolicy(Protocol):
    """What decides a batch's cycles (`decode.streams.Streams`): `BatchWidths`, `FixedBatchWidth`."""

    widths: Sequence[int]  # the candidate widths it weighs (none for a fixed one)

    def choose(self, batch: int, gains: Optional[Dict[int, float]] = None, columns: int = 0) -> int:
        """The width of a coming cycle of `batch` sequences whose attention reads `columns` K/V rows
        per block row (`gains`: the tokens they expect per width)."""

    def branches(self, batch: int, width: int, most: int, columns: int = 0) -> int:
        """The tree branches a drafted cycle of `width` verifies, where each sequence allows `most`."""

    def update(self, batch: int, width: int, seconds: float, tokens: int, branches: int = 0, columns: int = 0) -> None:
        """A cycle took `seconds` and committed `tokens` in all."""


def bucket(batch: int, columns: int = 0) -> tuple:
    """Batches measured together: sizes 1, 2, 3-4, 5-8, ... (neighbours cost alike, and each
    bucket's candidates are tried before it chooses, so fewer buckets explore less), and the K/V
    rows their attention reads up to `COLUMN_SPAN`, then each doubling."""
    span = (max(columns, 1) - 1) // COLUMN_SPAN
    return 1 << max(batch - 1, 0).bit_length(), span.bit_length()


class BatchWidths:
    """Per batch size (`bucket`): each candidate width's committed tokens per second, and the choice."""

    def __init__(self, max_width: int, widths: Sequence[int] = WIDTHS):
        self.widths: List[int] = sorted({min(w, max_width) for w in widths if w >= 1})
        # Keyed (`bucket` of batch size and K/V rows, width), trees with their branches after.
        self.tokens: Dict[Tuple[int, int], float] = {}  # (batch size, width) -> tokens committed per cycle
        self.seconds: Dict[Tuple[int, int], float] = {}  # (batch size, width) -> seconds per cycle
        self.runs: Dict[Tuple[int, int], int] = {}  # (batch size, width) -> cycles measured
        self.last: Dict[Tuple[int, int], int] = {}  # (batch size, width) -> the cycle it last ran
        self.chosen: Dict[Tuple[int, int], int] = {}  # (batch size, width) -> the cycle it was last chosen
        self.cycle = 0

    def rate(self, batch: int, width: int, branches: int = 0, columns: int = 0) -> float:
        """Measured tokens per second of cycles of `width` (trees of `branches`) at `batch`
        sequences: averages of tokens and of seconds, so that a cycle whose work an earlier one
        did (a plain step launched ahead) neither counts as infinitely fast nor drags the figure."""
        key = _key(batch, width, branches, columns)
        return self.tokens[key] / self.seconds[key]

    def choose(self, batch: int, gains: Optional[Dict[int, float]] = None, columns: int = 0) -> int:
        """The width of a coming cycle of `batch` sequences (their attention reading `columns` K/V
        rows per block row) (a batch chooses a cycle ahead, so
        that a plain step knows whether the next one is plain too): climbing the candidates from
        the narrowest while each beats the one below it, then the best, with its neighbours
        retried the more rarely the more a retry loses (tokens per second rise with the width,
        then fall). `gains`: the tokens the batch's sequences expect each width to commit, in
        all; a width is then rated by them over its seconds per cycle."""
        self.cycle += 1
        b, ws = bucket(batch, columns), self.widths
        if gains is None:
            rate = lambda w: self.tokens[(b, w)] / self.seconds[(b, w)]  # noqa: E731
        else:
            rate = lambda w: gains[w] / self.seconds[(b, w)]  # noqa: E731
        known = [w for w in ws if self.runs.get((b, w), 0) >= TRIES]
        k = len(known)
        if k < len(ws) and known == ws[:k] and (k < 2 or rate(ws[k - 1]) > rate(ws[k - 2])):
            return self._chose(b, ws[k])  # still climbing
        best = max(known, key=rate)
        if best != ws[0] and rate(best) < DRAFT_MARGIN * rate(ws[0]):
            best = ws[0]
        i = ws.index(best)
        top = rate(best)

        def overdue(w: int) -> float:
            """Cycles since w last ran, over the cycles between its retries."""
            interval = RETRY
            if self.runs.get((b, w), 0):
                lost = self.seconds[(b, w)] * max(0.0, 1 - rate(w) / top) / self.seconds[(b, best)]
                interval = min(max(RETRY, RETRY_BUDGET * lost), MAX_RETRY)
            return (self.cycle - self.chosen.get((b, w), 0)) / interval

        stale = max((w for w in ws[max(i - 1, 0) : i + 2] if w != best), key=overdue, default=best)
        return self._chose(b, stale if stale != best and overdue(stale) >= 1 else best)

    def _chose(self, b: int, width: int) -> int:
        self.chosen[(b, width)] = self.cycle
        return width

    def branches(self, batch: int, width: int, most: int, columns: int = 0) -> int:
        """The branches of the trees a drafted cycle of `width` at `batch` sequences verifies,
        where each sequence allows up to `most` (0: linear): each shape tried `TRIES` times once
        the width has been, then the faster (measured tokens per second), the other retried the
        more rarely the more a retry loses."""
        linear, tree = _key(batch, width, 0, columns), _key(batch, width, most, columns)
        if width < 2 or not most or self.runs.get(linear, 0) < TRIES or not self._rows_cheap(batch, width, most,
                                                                                             columns):
            return 0
        if self.runs.get(tree, 0) < TRIES:
            return most
        rates = {0: self.rate(batch, width, 0, columns), most: self.rate(batch, width, most, columns)}
        best = max(rates, key=rates.get)
        other = most - best
        key = _key(batch, width, other, columns)
        lost = self.seconds[key] * max(0.0, 1 - rates[other] / rates[best]) / self.seconds[_key(batch, width, best,
                                                                                                 columns)]
        interval = min(max(TREE_RETRY, RETRY_BUDGET * lost), MAX_RETRY)
        return other if self.cycle - self.last.get(key, 0) >= interval else best

    def _rows_cheap(self, batch: int, width: int, branches: int, columns: int = 0) -> bool:
        """Whether a tree's extra rows could cost less than `TREE_GAIN` of the linear cycle of
        `width` at `batch` sequences, at what a row costs between the narrower measured width
        and this one (none measured: not known to be cheap)."""
        below = [w for w in self.widths if w < width and self.runs.get(_key(batch, w, 0, columns), 0) >= TRIES]
        if not below:
            return False
        w0 = max(below)
        at, under = self.seconds[_key(batch, width, 0, columns)], self.seconds[_key(batch, w0, 0, columns)]
        per_row = max(0.0, at - under) / (width - w0)  # a block row of every sequence
        return per_row * (tree_rows(width, branches) - width) < TREE_GAIN * at

    def update(self, batch: int, width: int, seconds: float, tokens: int, branches: int = 0, columns: int = 0) -> None:
        """A cycle of `batch` sequences at `width` (trees of `branches`; their attention reading
        `columns` K/V rows per block row) took `seconds` and committed `tokens` in all."""
        if seconds <= 0:
            return
        key = _key(batch, width, branches, columns)
        n = self.runs.get(key, 0)
        # The first tries count alike, then recent cycles more: the figure so far keeps `DECAY` per
        # run, or per `RETRY` cycles since its last where that is less, so that a retry after a long
        # pause counts as much as the stale figure (not more: one cycle's timing is noisy).
        age = self.cycle - self.last.get(key, self.cycle)
        keep = n / (n + 1) if n < TRIES else max(DECAY ** max(age / RETRY, 1.0), STALE_KEEP)
        self.tokens[key] = keep * self.tokens.get(key, 0.0) + (1 - keep) * tokens
        self.seconds[key] = keep * self.seconds.get(key, 0.0) + (1 - keep) * seconds
        self.runs[key] = n + 1
        self.last[key] = self.cycle


def _key(batch: int, width: int, branches: int = 0, columns: int = 0) -> tuple:
    """Where a shape's figures are kept: linear cycles per (batch bucket, width), trees apart."""
    return (bucket(batch, columns), width) + ((branches,) if branches else ())


class FixedBatchWidth:
    """A fixed `--block-size`: every batched cycle at that width."""

    widths: Tuple[int, ...] = ()  # no candidates to weigh

    def __init__(self, width: int, trees: bool = True):
        """`trees`: a drafted cycle verifies trees wherever the sequences allow them."""
        self.width, self.trees = width, trees

    def choose(self, batch: int, gains: Optional[Dict[int, float]] = None, columns: int = 0) -> int:
        return self.width

    def branches(self, batch: int, width: int, most: int, columns: int = 0) -> int:
        """Trees wherever the sequences allow them (`tree=n` with a fixed size), unless told not to."""
        return most if width > 1 and self.trees else 0

    def update(self, batch: int, width: int, seconds: float, tokens: int, branches: int = 0, columns: int = 0) -> None:
        pass
