#!/usr/bin/env bash
# Rebuild the shipped demo pairs from scratch (on 2 CPU cores with OpenBLAS: the code pair about 45 minutes,
# the chat pair about 7 hours; far less on a Mac). Run from the repository root.
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

# 5. The chat pair (alias demo-chat): a target trained on synthetic agent conversations in stages, each going on
#    from the one before (on each turn's last 1,024 tokens, then with the real clients' long request shells, then
#    on each turn's last 2,048 tokens), and its DFlash 2 drafter trained on the target's answers to those
#    conversations' turns (the last 384 tokens of each prompt). Stages that did not ship (8, 10-12) are in
#    chat_target_training.json and benchmarks/demo/README.md.
W=/tmp/demo-chat-target
T="python benchmarks/demo/train_chat_target.py --eval-turns 0"
$T --out $W/1 --summary $W/1.json --conversations 4000 --steps 500 --lr 2e-3 --seed 0 --max-len 2048 --eval-turns 40
$T --init $W/1 --out $W/2 --summary $W/2.json --conversations 3000 --steps 400 --lr 1e-3 --seed 1 --max-len 2048 \
    --anchored 0.85
SHORT="--max-len 1024 --anchored 1.0 --kinds agents=1,synthetic=1"
$T --init $W/2 --out $W/3 --summary $W/3.json --conversations 5000 --steps 550 --lr 1e-3 --seed 2 $SHORT
$T --init $W/3 --out $W/4 --summary $W/4.json --conversations 8000 --steps 1500 --lr 1e-3 --seed 3 $SHORT
$T --init $W/4 --out $W/5 --summary $W/5.json --conversations 8000 --steps 1200 --lr 6e-4 --seed 4 $SHORT
$T --init $W/5 --out $W/6 --summary $W/6.json --conversations 8000 --steps 1500 --lr 6e-4 --seed 5 $SHORT
$T --init $W/6 --out $W/7 --summary $W/7.json --conversations 8000 --steps 1500 --lr 5e-4 --seed 6 \
    --max-len 1024 --anchored 1.0 --kinds claude=1,codex=1,agents=1,synthetic=1
$T --init $W/7 --out $W/9 --summary $W/9.json --conversations 4000 --steps 500 --lr 3e-4 --seed 8 \
    --max-len 2048 --anchored 1.0 --kinds claude=2,codex=1,agents=1,synthetic=1
rm -rf dflash_mlx/demo/chat-target && cp -r $W/9 dflash_mlx/demo/chat-target
python benchmarks/demo/chat_data.py --tokenizer dflash_mlx/demo/chat-target --prompts /tmp/chat-prompts.jsonl \
    -n 500 --seed 7 --tail 384
rm -rf /tmp/demo-chat-drafter
dflash-mlx train --model dflash_mlx/demo/chat-target --data /tmp/chat-prompts.jsonl --out /tmp/demo-chat-drafter \
    --arch dflash2 --block-size 16 --layers 2 --target-layers 0,1,2,3 --steps 1500 --lr 1e-3 --blocks-per-seq 16 \
    --max-new-tokens 96 --save-every 500 --eval-every 500
rm -rf dflash_mlx/demo/chat-drafter && cp -r /tmp/demo-chat-drafter/mlx dflash_mlx/demo/chat-drafter
cp /tmp/demo-chat-drafter/train_config.json benchmarks/demo/chat_drafter_config.json
cp /tmp/demo-chat-drafter/train_summary.json benchmarks/demo/chat_drafter_summary.json
