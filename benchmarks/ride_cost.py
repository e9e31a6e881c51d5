"""What a joining prompt's chunk costs riding in a batch's pass, against a pass of its own.

    LD_PRELOAD=... python benchmarks/ride_cost.py --pair ~/.cache/dflash-mlx/peers/pairs/widened [--out FILE]

On the pair's target: 3 sequences at `--context` tokens (a ragged batch) and a joiner at
`--joiner-context`; for each cycle width and chunk length, the median seconds of the cycle's
verify pass alone, the chunk's prefill pass alone, and one pass carrying the chunk
(`target.adapter.Rider`). Each timed pass is cut back after, so every one sees the same caches.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def median_seconds(f, repeats: int) -> float:
    f()  # warm-up
    times = []
    for _ in range(repeats):
        tic = time.perf_counter()
        f()
        times.append(time.perf_counter() - tic)
    return statistics.median(times)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", required=True, help="a folder with target/ and drafter/")
    ap.add_argument("--context", type=int, default=300, help="each decoding sequence's context")
    ap.add_argument("--joiner-context", type=int, default=1000, help="the joiner's context before the chunk")
    ap.add_argument("--widths", default="1,4,8")
    ap.add_argument("--chunks", default="16,40,64,128")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    import dflash_mlx
    from dflash_mlx.bench import machine_info
    from dflash_mlx.machine import blas_name
    from dflash_mlx.target.adapter import Rider
    from dflash_mlx.target.ragged import RaggedKVCache

    pair = Path(args.pair).expanduser()
    target = dflash_mlx.load(str(pair / "target"), str(pair / "drafter")).target

    def own(n):
        cache = target.make_cache()
        mx.eval(target(mx.zeros((1, n), mx.int32), cache)[0], [c.state for c in cache])
        return cache

    batch = [RaggedKVCache.merge(list(layer)) for layer in zip(*[own(args.context) for _ in range(3)])]
    joiner = own(args.joiner_context)

    def cycle(w, rider=None):
        logits, taps = target(mx.zeros((3, w), mx.int32), batch, record=True, rider=rider)
        mx.eval(logits, taps, [] if rider is None else (rider.hidden, [c.state for c in joiner]))
        for c in batch:
            c.crop([w] * 3)

    def chunk(L):
        _, taps = target(mx.zeros((1, L), mx.int32), joiner, last_only=True)
        mx.eval(taps, [c.state for c in joiner])

    def back(L):
        for c in joiner:
            c.trim(L)

    rows = []
    for w in [int(x) for x in args.widths.split(",")]:
        for L in [int(x) for x in args.chunks.split(",")]:
            alone = median_seconds(lambda: cycle(w), args.repeats)
            apart = median_seconds(lambda: (chunk(L), back(L)), args.repeats)
            riding = median_seconds(lambda: (cycle(w, Rider(mx.zeros((1, L), mx.int32), joiner)), back(L)),
                                    args.repeats)
            rows.append({"width": w, "chunk": L, "cycle": alone, "chunk_alone": apart, "riding": riding})
            print(f"3 x {w} rows, chunk {L}: cycle {alone * 1e3:.0f} ms, chunk alone {apart * 1e3:.0f} ms, "
                  f"apart {(alone + apart) * 1e3:.0f} ms, riding {riding * 1e3:.0f} ms", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({
            "what": "a joining prompt's chunk riding in a batch's verify pass against a pass of its own",
            "pair": str(pair), "machine": machine_info(), "blas": blas_name(), "settings": vars(args), "rows": rows,
            "command": "python benchmarks/ride_cost.py " + " ".join(argv or sys.argv[1:]),
        }, indent=2) + "\n")


if __name__ == "__main__":
    main()
