"""`dflash-mlx bench`: DFlash against plain mlx-lm decoding on this machine."""

import os
import signal
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, List, Optional

import typer
from rich.console import Console
from rich.markup import escape

from dflash_mlx.cli.common import (DRAFT_CONTEXT_HELP, SHARDING_HELP, TEMP_HELP, err, fail,
                                   note_draft_context, ranged, sharding_choice)
from dflash_mlx.cli.warning_lines import print_warning
from dflash_mlx.errors import DFlashError

# A shell's exit status for a process stopped by signal N (130 after Ctrl-C).
SIGNAL_EXIT_BASE = 128


def main(
    model: str = typer.Option("demo", "--model", help="Alias, repo id or directory."),
    draft: Optional[str] = typer.Option(None, "--draft", "--draft-model",
                                        help="DFlash drafter (default: the model's own)."),
    suite: str = typer.Option("all", "--suite",
                              help="code, math, chat, json (answers kept to a JSON schema each) or all."),
    prompts: Optional[str] = typer.Option(None, "--prompts", help="A .jsonl of {\"prompt\": ...} rows instead."),
    max_tokens: int = ranged(128, "--max-tokens", "-m", min=1, help="Tokens generated per prompt."),
    block_size: str = typer.Option("auto", "--block-size", help="N, auto, sweep, or a comma list (e.g. 4,8,16,auto)."),
    temp: float = ranged(0.0, "--temp", min=0.0, max=2.0, help=TEMP_HELP),
    repeats: int = ranged(1, "--repeats", min=1, help="Runs of each prompt; the median is reported."),
    out: Optional[str] = typer.Option(None, "--out", help="Write the results as JSON."),
    oracle: bool = typer.Option(False, "--oracle", help="Draft the target's own continuation (the ceiling)."),
    plot: Optional[str] = typer.Option(None, "--plot", help="Draw a PNG (needs matplotlib)."),
    context: Optional[str] = typer.Option(
        None, "--context", help="Put each prompt after this many tokens of a long document: e.g. 1k,8k,32k."),
    draft_context: Optional[int] = ranged(None, "--draft-context", min=1, help=DRAFT_CONTEXT_HELP),
    sharding: str = typer.Option("auto", "--sharding", help=SHARDING_HELP),
):
    """Benchmark DFlash against plain mlx-lm decoding on this machine."""
    from dflash_mlx import distributed

    sizes, sharding = _block_sizes(block_size), sharding_choice(sharding)
    contexts = _contexts(context) if context else [0]
    if context and sizes == ["sweep"]:
        fail("--context cannot be combined with --block-size sweep.")
    g = distributed.group()
    sharded, main_rank = g.size() > 1, distributed.is_main(g)
    if sharded and sizes == ["sweep"]:
        fail("--block-size sweep times one machine; give block sizes under mlx.launch.")
    for path in (out, plot):
        if path and Path(path).is_dir():
            fail(f"Cannot write {path}: it is a folder; give a file name.")
        if path and not Path(path).resolve().parent.is_dir():
            fail(f"Cannot write {path}: its folder does not exist; create it or pick another path.")
    if not main_rank:  # only rank 0 reports; every rank runs the same benchmark
        err.file = open(os.devnull, "w")
    try:
        with _terminate_as_interrupt() as signals:
            result = _run_bench(model, draft, suite, prompts, max_tokens, sizes, temp, repeats, oracle, contexts,
                                draft_context, sharding, g)
    except DFlashError as e:
        if not main_rank:
            err.file = None  # back to the process's stderr
        fail(f"rank {g.rank()} of {g.size()}: {e}" if sharded else str(e))
    except KeyboardInterrupt as stop:
        code = SIGNAL_EXIT_BASE + (signals[0] if signals else signal.SIGINT)
        if main_rank:
            _report_interrupted(getattr(stop, "result", None), temp, out, plot)
        raise typer.Exit(code)
    if not main_rank:
        return
    _print_bench(result, temp)
    _write_bench(result, out, plot)


