"""`dflash-mlx bench`: DFlash against plain mlx-lm decoding on this machine."""

import os
from pathlib import Path
from typing import List, Optional

import typer
from rich.markup import escape

from dflash_mlx.cli.common import (DRAFT_CONTEXT_HELP, SHARDING_HELP, TEMP_HELP, err, fail,
                                   note_draft_context, ranged, sharding_choice)
from dflash_mlx.cli.warning_lines import print_warning
from dflash_mlx.errors import DFlashError


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
        result = _run_bench(model, draft, suite, prompts, max_tokens, sizes, temp, repeats, oracle, contexts,
                            draft_context, sharding, g)
    except DFlashError as e:
        if not main_rank:
            err.file = None  # back to the process's stderr
        fail(f"rank {g.rank()} of {g.size()}: {e}" if sharded else str(e))
    if not main_rank:
        return
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
        for c in contexts:
            def step(done, total, what="measuring", c=c):
                progress(done, total, f"context {c}: {what}" if c else what)

            by_context[c] = B.run_bench(pair, texts, max_tokens, sizes, temp, repeats, oracle, step, c)
    result = by_context[contexts[0]]
    if contexts != [0]:
        result = dict(result, contexts={str(c): r for c, r in by_context.items()})
    return result


def _print_bench(result: dict, temp: float) -> None:
    """The machine line and the benchmark's tables."""
    from rich.table import Table

    from dflash_mlx import bench as B

    m = result["machine"]
    err.print(f"{m['chip']} ({m['cores']} cores, {m['memory_gb']} GB), MLX {m['mlx']} on {m['backend']}, "
              f"BLAS: {escape(m['blas'])}")
    if "verify_relative" in result:  # a sweep
        table = Table("width", *[f"verify/1 @ctx {c}" for c in result["contexts"]], "draft/verify1")
        for w in range(len(result["verify_relative"][0])):
            table.add_row(str(w + 1), *[f"{row[w]:.2f}" for row in result["verify_relative"]],
                          f"{result['draft_relative'][0][w]:.2f}")
        err.print(table)
        return
    table = Table("suite", "block", "baseline tok/s", "DFlash tok/s", "speedup", "acceptance", "identical",
                  caption="speedup: ratio of medians (median of per-prompt ratios, ratio of geometric means)")
    prompt_table = Table("suite", "block", "baseline prompt tok/s", "DFlash prompt tok/s", "ratio",
                         "baseline TTFT ms", "DFlash TTFT ms",
                         caption="prompt processing: medians of mlx-lm's and our own figures, same prompts")
    groups = [(name, result["suites"][name]) for name in result["suites"]] + [("overall", result["overall"])]
    for name, per_size in groups:
        for key, s in per_size.items():
            table.add_row(name, key, f"{s['baseline_tps']:.1f}", f"{s['dflash_tps']:.1f}",
                          f"{s['speedup']:.2f}x ({s['speedup_median_per_prompt']:.2f}x, "
                          f"{s['speedup_geomean']:.2f}x)", f"{s['mean_acceptance']:.2f}",
                          f"{s['identical']}/{s['prompts']}" if temp == 0 else "n/a")
            prompt_table.add_row(name, key, f"{s['baseline_prompt_tps']:.0f}", f"{s['dflash_prompt_tps']:.0f}",
                                 f"{s['prompt_speedup']:.2f}x", f"{(s['baseline_ttft'] or 0) * 1000:.0f}",
                                 f"{(s['dflash_ttft'] or 0) * 1000:.0f}")
    err.print(table)
    err.print(prompt_table)
    if "contexts" in result:
        ctx_table = Table("context", "prompt tokens", "block", "speedup", "acceptance", "DFlash TTFT ms",
                          "peak memory GB", caption="each suite prompt after a long document (this package's "
                                                    "source); peak memory is the process's so far")
        for c, r in result["contexts"].items():
            rows = [row for rows in r["prompts"].values() for row in rows]
            for key, s in r["overall"].items():
                ctx_table.add_row(c, str(int(B.median([row["prompt_tokens"] for row in rows]))), key,
                                  f"{s['speedup']:.2f}x", f"{s['mean_acceptance']:.2f}",
                                  f"{(s['dflash_ttft'] or 0) * 1000:.0f}", f"{r['peak_memory_gb']:.2f}")
        err.print(ctx_table)
    for key, s in result["overall"].items():
        if "overhead_seconds_per_cycle" in s:
            ms = {k: s[k] * 1000 for k in ("seconds_per_cycle", "verify_seconds_per_cycle", "overhead_seconds_per_cycle")}
            err.print(f"oracle, block {key}: {ms['seconds_per_cycle']:.2f} ms per cycle; the target's bare verify pass "
                      f"{ms['verify_seconds_per_cycle']:.2f} ms; the loop's own work "
                      f"{ms['overhead_seconds_per_cycle']:.2f} ms per cycle (the same cycles rerun with the "
                      f"target's results in place of its passes)")
    if "distributed" in result:
        d = result["distributed"]
        per_pass = ", ".join(f"width {w}: {s * 1000:.2f} ms" for w, s in d["seconds_per_pass"].items())
        shares = ", ".join(f"{k}: {v:.0%}" for k, v in d["share"].items())
        err.print(f"{d['ranks']} ranks: {d['collectives_per_pass']} collectives per target pass ({per_pass} alone); "
                  f"their share of a step or cycle: {shares}")
    for key, s in result["suites"].get("json", {}).items():
        err.print(f"json, block {key}: {s['stopped']} of {s['prompts']} answers ended within the budget, "
                  f"{s['stopped'] - len(s['invalid_prompts'])} of them valid against their schemas; "
                  f"{s['forced_tokens']} tokens forced by the grammars; {s['grammar_seconds'] * 1000:.0f} ms in "
                  "the grammar engine (both loops constrain with the same engine)")
    mismatched = [p for s in result["overall"].values() for p in s.get("mismatched_prompts", [])]
    if mismatched:
        print_warning(err, f"{len(mismatched)} greedy output(s) differ from plain mlx-lm decoding")
    invalid = [p for s in result["overall"].values() for p in s.get("invalid_prompts", [])]
    if invalid:
        print_warning(err, f"{len(invalid)} answer(s) that stopped do not validate against their schema")


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
