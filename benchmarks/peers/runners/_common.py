"""The protocol every runner speaks (standard library only: it runs in each peer's venv).

A runner is started once per pair: `python runners/<name>.py --target DIR --drafter DIR`.
It loads the pair, then prints one JSON line `{"ready": true, "info": {...}}` and answers
requests, one JSON line each way:

    request:  {"prompt_ids": [...], "max_tokens": 64, "setting": one of the runner's settings ("default", "block8", ...)}
    answer:   {"tokens": [...], "decode_seconds": s, "decode_tokens": n, "tps": n / s,
               "cycles": c, "cycle_tokens": t, "reported": {...}}
              or {"error": "one line"}

Timing is taken here, the same way for every runtime: a runner's `generate` yields the
token ids as the runtime hands them over; decode seconds run from the first event (the
prefill's token) to the last, decode tokens are those after the first event. A runtime
that returns all at once instead (no stream) gives its own prefill/decode split
(`timed_by_runtime`). `cycles` is the number of target passes after the prefill;
`cycle_tokens` the tokens those passes committed (each runner says where it reads them).

Only the protocol goes to the real stdout: anything the runtime prints (Python or C level)
is sent to stderr.
"""

import argparse
import json
import os
import sys
import time
import traceback


def _protocol_stream():
    fd = os.dup(1)
    os.dup2(2, 1)  # stray prints (python or native) land on stderr
    sys.stdout = sys.stderr
    return os.fdopen(fd, "w", buffering=1)


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--drafter", required=True)
    ap.add_argument("--drafter-zlab", required=True)
    ap.add_argument("--cache", default=None, help="a folder the runtime may keep calibrations in")
    return ap.parse_args()


def blas_name() -> str:
    """Which BLAS this process loaded (Linux: from /proc/self/maps; numpy's private copy ignored)."""
    try:
        maps = open("/proc/self/maps").read().lower()
    except OSError:
        return "unknown"
    libs = {l.split()[-1] for l in maps.splitlines() if "/" in l}
    libs = [l for l in libs if "numpy" not in l and "scipy_openblas" not in l]
    for name in ("openblas", "mkl", "blis", "accelerate"):
        if any(name in l for l in libs):
            return name
    return "reference (stock mlx[cpu])"


def float_dtypes(params) -> list:
    """The distinct float dtypes among a module's parameters (names as strings)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    out = set()
    for _, v in tree_flatten(params):
        if isinstance(v, mx.array) and mx.issubdtype(v.dtype, mx.floating):
            out.add(str(v.dtype).split(".")[-1])
    return sorted(out)


def serve(load, generate, settings=("default", "block8")):
    """`load(args)` -> (state, info dict); `generate(state, prompt_ids, max_tokens, setting)`
    -> generator of token-id lists, whose `return` value (StopIteration.value) is a dict with
    "cycles", "cycle_tokens", "reported" and optionally "timed_by_runtime":
    {"decode_seconds": s, "decode_tokens": n}."""
    out = _protocol_stream()
    args = parse_args()
    try:
        state, info = load(args)
    except Exception as e:  # noqa: BLE001 - reported to the orchestrator as one line
        traceback.print_exc()
        out.write(json.dumps({"ready": False, "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}) + "\n")
        return
    info["blas"] = blas_name()
    out.write(json.dumps({"ready": True, "info": info, "settings": list(settings)}) + "\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        if req.get("quit"):
            break
        try:
            tokens, first_n, t_first, t_end = [], None, None, None
            gen = generate(state, req["prompt_ids"], req["max_tokens"], req["setting"])
            while True:
                try:
                    toks = next(gen)
                except StopIteration as stop:
                    extra = stop.value or {}
                    break
                now = time.perf_counter()
                tokens.extend(int(t) for t in toks)
                if t_first is None:
                    t_first, first_n = now, len(tokens)
                t_end = now
            timed = extra.pop("timed_by_runtime", None)
            if timed:
                dsec, dtok = timed["decode_seconds"], timed["decode_tokens"]
            else:
                dsec, dtok = (t_end - t_first) if t_first is not None else 0.0, len(tokens) - (first_n or 0)
            ans = {"tokens": tokens, "decode_seconds": dsec, "decode_tokens": dtok,
                   "tps": dtok / dsec if dsec > 0 else None, "timing": "runtime" if timed else "stream", **extra}
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            ans = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
        out.write(json.dumps(ans) + "\n")
