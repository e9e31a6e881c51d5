#!/usr/bin/env bash
# Rebuild the shipped demo pair from scratch (about 45 minutes on 2 CPU cores
# with OpenBLAS; minutes on a Mac). Run from the repository root.
set -euo pipefail
BLAS=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3
if [ "$(uname)" = Linux ] && [ -e "$BLAS" ]; then export LD_PRELOAD=$BLAS; fi

# 1. The target: a small Qwen3 code model on the Python standard library.
python benchmarks/demo/train_target.py --steps 1500 --out dflash_mlx/demo/target --prompts-dir benchmarks/demo

# 2. Its drafter, trained with our own `dflash-mlx train` on the target's outputs.
rm -rf /tmp/demo-drafter
dflash-mlx train --model dflash_mlx/demo/target --data benchmarks/demo/prompts.jsonl --out /tmp/demo-drafter \
    --block-size 16 --layers 4 --target-layers 0,1,2,3 --steps 5000 --lr 1e-3 --blocks-per-seq 16 \
    --max-new-tokens 96 --save-every 500 --eval-every 500
rm -rf dflash_mlx/demo/drafter && cp -r /tmp/demo-drafter/mlx dflash_mlx/demo/drafter
cp /tmp/demo-drafter/train_config.json /tmp/demo-drafter/train_summary.json benchmarks/demo/

# 3. The figure in the README: greedy acceptance on held-out prompts.
python benchmarks/demo/eval_acceptance.py --block-sizes 8 16 --out benchmarks/demo/acceptance.json

# 4. A DFlash 2 drafter for the same target, same data and recipe (alias demo-dflash2).
rm -rf /tmp/demo-dflash2
dflash-mlx train --model dflash_mlx/demo/target --data benchmarks/demo/prompts.jsonl --out /tmp/demo-dflash2 \
    --arch dflash2 --block-size 16 --layers 4 --target-layers 0,1,2,3 --steps 3000 --lr 1e-3 --blocks-per-seq 16 \
    --max-new-tokens 96 --save-every 500 --eval-every 500
rm -rf dflash_mlx/demo/drafter2 && cp -r /tmp/demo-dflash2/mlx dflash_mlx/demo/drafter2
cp /tmp/demo-dflash2/train_config.json benchmarks/demo/train_config_dflash2.json
cp /tmp/demo-dflash2/train_summary.json benchmarks/demo/train_summary_dflash2.json
python benchmarks/demo/eval_acceptance.py --model demo-dflash2 --block-sizes 8 16 --max-tokens 96 \
    --out benchmarks/demo/acceptance-dflash2.json
