"""Train the demo target: a small Qwen3-architecture code model on the Python
standard library sources, which every machine with Python has offline.

Files are split train/held-out by a hash of their path (1 in 10 held out).
Writes an mlx-lm model directory (config.json, model.safetensors, tokenizer)
plus prompts.jsonl / heldout_prompts.jsonl for training and evaluating the
drafter. Run with OpenBLAS on Linux (see benchmarks/demo/README.md).
"""

import argparse
import hashlib
import json
import random
import sys
import sysconfig
import time
from functools import partial
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

SKIP_DIRS = {"test", "tests", "site-packages", "idlelib", "lib2to3", "turtledemo", "__pycache__"}


def stdlib_files():
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root)
        if SKIP_DIRS.intersection(rel.parts) or p.stat().st_size > 400_000:
            continue
        files.append((str(rel), p))
    return files


def is_heldout(rel: str) -> bool:
    return int(hashlib.sha1(rel.encode()).hexdigest(), 16) % 10 == 0


def train_tokenizer(texts, vocab_size, out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|mask|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
        "model_max_length": 2048,
    }))
    return tok


def make_prompts(texts, tok, n, rng, prompt_tokens=48):
    """Prompts that start at a `def` or `class` line and run ~48 tokens."""
    prompts = []
    starts = []
    for ti, text in enumerate(texts):
        for i, line in enumerate(text.splitlines(keepends=True)):
            if line.lstrip().startswith(("def ", "class ")):
                starts.append((ti, i))
    rng.shuffle(starts)
    for ti, i in starts[:n]:
        lines = texts[ti].splitlines(keepends=True)[i : i + 40]
        ids = tok.encode("".join(lines)).ids[:prompt_tokens]
        prompts.append({"prompt": tok.decode(ids)})
    return prompts


def loss_fn(model, x, y):
    return nn.losses.cross_entropy(model(x), y, reduction="mean")


def schedule(lr: float, steps: int, warm: int):
    """Linear warm-up to `lr`, then cosine decay to 5% of it."""
    return optim.join_schedules(
        [optim.linear_schedule(1e-6, lr, warm), optim.cosine_decay(lr, steps - warm, lr * 0.05)], [warm])


def trainer(model, lr: float, steps: int, warm: int):
    """A compiled AdamW step (warm-up, cosine decay, clipping) for `model`, and the state it updates."""
    opt = optim.AdamW(learning_rate=schedule(lr, steps, warm), weight_decay=0.05)
    loss_and_grad = nn.value_and_grad(model, loss_fn)
    state = [model.state, opt.state]

    @partial(mx.compile, inputs=state, outputs=state)
    def train_step(x, y):
        loss, grads = loss_and_grad(model, x, y)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        opt.update(model, grads)
        return loss

    return train_step, state


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="dflash_mlx/demo/target")
    ap.add_argument("--prompts-dir", default="benchmarks/demo")
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    random.seed(args.seed)
    mx.random.seed(args.seed)
    files = stdlib_files()
    train_texts = [p.read_text(errors="replace") for rel, p in files if not is_heldout(rel)]
    held_texts = [p.read_text(errors="replace") for rel, p in files if is_heldout(rel)]
    print(f"python {sys.version.split()[0]}: {len(train_texts)} train files, {len(held_texts)} held out")

    tok = train_tokenizer(train_texts, args.vocab, out)
    ids = np.concatenate([np.array(tok.encode(t).ids + [0], dtype=np.int32) for t in train_texts])
    held = np.concatenate([np.array(tok.encode(t).ids + [0], dtype=np.int32) for t in held_texts])
    print(f"{len(ids)} train tokens, {len(held)} held-out tokens")

    from mlx_lm.models import qwen3

    heads = args.hidden // 64
    cfg = dict(model_type="qwen3", hidden_size=args.hidden, num_hidden_layers=args.layers,
               intermediate_size=3 * args.hidden, num_attention_heads=heads,
               num_key_value_heads=max(1, heads // 2), head_dim=64, rms_norm_eps=1e-6,
               vocab_size=tok.get_vocab_size(), max_position_embeddings=2048,
               tie_word_embeddings=True, rope_theta=10000.0, eos_token_id=0,
               bos_token_id=0, torch_dtype="float16")
    model = qwen3.Model(qwen3.ModelArgs.from_dict(cfg))

    train_step, state = trainer(model, args.lr, args.steps, min(100, args.steps // 10))

    def held_loss(x, y):
        return loss_fn(model, x, y)

    def batch(data, rng):
        starts = rng.integers(0, len(data) - args.seq - 1, args.batch)
        x = np.stack([data[s : s + args.seq] for s in starts])
        y = np.stack([data[s + 1 : s + args.seq + 1] for s in starts])
        return mx.array(x), mx.array(y)

    rng = np.random.default_rng(args.seed)
    hrng = np.random.default_rng(1)
    hx, hy = batch(held, hrng)
    tic = time.time()
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn()) as bar:
        task = bar.add_task("training", total=args.steps)
        for step in range(args.steps):
            x, y = batch(ids, rng)
            loss = train_step(x, y)
            mx.eval(state, loss)
            if step % 50 == 0 or step == args.steps - 1:
                hl = held_loss(hx, hy).item()
                bar.update(task, description=f"loss {loss.item():.3f} held-out {hl:.3f}")
            bar.advance(task)
    wall = time.time() - tic
    model.set_dtype(mx.float16)
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())),
                        metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    final = held_loss(hx, hy).item()

    prompts_dir = Path(args.prompts_dir)
    prng = random.Random(args.seed)
    for name, texts, n in [("prompts.jsonl", train_texts, 1200), ("heldout_prompts.jsonl", held_texts, 64)]:
        rows = make_prompts(texts, tok, n, prng)
        (prompts_dir / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    info = dict(vars(args), python=sys.version.split()[0], train_tokens=int(len(ids)),
                heldout_tokens=int(len(held)), heldout_loss=final, wall_seconds=round(wall),
                mlx=mx.__version__, parameters=sum(v.size for _, v in tree_flatten(model.parameters())))
    (prompts_dir / "target_training.json").write_text(json.dumps(info, indent=2))
    print(json.dumps(info, indent=2))


if __name__ == "__main__":
    main()
