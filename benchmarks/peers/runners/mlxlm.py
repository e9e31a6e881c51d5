"""Runner: plain mlx-lm greedy decoding (the baseline), mlx_lm.stream_generate on the target alone.

Every yielded response is one token; each token after the first is one target pass, so
cycles = tokens - 1 and tokens per cycle is 1 by construction.
"""

import mlx.core as mx

from _common import float_dtypes, serve


def load(args):
    import mlx_lm
    from mlx_lm.utils import load as lm_load

    model, tokenizer = lm_load(args.target)
    dtypes = float_dtypes(model.parameters())
    if dtypes != ["float32"]:
        raise RuntimeError(f"the target loaded as {dtypes}, expected float32")
    return (model, tokenizer), {"runtime": "mlx-lm", "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__,
                                "dtype": "float32", "settings": {"default": "mlx_lm.stream_generate, greedy sampler"}}


def generate(state, prompt_ids, max_tokens, setting):
    from mlx_lm.generate import stream_generate
    from mlx_lm.sample_utils import make_sampler

    model, tokenizer = state
    n = 0
    for r in stream_generate(model, tokenizer, mx.array(prompt_ids), max_tokens=max_tokens,
                             sampler=make_sampler(0.0)):
        n += 1
        yield [r.token]
        last = r
    return {"cycles": n - 1, "cycle_tokens": n - 1,
            "reported": {"generation_tps": last.generation_tps},
            "acceptance_source": "one token per target pass"}


if __name__ == "__main__":
    serve(load, generate, settings=("default",))
