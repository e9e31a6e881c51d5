"""What a cycle costs at long contexts, measured, against what `auto`'s cost curve predicts.

`auto` times whole cycles at short contexts (`policy.costs.CONTEXTS`) and extends
them beyond: each width grows at its measured slope, never slower than a
plain step. This script times the same cycles (`decode.timing.cycle_parts`, as the
curve does) at long contexts and prints, per context and width, the measured
seconds, the curve's prediction and both relative to one plain token, plus
the drafter's catch-up per context row.

    python benchmarks/context_costs.py --stand-in 32768 --contexts 1k,4k,8k,16k,32k --out results/x.json

`--stand-in N` is the demo target with linear RoPE scaling to an N-token window
(`prompt_cache.py`), float32, with the demo drafter: its timing is a long-context
target's. Contexts must leave room for the widest cycle in the window.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

import dflash_mlx
from dflash_mlx.bench import machine_info
from dflash_mlx.decode.timing import cycle_parts

sys.path.insert(0, str(Path(__file__).parent))
from prompt_cache import DEMO, stand_in  # noqa: E402


def tokens(text: str) -> int:
    text = text.strip().lower()
    return int(float(text[:-1]) * 1024) if text.endswith("k") else int(text)


def time_width(run_draft, run_verify, w: int, repeats: int) -> float:
    """Median seconds per cycle (per plain step at width 1) at width w."""
    run_verify(w, run_draft(w))  # warm-up: this width's shapes
    out = []
    for _ in range(repeats):
        tic = time.perf_counter()
        steps = run_verify(w, run_draft(w)) or 1
        out.append((time.perf_counter() - tic) / steps)
    return statistics.median(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stand-in", type=int, default=32768, help="window of the RoPE-scaled demo target")
    ap.add_argument("--contexts", default="1k,4k,8k,16k,32k")
    ap.add_argument("--widths", default="1,2,4,8,16")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--draft-context", type=int, default=None, help="bound the drafter's context (as the CLI's)")
    ap.add_argument("--refine", type=int, default=10, help="refining runs at most, until every context is timed")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    widths = [int(w) for w in args.widths.split(",")]
    pair = dflash_mlx.load(str(stand_in(args.stand_in)), str(DEMO / "drafter"), draft_context=args.draft_context)
    W = pair.draft_source.block_size
    contexts = [min(tokens(c), args.stand_in - W - 1) for c in args.contexts.split(",")]
    print("measuring the cost curve (short contexts) ...", file=sys.stderr)
    curve = pair.cost_curve()
    for _ in range(args.refine):  # later runs' refinements, as `auto` makes them run after run
        if len(curve.contexts) == len(pair.curve_contexts()):
            break
        curve = pair.cost_curve()
    print(f"the curve's contexts: {curve.contexts}", file=sys.stderr)
    rows = []
    for n in contexts:
        tic = time.perf_counter()
        run_draft, run_verify, catch_up = cycle_parts(pair, n)
        setup = time.perf_counter() - tic
        measured = {w: time_width(run_draft, run_verify, w, args.repeats) for w in widths}
        predicted = curve.costs(n)
        for w in widths:
            rows.append({"context": n, "width": w, "seconds": measured[w], "predicted": predicted[w - 1],
                         "relative": measured[w] / measured[1], "predicted_relative": predicted[w - 1] / predicted[0]})
        rows.append({"context": n, "catch_up_per_row": catch_up, "predicted_catch_up_per_row":
                     curve.catch_up_seconds(n, n) / n, "setup_seconds": setup})
        print(f"context {n}: " + ", ".join(f"w{w} {measured[w] * 1e3:.1f} ms ({measured[w] / measured[1]:.2f}x; "
                                           f"curve {predicted[w - 1] / predicted[0]:.2f}x)" for w in widths)
              + f"; catch-up {catch_up * 1e6:.0f} us/row", file=sys.stderr)
        del run_draft, run_verify
        mx.clear_cache()
    print("| context | width | ms per cycle | x one plain token | curve's ms | curve's x one plain token |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        if "width" in r:
            print(f"| {r['context']:,} | {r['width']} | {r['seconds'] * 1e3:.1f} | {r['relative']:.2f} | "
                  f"{r['predicted'] * 1e3:.1f} | {r['predicted_relative']:.2f} |")
    print("\n| context | catch-up us per row | curve's |")
    print("|---|---|---|")
    for r in rows:
        if "catch_up_per_row" in r:
            print(f"| {r['context']:,} | {r['catch_up_per_row'] * 1e6:.0f} | {r['predicted_catch_up_per_row'] * 1e6:.0f} |")
    if args.out:
        result = {"command": "python benchmarks/context_costs.py " + " ".join(sys.argv[1:]),
                  "machine": machine_info(), "model": f"demo target, linear RoPE scaling to {args.stand_in} "
                  "(timing stand-in), float32; demo drafter", "draft_context": args.draft_context,
                  "curve_contexts": curve.contexts, "rows": rows}
        tmp = Path(args.out).with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=2) + "\n")
        tmp.replace(args.out)


if __name__ == "__main__":
    main()