@contextmanager
def _terminate_as_interrupt() -> Iterator[List[int]]:
    """SIGTERM stops the benchmark as Ctrl-C does (a KeyboardInterrupt), so what it measured is
    still reported; yields a list that gets the number of the signal that stopped it."""
    signals = []

    def stop(signum, frame):
        signals.append(signum)
        raise KeyboardInterrupt

    # Only the main thread may set a handler, and a SIGTERM the caller ignores stays ignored.
    own = (threading.current_thread() is threading.main_thread()
           and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL)
    if own:
        signal.signal(signal.SIGTERM, stop)
    try:
        yield signals
    finally:
        if own:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _report_interrupted(result: Optional[dict], temp: float, out: Optional[str], plot: Optional[str]) -> None:
    """The tables and the results file of the prompts finished before the interrupt."""
    if not result or not result.get("prompts_measured"):
        err.print("interrupted before a prompt was measured" + (f"; {out} not written" if out else ""))
        return
    err.print(f"interrupted: {result['prompts_measured']} of {_count(result['prompts_planned'], 'prompt')} "
              "measured")
    _print_bench(result, temp)
    _write_bench(result, out, plot)


def _contexts(text: str) -> List[int]:
    """'1k,8k,32k' -> [1024, 8192, 32768] (a plain number is tokens)."""
    out = []
    for part in text.split(","):
        part = part.strip().lower()
        number = part[:-1] if part.endswith("k") else part
        if not number.isdigit() or int(number) == 0:
            fail(f"--context takes token counts such as 1k,8k,32k or 3000 (got '{text}').")
        out.append(int(number) * (1024 if part.endswith("k") else 1))
    return sorted(set(out))


def _block_sizes(text: str):
    sizes = []
    for part in text.split(","):
        part = part.strip()
        if part in ("auto", "sweep"):
            sizes.append(part)
        elif part.isdigit() and 1 <= int(part) <= 64:
            sizes.append(int(part))
        else:
            fail(f"--block-size takes N (1-64), auto, sweep, or a comma list of them (got '{text}').")
    if "sweep" in sizes and len(sizes) > 1:
        fail("--block-size sweep cannot be combined with other sizes.")
    return sizes


def _run_bench(model, draft, suite, prompts, max_tokens, sizes, temp, repeats, oracle, contexts, draft_context,
               sharding, g) -> dict:
    """Load the pair (sharded under mlx.launch) and run the benchmark at each context."""
    import dflash_mlx
    from dflash_mlx import bench as B
    from dflash_mlx import distributed
    from dflash_mlx.cli.progress import progress as show_progress

    texts = None if sizes == ["sweep"] else B.load_prompts(suite, prompts)  # before any model loads
    if g.size() > 1:
        pair = distributed.load_sharded(model, draft, g, sharding, draft_context)
        if "auto" in sizes:  # each rank would time its own curve and pick its own widths
            fixed = pair.draft_source.block_size
            sizes = list(dict.fromkeys(fixed if s == "auto" else s for s in sizes))
            err.print(f"note: --block-size auto times one machine; {g.size()} ranks use the drafter's "
                      f"block size, {fixed}")
    else:
        pair = dflash_mlx.load(model, draft, draft_context=draft_context)
    note_draft_context(pair)
    with show_progress(err, "benchmark") as update:

        def progress(done, total, what="measuring"):
            update(done, total, what)

        if sizes == ["sweep"]:
            return B.sweep(pair, pair.draft_source.block_size, progress=progress)
        B.check_context(pair, contexts, max_tokens)
        by_context = {}
        for i, c in enumerate(contexts):
            def step(done, total, what="measuring", c=c, i=i):  # one count over every context
                progress(i * total + done, len(contexts) * total, f"context {c}: {what}" if c else what)

            try:
                by_context[c] = B.run_bench(pair, texts, max_tokens, sizes, temp, repeats, oracle, step, c)
            except B.Interrupted as stop:
                if stop.result["prompts_measured"]:
                    by_context[c] = stop.result
                raise B.Interrupted(_by_context(by_context, contexts)) if by_context else stop from None
    return _by_context(by_context, contexts)


