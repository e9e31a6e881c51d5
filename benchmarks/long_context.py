"""Acceptance at long contexts on the long-context demo pair, against z-lab's MLX loop.

For each held-out long prompt (1k-8k tokens, `demo/train_long_target.py`), greedy,
float32, the same drafter in both runtimes: tokens per cycle pooled over all
cycles, and whether every full-width cycle committed as many tokens as z-lab's
`dflash.model_mlx.stream_generate` (and the same tokens). Two more runs of ours
show what the context buys: the same drafter bounded to 2,048 rows
(`--draft-context 2048`), and the demo drafter, trained on short prompts only.

    python benchmarks/demo/train_long_target.py --out ~/.cache/dflash-mlx/bench/demo-long   # see build_long.sh
    python benchmarks/long_context.py --pair ~/.cache/dflash-mlx/bench/demo-long --out results/x.json

Needs z-lab's `dflash` package (`pip install --no-deps dflash==0.1.0`).
"""

import argparse
import json
import shutil
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import mlx.core as mx

import dflash_mlx
from dflash_mlx.bench import machine_info
from dflash_mlx.hub import builtin_path

BOUND = 2048  # the bounded run's --draft-context: the demo target's own window


def float32_pair(target: Path, drafter: str, draft_context=None):
    pair = dflash_mlx.load(str(target), drafter, draft_context=draft_context)
    pair.target.model.set_dtype(mx.float32)
    pair.drafter.set_dtype(mx.float32)
    return pair


def ours(pair, ids, max_tokens, block):
    tokens, lengths = [], []
    for ev in dflash_mlx.stream_generate(pair, ids, max_tokens=max_tokens, block_size=block, lookup=False):
        tokens += ev.tokens
        lengths = ev.stats.acceptance_lengths
    return tokens, lengths


class ZLab:
    """z-lab's MLX loop on a local target and a z-lab-layout drafter folder (no hub)."""

    def __init__(self, target: Path, drafter: Path):
        import dflash.model_mlx as zl

        zl.snapshot_download = lambda repo_id, **kw: repo_id  # its loader fetches from the hub by name
        self.zl = zl
        self.model, self.tokenizer = zl.load(str(target))
        self.draft = zl.load_draft(str(drafter))
        self.model.set_dtype(mx.float32)
        self.draft.set_dtype(mx.float32)

    def __call__(self, ids, max_tokens, block):
        tokens, accepted = [], []
        for r in self.zl.stream_generate(self.model, self.draft, self.tokenizer, ids, block_size=block,
                                         max_tokens=max_tokens):
            tokens += r.tokens
            if r.accepted is not None:
                accepted.append(r.accepted)
        return tokens, accepted


def full_width(lengths, max_tokens, block):
    """Cycles the token budget did not narrow (the runtimes cut the last ones differently)."""
    return [i for i in range(len(lengths) - 1) if max_tokens - 1 - sum(lengths[:i]) >= block]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", required=True, help="build_long.sh's folder: target/, drafter/, long_heldout_prompts.jsonl")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    root = Path(args.pair).expanduser()
    target, drafter = root / "target", root / "drafter"
    rows = [json.loads(line) for line in (root / "long_heldout_prompts.jsonl").read_text().splitlines()]

    runs = {
        "ours": float32_pair(target, str(drafter / "mlx")),
        f"ours, --draft-context {BOUND}": float32_pair(target, str(drafter / "mlx"), BOUND),
        "ours, demo drafter (short prompts only)": float32_pair(target, builtin_path("demo/drafter")),
    }
    tok = runs["ours"].tokenizer
    with tempfile.TemporaryDirectory() as tmp:
        zdir = Path(tmp) / "drafter"
        zdir.mkdir()
        shutil.copy(drafter / "model.safetensors", zdir)
        shutil.copy(drafter / "config.json", zdir)
        zlab = ZLab(target, zdir)

        per_prompt = []
        for n, row in enumerate(rows):
            ids = tok.encode(row["prompt"])
            out = {"tokens": len(ids)}
            z_tokens, z_acc = zlab(ids, args.max_tokens, args.block_size)
            out["zlab"] = {"committed": sum(z_acc), "cycles": len(z_acc)}
            for name, pair in runs.items():
                tokens, lengths = ours(pair, ids, args.max_tokens, args.block_size)
                full = full_width(lengths, args.max_tokens, args.block_size)
                out[name] = {
                    "committed": sum(lengths), "cycles": len(lengths),
                    "same_tokens_as_zlab": tokens == z_tokens[: len(tokens)],
                    "full_width_cycles": len(full),
                    "cycles_equal_to_zlab": sum(i < len(z_acc) and lengths[i] == z_acc[i] for i in full),
                }
            per_prompt.append(out)
            ours_tpc = out["ours"]["committed"] / out["ours"]["cycles"]
            print(f"[{n + 1}/{len(rows)}] {len(ids)} tokens: ours {ours_tpc:.2f} tokens/cycle, z-lab "
                  f"{out['zlab']['committed'] / out['zlab']['cycles']:.2f}, equal cycles "
                  f"{out['ours']['cycles_equal_to_zlab']}/{out['ours']['full_width_cycles']}", flush=True)

    table = defaultdict(lambda: defaultdict(lambda: defaultdict(int)))
    for p, row in zip(per_prompt, rows):
        for name, r in p.items():
            if name == "tokens":
                continue
            t = table[row["tokens"]][name]
            t["committed"] += r["committed"]
            t["cycles"] += r["cycles"]
            for k in ("full_width_cycles", "cycles_equal_to_zlab"):
                t[k] += r.get(k, 0)
            t["same_tokens_as_zlab"] += r.get("same_tokens_as_zlab", True)
            t["prompts"] += 1
    summary = {str(n): {name: dict(v, tokens_per_cycle=v["committed"] / v["cycles"]) for name, v in cols.items()}
               for n, cols in sorted(table.items())}
    names = ["zlab", *runs]
    print("\ntokens per cycle (pooled), block", args.block_size)
    print("prompt tokens | " + " | ".join(names) + " | cycles equal to z-lab")
    for n, cols in summary.items():
        print(f"{n} | " + " | ".join(f"{cols[k]['tokens_per_cycle']:.3f}" for k in names)
              + f" | {cols['ours']['cycles_equal_to_zlab']}/{cols['ours']['full_width_cycles']}")
    if args.out:
        Path(args.out).write_text(json.dumps({
            "machine": machine_info(), "pair": str(root), "block_size": args.block_size,
            "max_tokens": args.max_tokens, "dtype": "float32", "summary": summary, "prompts": per_prompt,
        }, indent=1))


if __name__ == "__main__":
    sys.exit(main())
