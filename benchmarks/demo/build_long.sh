#!/usr/bin/env bash
# Build the long-context demo pair (not shipped: it is for benchmarks) into
# $DFLASH_MLX_CACHE/bench/demo-long (default ~/.cache/dflash-mlx/bench/demo-long):
# the demo target with an 8,192-token window, fine-tuned on long sequences, and
# the demo drafter fine-tuned on its answers to 1k-8k-token prompts. About 100
# minutes on 2 CPU cores with OpenBLAS. Run from the repository root.
set -euo pipefail
BLAS=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3
if [ "$(uname)" = Linux ] && [ -e "$BLAS" ]; then export LD_PRELOAD=$BLAS; fi
OUT=${DFLASH_MLX_CACHE:-$HOME/.cache/dflash-mlx}/bench/demo-long

# 1. The target: linear RoPE scaling x4, then 48 steps on 2k-8k-token sequences.
(cd benchmarks/demo && python train_long_target.py --out "$OUT" --info long_target_training.json)

# 2. The drafter: the shipped demo drafter, fine-tuned on the target's answers to 400 long prompts.
rm -rf "$OUT/drafter"
dflash-mlx train --model "$OUT/target" --data "$OUT/long_prompts.jsonl" --out "$OUT/drafter" \
    --init dflash_mlx/demo/drafter --block-size 16 --layers 4 --target-layers 0,1,2,3 --steps 150 --lr 5e-4 \
    --blocks-per-seq 81 --max-new-tokens 96 --save-every 50 --eval-every 150
cp "$OUT/drafter/train_config.json" benchmarks/demo/long_train_config.json
cp "$OUT/drafter/train_summary.json" benchmarks/demo/long_train_summary.json

# 3. The figures in benchmarks/README.md: acceptance against z-lab's MLX loop, then `bench` at long contexts.
python benchmarks/long_context.py --pair "$OUT" --out benchmarks/results/long-pair-acceptance-linux-cpu-openblas.json
# bench runs the weights as saved: time a float32 copy (float16 matmuls are slow on a CPU).
python - "$OUT" <<'EOF'
import json, shutil, sys
from pathlib import Path
import mlx.core as mx
src = Path(sys.argv[1]) / "target"
dst = src.with_name("target-f32")
shutil.rmtree(dst, ignore_errors=True)
shutil.copytree(src, dst)
for f in dst.glob("*.safetensors"):
    mx.save_safetensors(str(f), {k: v.astype(mx.float32) for k, v in mx.load(str(f)).items()}, metadata={"format": "mlx"})
cfg = json.loads((dst / "config.json").read_text())
(dst / "config.json").write_text(json.dumps({**cfg, "torch_dtype": "float32"}, indent=2))
EOF
head -3 dflash_mlx/suites/code.jsonl > "$OUT/code3.jsonl"
dflash-mlx bench --model "$OUT/target-f32" --draft "$OUT/drafter/mlx" --prompts "$OUT/code3.jsonl" --context 1k,2k,4k,8000 \
    --block-size 8,16,auto --max-tokens 96 --out benchmarks/results/long-pair-bench-linux-cpu-openblas.json
