"""The width of a batched cycle: measured, per batch size.

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
"""

from typing import Dict, List, Optional, Sequence, Tuple

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
STALE_KEEP = 0.5  # what a figure keeps, at least, of itself when a retry after a long pause updates it
# A drafting width must beat plain batched decoding (width 1) by this much to be chosen: drafted
# cycles make a batch's sequences finish apart, so a wave of requests leaves smaller, slower
# batches behind, a cost a cycle's own rate does not show (widened pair, 8 clients: widths 1-4
# within a few percent per cycle, width 1 about 10% faster over the whole wave).
DRAFT_MARGIN = 1.1


def bucket(batch: int) -> int:
    """Batch sizes measured together (1, 2, 3-4, 5-8, ...): neighbours cost alike, and each
    bucket's candidates are tried before it chooses, so fewer buckets explore less."""
    return 1 << max(batch - 1, 0).bit_length()


class BatchWidths:
    """Per batch size (`bucket`): each candidate width's committed tokens per second, and the choice."""

    def __init__(self, max_width: int, widths: Sequence[int] = WIDTHS):
        self.widths: List[int] = sorted({min(w, max_width) for w in widths if w >= 1})
        self.tokens: Dict[Tuple[int, int], float] = {}  # (batch size, width) -> tokens committed per cycle
        self.seconds: Dict[Tuple[int, int], float] = {}  # (batch size, width) -> seconds per cycle
        self.runs: Dict[Tuple[int, int], int] = {}  # (batch size, width) -> cycles measured
        self.last: Dict[Tuple[int, int], int] = {}  # (batch size, width) -> the cycle it last ran
        self.chosen: Dict[Tuple[int, int], int] = {}  # (batch size, width) -> the cycle it was last chosen
        self.cycle = 0

    def rate(self, batch: int, width: int) -> float:
        """Measured tokens per second of cycles of `width` at `batch` sequences: averages of
        tokens and of seconds, so that a cycle whose work an earlier one did (a plain step
        launched ahead) neither counts as infinitely fast nor drags the figure."""
        key = (bucket(batch), width)
        return self.tokens[key] / self.seconds[key]

    def choose(self, batch: int, gains: Optional[Dict[int, float]] = None) -> int:
        """The width of a coming cycle of `batch` sequences (a batch chooses a cycle ahead, so
        that a plain step knows whether the next one is plain too): climbing the candidates from
        the narrowest while each beats the one below it, then the best, with its neighbours
        retried the more rarely the more a retry loses (tokens per second rise with the width,
        then fall). `gains`: the tokens the batch's sequences expect each width to commit, in
        all; a width is then rated by them over its seconds per cycle."""
        self.cycle += 1
        b, ws = bucket(batch), self.widths
        if gains is None:
            rate = lambda w: self.rate(b, w)  # noqa: E731
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

    def update(self, batch: int, width: int, seconds: float, tokens: int) -> None:
        """A cycle of `batch` sequences at `width` took `seconds` and committed `tokens` in all."""
        if seconds <= 0:
            return
        key = (bucket(batch), width)
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


class FixedBatchWidth:
    """A fixed `--block-size`: every batched cycle at that width."""

    widths: Tuple[int, ...] = ()  # no candidates to weigh

    def __init__(self, width: int):
        self.width = width

    def choose(self, batch: int, gains: Optional[Dict[int, float]] = None) -> int:
        return self.width

    def update(self, batch: int, width: int, seconds: float, tokens: int) -> None:
        pass
