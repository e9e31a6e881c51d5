"""Greedy acceptance of the shipped demo pair on held-out prompts.

For each block size, runs DFlash on every held-out prompt, checks the output
equals plain mlx-lm greedy decoding token for token, and reports the mean
acceptance length (tokens committed per verify cycle). Writes JSON.

    python benchmarks/demo/eval_acceptance.py --block-sizes 8 16 --out benchmarks/demo/acceptance.json
"""

import argparse
import json
import platform
import time
from pathlib import Path

import mlx.core as mx

import dflash_mlx
from dflash_mlx.target import baseline

HERE = Path(__file__).parent


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="demo")
    ap.add_argument("--draft", default=None)
    ap.add_argument("--prompts", default=str(HERE / "heldout_prompts.jsonl"))
    ap.add_argument("--block-sizes", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    pair = dflash_mlx.load(args.model, args.draft)
    tok = pair.tokenizer
    prompts = [json.loads(l)["prompt"] for l in Path(args.prompts).read_text().splitlines() if l.strip()]
    results = {"model": args.model, "prompts": len(prompts), "max_tokens": args.max_tokens,
               "machine": platform.machine(), "mlx": mx.__version__, "device": str(mx.default_device()),
               "block_sizes": {}}
    plain = baseline.plain_target(pair)  # mlx-lm on an instance the adapter has not wrapped
    refs = [baseline.generate(plain, tok, tok.encode(p), args.max_tokens)["tokens"] for p in prompts]
    for bs in args.block_sizes:
        cycles = committed = mismatches = 0
        tic = time.perf_counter()
        for p, ref in zip(prompts, refs):
            ids = tok.encode(p)
            out, stats = [], None
            for ev in dflash_mlx.stream_generate(pair, ids, max_tokens=args.max_tokens, block_size=bs):
                out += ev.tokens
                stats = ev.stats
            mismatches += out != ref
            cycles += len(stats.acceptance_lengths)
            committed += sum(stats.acceptance_lengths)
        mean = committed / max(cycles, 1)
        results["block_sizes"][bs] = {"mean_acceptance": round(mean, 3), "cycles": cycles,
                                      "mismatches": mismatches, "seconds": round(time.perf_counter() - tic, 2)}
        print(f"block {bs}: mean acceptance {mean:.2f} tokens/cycle over {cycles} cycles, "
              f"{mismatches} outputs differing from mlx-lm greedy")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
