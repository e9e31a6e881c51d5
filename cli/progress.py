"""Progress for long work: a rich bar on a terminal, plain timestamped lines elsewhere.

Where the work has a total, both show the time left at the rate of the work
done so far."""

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Tuple

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn, TimeElapsedColumn
from rich.text import Text

Update = Callable[..., None]  # update(done, total=None, description=None)


def about(seconds: float) -> str:
    """'about 40 s', 'about 11 min', 'about 2 h 5 min'."""
    if round(seconds) < 60:
        return f"about {max(round(seconds), 1)} s"
    hours, minutes = divmod(round(seconds / 60), 60)
    if not hours:
        return f"about {minutes} min"
    return f"about {hours} h {minutes} min" if minutes else f"about {hours} h"


@dataclass
class Rate:
    """The time left at the rate of the work done since the first update (a resumed
    run's earlier work, done before it, does not count)."""

    first: Optional[Tuple[float, float]] = None  # (time, done) at the first update
    latest: Optional[Tuple[float, float]] = None  # at the latest update that did more

    def record(self, done: float, now: Optional[float] = None) -> None:
        now = time.monotonic() if now is None else now
        if self.first is None:
            self.first = self.latest = (now, done)
        elif done > self.latest[1]:
            self.latest = (now, done)

    def left(self, total: Optional[float]) -> Optional[float]:
        """Seconds left, or None before any work is done, without a total and once it is all done."""
        if self.first is None or not total:
            return None
        (t0, d0), (t1, d1) = self.first, self.latest
        if d1 <= d0 or d1 >= total:
            return None
        return (total - d1) * (t1 - t0) / (d1 - d0)


class TimeLeftColumn(ProgressColumn):
    """The bar's 'about 11 min left', from the same `Rate` as the plain lines."""

    def __init__(self, rate: Rate):
        super().__init__()
        self.rate = rate

    def render(self, task) -> Text:
        left = self.rate.left(task.total)
        return Text("" if left is None else f"{about(left)} left", style="progress.remaining")


@contextmanager
def progress(console: Console, description: str, total: Optional[float] = None, transient: bool = True,
             every: float = 5.0, counts: bool = True, quiet_for: float = 0.0) -> Iterator[Update]:
    """Yield `update(done, total=None, description=None)`.

    Off a terminal (a pipe, a log file, CI) rich draws nothing until the end,
    so plain lines are printed instead: one at the start, one at most every
    `every` seconds (repeated while one step runs long) and one at the end;
    with `quiet_for`, none at all unless the work outlasts that many seconds.
    """
    rate = Rate()
    if console.is_terminal:
        columns = [TextColumn("{task.description}"), BarColumn()]
        columns += [MofNCompleteColumn()] if counts else []
        with Progress(*columns, TimeElapsedColumn(), TimeLeftColumn(rate), console=console,
                      transient=transient) as bar:
            task = bar.add_task(description, total=total)

            def update(done, total=None, description=None):
                rate.record(done)
                fields = {"description": description} if description else {}
                bar.update(task, completed=done, total=total, **fields)

            yield update
        return
    start = last = time.monotonic()
    state = {"description": description, "done": 0, "total": total, "shown": quiet_for <= 0}
    lock, finished = threading.Lock(), threading.Event()
    if state["shown"]:
        console.print(f"{description} ...", highlight=False)

    def line(final=False):
        d, t = state["done"], state["total"]
        amount = f" {d:.0f}/{t:.0f}" if counts and t else ""
        left = None if final else rate.left(t)
        eta = "" if left is None else f", {about(left)} left"
        return f"{state['description']}{amount} ({time.monotonic() - start:.0f} s{eta})"

    def show_if_due():  # under `lock`
        nonlocal last
        now = time.monotonic()
        if state["shown"]:
            if now - last < every:
                return
        elif now - start >= quiet_for:
            state["shown"] = True
        else:
            return
        last = now
        console.print(line(), highlight=False)

    def update(done, total=None, description=None):
        with lock:
            rate.record(done)
            state.update(done=done, total=total or state["total"], description=description or state["description"])
            show_if_due()

    def heartbeat():  # one step may take minutes (a long prompt's prefill): say it is still going
        while not finished.wait(every):
            with lock:
                show_if_due()

    beat = threading.Thread(target=heartbeat, daemon=True) if every > 0 else None
    if beat:
        beat.start()
    try:
        yield update
    finally:
        finished.set()
        if beat:
            beat.join()
    if state["shown"]:
        console.print(line(final=True) + ": done", highlight=False)
