"""Custom kernels: references against unfused code, the guard, the Metal wiring.

Metal cannot run here. What runs: every reference against straightforward
code, each kernel's self-check against its reference (and against a broken
implementation, which it must reject), the guard's fallback logic on a
pretend-Metal backend, and a g++ syntax check of every Metal source and CUDA
twin as the Python wrapper really instantiates it (see tests/metal/*_stub.h
for what that does and does not catch).
"""

import importlib
import logging
import re
import shutil
import subprocess
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from typer.testing import CliRunner

from dflash_mlx.kernels import guard
from dflash_mlx.sampling import SamplingParams, log_probs

# The package exports each kernel's public function under its module's name.
va, verify_mod, replay_mod, qmm_mod = (importlib.import_module(f"dflash_mlx.kernels.{m}") for m in
                                       ("verify_accept", "gdn_verify", "gdn_replay", "qmm_verify"))

# ---------------------------------------------------------------- verify-and-accept


def np_filtered_probs(x, params):
    """mlx-lm's filter semantics, one row at a time, with a sort."""
    x = x.astype(np.float64)
    lp = x - (x.max() + np.log(np.exp(x - x.max()).sum()))
    keep = np.ones_like(lp, dtype=bool)
    order = np.argsort(-lp, kind="stable")
    if params.top_p < 1:
        p = np.exp(lp[order])
        above = np.concatenate([[0.0], np.cumsum(p)[:-1]])  # mass ranked strictly above
        keep[order[above >= params.top_p * p.sum()]] = False
    if params.min_p > 0:
        keep &= lp >= lp.max() + np.log(params.min_p)
    if 0 < params.top_k < len(lp):
        keep[order[params.top_k:]] = False
    z = np.where(keep, lp / params.temp, -np.inf)
    p = np.exp(z - z.max())
    return p / p.sum()


def np_inverse_cdf(row, u):
    c = np.cumsum(row)
    return min(int((c <= u * c[-1]).sum()), len(row) - 1)


def np_speculative(draft, logits, q_lp, u, params):
    n = len(draft)
    for i in range(n + 1):
        p = np_filtered_probs(logits[i], params)
        if i == n:
            return n, np_inverse_cdf(p, u[i, 1])
        q = np.exp(q_lp[i].astype(np.float64))
        d = draft[i]
        if not u[i, 0] * q[d] < p[d]:
            residual = np.maximum(p - q, 0)
            return i, np_inverse_cdf(residual if residual.sum() > 0 else p, u[i, 1])


def random_case(seed, n, V, scale=3.0):
    key = mx.random.key(seed)
    k1, k2, k3, k4 = mx.random.split(key, 4)
    logits = scale * mx.random.normal((n + 1, V), key=k1)
    agree = mx.argmax(logits[:n], axis=-1)
    noise = mx.random.randint(0, V, (n,), key=k2)
    cut = int(mx.random.randint(0, n + 1, (), key=k3).item()) if n else 0
    draft = mx.where(mx.arange(n) < cut, agree, noise).astype(mx.int32)
    return draft, logits, k4


def mlx_lm_greedy_rows(logits):
    """mlx-lm's generate_step pick, one [1, V] row at a time: its greedy sampler on
    `logits - logsumexp(logits)` computed in the logits' dtype."""
    from mlx_lm.sample_utils import greedy_sampler

    picks = []
    for i in range(logits.shape[0]):
        row = logits[i : i + 1]
        picks.append(greedy_sampler(row - mx.logsumexp(row, keepdims=True)).item())
    return picks


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16], ids=str)
@pytest.mark.parametrize("seed", range(12))
def test_greedy_reference_is_the_longest_agreeing_prefix(seed, dtype):
    n = seed % 6 + 1
    draft, logits, _ = random_case(seed, n, 301)
    logits = logits.astype(dtype)
    accepted, nxt = va.greedy_reference(draft, logits)
    post = mlx_lm_greedy_rows(logits)
    d = np.array(draft)
    want = 0
    while want < n and d[want] == post[want]:
        want += 1
    assert (accepted.item(), nxt.item()) == (want, post[want])


