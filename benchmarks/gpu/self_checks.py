"""Each custom kernel's first-use self-check on this backend, and the tree self-check on the demo target.

    python benchmarks/gpu/self_checks.py
"""

import importlib
import time

import mlx.core as mx

import dflash_mlx
from dflash_mlx.draft import tree
from dflash_mlx.kernels import guard

KERNELS = ("verify_accept", "gdn_verify", "gdn_replay", "qmm_verify")


def main():
    print("MLX", mx.__version__, mx.default_device(), "backend:", guard.backend())
    for name in KERNELS:
        importlib.import_module(f"dflash_mlx.kernels.{name}")
    for name, kernel in guard.REGISTRY.items():
        tic = time.perf_counter()
        state = kernel.resolve()  # compiles the kernel, then checks it against its reference
        print(f"kernel {name}: {state} ({kernel.reason}), {time.perf_counter() - tic:.1f} s")
    pair = dflash_mlx.load("demo")
    print("tree self-check on the demo target:", tree.self_check(pair.target) or "passed")


if __name__ == "__main__":
    main()
