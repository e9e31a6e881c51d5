"""Plain mlx-lm decoding: the baseline DFlash is benchmarked against and the
source of the target's own outputs that drafters are trained on.

`generate` runs mlx-lm's own loop (`mlx_lm.generate.stream_generate`) and
returns the tokens with mlx-lm's timings. It must run on a model instance
that carries none of the adapter's wrappers: `plain_target` gives one for a
loaded pair.
"""

import time
from pathlib import Path
from typing import Dict, Sequence, Set

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .adapter import _Wrapper, materialize
from ..errors import DFlashError


def generate(model: nn.Module, tokenizer, prompt: Sequence[int], max_tokens: int, temp: float = 0.0,
             processors: Sequence = ()) -> Dict:
    """Tokens from mlx-lm's own decoding loop (with its `logits_processors`), stopping at the
    tokenizer's EOS (not included), with mlx-lm's timings: "generation_tps" and "prompt_tps"
    as mlx-lm reports them, and "ttft", the seconds to the first token."""
    from mlx_lm.generate import generation_stream, stream_generate
    from mlx_lm.sample_utils import make_sampler

    tokens, last, ttft = [], None, None
    tic = time.perf_counter()
    for r in stream_generate(model, tokenizer, mx.array(prompt), max_tokens=max_tokens,
                             sampler=make_sampler(temp), logits_processors=list(processors) or None):
        if ttft is None:
            ttft = time.perf_counter() - tic
        if r.finish_reason != "stop":  # "stop": the EOS token itself
            tokens.append(r.token)
        last = r
    # mlx-lm has one more step under way on its own stream: let it finish, or
    # a sharded target's collectives from it would interleave with the next run's.
    mx.synchronize(generation_stream)
    return {"tokens": tokens, "generation_tps": last.generation_tps, "prompt_tps": last.prompt_tps, "ttft": ttft}


def _unwrapped_key(key: str, wrappers: Set[str]) -> str:
    """A parameter path of the wrapped model as the plain model spells it:
    the `inner` step under each wrapper dropped."""
    parts, out, path, i = key.split("."), [], [], 0
    while i < len(parts):
        path.append(parts[i])
        out.append(parts[i])
        while ".".join(path) in wrappers and i + 1 < len(parts) and parts[i + 1] == "inner":  # wrappers nest
            path.append("inner")
            i += 1
        i += 1
    return ".".join(out)


def plain_target(pair) -> nn.Module:
    """A plain mlx-lm instance of the pair's target, holding the pair's own weights.

    The adapter wraps layer instances of `pair.target.model` (tapped layers,
    Gated DeltaNet tapes, quantized linears routed to a kernel), so mlx-lm
    timed on that model would time our wrappers. This builds the model again
    with mlx-lm from `pair.target_path` and gives it the arrays the pair
    runs: the same values and dtype (the demo's float32 cast on the CPU
    backend included), and no second copy of the weights in memory (the
    files are opened lazily and never read).
    """
    from mlx_lm.utils import load_model

    wrapped = pair.target.model
    try:
        model, _ = load_model(Path(pair.target_path), lazy=True)
    except (ValueError, FileNotFoundError) as e:
        raise DFlashError(f"Could not load the target from {pair.target_path} for the baseline: "
                          f"{str(e).splitlines()[0]}")
    wrappers = {path for path, m in wrapped.named_modules() if isinstance(m, _Wrapper)}
    weights = [(_unwrapped_key(k, wrappers), v) for k, v in tree_flatten(wrapped.parameters())]
    if getattr(pair, "group", None) is not None:  # sharded as the pair's target is (same names, same slices)
        from ..distributed import shard_like

        shard_like(model, pair)
    model.load_weights(weights, strict=True)  # same names and shapes, or it raises
    model.eval()
    materialize(model)
    return model
