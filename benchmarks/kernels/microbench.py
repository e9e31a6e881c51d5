"""Microbenchmarks: each custom kernel against its reference and the stock path.

    python benchmarks/kernels/microbench.py [--out results.json] [--repeats 20]

Shapes follow the published targets (Qwen3-4B vocabulary and widths, a
Qwen3.5 Gated DeltaNet layer). On a backend without the kernel (here: Linux
CPU) only the reference and stock columns are timed and the kernel column says
why it did not run. Times are medians in milliseconds, taken in one run.
"""

import argparse
import importlib
import json
import platform
import statistics
import time

import mlx.core as mx
from rich.console import Console
from rich.markup import escape
from rich.progress import Progress
from rich.table import Table

from dflash_mlx import kernels
from dflash_mlx.machine import blas_name
from dflash_mlx.sampling import SamplingParams, log_probs

va, gv, gr, qm = (importlib.import_module(f"dflash_mlx.kernels.{m}") for m in
                  ("verify_accept", "gdn_verify", "gdn_replay", "qmm_verify"))


def timed(fn, repeats):
    mx.eval(fn())
    times = []
    for _ in range(repeats):
        tic = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - tic)
    return statistics.median(times) * 1e3


def cases():
    V, W = 151936, 16
    logits = 4 * mx.random.normal((W, V))
    draft = mx.argmax(logits[: W - 1], axis=-1).astype(mx.int32)
    draft = mx.concatenate([draft[:5], mx.zeros((W - 6,), mx.int32)])
    greedy = SamplingParams()
    yield ("verify_accept greedy [16, 151936]", va.KERNEL,
           lambda: va.greedy_reference(draft, logits),
           lambda: va.verify_accept(draft, logits, greedy),
           None)
    params = SamplingParams(temp=0.7, top_p=0.9)
    q_lp = log_probs(logits[: W - 1] + mx.random.normal((W - 1, V)), params)
    u = mx.random.uniform(shape=(W, 2))
    yield ("verify_accept top-p [16, 151936]", va.KERNEL,
           lambda: va.sampled_reference(draft, logits, q_lp, u, params),
           lambda: va.verify_accept(draft, logits, params, q_lp),
           None)

    from mlx_lm.models.gated_delta import gated_delta_update  # the stock recurrence (tests/bench only)

    q, k, v, g, beta, state = gv.random_inputs(mx.random.key(0), B=1, T=16, Hk=16, Hv=32, Dk=128, Dv=128,
                                               dtype=mx.bfloat16)
    yield ("gdn_verify T=16 (Qwen3.5 layer)", gv.KERNEL,
           lambda: gv.gdn_verify_reference(q, k, v, g, beta, state),
           lambda: gv.gdn_verify(q, k, v, g, beta, state),
           None)
    _, _, delta = gv.gdn_verify_reference(q, k, v, g, beta, state)
    a = mx.zeros((1, 16, 32))
    b = mx.zeros((1, 16, 32))
    A_log, dt_bias = mx.zeros((32,)), mx.zeros((32,))
    yield ("gdn_replay keep=5 of 16", gr.KERNEL,
           lambda: gr.gdn_replay_reference(state, k, g, delta, 5),
           lambda: gr.gdn_replay(state, k, g, delta, 5),
           lambda: gated_delta_update(q[:, :5], k[:, :5], v[:, :5], a[:, :5], b[:, :5], A_log, dt_bias, state)[1])

    for M in (2, 4, 8, 16):
        wq, s, bb = qm.quantized(mx.random.key(1), N=9728, K=2560, group_size=64, bits=4)
        x = mx.random.normal((M, 2560)).astype(mx.float16)
        yield (f"qmm_verify 4-bit M={M} [2560 -> 9728]", qm.KERNEL,
               lambda x=x, wq=wq, s=s, bb=bb: qm.qmm_reference(x, wq, s, bb, 64, 4),
               lambda x=x, wq=wq, s=s, bb=bb: qm.qmm_verify(x, wq, s, bb, 64, 4),
               lambda x=x, wq=wq, s=s, bb=bb: qm.stock(x, wq, s, bb, 64, 4))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    console = Console(stderr=True, highlight=False)
    rows = []
    all_cases = list(cases())
    with Progress(console=console, transient=True) as bar:
        task = bar.add_task("kernels", total=len(all_cases))
        for name, kernel, reference, public, stock in all_cases:
            state = kernel.resolve()
            row = {"case": name, "kernel": kernel.name, "state": state, "reason": kernel.reason,
                   "reference_ms": timed(reference, args.repeats),
                   "public_ms": timed(public, args.repeats),
                   "stock_ms": timed(stock, args.repeats) if stock else None}
            rows.append(row)
            bar.advance(task)
    device = "metal" if kernels.backend() == "metal" else str(mx.default_device())
    machine = {"system": platform.system(), "machine": platform.machine(), "processor": platform.processor(),
               "mlx": mx.__version__, "device": device, "blas": blas_name()}
    console.print(f"MLX {mx.__version__} on {device}, BLAS: {escape(machine['blas'])}")
    table = Table("case", "kernel", "reference ms", "public path ms", "stock ms")
    for r in rows:
        table.add_row(r["case"], r["state"], f"{r['reference_ms']:.3f}", f"{r['public_ms']:.3f}",
                      "" if r["stock_ms"] is None else f"{r['stock_ms']:.3f}")
    Console(highlight=False).print(table)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": machine, "repeats": args.repeats, "rows": rows}, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