def _by_context(by_context: dict, contexts: List[int]) -> dict:
    """The first context's result, with every measured context's under "contexts" where
    --context was given; partial where a context is partial or was not reached."""
    result = next(iter(by_context.values()))
    if contexts == [0]:
        return result
    measured = sum(r["prompts_measured"] for r in by_context.values())
    planned = result["prompts_planned"] * len(contexts)
    return dict(result, contexts={str(c): r for c, r in by_context.items()}, partial=measured < planned,
                prompts_measured=measured, prompts_planned=planned)


def _plural(n, word: str) -> str:
    return word if n == 1 else word + "s"


def _count(n, word: str) -> str:
    """'1 prompt', '2 prompts'."""
    return f"{n} {_plural(n, word)}"


def _figure(x, spec: str, suffix: str = "") -> str:
    """`x` formatted, or n/a where there is none (no prompt of a suite finished, no cycle drafted)."""
    return "n/a" if x is None else f"{format(x, spec)}{suffix}"


def _table(*headers: str, caption: Optional[str] = None):
    """A results table whose cells fold rather than end in an ellipsis: a header or a figure
    keeps every character on a terminal too narrow for the table."""
    from rich.table import Column, Table

    return Table(*[Column(h, overflow="fold") for h in headers], caption=caption)


def _show(console: Console, table) -> None:
    """Off a terminal (a pipe, a file) a table takes its natural width: no cell wraps, nothing
    is cut, whatever COLUMNS says. On a terminal it fits the width (see `_table`)."""
    from rich.measure import Measurement

    if not console.is_terminal:
        console.width = Measurement.get(console, console.options.update_width(1 << 16), table).maximum
    console.print(table)


