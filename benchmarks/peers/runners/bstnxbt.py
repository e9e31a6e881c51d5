"""Runner: bstnxbt `dflash-mlx==0.1.8` (import name `dflash_mlx`, hence its own venv), greedy.

Loading: `dflash_mlx.runtime.bundle.load_runtime_bundle(model_ref=target, draft_ref=drafter)`
on local folders (its loader reads the drafter through mlx-lm's load_model, which needs the
original layout's top-level block_size/rope_theta). No draft quantization is requested
(unregistered models get none by default).
Generation: `dflash_mlx.runtime.stream_dflash_generate` with `prompt_tokens_override` (the
prompt ids the benchmark built) and an offline runtime context:
- "default": `build_offline_runtime_context()`, i.e. its default verify mode ("adaptive":
  the verify block shrinks from the drafter's 16 when acceptance is low) and block_tokens
  None (the drafter's block size);
- "block8": verify_mode "dflash" (fixed blocks) and block_tokens=8.
Acceptance: the SummaryEvent's cycles_completed (target verify passes after the prefill)
and generation_tokens; cycle tokens = generation_tokens - 1 (the prefill's token is not a
cycle's). Its own `tokens_per_cycle` (generation_tokens / cycles, prefill token included)
and `acceptance_history` (accepted drafts per cycle) are reported as given.
"""

import mlx.core as mx

from _common import float_dtypes, serve


def load(args):
    import importlib.metadata as md

    from dflash_mlx.runtime import get_stop_token_ids
    from dflash_mlx.runtime.bundle import load_runtime_bundle

    bundle = load_runtime_bundle(model_ref=args.target, draft_ref=args.drafter_zlab)
    dtypes = sorted(set(float_dtypes(bundle.target_model.parameters()))
                    | set(float_dtypes(bundle.draft_model.parameters())))
    if dtypes != ["float32"]:
        raise RuntimeError(f"the pair loaded as {dtypes}, expected float32")
    return (bundle, get_stop_token_ids(bundle.tokenizer)), {
        "runtime": "bstnxbt dflash-mlx", "version": md.version("dflash-mlx"), "mlx": mx.__version__,
        "mlx_lm": md.version("mlx-lm"), "dtype": "float32", "draft_quant": bundle.effective_draft_quant,
        "settings": {"default": "build_offline_runtime_context() (verify_mode 'adaptive'), block_tokens=None",
                     "block8": "verify_mode='dflash', block_tokens=8"}}


def generate(state, prompt_ids, max_tokens, setting):
    from dflash_mlx.engine.events import SummaryEvent, TokenEvent
    from dflash_mlx.runtime import stream_dflash_generate
    from dflash_mlx.runtime.context import build_offline_runtime_context

    bundle, stop_ids = state
    if setting == "default":
        ctx, block = build_offline_runtime_context(), None
    else:
        ctx, block = build_offline_runtime_context(verify_mode="dflash"), 8
    summary = None
    stream = stream_dflash_generate(
        target_model=bundle.target_model, target_ops=bundle.target_ops, tokenizer=bundle.tokenizer,
        draft_model=bundle.draft_model, draft_backend=bundle.draft_backend, prompt="",
        max_new_tokens=max_tokens, block_tokens=block, stop_token_ids=stop_ids,
        prompt_tokens_override=list(prompt_ids), runtime_context=ctx)
    try:
        for ev in stream:
            if isinstance(ev, TokenEvent):
                yield [ev.token_id]
            elif isinstance(ev, SummaryEvent):
                summary = ev
    finally:
        stream.close()
    if summary is None:
        raise RuntimeError("no SummaryEvent")
    return {"cycles": summary.cycles_completed, "cycle_tokens": summary.generation_tokens - 1,
            "reported": {"tokens_per_cycle": summary.tokens_per_cycle,
                         "acceptance_ratio": summary.acceptance_ratio,
                         "acceptance_history": list(summary.acceptance_history),
                         "block_tokens": summary.block_tokens,
                         "adaptive_block_reductions": summary.adaptive_block_reductions,
                         "copyspec_hits": summary.copyspec_hits, "fallback_ar": summary.fallback_ar,
                         "fallback_reason": summary.fallback_reason},
            "acceptance_source": "SummaryEvent.cycles_completed; cycle tokens = generation_tokens - 1"}


if __name__ == "__main__":
    serve(load, generate)
