"""`dflash-mlx convert`: a PyTorch / z-lab drafter checkpoint as an MLX one."""

from typing import Optional

import typer

from dflash_mlx.cli.common import err, fail
from dflash_mlx.errors import DFlashError


def main(
    hf_path: str = typer.Option(..., "--hf-path", help="Drafter repo id, directory or checkpoint file."),
    mlx_path: str = typer.Option(..., "--mlx-path", help="Output directory."),
    dtype: Optional[str] = typer.Option(
        None, "--dtype", help="bfloat16, float16 or float32 (default: the checkpoint's)."
    ),
    quantize: bool = typer.Option(False, "-q", "--quantize", help="Quantize the linear layers."),
    q_bits: int = typer.Option(4, "--q-bits", help="Bits per weight: 4 or 8."),
    q_group_size: int = typer.Option(64, "--q-group-size", help="Group size: 32, 64 or 128."),
    target: Optional[str] = typer.Option(
        None, "--target", help="Check the drafter fits this target (alias, repo id or directory) first."
    ),
    force: int = typer.Option(0, "--force", count=True, metavar="", help="Replace a previous conversion at --mlx-path; "
                              "twice (--force --force) to replace any folder there."),
):
    """Convert a PyTorch / z-lab DFlash drafter checkpoint to MLX."""
    from dflash_mlx.cli.progress import progress
    from dflash_mlx.convert import convert_drafter
    from dflash_mlx.hub import resolve

    target_name = resolve(target).target if target else None
    try:
        with progress(err, "converting", counts=False, quiet_for=2.0) as update:
            result = convert_drafter(
                hf_path, mlx_path, dtype=dtype, quantize=quantize, q_bits=q_bits,
                q_group_size=q_group_size, target=target_name, force=force,
                progress=lambda step: update(0, description=f"converting: {step}"),
            )
    except DFlashError as e:
        fail(str(e))
    quant = (
        f", {result.quantization['bits']}-bit groups of {result.quantization['group_size']}"
        if result.quantization else ""
    )
    err.print(
        f"wrote {result.path} ({result.parameters / 1e6:.1f}M parameters, {result.dtype}{quant}, "
        f"{result.bits_per_weight:.2f} bits per weight)"
    )