def test_greedy_reference_breaks_bf16_near_ties_like_mlx_lm():
    """199,999 logits of 2.0 and one of 2.015625: the raw argmax is the last index,
    mlx-lm's (argmax of bf16 log probabilities, which tie) is the first."""
    tie = mx.concatenate([mx.full((199_999,), 2.0, dtype=mx.bfloat16), mx.array([2.015625], dtype=mx.bfloat16)])
    logits = mx.stack([tie, tie[::-1]])
    assert mx.argmax(logits, axis=-1).tolist() == [199_999, 0]
    assert mlx_lm_greedy_rows(logits) == [0, 0]
    accepted, nxt = va.greedy_reference(mx.array([0], dtype=mx.int32), logits)
    assert (accepted.item(), nxt.item()) == (1, 0)
    accepted, nxt = va.greedy_reference(mx.array([199_999], dtype=mx.int32), logits)
    assert (accepted.item(), nxt.item()) == (0, 0)


@pytest.mark.parametrize("params", [
    SamplingParams(temp=1.0),
    SamplingParams(temp=0.6, top_p=0.85),
    SamplingParams(temp=1.4, top_k=7),
    SamplingParams(temp=0.9, min_p=0.05),
    SamplingParams(temp=1.1, top_p=0.7, top_k=20, min_p=0.01),
])
def test_sampled_reference_matches_unfused_code(params):
    for seed in range(10):
        n = seed % 5 + 1
        draft, logits, key = random_case(100 + seed, n, 97, scale=2.0)
        k1, k2 = mx.random.split(key)
        # A drafter that roughly agrees with the target, so some drafts pass.
        q_lp = log_probs(logits[:n] + mx.random.normal((n, 97), key=k1), params)
        u = mx.random.uniform(shape=(n + 1, 2), key=k2)
        got = va.sampled_reference(draft, logits, q_lp, u, params)
        want = np_speculative(np.array(draft), np.array(logits), np.array(q_lp), np.array(u), params)
        assert (got[0].item(), got[1].item()) == want


def test_residual_falls_back_to_p_when_q_equals_p():
    params = SamplingParams(temp=1.0)
    logits = mx.random.normal((3, 50), key=mx.random.key(5))
    q_lp = log_probs(logits[:2], params)
    draft = mx.array([0, 1], dtype=mx.int32)
    u = mx.array([[1.0, 0.3], [0.2, 0.4], [0.5, 0.5]])  # u = 1 rejects the first draft
    accepted, token = va.sampled_reference(draft, logits, q_lp, u, params)
    p = np.exp(np.array(log_probs(logits[0], params)), dtype=np.float64)
    assert accepted.item() == 0 and token.item() == np_inverse_cdf(p, 0.3)


# ---------------------------------------------------------------- Gated DeltaNet


def test_gdn_verify_reference_equals_mlx_lm_bitwise():
    from mlx_lm.models.gated_delta import gated_delta_ops

    for dtype in (mx.float32, mx.bfloat16):
        args = verify_mod.random_inputs(mx.random.key(1), B=2, T=7, dtype=dtype)
        y, state, delta = verify_mod.gdn_verify_reference(*args)
        y_ref, state_ref = gated_delta_ops(*args)
        assert mx.array_equal(y, y_ref).item() and mx.array_equal(state, state_ref).item()
        assert delta.shape == y.shape and delta.dtype == mx.float32


def test_gdn_deltas_match_a_straightforward_recurrence():
    q, k, v, g, beta, state = verify_mod.random_inputs(mx.random.key(2), B=1, T=4, Hk=1, Hv=2, Dk=32, Dv=8)
    _, _, delta = verify_mod.gdn_verify_reference(q, k, v, g, beta, state)
    S = np.array(state, dtype=np.float64)
    K, Vv, G, Bt = (np.array(a, dtype=np.float64) for a in (k, v, g, beta))
    for t in range(4):
        for h in range(2):
            S[0, h] *= G[0, t, h]
            d = (Vv[0, t, h] - S[0, h] @ K[0, t, 0]) * Bt[0, t, h]
            S[0, h] += np.outer(d, K[0, t, 0])
            np.testing.assert_allclose(np.array(delta[0, t, h]), d, rtol=1e-4, atol=1e-5)


