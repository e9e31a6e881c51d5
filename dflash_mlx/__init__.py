"""DFlash block-diffusion speculative decoding on MLX."""

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
