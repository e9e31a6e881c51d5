"""What a seed costs in tokens per cycle: a seeded sampled request against an unseeded one.

    python benchmarks/seed_cost.py [--pair demo] [--width 8] [--temp 1.0] [--seeds 4] [--out FILE]

A seeded request draws every position with its seed's noise (`sampling.Draws`), so its text is
the same at every width; an unseeded one is verified by rejection sampling, the best coupling of
draft and target, with learned proposal scales (`--proposal-scale auto`) or the drafter's own
distribution (`1`). All three sample the target's exact distribution; they differ in how often a
draft is accepted. Tokens per cycle are pooled over every drafted cycle of every prompt; the
figure per seed gives the spread (standard error over seeds).
"""

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import mlx.core as mx

import dflash_mlx
from dflash_mlx.bench import load_prompts, machine_info
from dflash_mlx.sampling import SamplingParams

sys.path.insert(0, str(Path(__file__).parent / "peers"))

SETTINGS = {"seeded": dict(seeded=True, scale="auto"), "unseeded, learned scales": dict(seeded=False, scale="auto"),
            "unseeded, drafter's q": dict(seeded=False, scale=1.0)}


def load_pair(name: str):
    if name == "demo":
        return dflash_mlx.load("demo")
    import widen

    folder = widen.prepare(name)
    return dflash_mlx.load(str(folder / "target"), str(folder / "drafter"))


def pooled(pair, prompts, width: int, temp: float, max_tokens: int, seed: int, seeded: bool, scale) -> dict:
    """Tokens and cycles over every prompt at one setting and seed."""
    tokens = cycles = 0
    for i, prompt in enumerate(prompts):
        params = SamplingParams(temp=temp, seed=1000 * seed + i if seeded else None)
        mx.random.seed(1000 * seed + i)
        for event in dflash_mlx.stream_generate(pair, prompt, max_tokens=max_tokens, sampling=params,
                                                block_size=width, lookup=False, proposal_scale=scale):
            stats = event.stats
        tokens += sum(stats.acceptance_lengths)
        cycles += len(stats.acceptance_lengths)
    return {"tokens": tokens, "cycles": cycles, "per_cycle": tokens / max(cycles, 1)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", choices=["demo", "widened"], default="demo")
    ap.add_argument("--width", type=int, default=8)
    ap.add_argument("--temp", type=float, default=1.0)
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=12, help="the first N prompts of the code suite")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    pair = load_pair(args.pair)
    prompts = [pair.tokenizer.encode(t) for t in load_prompts("code")["code"][: args.prompts]]
    rows = {name: [] for name in SETTINGS}
    for seed in range(args.seeds):
        for name, s in SETTINGS.items():
            rows[name].append(pooled(pair, prompts, args.width, args.temp, args.max_tokens, seed, **s))
            print(f"seed {seed} {name}: {rows[name][-1]['per_cycle']:.3f} tokens per cycle", flush=True)
    summary = {}
    for name, runs in rows.items():
        per = [r["per_cycle"] for r in runs]
        se = statistics.stdev(per) / math.sqrt(len(per)) if len(per) > 1 else 0.0
        total = sum(r["tokens"] for r in runs) / sum(r["cycles"] for r in runs)
        summary[name] = {"per_cycle_pooled": total, "per_cycle_seeds": per, "stderr": se}
    base = summary["unseeded, learned scales"]["per_cycle_pooled"]
    print(f"\n| setting | tokens per cycle (pooled) | ± s.e. over {args.seeds} seeds | x unseeded default |")
    print("|---|---|---|---|")
    for name, s in summary.items():
        print(f"| {name} | {s['per_cycle_pooled']:.3f} | {s['stderr']:.3f} | {s['per_cycle_pooled'] / base:.3f} |")
    if args.out:
        Path(args.out).write_text(json.dumps({
            "what": "tokens per drafted cycle, seeded against unseeded sampling", "pair": args.pair,
            "dtype": str(pair.target.dtype), "machine": machine_info(), "settings": vars(args),
            "summary": summary, "command": "python benchmarks/seed_cost.py " + " ".join(argv or sys.argv[1:]),
        }, indent=2) + "\n")


if __name__ == "__main__":
    main()