def test_gdn_replay_rebuilds_every_prefix_bitwise():
    q, k, v, g, beta, state = verify_mod.random_inputs(mx.random.key(3), B=2, T=9)
    _, final, delta = verify_mod.gdn_verify_reference(q, k, v, g, beta, state)
    assert mx.array_equal(replay_mod.gdn_replay(state, k, g, delta, 0), state).item()
    for keep in range(1, 10):
        want = verify_mod.gdn_verify_reference(q[:, :keep], k[:, :keep], v[:, :keep], g[:, :keep],
                                               beta[:, :keep], state)[1]
        got = replay_mod.gdn_replay(state, k, g, delta, keep)
        assert mx.array_equal(got, want).item(), keep
    assert mx.array_equal(replay_mod.gdn_replay(state, k, g, delta, 9), final).item()


# ---------------------------------------------------------------- quantized matmul


@pytest.mark.parametrize("bits, group_size", [(4, 64), (8, 32), (4, 128)])
def test_qmm_reference_and_public_path_match_quantized_matmul(bits, group_size):
    wq, s, b = qmm_mod.quantized(mx.random.key(4), N=48, K=256, group_size=group_size, bits=bits, dtype=mx.float32)
    x = mx.random.normal((5, 256), key=mx.random.key(5))
    stock = mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=group_size, bits=bits)
    assert mx.allclose(qmm_mod.qmm_reference(x, wq, s, b, group_size, bits), stock, atol=1e-4, rtol=1e-4).item()
    assert mx.array_equal(qmm_mod.qmm_verify(x, wq, s, b, group_size, bits), stock).item()


def test_qmm_supported_shapes():
    ok = mx.zeros((4, 512))
    assert qmm_mod.supported(ok, 64, 4) and qmm_mod.supported(ok, 32, 8)
    assert not qmm_mod.supported(mx.zeros((1, 512)), 64, 4)  # one row: stock decode path
    assert not qmm_mod.supported(mx.zeros((17, 512)), 64, 4)
    assert not qmm_mod.supported(mx.zeros((4, 320)), 64, 4)
    assert not qmm_mod.supported(ok, 64, 3)


def test_quantized_linears_are_wrapped_without_changing_outputs():
    from dflash_mlx.target.adapter import VerifyQuantizedLinear, wrap_quantized_linears

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.Linear(256, 64, bias=True)
            self.layers = [nn.Linear(64, 256, bias=False), nn.Linear(64, 256)]

        def __call__(self, x):
            h = self.up(x)
            return self.layers[0](h) + self.layers[1](h)

    mx.random.seed(0)
    model = Block()
    nn.quantize(model, group_size=64, bits=4)
    xs = [mx.random.normal((1, r, 256)) for r in (1, 4, 16, 20)]
    before = [model(x) for x in xs]
    assert wrap_quantized_linears(model) == 3
    assert isinstance(model.up, VerifyQuantizedLinear) and isinstance(model.layers[1], VerifyQuantizedLinear)
    for x, want in zip(xs, before):
        assert mx.allclose(model(x), want, atol=1e-5).item()


# ---------------------------------------------------------------- self-checks and the guard


def as_kernel(module):
    """The module's reference, called the way its kernel is."""
    if module is va:
        return lambda draft, logits, q_lp=None, u=None, params=None: (
            va.greedy_reference(draft, logits) if q_lp is None else va.sampled_reference(draft, logits, q_lp, u, params))
    if module is verify_mod:
        return verify_mod.gdn_verify_reference
    if module is replay_mod:
        return replay_mod.gdn_replay_reference
    return qmm_mod.qmm_reference


def broken(module):
    ref = as_kernel(module)
    if module is va:
        def run(*a, **k):
            accepted, token = ref(*a, **k)
            return mx.minimum(accepted + 1, a[0].shape[0]), token
        return run
    if module is verify_mod:
        return lambda *a: tuple(o * 1.001 if i == 2 else o for i, o in enumerate(ref(*a)))
    if module is replay_mod:
        return lambda state, k, g, delta, keep: ref(state, k, g, delta, keep - 1)
    return lambda x, *a: ref(x, *a) * 1.05 + 0.1