def _print_bench(result: dict, temp: float, console: Optional[Console] = None) -> None:
    """The machine line, the benchmark's tables and its summary lines on stdout; warnings on stderr."""
    from dflash_mlx import bench as B

    out = console or Console(highlight=False, soft_wrap=True)
    m = result["machine"]
    out.print(escape(f"{m['chip']} ({_count(m['cores'], 'core')}, {m['memory_gb']} GB), MLX {m['mlx']} on "
                     f"{m['backend']}, BLAS: {m['blas']}"))
    if result.get("partial"):
        out.print(f"partial results: {result['prompts_measured']} of {_count(result['prompts_planned'], 'prompt')} "
                  "measured (the run was interrupted)")
    if "verify_relative" in result:  # a sweep
        table = _table("width", *[f"verify/1 @ctx {c}" for c in result["contexts"]], "draft/verify1")
        for w in range(len(result["verify_relative"][0])):
            table.add_row(str(w + 1), *[f"{row[w]:.2f}" for row in result["verify_relative"]],
                          f"{result['draft_relative'][0][w]:.2f}")
        _show(out, table)
        return
    table = _table("suite", "block", "baseline tok/s", "DFlash tok/s", "speedup", "accept.", "identical",
                   caption="speedup: ratio of medians (median of per-prompt ratios, ratio of geometric means); "
                           "accept.: mean tokens committed per cycle")
    prompt_table = _table("suite", "block", "baseline prompt tok/s", "DFlash prompt tok/s", "ratio",
                          "baseline TTFT ms", "DFlash TTFT ms",
                          caption="prompt processing: medians of mlx-lm's and our own figures, same prompts")
    groups = [(name, result["suites"][name]) for name in result["suites"]] + [("overall", result["overall"])]
    for name, per_size in groups:
        for key, s in per_size.items():
            speedup = (f"{_figure(s['speedup'], '.2f', 'x')} ({_figure(s['speedup_median_per_prompt'], '.2f', 'x')}, "
                       f"{_figure(s['speedup_geomean'], '.2f', 'x')})")
            table.add_row(name, key, _figure(s["baseline_tps"], ".1f"), _figure(s["dflash_tps"], ".1f"), speedup,
                          _figure(s["mean_acceptance"], ".2f"),
                          f"{s['identical']}/{s['prompts']}" if temp == 0 else "n/a")
            prompt_table.add_row(name, key, _figure(s["baseline_prompt_tps"], ".0f"),
                                 _figure(s["dflash_prompt_tps"], ".0f"), _figure(s["prompt_speedup"], ".2f", "x"),
                                 f"{(s['baseline_ttft'] or 0) * 1000:.0f}", f"{(s['dflash_ttft'] or 0) * 1000:.0f}")
    _show(out, table)
    _show(out, prompt_table)
    if "contexts" in result:
        ctx_table = _table("context", "prompt tokens", "block", "speedup", "accept.", "DFlash TTFT ms",
                           "peak memory GB", caption="each suite prompt after a long document (this package's "
                                                     "source); peak memory is the process's so far")
        for c, r in result["contexts"].items():
            rows = [row for rows in r["prompts"].values() for row in rows]
            for key, s in r["overall"].items():
                ctx_table.add_row(c, _figure(B.median([row["prompt_tokens"] for row in rows]), ".0f"), key,
                                  _figure(s["speedup"], ".2f", "x"), _figure(s["mean_acceptance"], ".2f"),
                                  f"{(s['dflash_ttft'] or 0) * 1000:.0f}", f"{r['peak_memory_gb']:.2f}")
        _show(out, ctx_table)
    for key, s in result["overall"].items():
        if "overhead_seconds_per_cycle" in s:
            ms = {k: s[k] * 1000 for k in ("seconds_per_cycle", "verify_seconds_per_cycle", "overhead_seconds_per_cycle")}
            out.print(f"oracle, block {key}: {ms['seconds_per_cycle']:.2f} ms per cycle; the target's bare verify pass "
                      f"{ms['verify_seconds_per_cycle']:.2f} ms; the loop's own work "
                      f"{ms['overhead_seconds_per_cycle']:.2f} ms per cycle (the same cycles rerun with the "
                      f"target's results in place of its passes)")
    if "distributed" in result:
        d = result["distributed"]
        per_pass = ", ".join(f"width {w}: {s * 1000:.2f} ms" for w, s in d["seconds_per_pass"].items())
        shares = ", ".join(f"{k}: {v:.0%}" for k, v in d["share"].items())
        out.print(f"{d['ranks']} ranks: {_count(d['collectives_per_pass'], 'collective')} per target pass "
                  f"({per_pass} alone); their share of a step or cycle: {shares}")
    for key, s in result["suites"].get("json", {}).items():
        valid, n = s["stopped"] - len(s["invalid_prompts"]), s["prompts"]
        out.print(f"json, block {key}: {s['stopped']} of {_count(n, 'answer')} ended within the budget, "
                  f"{valid} of them valid against {'its schema' if n == 1 else 'their schemas'}; "
                  f"{_count(s['forced_tokens'], 'token')} forced by the {_plural(n, 'grammar')}; "
                  f"{s['grammar_seconds'] * 1000:.0f} ms in the grammar engine (both loops constrain with the same "
                  "engine)")
    mismatched = [p for s in result["overall"].values() for p in s.get("mismatched_prompts", [])]
    if mismatched:
        n = len(mismatched)
        print_warning(err, f"{_count(n, 'greedy output')} {'differs' if n == 1 else 'differ'} from plain mlx-lm "
                           "decoding")
    invalid = [p for s in result["overall"].values() for p in s.get("invalid_prompts", [])]
    if invalid:
        n = len(invalid)
        print_warning(err, f"{_count(n, 'answer')} that stopped "
                           + ("does not validate against its schema" if n == 1
                              else "do not validate against their schemas"))


def _write_bench(result: dict, out: Optional[str], plot: Optional[str]) -> None:
    """The results as JSON (a half-written file never replaces an earlier one) and the plot."""
    import json

    from dflash_mlx import bench as B

    if out:
        tmp = Path(out).with_name(Path(out).name + ".tmp")
        tmp.write_text(json.dumps(result, indent=2) + "\n")
        tmp.replace(out)
        err.print(f"wrote {out}")
    if plot:
        try:
            B.plot(result, plot)
        except ImportError:
            fail("--plot needs matplotlib: pip install 'dflash-mlx[plot]'.")
        err.print(f"wrote {plot}")
