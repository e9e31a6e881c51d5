"""DFlash block-diffusion speculative decoding on MLX.

The public API is here: `load`, `generate`, `stream_generate`, `PromptCache`,
`SamplingParams`. The folders: `decode/` (the decoder: one request, or many decoded
together), `policy/` (each cycle's plan), `draft/` (the drafters,
lookup, trees), `target/` (the mlx-lm model behind its adapter), `cache/` (the
prompt cache), `kernels/`, and `serve/` (the HTTP server); docs/how-it-works.md
maps every module.

The API's names are imported when first used, so that what needs none of them (the
command line's `--help`, its argument errors) does not wait for MLX and mlx-lm to load.
"""

from typing import TYPE_CHECKING

from .errors import DFlashError

__version__ = "0.1.0"

__all__ = [
    "DFlashError",
    "DFlashPair",
    "GenerationEvent",
    "GenerationStats",
    "PromptCache",
    "SamplingParams",
    "generate",
    "load",
    "stream_generate",
]

if TYPE_CHECKING:
    from .cache.prompt_cache import PromptCache
    from .decode import GenerationEvent, GenerationStats, generate, stream_generate
    from .pair import DFlashPair, load
    from .sampling import SamplingParams


def __getattr__(name: str):
    if name in ("GenerationEvent", "GenerationStats", "generate", "stream_generate"):
        from . import decode as module
    elif name in ("DFlashPair", "load"):
        from . import pair as module
    elif name == "PromptCache":
        from .cache import prompt_cache as module
    elif name == "SamplingParams":
        from . import sampling as module
    else:
        raise AttributeError(f"module 'dflash_mlx' has no attribute '{name}'")
    value = getattr(module, name)
    globals()[name] = value
    return value
