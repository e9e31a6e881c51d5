"""Padding or grouping: what a verify pass costs as the batch's widths differ.

    python benchmarks/batch_shapes.py --pair ~/.cache/dflash-mlx/peers/pairs/widened --batch 8 \
        --out benchmarks/results/batch-shapes-widened-linux-cpu-openblas.json

When the sequences of a batch would rather verify different widths, one pass can pad every
block to the widest (the narrower sequences' extra rows are wasted, masked work) or the batch
can be split into groups of equal width, each its own pass (each re-reads the weights). This
times the target's verify pass of B sequences (each with a `--context`-token prompt) at each
width, and the two groups' passes (B/2 at the widest, B/2 at width 1) against one padded pass.
Each figure is the median of `--repeats` timed passes, the shapes in a fresh random order per
repeat.
"""

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def batch_of(pair, n, context, seed):
    """A decoder holding n sequences of `context` random prompt tokens each."""
    from dflash_mlx.decode.decoder import Decoder

    dec = Decoder(pair, 16)
    key = mx.random.key(seed)
    prompts = mx.random.randint(0, pair.target.vocab_size, (n, context), key=key).tolist()
    for p in prompts:
        dec.add(p, 10**6)
    return dec


def timed(dec, width):
    """One verify pass of every sequence's block of `width`, then cropped back (seconds)."""
    B = len(dec.seqs)
    block = mx.zeros((B, width), mx.uint32)
    tic = time.perf_counter()
    logits, hidden = dec.target(block, dec.caches.layers, taps=True, record=dec.target.recurrent)
    mx.eval(logits, hidden)
    seconds = time.perf_counter() - tic
    dec.target.crop_each(dec.caches.layers, [0] * B, width)
    return seconds


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", required=True, help="a folder with target/ and drafter/ (peers/widen.py builds them)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--widths", default="1,2,4,8")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import dflash_mlx
    from dflash_mlx.bench import machine_info
    from dflash_mlx.machine import blas_name

    pair = dflash_mlx.load(str(Path(args.pair).expanduser() / "target"), str(Path(args.pair).expanduser() / "drafter"))
    widths = [int(w) for w in args.widths.split(",")]
    B, half = args.batch, args.batch // 2
    whole, group = batch_of(pair, B, args.context, args.seed), batch_of(pair, half, args.context, args.seed + 1)
    shapes = [("whole", w) for w in widths] + [("half", w) for w in sorted({1, max(widths)})]
    times = {s: [] for s in shapes}
    rng = random.Random(args.seed)
    for s in shapes:  # warm-up
        timed(whole if s[0] == "whole" else group, s[1])
    for _ in range(args.repeats):
        rng.shuffle(shapes)
        for s in shapes:
            times[s].append(timed(whole if s[0] == "whole" else group, s[1]))
    ms = {f"{k} w{w}": 1000 * statistics.median(v) for (k, w), v in times.items()}
    W = max(widths)
    print(f"| pass | ms | vs {B} at width 1 |")
    print("|---|---|---|")
    for w in widths:
        print(f"| {B} sequences at width {w} | {ms[f'whole w{w}']:.1f} | {ms[f'whole w{w}'] / ms['whole w1']:.2f}x |")
    grouped = ms[f"half w{W}"] + ms["half w1"]
    print(f"| {half} at width {W} + {half} at width 1 (two passes) | {grouped:.1f} | "
          f"{grouped / ms['whole w1']:.2f}x |")
    if args.out:
        result = {"machine": machine_info(), "blas": blas_name(), "mlx": mx.__version__, "pair": args.pair,
                  "dtype": str(pair.target.dtype), "settings": vars(args), "ms": ms, "grouped_ms": grouped}
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