@pytest.mark.parametrize("module", [va, verify_mod, replay_mod, qmm_mod], ids=lambda m: m.__name__.split(".")[-1])
def test_self_check_accepts_the_reference_and_rejects_a_broken_kernel(module):
    module._check(as_kernel(module))
    with pytest.raises(AssertionError):
        module._check(broken(module))


def test_guard_states_on_this_machine(monkeypatch):
    k = va.KERNEL
    k.reset()
    monkeypatch.delenv(guard.ENV, raising=False)
    assert guard.backend() is None and k.resolve() == "unavailable" and k.kernel() is None
    monkeypatch.setenv(guard.ENV, "verify_accept,qmm_verify")
    k.reset()
    assert k.resolve() == "reference" and guard.forced_reference("qmm_verify")
    assert not guard.forced_reference("gdn_verify")
    monkeypatch.setenv(guard.ENV, "1")
    assert guard.forced_reference("gdn_replay")
    k.reset()


def test_guard_falls_back_once_with_a_warning(monkeypatch, caplog):
    monkeypatch.delenv(guard.ENV, raising=False)
    monkeypatch.setattr(guard, "backend", lambda: "metal")
    calls = []

    def failing_build(be):
        calls.append(be)
        raise RuntimeError("Unable to build metal library from source\nline 2")

    k = guard.GuardedKernel("toy", "toy", failing_build, lambda fn: None)
    with caplog.at_level(logging.WARNING, logger="dflash_mlx"):
        assert k.kernel() is None and k.kernel() is None
    assert k.state == "fallback" and "Unable to build" in k.reason and calls == ["metal"]
    assert sum("toy" in r.getMessage() for r in caplog.records) == 1

    wrong = guard.GuardedKernel("toy2", "toy", lambda be: (lambda x: x + 1), lambda fn: va._check(lambda *a, **kw: (mx.array(-1), mx.array(-1))))
    assert wrong.kernel() is None and wrong.state == "fallback" and "AssertionError" in wrong.reason

    good_fn = as_kernel(va)
    good = guard.GuardedKernel("toy3", "toy", lambda be: good_fn, va._check)
    assert good.kernel() is good_fn and good.state == "active"


def test_decode_uses_an_active_kernel_through_its_public_function(monkeypatch, pairs):
    """With verify_accept active (a pretend Metal build), every verify cycle runs it."""
    from dflash_mlx.decode import stream_generate

    monkeypatch.setattr(guard, "backend", lambda: "metal")
    used = []
    ref = as_kernel(va)

    def build(be):
        def run(*a, **k):
            used.append(1)
            return ref(*a, **k)
        return run

    monkeypatch.setattr(va.KERNEL, "_build", build)
    va.KERNEL.reset()
    try:
        assert va.KERNEL.resolve() == "active"
        before = len(used)
        events = list(stream_generate(pairs["qwen3"], [5, 6, 7, 8], max_tokens=12, block_size=4))
        cycles = events[-1].stats.cycles
        # Every cycle but a last one of width 1 (no draft left to check) runs the kernel.
        assert cycles > 1 and cycles - 1 <= len(used) - before <= cycles
    finally:
        va.KERNEL.reset()


def test_doctor_lists_every_kernel(monkeypatch):
    from dflash_mlx.cli.main import app

    monkeypatch.delenv(guard.ENV, raising=False)
    for k in guard.REGISTRY.values():
        k.reset()
    out = CliRunner().invoke(app, ["doctor"], env={"COLUMNS": "200"})
    assert out.exit_code == 0, out.output
    for name in ("verify_accept", "gdn_verify", "gdn_replay", "qmm_verify"):
        assert re.search(rf"{name}\s+│\s+unavailable", out.output), out.output
    out = CliRunner().invoke(app, ["doctor"], env={"COLUMNS": "200", guard.ENV: "1"})
    assert out.output.count("forced by") == 4
    for k in guard.REGISTRY.values():
        k.reset()


# ---------------------------------------------------------------- Metal sources: wiring and g++


