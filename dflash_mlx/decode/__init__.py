"""The DFlash loop (`generate.py`) and its parts: the model passes (`passes.py`),
the cycles (`cycle.py`), a request's checks and text stream (`request.py`) and the cost
curve's harness over the same cycles (`timing.py`)."""

from .events import GenerationEvent, GenerationStats
from .generate import generate, stream_generate

__all__ = ["GenerationEvent", "GenerationStats", "generate", "stream_generate"]
