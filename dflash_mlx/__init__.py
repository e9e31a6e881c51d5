"""DFlash block-diffusion speculative decoding on MLX.

The public API is here: `load`, `generate`, `stream_generate`, `PromptCache`,
`SamplingParams`. The folders: `decode/` (the decoder: one request, or many decoded
together), `policy/` (each cycle's plan), `draft/` (the drafters,
lookup, trees), `target/` (the mlx-lm model behind its adapter), `cache/` (the
prompt cache), `kernels/`, and `serve/` (the HTTP server); docs/how-it-works.md
maps every module.
"""

from .errors import DFlashError
from .decode import GenerationEvent, GenerationStats, generate, stream_generate
from .load import DFlashPair, load
from .cache.prompt_cache import PromptCache
from .sampling import SamplingParams

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