class Recorder:
    """Stands in for mx.fast.metal_kernel / cuda_kernel: records the build and each call."""

    def __init__(self):
        self.kernels = []

    def __call__(self, name, input_names, output_names, source, header="", **kw):
        entry = {"name": name, "inputs": list(input_names), "outputs": list(output_names), "source": source,
                 "header": header, "calls": []}
        self.kernels.append(entry)

        def call(inputs, template, grid, threadgroup, output_shapes, output_dtypes, **kw):
            entry["calls"].append(dict(inputs=inputs, template=template, grid=grid, threadgroup=threadgroup,
                                       output_shapes=output_shapes, output_dtypes=output_dtypes))
            return [mx.zeros(s, dtype=d) for s, d in zip(output_shapes, output_dtypes)]

        return call


def recorded_builds(monkeypatch, be="metal"):
    rec = Recorder()
    monkeypatch.setattr(mx.fast, "metal_kernel" if be == "metal" else "cuda_kernel", rec)
    draft, logits, _ = random_case(1, 5, 3000)
    run = va._build(be)
    run(draft, logits.astype(mx.float16))
    q_lp = log_probs(logits[:5], SamplingParams(temp=1.0))
    run(draft, logits, q_lp, mx.random.uniform(shape=(6, 2)), SamplingParams(temp=0.8, top_p=0.9, top_k=5))
    args = verify_mod.random_inputs(mx.random.key(0), B=2, T=4, Hk=2, Hv=4, Dk=128, Dv=64, dtype=mx.bfloat16)
    verify_mod._build(be)(*args)
    replay_mod._build(be)(args[5], args[1], args[3], mx.zeros((2, 4, 4, 64)), 3)
    for bits, gs in ((4, 64), (8, 128)):
        wq, s, b = qmm_mod.quantized(mx.random.key(1), N=200, K=512, group_size=gs, bits=bits)
        qmm_mod._build(be)(mx.zeros((6, 512), dtype=mx.float16), wq, s, b, gs, bits)
    return rec.kernels


ATTRIBUTES = {
    "thread_position_in_grid": "uint3", "thread_position_in_threadgroup": "uint3",
    "threadgroup_position_in_grid": "uint3", "threads_per_threadgroup": "uint3",
    "thread_index_in_simdgroup": "uint", "simdgroup_index_in_threadgroup": "uint",
}
METAL_TYPES = {mx.float32: "float", mx.float16: "half", mx.bfloat16: "bfloat16_t", mx.int32: "int",
               mx.uint32: "uint"}
CUDA_TYPES = {mx.float32: "float", mx.float16: "__half", mx.bfloat16: "__nv_bfloat16", mx.int32: "int32_t",
              mx.uint32: "uint32_t"}
NAMES = {"dflash_verify_accept_greedy", "dflash_verify_accept_sampled", "dflash_gdn_verify", "dflash_gdn_replay",
         "dflash_qmm_verify"}


@pytest.mark.parametrize("be", ["metal", "cuda"])
def test_kernel_wiring(monkeypatch, be):
    kernels = recorded_builds(monkeypatch, be)
    assert {k["name"] for k in kernels} == NAMES
    for k in kernels:
        body = k["header"] + k["source"]
        for name in k["inputs"] + k["outputs"]:
            assert re.search(rf"\b{name}\b", k["source"]), (k["name"], name)
        assert k["calls"], k["name"]
        for c in k["calls"]:
            assert len(c["inputs"]) == len(k["inputs"]) and len(c["output_shapes"]) == len(k["outputs"])
            group = c["threadgroup"]
            assert np.prod(group) <= 1024 and group[0] % 32 == 0
            assert all(g % t == 0 for g, t in zip(c["grid"], group)), (k["name"], c["grid"], group)
            names = {n for n, _ in c["template"]}
            assert all(re.search(rf"\b{n}\b", body) for n in names), (k["name"], names)
        if k["name"].startswith("dflash_verify_accept"):
            rows = k["calls"][0]["output_shapes"][0][0]
            assert k["calls"][0]["grid"][0] == rows * va.THREADS  # one threadgroup per block row
        if k["name"] == "dflash_qmm_verify":
            for c in k["calls"]:
                N = c["output_shapes"][0][1]
                assert c["grid"][1] * qmm_mod.SIMDGROUPS * qmm_mod.COLS >= N  # every column is covered


