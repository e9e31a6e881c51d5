"""Runner: z-lab `dflash==0.1.0`, its MLX module `dflash.model_mlx`, greedy (temperature 0).

Loading: `model_mlx.load` (mlx_lm.load) for the target; `model_mlx.load_draft` for the
drafter, which fetches through huggingface_hub.snapshot_download: here that name is bound
to a function returning the local folder, so z-lab's own config reading and weight loading
run unchanged on the converted (original-layout) drafter copy.
Settings: "default" = block_size None (z-lab's default: the drafter config's block_size,
16), "block8" = block_size=8.
Acceptance: each GenerationResponse after the first carries `accepted` = tokens that
cycle committed (accepted drafts + the target's token); cycles = responses with
`accepted` not None, cycle tokens = their sum.
"""

from pathlib import Path

import mlx.core as mx

from _common import float_dtypes, serve

BLOCKS = {"default": None, "block8": 8, "t1-default": None}
TEMPS = {"t1-default": 1.0}  # sampled settings (temperature 1, a fresh seed per request)
_requests = [0]


def load(args):
    import importlib.metadata as md

    import dflash.model_mlx as zl

    zl.snapshot_download = lambda repo_id, **kw: str(Path(repo_id))  # local folder, no hub
    model, tokenizer = zl.load(args.target)
    draft = zl.load_draft(args.drafter_zlab)
    dtypes = sorted(set(float_dtypes(model.parameters())) | set(float_dtypes(draft.parameters())))
    if dtypes != ["float32"]:
        raise RuntimeError(f"the pair loaded as {dtypes}, expected float32")
    return (model, draft, tokenizer), {
        "runtime": "z-lab dflash (dflash.model_mlx)", "version": md.version("dflash"), "mlx": mx.__version__,
        "mlx_lm": md.version("mlx-lm"), "dtype": "float32",
        "settings": {"default": f"block_size=None (drafter config: {draft.config.block_size})",
                     "block8": "block_size=8", "t1-default": "block_size=None, temperature=1.0"}}


def generate(state, prompt_ids, max_tokens, setting):
    import dflash.model_mlx as zl

    model, draft, tokenizer = state
    cycles = cycle_tokens = 0
    _requests[0] += 1
    mx.random.seed(_requests[0])
    for r in zl.stream_generate(model, draft, tokenizer, prompt_ids, block_size=BLOCKS[setting],
                                max_tokens=max_tokens, temperature=TEMPS.get(setting, 0.0)):
        if r.accepted is not None:
            cycles += 1
            cycle_tokens += r.accepted
        if r.tokens:
            yield r.tokens
        last = r
    return {"cycles": cycles, "cycle_tokens": cycle_tokens,
            "reported": {"generation_tps": last.generation_tps},
            "acceptance_source": "GenerationResponse.accepted (tokens committed per cycle)"}


if __name__ == "__main__":
    serve(load, generate, settings=tuple(BLOCKS))
