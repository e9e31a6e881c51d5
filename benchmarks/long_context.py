"""Acceptance at long contexts on the long-context demo pair, against z-lab's MLX loop.

For each held-out long prompt (1k-8k tokens, `demo/train_long_target.py`), greedy,
float32, the same drafter files in every runtime: tokens per cycle pooled over
all cycles, and how many full-width cycles committed as many tokens as z-lab's
PyTorch reference `dflash.model.dflash_generate` and as its MLX loop
`dflash.model_mlx.stream_generate` (and whether the tokens are the same). Two more runs of ours
show what the context buys: the same drafter bounded to 2,048 rows
(`--draft-context 2048`), and the demo drafter, trained on short prompts only.

    python benchmarks/demo/train_long_target.py --out ~/.cache/dflash-mlx/bench/demo-long   # see build_long.sh
    python benchmarks/long_context.py --pair ~/.cache/dflash-mlx/bench/demo-long --out results/x.json

Needs z-lab's `dflash` package (`pip install --no-deps dflash==0.1.0`), torch and transformers.
"""

import argparse
import json
import shutil
import sys
import tempfile
import time
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


class ZLabTorch:
    """z-lab's PyTorch reference loop (`dflash.model.dflash_generate`), float32, on the same files."""

    def __init__(self, target: Path, drafter: Path, eos):
        import numpy as np
        import torch
        import dflash.model as reference
        from safetensors.numpy import load_file
        from transformers import Qwen3Config, Qwen3ForCausalLM

        def weights(path):
            return {k: torch.tensor(v.astype(np.float32)) for k, v in load_file(str(path)).items()}

        reference._cuda_time = time.perf_counter  # it times itself with torch.cuda
        self.torch, self.reference, self.eos = torch, reference, list(eos)
        cfg = json.loads((target / "config.json").read_text())
        self.target = Qwen3ForCausalLM(Qwen3Config(**cfg)).float().eval()
        self.target.load_state_dict(weights(target / "model.safetensors"), strict=False)
        self.target.tie_weights()
        self.drafter = reference.DFlashDraftModel(Qwen3Config(**json.loads((drafter / "config.json").read_text())))
        self.drafter = self.drafter.float().eval()
        self.drafter.load_state_dict(weights(drafter / "model.safetensors"), strict=True)

    def __call__(self, ids, max_tokens, block):
        with self.torch.no_grad():
            ref = self.reference.dflash_generate(self.drafter, self.target, self.torch.tensor([ids]), max_tokens,
                                                 self.eos, temperature=0.0, block_size=block, return_stats=True)
        tokens = ref.output_ids[0, len(ids):].tolist()
        return tokens[: next((i for i, t in enumerate(tokens) if t in self.eos), len(tokens))], ref.acceptance_lengths


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

    # The checkpoint itself (float32, converted on load), as z-lab's loop reads it: not the float16 mlx/ copy.
    runs = {
        "ours": float32_pair(target, str(drafter)),
        f"ours, --draft-context {BOUND}": float32_pair(target, str(drafter), BOUND),
        "ours, demo drafter (short prompts only)": float32_pair(target, builtin_path("demo/drafter")),
    }
    tok = runs["ours"].tokenizer
    with tempfile.TemporaryDirectory() as tmp:
        zdir = Path(tmp) / "drafter"
        zdir.mkdir()
        shutil.copy(drafter / "model.safetensors", zdir)
        shutil.copy(drafter / "config.json", zdir)
        references = {"zlab_torch": ZLabTorch(target, drafter, sorted(tok.eos_token_ids)),
                      "zlab_mlx": ZLab(target, zdir)}

        per_prompt = []
        for n, row in enumerate(rows):
            ids = tok.encode(row["prompt"])
            out = {"tokens": len(ids)}
            refs = {}
            for name, run in references.items():
                refs[name] = run(ids, args.max_tokens, args.block_size)
                out[name] = {"committed": sum(refs[name][1]), "cycles": len(refs[name][1])}
            for name, pair in runs.items():
                tokens, lengths = ours(pair, ids, args.max_tokens, args.block_size)
                full = full_width(lengths, args.max_tokens, args.block_size)
                out[name] = {"committed": sum(lengths), "cycles": len(lengths), "full_width_cycles": len(full)}
                for ref, (r_tokens, r_acc) in refs.items():
                    out[name][f"same_tokens_as_{ref}"] = tokens == r_tokens[: len(tokens)]
                    out[name][f"cycles_equal_to_{ref}"] = sum(i < len(r_acc) and lengths[i] == r_acc[i] for i in full)
            per_prompt.append(out)
            o = out["ours"]
            print(f"[{n + 1}/{len(rows)}] {len(ids)} tokens: tokens/cycle ours {o['committed'] / o['cycles']:.2f}, "
                  + ", ".join(f"{r} {out[r]['committed'] / out[r]['cycles']:.2f}" for r in references)
                  + f"; cycles equal to dflash_generate {o['cycles_equal_to_zlab_torch']}/{o['full_width_cycles']}, "
                  f"to the MLX loop {o['cycles_equal_to_zlab_mlx']}/{o['full_width_cycles']}", flush=True)

    table = defaultdict(lambda: defaultdict(lambda: defaultdict(int)))
    for p, row in zip(per_prompt, rows):
        for name, r in p.items():
            if name == "tokens":
                continue
            t = table[row["tokens"]][name]
            for k, v in r.items():
                t[k] += v  # counts, and booleans counted
            t["prompts"] += 1
    summary = {str(n): {name: dict(v, tokens_per_cycle=v["committed"] / v["cycles"]) for name, v in cols.items()}
               for n, cols in sorted(table.items())}
    names = [*references, *runs]
    print("\ntokens per cycle (pooled), block", args.block_size)
    print("prompt tokens | " + " | ".join(names) + " | ours: cycles equal to dflash_generate / to the MLX loop")
    for n, cols in summary.items():
        o = cols["ours"]
        print(f"{n} | " + " | ".join(f"{cols[k]['tokens_per_cycle']:.3f}" for k in names)
              + f" | {o['cycles_equal_to_zlab_torch']}/{o['full_width_cycles']} / "
              f"{o['cycles_equal_to_zlab_mlx']}/{o['full_width_cycles']}")
    if args.out:
        Path(args.out).write_text(json.dumps({
            "machine": machine_info(), "pair": str(root), "block_size": args.block_size,
            "max_tokens": args.max_tokens, "dtype": "float32", "summary": summary, "prompts": per_prompt,
        }, indent=1))


if __name__ == "__main__":
    sys.exit(main())