def metal_unit(k, call, index):
    """A translation unit shaped like MLX's Metal kernel: template params, generated signature."""
    tparams, targs = [], []
    for name, value in call["template"]:
        if isinstance(value, mx.Dtype):
            tparams.append(f"typename {name}")
            targs.append(METAL_TYPES[value])
        else:
            tparams.append(f"{'bool' if isinstance(value, bool) else 'int'} {name}")
            targs.append(str(value).lower() if isinstance(value, bool) else str(value))
    params, args = [], []
    for name, value in zip(k["inputs"], call["inputs"]):
        if isinstance(value, int):
            params.append(f"const constant int& {name}")
            args.append(str(value))
        else:
            params.append(f"const device {METAL_TYPES[value.dtype]}* {name}")
            args.append("nullptr")
    for name, dtype in zip(k["outputs"], call["output_dtypes"]):
        params.append(f"device {METAL_TYPES[dtype]}* {name}")
        args.append("nullptr")
    for attr, ctype in ATTRIBUTES.items():
        if re.search(rf"\b{attr}\b", k["source"]):
            params.append(f"{ctype} {attr}")
            args.append(f"{ctype}{{}}")
    fn = f"{k['name']}_{index}"
    return (f"{k['header']}\ntemplate <{', '.join(tparams)}>\nvoid {fn}({', '.join(params)}) {{\n{k['source']}\n}}\n"
            f"void instantiate_{index}() {{ {fn}<{', '.join(targs)}>({', '.join(args)}); }}\n")


def cuda_unit(k, call, index):
    """A translation unit shaped like MLX's CUDA kernel: constants declared inside the body."""
    params = []
    for name, value in zip(k["inputs"], call["inputs"]):
        ctype = "int32_t" if isinstance(value, int) else CUDA_TYPES[value.dtype]  # scalars become 0-d arrays
        params.append(f"const {ctype}* {name}")
    params += [f"{CUDA_TYPES[d]}* {name}" for name, d in zip(k["outputs"], call["output_dtypes"])]
    consts = []
    for name, value in call["template"]:
        if isinstance(value, mx.Dtype):
            consts.append(f"  using {name} = {CUDA_TYPES[value]};")
        else:
            consts.append(f"  constexpr {'bool' if isinstance(value, bool) else 'int'} {name} = "
                          f"{str(value).lower() if isinstance(value, bool) else value};")
    return (f"{k['header']}\nnamespace mlx::core::cu {{\nnamespace cg = cooperative_groups;\n"
            f"__global__ void {k['name']}_{index}({', '.join(params)}) {{\n" + "\n".join(consts)
            + f"\n{k['source']}\n}}\n}}\n")


# Builtins the kernels use that the stub headers do not declare (same caveats).
EXTRA_STUBS = {
    "metal_stub.h": "namespace metal {\nnamespace fast { inline float exp(float x) { return std::exp(x); } }\n"
                    "inline bool isinf(float x) { return std::isinf(x); }\n}\n",
    "cuda_stub.h": "inline float __expf(float x) { return expf(x); }\n",
}


def gpp(source: str, stub: str, path: Path):
    compiler = shutil.which("g++")
    assert compiler, "g++ is needed for the kernel syntax check (apt-get install g++)"
    path.write_text(f'#include "{Path(__file__).parent / "metal" / stub}"\n' + EXTRA_STUBS[stub] + source)
    return subprocess.run([compiler, "-std=c++17", "-fsyntax-only", "-Wall", "-Wno-unused", str(path)],
                          capture_output=True, text=True)


@pytest.mark.parametrize("be", ["metal", "cuda"])
def test_kernel_sources_pass_a_gpp_syntax_check(monkeypatch, tmp_path, be):
    unit, stub = (metal_unit, "metal_stub.h") if be == "metal" else (cuda_unit, "cuda_stub.h")
    for k in recorded_builds(monkeypatch, be):
        for j, call in enumerate(k["calls"]):
            r = gpp(unit(k, call, j), stub, tmp_path / f"{k['name']}_{j}.cpp")
            assert r.returncode == 0, f"{be} {k['name']} call {j}:\n{r.stderr[:3000]}"


