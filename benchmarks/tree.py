"""Tree verification against linear verification: tokens per cycle and tok/s at fixed widths.

Greedy decoding of the `code` prompts at each `--widths` with `--trees`
branches (0: linear verification), every setting run on every prompt in a
fresh random order per repeat, so a slow spell of a shared machine does not
favour one setting. Reports, per setting, tokens per cycle pooled over all
cycles, and tok/s as the geometric mean over (prompt, repeat) of its ratio to
linear verification at the same width in the same repeat; checks that every
output equals linear verification's (which the lossless tests check against
plain mlx-lm). On a shared machine, tokens per process CPU second (prefill
included) are reported beside tok/s: they do not count time the process
waited for a core.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \\
        python benchmarks/tree.py --pair demo --out benchmarks/results/tree-demo-linux-cpu-openblas.json

`--pair widened` runs the widened target (`peers/widen.py` builds it: the
demo's outputs from a ~100 M parameter target, so a target pass costs many
drafter passes, as with a real pair).

`--batch N` decodes the prompts N at a time, together (`Streams` at the fixed
width: every drafted cycle verifies all N trees in one pass), tok/s then being
the group's tokens over its seconds from the first token:

    python benchmarks/tree.py --pair widened --batch 2 --widths 4 8 --trees 0 2 \
        --out benchmarks/results/tree-batch2-widened-linux-cpu-openblas.json

`--costs` instead reports what this machine's cost curve (the one `auto`
uses, measured now if not cached) says a tree cycle costs: the timed trees
and those between them, against the linear model (a drafted cycle at the
path's width plus the extra rows of a bare verify) and against linear
cycles of the path's width, i.e. how many more tokens per cycle a tree must
commit to pay there:

    python benchmarks/tree.py --pair demo --costs --out benchmarks/results/tree-costs-demo-linux-cpu-stockblas.json
"""

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

import mlx.core as mx

import dflash_mlx
from dflash_mlx.bench import geomean, load_prompts, machine_info

sys.path.insert(0, str(Path(__file__).parent / "peers"))


def load_pair(name: str):
    if name == "demo":
        return dflash_mlx.load("demo")
    import widen

    folder = widen.prepare(name)
    return dflash_mlx.load(str(folder / "target"), str(folder / "drafter"))


def run_one(pair, prompt, max_tokens, width, tree):
    """(tokens, stats, process CPU seconds of the whole request)."""
    tokens, stats = [], None
    cpu = time.process_time()
    for event in dflash_mlx.stream_generate(pair, prompt, max_tokens=max_tokens, block_size=width, tree=tree):
        tokens += event.tokens
        stats = event.stats
    return tokens, stats, time.process_time() - cpu


def run_batch(pair, prompts, max_tokens, width, tree):
    """`run` for prompts decoded together: (their tokens, one after another; the pooled stats;
    CPU seconds), the stats' tok/s being all tokens over the seconds from the first token."""
    from dflash_mlx.decode.running import Asks
    from dflash_mlx.decode.streams import Joining, Streams
    from dflash_mlx.policy.batch import FixedBatchWidth

    cpu = time.process_time()
    streams = Streams(pair, width, FixedBatchWidth(width), block_size=width)
    firsts = streams.add_many([Joining(p, max_tokens, asks=Asks(tree=tree)) for p in prompts])
    out = {uid: list(ev.tokens) for uid, ev in firsts}
    tic = time.perf_counter()
    stats = {}
    while len(streams):
        for uid, ev in streams.step():
            out.setdefault(uid, []).extend(ev.tokens)
            stats[uid] = ev.stats
    seconds = time.perf_counter() - tic
    pooled = stats[firsts[0][0]]
    for uid, _ in firsts[1:]:
        for name in ("cycles", "tree_cycles", "branch_cycles"):
            setattr(pooled, name, getattr(pooled, name) + getattr(stats[uid], name))
        pooled.acceptance_lengths = pooled.acceptance_lengths + stats[uid].acceptance_lengths
    tokens = [t for uid, _ in firsts for t in out[uid]]
    pooled.generation_tps = (len(tokens) - len(firsts)) / seconds
    return tokens, pooled, time.process_time() - cpu


