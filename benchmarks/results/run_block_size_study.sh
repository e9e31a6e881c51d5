#!/usr/bin/env bash
# Fixed block sizes against --block-size auto on the demo pair, on two cost
# curves: MLX's stock reference BLAS and Debian's OpenBLAS (Linux, CPU backend).
# Each run measures its own cost curve (cached per BLAS) and reports speedups
# as ratios within that run (medians and geometric means over prompts). Run
# from the repository root.
set -euo pipefail
SIZES=1,2,3,4,6,8,12,16,auto
ARGS="--suite code --block-size $SIZES --max-tokens 96 --repeats 5"
export DFLASH_MLX_CACHE=$(mktemp -d)  # fresh cost curves (they are cached per BLAS)
dflash-mlx bench $ARGS --out benchmarks/results/demo-linux-cpu-stockblas.json
LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \
    dflash-mlx bench $ARGS --out benchmarks/results/demo-linux-cpu-openblas.json
