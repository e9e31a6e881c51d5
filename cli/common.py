"""What the commands share: the error line, ranged numeric options, loading the pair and
readying `--block-size auto`."""

import os
from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape

from dflash_mlx.errors import printable

err = Console(stderr=True, highlight=False, soft_wrap=True)


def fail(message: str) -> None:
    err.print(f"[bold red]error:[/] {escape(printable(message))}", soft_wrap=True)
    raise typer.Exit(1)


def _number(x) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def ranged(default, *names, min=None, max=None, help: Optional[str] = None, **kwargs):
    """A numeric typer.Option that takes values from `min` to `max`.

    Out of range is one `error:` line and exit 1, as the commands' own checks
    give (typer's own bounds print a usage box and exit 2), and it is refused
    while the command line is read, before any model loads."""
    low, high = min, max
    span = (f"from {_number(low)} to {_number(high)}" if low is not None and high is not None
            else f"{_number(low)} or more" if low is not None else f"{_number(high)} or less")

    def check(param: typer.CallbackParam, value):
        if value is not None and (low is not None and value < low or high is not None and value > high):
            name = next((o for o in param.opts if o.startswith("--")), param.opts[0])
            fail(f"{name} must be {span} (got {_number(value)}).")
        return value

    help = " ".join(filter(None, [help, f"Range: {span.removeprefix('from ')}."]))
    return typer.Option(default, *names, callback=check, help=help, **kwargs)



TEMP_HELP = "Sampling temperature (0 = greedy)."
DRAFT_CONTEXT_HELP = (
    "Let the drafter read only the first 4 and the last N rows of the context (default: every row, or the "
    "windows its checkpoint declares). Keeps a draft's cost flat on long prompts; past N tokens the drafts "
    "change and acceptance may drop. Output stays exact.")
SHARDING_HELP = ("Under mlx.launch: mlx-lm's 'tensor' or 'pipeline' parallelism for the target (auto: tensor "
                 "where the family has it, else pipeline).")


def load_pair(model, draft, g, sharding, draft_context, block):
    """The pair (sharded across `g`'s processes where there are several) and the block size
    it runs: under mlx.launch 'auto' becomes the drafter's block size, since each rank would
    time its own curve and pick its own widths."""
    import dflash_mlx
    from dflash_mlx import distributed

    if g.size() == 1:
        return dflash_mlx.load(model, draft, draft_context=draft_context), block
    pair = distributed.load_sharded(model, draft, g, sharding, draft_context)
    if block == "auto":
        block = pair.draft_source.block_size
        if distributed.is_main(g):
            err.print(f"note: --block-size auto times one machine; {g.size()} ranks use the drafter's "
                      f"block size, {block}")
    return pair, block


def note_draft_context(pair) -> None:
    """A bounded drafter context is never silent: one line says what the drafts read."""
    if pair.draft_context is not None:
        err.print(f"note: drafts read the first {pair.drafter.context_bound[0]} and the last {pair.draft_context} "
                  f"context rows (--draft-context); past that, drafts differ from the checkpoint's own")


def auto_sizer(pair, context: int) -> Optional[str]:
    """Ready --block-size auto (measuring this machine's costs first if needed,
    with progress); say and return what the cost curve predicts where it
    predicts that the drafter does not pay (None where it predicts drafting)."""
    from contextlib import ExitStack

    from dflash_mlx.cli.progress import progress

    with ExitStack() as stack:
        bar = []

        def update(done, total):
            if not bar:  # nothing is shown when the costs are already cached
                busy = _busy()
                if busy:
                    err.print(busy, highlight=False)
                bar.append(stack.enter_context(progress(
                    err, "measuring this machine's verify costs (about 10 s, first runs only)", counts=False)))
            bar[0](done, total)

        sizer = pair.auto_sizer(progress=update)
    prediction = sizer.explain(context)
    if prediction:
        err.print(prediction, highlight=False)
    return prediction


def _busy() -> Optional[str]:
    """A warning when other work loads the machine: costs measured now may be off."""
    try:
        load, cores = os.getloadavg()[0], os.cpu_count() or 1
    except (AttributeError, OSError):
        return None
    if load < 0.75 * cores:
        return None
    return (f"note: this machine is busy (load {load:.1f} on {cores} core{'' if cores == 1 else 's'}); the costs "
            "measured now may be off, and later runs refine them.")


def sharding_choice(text: str) -> str:
    from dflash_mlx.distributed import SHARDINGS

    if text not in SHARDINGS:
        fail(f"--sharding must be one of {', '.join(SHARDINGS)} (got '{text}').")
    return text


def block_size_choice(text: str):
    if text == "auto":
        return "auto"
    if text.isdigit() and 1 <= int(text) <= 64:
        return int(text)
    fail(f"--block-size takes a number from 1 to 64 or 'auto' (got '{text}').")
