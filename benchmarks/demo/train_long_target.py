"""Fine-tune the demo target for long contexts: linear RoPE scaling (factor 4,
an 8,192-token window), then a short run on long sequences of the same
standard-library stream the demo target was trained on.

Writes OUT/target, an mlx-lm model folder (the demo tokenizer, float16
weights), and long prompts for the drafter (OUT/long_prompts.jsonl) and for
evaluation (OUT/long_heldout_prompts.jsonl, from held-out files): each ends a
few tokens into a `def`/`class` line that comes after 1k-8k tokens of the
stream before it. The settings and losses go to --info.
Held-out loss is reported per position range, before and after, so the
effect of the window shows. Run with OpenBLAS on Linux (see README.md).
"""

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from train_target import is_heldout, stdlib_files, trainer

DEMO = Path(__file__).resolve().parents[2] / "dflash_mlx" / "demo" / "target"
# Position ranges the held-out loss is reported over: the demo window, then beyond it.
BUCKETS = [(0, 512), (512, 2048), (2048, 4096), (4096, 8192)]
# Sequence shapes cycled through training: full windows, and more rows at half and quarter length.
SHAPES = [(1, 8192), (2, 4096), (4, 2048)]
PROMPT_TAIL = 8  # tokens of the def/class line the prompt ends with


def token_stream(tok, texts):
    """The texts' ids joined with end-of-text (0), and where each def/class line starts."""
    ids, starts = [], []
    base = 0
    for text in texts:
        enc = tok.encode(text)
        line_starts, pos = [], 0
        for line in text.splitlines(keepends=True):
            if line.lstrip().startswith(("def ", "class ")):
                line_starts.append(pos)
            pos += len(line)
        j = 0
        offsets = enc.offsets
        for c in line_starts:
            while j < len(offsets) and offsets[j][0] < c:
                j += 1
            if j < len(offsets):
                starts.append(base + j)
        ids.extend(enc.ids + [0])
        base += len(enc.ids) + 1
    return np.array(ids, dtype=np.int32), np.array(starts)


def long_prompts(tok, stream, starts, lengths, rng):
    """A prompt per length: `length` tokens ending PROMPT_TAIL tokens into a def/class line."""
    rows = []
    for n in lengths:
        ok = starts[(starts >= n) & (starts + PROMPT_TAIL < len(stream))]
        end = int(rng.choice(ok)) + PROMPT_TAIL
        rows.append({"prompt": tok.decode(stream[end - n : end].tolist()), "tokens": int(n)})
    return rows


def bucket_losses(model, held, windows):
    ce = []
    for s in windows:
        x = mx.array(held[s : s + 8192])[None]
        y = mx.array(held[s + 1 : s + 8193])[None]
        ce.append(np.array(nn.losses.cross_entropy(model(x), y, reduction="none")[0]))
    ce = np.stack(ce).mean(0)
    return {f"{a}-{b}": round(float(ce[a:b].mean()), 3) for a, b in BUCKETS}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, help="a folder for the target and the prompts")
    ap.add_argument("--info", default="benchmarks/demo/long_target_training.json")
    ap.add_argument("--factor", type=float, default=4.0)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--train-prompts", type=int, default=400)
    args = ap.parse_args()

    from mlx_lm.models import qwen3
    from tokenizers import Tokenizer

    out = Path(args.out) / "target"
    tok = Tokenizer.from_file(str(DEMO / "tokenizer.json"))
    files = stdlib_files()
    train_texts = [p.read_text(errors="replace") for rel, p in files if not is_heldout(rel)]
    held_texts = [p.read_text(errors="replace") for rel, p in files if is_heldout(rel)]
    ids, starts = token_stream(tok, train_texts)
    held, held_starts = token_stream(tok, held_texts)
    print(f"python {sys.version.split()[0]}: {len(ids)} train tokens, {len(held)} held out", flush=True)

    window = int(2048 * args.factor)
    cfg = json.loads((DEMO / "config.json").read_text())
    cfg.update(max_position_embeddings=window, rope_scaling={"rope_type": "linear", "factor": args.factor})
    model = qwen3.Model(qwen3.ModelArgs.from_dict(cfg))
    model.load_weights(str(DEMO / "model.safetensors"))
    model.set_dtype(mx.float32)
    windows = np.random.default_rng(1).integers(0, len(held) - window - 1, 3)
    before = bucket_losses(model, held, windows)
    print("held-out loss before", before, flush=True)

    train_step, state = trainer(model, args.lr, args.steps, max(1, args.steps // 10))

    rng = np.random.default_rng(args.seed)
    tic = time.time()
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn()) as bar:
        task = bar.add_task("fine-tuning", total=args.steps)
        for step in range(args.steps):
            b, n = SHAPES[step % len(SHAPES)]
            s = rng.integers(0, len(ids) - n - 1, b)
            x = mx.array(np.stack([ids[i : i + n] for i in s]))
            y = mx.array(np.stack([ids[i + 1 : i + n + 1] for i in s]))
            loss = train_step(x, y)
            mx.eval(state, loss)
            bar.update(task, advance=1, description=f"fine-tuning  loss {loss.item():.3f} ({b}x{n})")
            if not sys.stderr.isatty():
                print(f"step {step + 1}/{args.steps} loss {loss.item():.3f}", flush=True)
    wall = time.time() - tic
    after = bucket_losses(model, held, windows)
    print("held-out loss after", after, flush=True)

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO / name, tmp / name)
    tok_cfg = json.loads((tmp / "tokenizer_config.json").read_text())
    (tmp / "tokenizer_config.json").write_text(json.dumps(dict(tok_cfg, model_max_length=window)))
    model.set_dtype(mx.float16)
    mx.save_safetensors(str(tmp / "model.safetensors"), dict(tree_flatten(model.parameters())),
                        metadata={"format": "mlx"})
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)

    prompts_dir = Path(args.out)
    prng = np.random.default_rng(args.seed)
    # Training prompts: lengths spread evenly over 1k to the window (less the answer and a block).
    lengths = prng.integers(1024, window - 160, args.train_prompts)
    rows = long_prompts(tok, ids, starts, lengths, prng)
    (prompts_dir / "long_prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    held_rows = long_prompts(tok, held, held_starts, [n for n in (1024, 2048, 4096, 8000) for _ in range(4)], prng)
    (prompts_dir / "long_heldout_prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in held_rows))
    info = dict(vars(args), window=window, shapes=SHAPES, heldout_loss_before=before, heldout_loss_after=after,
                heldout_loss_note="mean over 3 held-out windows of 8,192 tokens, per position range",
                wall_seconds=round(wall), mlx=mx.__version__, python=sys.version.split()[0])
    Path(args.info).write_text(json.dumps(info, indent=2))
    print(json.dumps(info, indent=2))


if __name__ == "__main__":
    main()
