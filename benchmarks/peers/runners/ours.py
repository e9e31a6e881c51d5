"""Runner: this repository's runtime (`dflash_mlx.load` + `dflash_mlx.stream_generate`), greedy.

Settings: "default" = block_size "auto" (the adaptive sizer, its cost curve measured once
and cached under ~/.cache/dflash-mlx/costs, with lookup drafts), "no-lookup" = "auto"
without lookup drafts (the drafter only), "block4" / "block8" = fixed block sizes (the
drafter alone, every cycle), "block1" = plain decoding through this loop (width 1 every cycle; "t1-block1" at
temperature 1), "tree2" = "auto" also
weighing tree verification with up to 2 branches (`tree=2`).
Sampled settings ("t1-*", temperature 1) seed MLX's generator before each request
(`mx.random.seed`, a fresh seed per request), as the z-lab runner does; "t1-seeded" instead
passes the seed with the request (`SamplingParams(seed=...)`), which makes its text
independent of earlier requests: its sizer and proposal scales start from their priors.
Acceptance: GenerationStats.cycles (target passes after the prefill, plain width-1 steps
included) and GenerationStats.acceptance_lengths (tokens each cycle committed).
"""

import mlx.core as mx

from _common import float_dtypes, serve

BLOCKS = {"default": ("auto", True), "no-lookup": ("auto", False), "block4": (4, False), "block8": (8, False),
          "t1-default": ("auto", True), "t1-block16": (16, False), "block1": (1, False),
          "tree2": ("auto", True), "t1-seeded": ("auto", True), "t1-block1": (1, False)}
TREES = {"tree2": 2}  # `auto` also weighing trees of up to 2 branches
TEMPS = {"t1-default": 1.0, "t1-block16": 1.0, "t1-seeded": 1.0, "t1-block1": 1.0}  # temperature 1, a fresh seed per request
SEEDED = {"t1-seeded"}  # the seed goes with the request (the others seed MLX's generator)
DESCRIBED = {"default": "block_size='auto'", "no-lookup": "block_size='auto', lookup=False",
             "block4": "block_size=4", "block8": "block_size=8", "block1": "block_size=1",
             "t1-default": "block_size='auto', temp=1.0", "t1-block16": "block_size=16, temp=1.0",
             "tree2": "block_size='auto', tree=2", "t1-seeded": "block_size='auto', temp=1.0, seed=<request number>",
             "t1-block1": "block_size=1, temp=1.0"}  # what each setting passes, for the results file
_requests = [0]


def load(args):
    import mlx_lm

    import dflash_mlx
    from dflash_mlx.machine import blas_name

    pair = dflash_mlx.load(args.target, args.drafter)
    dtypes = sorted(set(float_dtypes(pair.target.model.parameters())) | set(float_dtypes(pair.drafter.parameters())))
    if dtypes != ["float32"]:
        raise RuntimeError(f"the pair loaded as {dtypes}, expected float32")
    return pair, {"runtime": "dflash-mlx (this repository)", "version": dflash_mlx.__version__,
                  "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__, "blas": blas_name(), "dtype": "float32",
                  "settings": DESCRIBED}


def generate(pair, prompt_ids, max_tokens, setting):
    from dflash_mlx import SamplingParams, stream_generate

    stats = None
    block_size, lookup = BLOCKS[setting]
    _requests[0] += 1
    if setting in TEMPS and setting not in SEEDED:
        mx.random.seed(_requests[0])
    params = SamplingParams(temp=TEMPS.get(setting, 0.0), seed=_requests[0] if setting in SEEDED else None)
    for ev in stream_generate(pair, prompt_ids, max_tokens=max_tokens, sampling=params,
                              block_size=block_size, lookup=lookup, tree=TREES.get(setting)):
        stats = ev.stats
        yield ev.tokens
    return {"cycles": stats.cycles, "cycle_tokens": sum(stats.acceptance_lengths),
            "reported": {"generation_tps": stats.generation_tps, "mean_acceptance": stats.mean_acceptance,
                         "draft_cycles": stats.draft_cycles, "lookup_cycles": stats.lookup_cycles},
            "acceptance_source": "GenerationStats.cycles and sum(acceptance_lengths)"}


if __name__ == "__main__":
    serve(load, generate, settings=tuple(BLOCKS))
