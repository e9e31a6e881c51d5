"""`dflash-mlx convert`: PyTorch / z-lab drafter checkpoints to MLX."""

from .convert import ConvertResult, convert_drafter, is_converted, read_checkpoint

__all__ = ["ConvertResult", "convert_drafter", "is_converted", "read_checkpoint"]
