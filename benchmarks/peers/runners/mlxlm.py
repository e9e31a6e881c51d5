"""Runner: plain mlx-lm decoding (the baseline), mlx_lm.stream_generate on the target alone.

Settings: "default" = greedy; "t1-default" = its sampler at temperature 1
(`make_sampler(1.0)`), MLX's generator seeded before each request (`mx.random.seed`, a
fresh seed per request, as the other runners' sampled settings do): the baseline of the
"t1-*" settings.

Every yielded response is one token; each token after the first is one target pass, so
cycles = tokens - 1 and tokens per cycle is 1 by construction.
"""

import mlx.core as mx

from _common import float_dtypes, serve

TEMPS = {"t1-default": 1.0}
_requests = [0]


def load(args):
    import mlx_lm
    from mlx_lm.utils import load as lm_load

    model, tokenizer = lm_load(args.target)
    dtypes = float_dtypes(model.parameters())
    if dtypes != ["float32"]:
        raise RuntimeError(f"the target loaded as {dtypes}, expected float32")
    return (model, tokenizer), {"runtime": "mlx-lm", "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__,
                                "dtype": "float32", "settings": {"default": "mlx_lm.stream_generate, greedy sampler",
                                                                 "t1-default": "make_sampler(1.0)"}}


def generate(state, prompt_ids, max_tokens, setting):
    from mlx_lm.generate import stream_generate
    from mlx_lm.sample_utils import make_sampler

    model, tokenizer = state
    n = 0
    _requests[0] += 1
    if setting in TEMPS:
        mx.random.seed(_requests[0])
    for r in stream_generate(model, tokenizer, mx.array(prompt_ids), max_tokens=max_tokens,
                             sampler=make_sampler(TEMPS.get(setting, 0.0))):
        n += 1
        yield [r.token]
        last = r
    return {"cycles": n - 1, "cycle_tokens": n - 1,
            "reported": {"generation_tps": last.generation_tps},
            "acceptance_source": "one token per target pass"}


if __name__ == "__main__":
    serve(load, generate, settings=("default", *TEMPS))
