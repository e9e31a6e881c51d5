"""`dflash-mlx train`: a drafter trained on a target's own outputs."""

from typing import Optional

import typer

from dflash_mlx.cli.common import err, fail, ranged
from dflash_mlx.errors import DFlashError


def main(
    model: str = typer.Option(..., "--model", help="Target: alias, repo id or mlx-lm directory."),
    data: str = typer.Option(..., "--data", help="Prompts .jsonl ('prompt'/'text'/'messages') or a text directory."),
    out: str = typer.Option(..., "--out", help="Output directory (z-lab layout, plus mlx/)."),
    block_size: int = ranged(16, "--block-size", min=2, max=64, help="Tokens per drafted block."),
    layers: int = ranged(5, "--layers", min=1, max=64, help="Drafter layers."),
    target_layers: Optional[str] = typer.Option(
        None, "--target-layers", help="Comma-separated target layers to tap (default: spread evenly)."
    ),
    steps: Optional[int] = ranged(None, "--steps", min=1, help="Training steps (default: --epochs)."),
    epochs: int = ranged(1, "--epochs", min=1, help="Passes over the prompts (where --steps is not given)."),
    lr: float = ranged(6e-4, "--lr", min=0.0, help="Peak learning rate (AdamW, warm-up then cosine decay)."),
    blocks_per_seq: int = ranged(16, "--blocks-per-seq", min=1, help="Blocks trained per sequence."),
    max_new_tokens: int = ranged(256, "--max-new-tokens", min=1, help="Target response length."),
    temp: float = ranged(0.0, "--temp", min=0.0, max=2.0, help="Target sampling temperature for the data."),
    save_every: int = ranged(200, "--save-every", min=1, help="Steps between checkpoints."),
    eval_every: int = ranged(50, "--eval-every", min=1, help="Steps between held-out acceptance estimates."),
    seed: int = typer.Option(0, "--seed", help="Seed of the data order, the trained blocks and sampled responses."),
    mask_token_id: Optional[int] = typer.Option(
        None, "--mask-token-id", help="Token id of the drafter's mask (default: the tokenizer's mask token, else a spare embedding row, else its pad token)."),
    resume: bool = typer.Option(False, "--resume", help="Continue from the latest checkpoint in --out."),
    arch: str = typer.Option("dflash", "--arch", help="dflash, or dflash2 (convolutions, sliding windows, "
                             "candidate selector)."),
    sliding_window: int = ranged(512, "--sliding-window", min=1, help="DFlash 2: the context window."),
    init: Optional[str] = typer.Option(None, "--init", help="Start from this drafter's weights (a folder of the "
                                       "same shape): fine-tune it on new data, such as longer contexts."),
):
    """Train a DFlash drafter for a target on the target's own outputs."""
    from contextlib import ExitStack

    import mlx.core as mx

    from dflash_mlx.target.adapter import load_target
    from dflash_mlx.cli.progress import progress
    from dflash_mlx.hub import fetch, resolve
    from dflash_mlx.train import TrainConfig, read_prompts
    from dflash_mlx.train import train as run_training

    if arch not in ("dflash", "dflash2"):
        fail(f"--arch must be dflash or dflash2 (got {arch}).")
    try:
        taps = [int(x) for x in target_layers.split(",")] if target_layers else None
    except ValueError:
        fail(f"--target-layers must be comma-separated integers (got '{target_layers}').")
    cfg = TrainConfig(block_size=block_size, layers=layers, target_layers=taps, steps=steps, epochs=epochs,
                      lr=lr, blocks_per_seq=blocks_per_seq, max_new_tokens=max_new_tokens, temp=temp,
                      save_every=save_every, eval_every=eval_every, seed=seed, mask_token_id=mask_token_id,
                      arch=arch, sliding_window=sliding_window, init=init)
    try:
        target_model, tokenizer, _ = load_target(fetch(resolve(model).target, "model"))
        if mx.default_device() == mx.cpu:
            # The CPU backend has no fast half-precision matmul.
            target_model.set_dtype(mx.float32)
        prompts = read_prompts(data, tokenizer)
        with ExitStack() as data_bar, ExitStack() as train_bar:
            gen = data_bar.enter_context(progress(err, "target responses", total=len(prompts), transient=False))
            fit = []

            def on_step(step, total, loss, acc):
                if not fit:  # one bar at a time: the data bar ends where training starts
                    data_bar.close()
                    fit.append(train_bar.enter_context(progress(err, "training", total=total, transient=False)))
                fit[0](step, total, f"training  loss {loss:.3f}  held-out acceptance {acc:.2f}")

            summary = run_training(target_model, tokenizer, prompts, out, cfg, resume=resume,
                                   on_data=lambda i, n: gen(i, n), on_step=on_step)
    except DFlashError as e:
        fail(str(e))
    err.print(
        f"wrote {out} (z-lab layout) and {out}/mlx: loss {summary['loss']:.3f}, held-out acceptance "
        f"{summary['heldout_acceptance']:.2f} tokens/cycle at block {block_size}"
    )