@pytest.mark.parametrize("be", ["metal", "cuda"])
def test_gpp_check_catches_a_broken_source(monkeypatch, tmp_path, be):
    """The syntax check is not vacuous: a typo in a source fails it."""
    monkeypatch.setattr(va, "GREEDY_BODY", va.GREEDY_BODY.replace("? best_v[lane]", "? bets_v[lane]"))
    k = [k for k in recorded_builds(monkeypatch, be) if k["name"] == "dflash_verify_accept_greedy"][0]
    unit, stub = (metal_unit, "metal_stub.h") if be == "metal" else (cuda_unit, "cuda_stub.h")
    r = gpp(unit(k, k["calls"][0], 0), stub, tmp_path / "broken.cpp")
    assert r.returncode != 0 and "bets_v" in r.stderr


# ---------------------------------------------------------------- the greedy body, executed

# A minimal SIMT emulation (for this test only): one std::thread per GPU thread,
# std::barrier for __syncthreads and for each warp's shuffles, static locals as
# shared memory, a bfloat16 that rounds to nearest even. It runs the real CUDA
# twin source (and, with the Metal prelude's log-sum-exp settings, the Metal
# shape of it): it checks the logic and the dtype rounding, not a GPU's
# floating-point reduction order.
SIMT = r'''
#include <math.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <cstdio>
#include <cstdlib>
#include <barrier>
#include <thread>
#include <vector>
#include <algorithm>
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
struct dim3 { unsigned int x = 0, y = 1, z = 1; };
thread_local dim3 threadIdx, blockIdx;
dim3 blockDim, gridDim;
struct __nv_bfloat16 {  // round-to-nearest-even, as the hardware converts
  uint16_t bits = 0;
  __nv_bfloat16() {}
  __nv_bfloat16(float f) {
    uint32_t u; std::memcpy(&u, &f, 4);
    bits = std::isnan(f) ? 0x7fc0 : (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
  operator float() const { uint32_t u = (uint32_t)bits << 16; float f; std::memcpy(&f, &u, 4); return f; }
};
using std::max;
using std::min;
static std::barrier<>* block_bar;
struct WarpX { std::barrier<>* bar; uint32_t slot[32]; };
static WarpX warps[32];
void __syncthreads() { block_bar->arrive_and_wait(); }
template <typename T> T shfl_from(T v, int src) {
  int lane = threadIdx.x & 31; WarpX& w = warps[threadIdx.x >> 5];
  uint32_t u; std::memcpy(&u, &v, 4); w.slot[lane] = u; w.bar->arrive_and_wait();
  uint32_t r = w.slot[src]; w.bar->arrive_and_wait();
  T out; std::memcpy(&out, &r, 4); return out;
}
template <typename T> T __shfl_xor_sync(unsigned, T v, int mask, int = 32) { return shfl_from(v, (threadIdx.x & 31) ^ mask); }
template <typename T> T __shfl_down_sync(unsigned, T v, unsigned off, int = 32) {
  int l = threadIdx.x & 31; return shfl_from(v, l + (int)off < 32 ? l + (int)off : l);
}
unsigned int __float_as_uint(float f) { unsigned int u; std::memcpy(&u, &f, 4); return u; }
float __uint_as_float(unsigned int u) { float f; std::memcpy(&f, &u, 4); return f; }
inline float __expf(float x) { return expf(x); }
namespace cooperative_groups {}
'''



