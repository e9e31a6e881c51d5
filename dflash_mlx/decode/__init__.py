"""The decoder of one sequence or many (`decoder.py`), its requests' streams (`streams.py`)
and `stream_generate` (`generate.py`, a request alone); their parts: each sequence's state
(`sequence.py`, `running.py`), the cycles (`cycle.py`) and their drafts (`drafting.py`),
the model passes (`passes.py`), the target's caches (`caches.py`), the prompts prefilled
while others decode (`filling.py`), what finished sequences leave the prompt cache
(`kept.py`), a request's checks and
text stream (`request.py`) and the cost curve's harness over the same cycles (`timing.py`)."""

from .events import GenerationEvent, GenerationStats
from .generate import generate, stream_generate

__all__ = ["GenerationEvent", "GenerationStats", "generate", "stream_generate"]
