"""Runner: `mlx-dspark==0.20.3` in its z-lab DFlash mode (`mlx_dspark.dflash_generate`), greedy.

Loading as its CLI's `generate --mode dflash` does: `load_target(target, require_tap=True)`
(which also checks that its hidden-state tap reproduces the model's own forward), then
`load_dflash(drafter, quantize=False)` and `drafter.bind(target.model)`. Its CLI quantizes
the drafter to 4 bits by default (`--drafter-bits 4`); here it stays float32 like every
other runtime. The CLI's kernel switches (small-M qmm, SDPA split, multi-row attention,
wide GEMM, CPU split) are for quantized weights / Metal and are not applied.
Settings:
- "default": the cap its CLI derives when --max-draft is omitted, `calibrate.static_cap`
  (measured once on this machine, cached in the runner's cache folder per BLAS);
- "block8": max_draft_tokens=7, i.e. 8 tokens verified per cycle. mlx-dspark always runs
  the drafter over its full block (16) and caps how many drafted tokens are verified, so
  this is its way of running "block 8".
Timing: dflash_generate returns at the end (no token stream), so decode seconds are its own
`GenResult.decode_seconds` (seconds minus prefill_seconds) and decode tokens are the tokens
after the prefill's one, counted up to max_tokens (its last cycle may commit past it).
Acceptance: GenResult.num_rounds (target passes after the prefill) and
sum(accept_lengths) (tokens each round committed).
"""

from pathlib import Path

import mlx.core as mx

from _common import float_dtypes, serve


def load(args):
    import importlib.metadata as md

    from mlx_dspark.calibrate import static_cap
    from mlx_dspark.load import load_dflash, load_target

    target, tok = load_target(args.target, require_tap=True)
    drafter, cfg = load_dflash(args.drafter_zlab, quantize=False)
    drafter.bind(target.model)
    dtypes = sorted(set(float_dtypes(target.model.parameters())) | set(float_dtypes(drafter.parameters())))
    if dtypes != ["float32"]:
        raise RuntimeError(f"the pair loaded as {dtypes}, expected float32")
    full = max(1, int(cfg.block_size) - 1)
    cache = args.cache or str(Path.home() / ".cache" / "dflash-mlx" / "peers" / "dspark" / "calibration")
    cap = static_cap(target, drafter, mode="dflash", target_repo=args.target, drafter_repo=args.drafter_zlab,
                     cache_dir=cache, fallback=full)
    return (target, tok, drafter, cap), {
        "runtime": "mlx-dspark (dflash mode)", "version": md.version("mlx-dspark"), "mlx": mx.__version__,
        "mlx_lm": md.version("mlx-lm"), "dtype": "float32",
        "settings": {"default": f"max_draft_tokens=static_cap(...) = {cap} (verify {cap + 1}); drafter block "
                                f"{cfg.block_size}", "block8": "max_draft_tokens=7 (verify 8)"},
        "static_cap": cap}


def generate(state, prompt_ids, max_tokens, setting):
    from mlx_dspark.generate import dflash_generate

    target, tok, drafter, cap = state
    res = dflash_generate(target, tok, drafter, prompt_ids=list(prompt_ids), max_new_tokens=max_tokens,
                          max_draft_tokens=cap if setting == "default" else 7, temperature=0.0)
    ids = res.token_ids
    yield ids
    return {"cycles": res.num_rounds, "cycle_tokens": sum(res.accept_lengths),
            "timed_by_runtime": {"decode_seconds": res.decode_seconds,
                                 "decode_tokens": min(len(ids), max_tokens) - 1},
            "reported": {"mean_accept_len": res.mean_accept_len, "decode_tokens_per_sec": res.decode_tokens_per_sec,
                         "target_forwards": res.target_forwards, "lookup_rounds": res.lookup_rounds},
            "acceptance_source": "GenResult.num_rounds and sum(accept_lengths)"}


if __name__ == "__main__":
    serve(load, generate)