def simt_greedy(logits, mode, workdir):
    """Posterior of every row from the greedy kernel body run under the emulation."""
    R, V = logits.shape
    ctype = {mx.float32: "float", mx.bfloat16: "__nv_bfloat16"}[logits.dtype]
    header, greedy_src, _ = va.sources("cuda")
    if mode == "metal":  # the Metal build's log-sum-exp: 4 reads per thread, one-pass block kernel to 4096
        header += "\n#undef LSE_READS\n#define LSE_READS(T) 4\n#undef LSE_BLOCK_LIMIT\n#define LSE_BLOCK_LIMIT 4096\n"
    src = SIMT + header + f"""
__global__ void kernel(const {ctype}* logits, int32_t* posterior) {{
  using T = {ctype};
  constexpr int V = {V};
{greedy_src}
}}
int main(int argc, char** argv) {{
  int rows = std::atoi(argv[1]);
  std::vector<{ctype}> x((size_t)rows * {V});
  FILE* f = std::fopen(argv[2], "rb");
  if (std::fread(x.data(), sizeof({ctype}), x.size(), f) != x.size()) return 1;
  std::fclose(f);
  std::vector<int32_t> post(rows);
  blockDim.x = {va.THREADS};
  for (int w = 0; w < 32; ++w) warps[w].bar = new std::barrier<>(32);
  block_bar = new std::barrier<>({va.THREADS});
  for (int row = 0; row < rows; ++row) {{
    std::vector<std::thread> ts;
    for (int t = 0; t < {va.THREADS}; ++t)
      ts.emplace_back([&, t, row] {{ threadIdx.x = t; blockIdx.x = row; kernel(x.data(), post.data()); }});
    for (auto& t : ts) t.join();
  }}
  for (int r = 0; r < rows; ++r) std::printf("%d\\n", post[r]);
}}
"""
    (workdir / "k.cpp").write_text(src)
    r = subprocess.run([shutil.which("g++"), "-std=c++20", "-O1", "-pthread", "-w", str(workdir / "k.cpp"), "-o",
                        str(workdir / "k")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[:3000]
    np.array(logits.view(mx.uint16) if logits.dtype == mx.bfloat16 else logits).tofile(workdir / "in.bin")
    out = subprocess.run([str(workdir / "k"), str(R), str(workdir / "in.bin")], capture_output=True, text=True,
                         check=True).stdout
    return [int(v) for v in out.split()]


def near_tie_rows(V, rows, seed):
    """bf16 rows of 2.0 (and lower noise) with one 2.015625 late in the row: the raw
    argmax is that one; mlx-lm's, on tied bf16 log probabilities, the first 2.0."""
    rng = np.random.default_rng(seed)
    x = np.where(rng.random((rows, V)) < 0.6, 2.0, rng.normal(-2.0, 1.0, (rows, V)))
    x[:, 0] = 2.0
    x[np.arange(rows), rng.integers(V // 2, V, rows)] = 2.015625
    return mx.array(x.astype(np.float32)).astype(mx.bfloat16)


@pytest.mark.parametrize("mode", ["cuda", "metal"])
def test_greedy_kernel_body_picks_like_mlx_lm_when_executed(mode, tmp_path):
    cases = [
        mx.stack([mx.concatenate([mx.full((199_999,), 2.0, dtype=mx.bfloat16), mx.array([2.015625], mx.bfloat16)])]),
        near_tie_rows(1000, 3, 0),  # the one-pass block branch in the Metal shape
        near_tie_rows(9000, 3, 1),  # the looped branch
        3 * mx.random.normal((3, 4099), key=mx.random.key(9)),  # float32
    ]
    for i, logits in enumerate(cases):
        want = mlx_lm_greedy_rows(logits)
        if logits.dtype == mx.bfloat16:
            assert want != mx.argmax(logits, axis=-1).tolist()  # the case tells the two rules apart
        work = tmp_path / str(i)
        work.mkdir()
        assert simt_greedy(logits, mode, work) == want, (mode, i)


def test_qmm_timing_leaves_the_global_random_state_alone(monkeypatch):
    # The one-time timing runs mid-request on a GPU; seeded sampling must not see it.
    monkeypatch.setattr(qmm_mod, "_faster", {})
    w = mx.random.normal((64, 128), key=mx.random.key(1))
    wq, scales, biases = mx.quantize(w, group_size=64, bits=4)
    x = mx.random.normal((4, 128), key=mx.random.key(2))
    mx.random.seed(5)
    expected = mx.random.uniform(shape=(4,))
    mx.random.seed(5)
    qmm_mod.kernel_wins(qmm_mod.stock, x, wq, scales, biases, 64, 4)
    assert mx.array_equal(mx.random.uniform(shape=(4,)), expected)
