"""Progress for long work: a rich bar on a terminal, plain timestamped lines elsewhere."""

import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

Update = Callable[..., None]  # update(done, total=None, description=None)


@contextmanager
def progress(console: Console, description: str, total: Optional[float] = None, transient: bool = True,
             every: float = 5.0, counts: bool = True, quiet_for: float = 0.0) -> Iterator[Update]:
    """Yield `update(done, total=None, description=None)`.

    Off a terminal (a pipe, a log file, CI) rich draws nothing until the end,
    so plain lines are printed instead: one at the start, one at most every
    `every` seconds (repeated while one step runs long) and one at the end;
    with `quiet_for`, none at all unless the work outlasts that many seconds.
    """
    if console.is_terminal:
        columns = [TextColumn("{task.description}"), BarColumn()]
        columns += [MofNCompleteColumn()] if counts else []
        with Progress(*columns, TimeElapsedColumn(), console=console, transient=transient) as bar:
            task = bar.add_task(description, total=total)

            def update(done, total=None, description=None):
                fields = {"description": description} if description else {}
                bar.update(task, completed=done, total=total, **fields)

            yield update
        return
    start = last = time.monotonic()
    state = {"description": description, "done": 0, "total": total, "shown": quiet_for <= 0}
    lock, finished = threading.Lock(), threading.Event()
    if state["shown"]:
        console.print(f"{description} ...", highlight=False)

    def line():
        d, t = state["done"], state["total"]
        amount = f" {d:.0f}/{t:.0f}" if counts and t else ""
        return f"{state['description']}{amount} ({time.monotonic() - start:.0f} s)"

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
        console.print(line() + ": done", highlight=False)