def costs(pair, name, out=None, argv=None):
    """The cost curve's tree costs against the linear model and linear cycles, per context."""
    from dflash_mlx.policy.costs import tree_rows

    curve = pair.cost_curve()
    if not curve.tree:
        sys.exit("this curve timed no trees (the target cannot verify them)")
    contexts = []
    for ctx in curve.contexts:
        linear, copies = curve.costs(ctx), curve.copy_costs(ctx)
        rows = []
        for (w, b), t in sorted(curve.tree_costs(ctx, curve.tree_branches).items(), key=lambda kv: kv[0][::-1]):
            n = tree_rows(w, b)
            model = linear[w - 1] + copies[n - 1] - copies[w - 1]
            rows.append({"width": w, "branches": b, "rows": n, "timed": (w, b) in curve.tree_shapes,
                         "seconds": t, "model_seconds": model, "ratio_to_model": t / model,
                         "ratio_to_linear_same_width": t / linear[w - 1],
                         "ratio_to_linear_same_rows": t / linear[n - 1]})
        contexts.append({"context": ctx, "plain_step_seconds": linear[0], "trees": rows})
        print(f"\n{name} pair, context {ctx}: a plain step {1e3 * linear[0]:.2f} ms")
        print("| width | branches | rows | timed | ms | x linear model | x linear, same width | "
              "x linear, same rows |")
        print("|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['width']} | {r['branches']} | {r['rows']} | {'yes' if r['timed'] else ''} | "
                  f"{1e3 * r['seconds']:.2f} | {r['ratio_to_model']:.3f} | {r['ratio_to_linear_same_width']:.3f} | "
                  f"{r['ratio_to_linear_same_rows']:.3f} |")
    if out:
        Path(out).write_text(json.dumps({
            "what": "tree cycle costs from the cost curve `auto` uses (timed shapes and those between them)",
            "pair": name, "dtype": str(pair.target.dtype), "machine": machine_info(),
            "ld_preload": os.environ.get("LD_PRELOAD"), "load_average": os.getloadavg(),
            "tree_shapes": curve.tree_shapes, "contexts": contexts,
            "command": "python benchmarks/tree.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        }, indent=2) + "\n")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", choices=["demo", "widened"], default="demo")
    ap.add_argument("--widths", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--trees", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--prompts", type=int, default=6, help="the first N prompts of the code suite")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--costs", action="store_true", help="report the cost curve's tree costs and exit")
    ap.add_argument("--batch", type=int, default=1, help="decode the prompts this many at a time, together")
    args = ap.parse_args(argv)
    trees = sorted(set(args.trees) | {0})

    pair = load_pair(args.pair)
    if args.costs:
        return costs(pair, args.pair, args.out, argv)
    texts = load_prompts("code")["code"][: args.prompts]
    prompts = [pair.tokenizer.encode(t) for t in texts]
    if args.batch > 1:
        prompts = [prompts[i : i + args.batch] for i in range(0, len(prompts) - args.batch + 1, args.batch)]
        run = run_batch
    else:
        run = run_one
    run(pair, prompts[0], 16, args.widths[0], max(trees))  # warm-up
    settings = [(w, t) for w in args.widths for t in trees]
    rnd = random.Random(args.seed)
    load_before = os.getloadavg()
    rows = []
    tic = time.perf_counter()
    for r in range(args.repeats):
        for p, prompt in enumerate(prompts):
            order = settings[:]
            rnd.shuffle(order)
            out = {}
            for w, t in order:
                tokens, stats, cpu = run(pair, prompt, args.max_tokens, w, t)
                out[(w, t)] = tokens
                rows.append({"repeat": r, "prompt": p, "width": w, "tree": t, "tokens": len(tokens),
                             "tps": stats.generation_tps, "cpu_s": cpu, "cycles": stats.cycles,
                             "accepted": sum(stats.acceptance_lengths), "tree_cycles": stats.tree_cycles,
                             "branch_cycles": stats.branch_cycles})
            for w, t in settings:
                if out[(w, t)] != out[(w, 0)]:
                    sys.exit(f"prompt {p}: width {w} tree {t} output differs from linear verification")
            print(f"[repeat {r + 1}/{args.repeats}] prompt {p + 1}/{len(prompts)} "
                  f"({time.perf_counter() - tic:.0f} s)", flush=True)
    load_after = os.getloadavg()

    summary = []
    for w, t in settings:
        mine = [x for x in rows if (x["width"], x["tree"]) == (w, t)]
        base = {(x["repeat"], x["prompt"]): x for x in rows if (x["width"], x["tree"]) == (w, 0)}
        widest = {(x["repeat"], x["prompt"]): x for x in rows if (x["width"], x["tree"]) == (max(args.widths), 0)}
        summary.append({
            "width": w, "tree": t,
            "tokens_per_cycle": sum(x["accepted"] for x in mine) / sum(x["cycles"] for x in mine),
            "branch_cycle_share": sum(x["branch_cycles"] for x in mine) / max(1, sum(x["tree_cycles"] for x in mine)),
            "tps_geomean": geomean([x["tps"] for x in mine]),
            "tps_ratio_to_linear_same_width": geomean([x["tps"] / base[(x["repeat"], x["prompt"])]["tps"]
                                                       for x in mine]),
            "tps_ratio_to_linear_widest": geomean([x["tps"] / widest[(x["repeat"], x["prompt"])]["tps"]
                                                   for x in mine]),
            # Tokens per process CPU second (prefill included), steadier than wall time on a shared machine.
            "cpu_ratio_to_linear_same_width": geomean([base[(x["repeat"], x["prompt"])]["cpu_s"] / x["cpu_s"]
                                                       for x in mine]),
            "cpu_ratio_to_linear_widest": geomean([widest[(x["repeat"], x["prompt"])]["cpu_s"] / x["cpu_s"]
                                                   for x in mine]),
        })
    print(f"\n{args.pair} pair, {len(prompts)} prompts (batches of {args.batch}) x {args.repeats} repeats, {args.max_tokens} tokens, "
          f"load average {load_before[0]:.1f} -> {load_after[0]:.1f}")
    W = max(args.widths)
    print("| width | tree | tokens/cycle | cycles through a branch | tok/s | tok/s vs linear, same width | "
          f"vs linear width {W} | tokens per CPU s vs linear, same width | vs linear width {W} |")
    print("|---|---|---|---|---|---|---|---|---|")
    for s in summary:
        print(f"| {s['width']} | {s['tree']} | {s['tokens_per_cycle']:.2f} | {s['branch_cycle_share']:.0%} | "
              f"{s['tps_geomean']:.1f} | {s['tps_ratio_to_linear_same_width']:.3f}x | "
              f"{s['tps_ratio_to_linear_widest']:.3f}x | {s['cpu_ratio_to_linear_same_width']:.3f}x | "
              f"{s['cpu_ratio_to_linear_widest']:.3f}x |")
    if args.out:
        result = {
            "what": "greedy tree verification (tree = branches) against linear verification at fixed widths",
            "pair": args.pair, "dtype": str(pair.target.dtype), "prompts": len(prompts), "batch": args.batch,
            "max_tokens": args.max_tokens, "repeats": args.repeats,
            "machine": machine_info(), "ld_preload": os.environ.get("LD_PRELOAD"),
            "load_average_before_after": [load_before, load_after], "cpu_count": os.cpu_count(),
            "summary": summary, "rows": rows,
            "command": "python benchmarks/tree.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        }
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    mx.clear_cache()


if __name__ == "__main__":
    main()
