"""Batched decoding: aggregate decode tokens/s of B sequences decoded together.

    python benchmarks/batch_decode.py --pair ~/.cache/dflash-mlx/peers/pairs/widened --batch 1,2,4,8 \
        --widths 1,2,4 --apart --max-tokens 64 --out benchmarks/results/batch-decode-pooled-widened-linux-cpu-openblas.json

For each batch size B the first B prompts of the `code` suite (past its last, the
same marked as variants) are decoded greedily, `--max-tokens` each: by mlx-lm's
`batch_generate` (its continuous batching, plain decoding) and by
`dflash_mlx.decode.decoder.Decoder` at each width (1: plain batched
decoding through this package; above 1: batched speculation, with `--apart` also
each sequence drafting in a drafter pass of its own). Reported: aggregate
decode tok/s (tokens after each sequence's first, over the time from the first
batched cycle to the last), the ratio to mlx-lm's at the same B, tokens per cycle
per sequence, and whether every output equals mlx-lm's. Settings run in a fresh
random order per repeat; figures are medians over repeats.
"""

import argparse
import json
import random
import sys
import time
from pathlib import Path

import mlx.core as mx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def ours(pair, prompts, max_tokens, width, apart=False):
    from dflash_mlx.decode.decoder import Decoder

    dec = Decoder(pair, width)
    if apart:
        dec.drafting.poolable = None
    out, cycles = {}, 0
    for p in prompts:
        first = dec.add(p, max_tokens)
        out[first.uid] = list(first.tokens)
    tic = time.perf_counter()
    while len(dec):
        for c in dec.step():
            out[c.uid] += c.tokens
        cycles += 1
    seconds = time.perf_counter() - tic
    tokens = sum(len(t) - 1 for t in out.values())
    return [out[i] for i in range(len(prompts))], tokens / seconds, tokens / max(cycles, 1) / len(prompts)


def width_of(setting):
    """(width, apart) of a `--widths` entry (an int, or "W apart")."""
    return (int(setting.split()[0]), True) if isinstance(setting, str) else (setting, False)


def mlx_lm(model, tokenizer, prompts, max_tokens):
    from mlx_lm.generate import batch_generate

    r = batch_generate(model, tokenizer, prompts, max_tokens=max_tokens, return_token_ids=True)
    ids = [[t for t in seq if t not in tokenizer.eos_token_ids] for seq in r.token_ids]
    return ids, r.stats.generation_tps


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", required=True, help="a folder with target/ and drafter/ (peers/widen.py builds them)")
    ap.add_argument("--batch", default="1,2,4,8")
    ap.add_argument("--widths", default="1,4,8")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--apart", action="store_true", help="also draft each sequence in a pass of its own")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import dflash_mlx
    from dflash_mlx.bench import load_prompts, machine_info, median
    from dflash_mlx.machine import blas_name
    from dflash_mlx.prompt import build_prompt
    from mlx_lm import load

    pair_dir = Path(args.pair).expanduser()
    pair = dflash_mlx.load(str(pair_dir / "target"), str(pair_dir / "drafter"))
    model, tokenizer = load(str(pair_dir / "target"))
    batches = [int(b) for b in args.batch.split(",")]
    widths = [int(w) for w in args.widths.split(",")]
    if args.apart:
        widths += [f"{w} apart" for w in widths if w > 1]
    texts = load_prompts("code")["code"]
    if max(batches) > len(texts):  # distinct prompts for every sequence, as serve_load.py makes them
        texts = [f"{t}\n# variant {i}" for i in range(-(-max(batches) // len(texts))) for t in texts]
    prompts = [build_prompt(tokenizer, t) for t in texts[: max(batches)]]
    settings = [(b, "mlx-lm") for b in batches] + [(b, w) for b in batches for w in widths]
    runs = {s: [] for s in settings}
    rng = random.Random(args.seed)
    for s in settings:  # warm-up
        b, w = s
        mlx_lm(model, tokenizer, prompts[:b], 8) if w == "mlx-lm" else ours(pair, prompts[:b], 8, *width_of(w))
    for r in range(args.repeats):
        order = list(settings)
        rng.shuffle(order)
        for b, w in order:
            if w == "mlx-lm":
                ids, tps = mlx_lm(model, tokenizer, prompts[:b], args.max_tokens)
                runs[(b, w)].append({"ids": ids, "tps": tps})
            else:
                ids, tps, per = ours(pair, prompts[:b], args.max_tokens, *width_of(w))
                runs[(b, w)].append({"ids": ids, "tps": tps, "tokens_per_cycle": per})
            print(f"repeat {r + 1}: B={b} {w}: {tps:.1f} tok/s", file=sys.stderr, flush=True)
    rows = []
    for b in batches:
        base = median([x["tps"] for x in runs[(b, "mlx-lm")]])
        ref = runs[(b, "mlx-lm")][0]["ids"]
        for w in ["mlx-lm"] + widths:
            xs = runs[(b, w)]
            tps = median([x["tps"] for x in xs])
            rows.append({"batch": b, "width": w, "tps": tps, "vs_mlx_lm": tps / base,
                         "tokens_per_cycle": median([x["tokens_per_cycle"] for x in xs]) if w != "mlx-lm" else 1.0,
                         "identical": all(x["ids"] == ref for x in xs)})
    print("| B | decoder | aggregate tok/s | vs mlx-lm | tokens per cycle per sequence | outputs = mlx-lm |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        name = "mlx-lm batch_generate" if row["width"] == "mlx-lm" else f"ours, width {row['width']}"
        print(f"| {row['batch']} | {name} | {row['tps']:.1f} | {row['vs_mlx_lm']:.2f}x | "
              f"{row['tokens_per_cycle']:.2f} | {row['identical']} |")
    if args.out:
        result = {"machine": machine_info(), "blas": blas_name(), "mlx": mx.__version__, "pair": str(pair_dir),
                  "dtype": str(pair.target.dtype), "settings": vars(args), "rows": rows}
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
