#!/usr/bin/env bash
# Benchmarks on a GPU, each step bounded in time; results and logs in OUT_DIR.
#   bash benchmarks/gpu/run_bench.sh OUT_DIR DRAFTER_CONFIG
# DRAFTER_CONFIG: z-lab's Qwen3-4B-DFlash-b16 config.json (for the real-shape pair).
set -u
OUT=${1:?output folder}; DCFG=${2:?drafter config}; mkdir -p "$OUT"
cd "$(dirname "$0")/../.."
P=$HOME/.cache/dflash-mlx/peers/pairs; RS=$OUT/real
head -4 dflash_mlx/suites/code.jsonl > "$OUT/prompts.jsonl"
step() { local s=$1; shift; echo "== $*"; timeout "$s" "$@"; }
step 300 python benchmarks/kernels/microbench.py --repeats 10 --out "$OUT/kernels-microbench.json"
step 300 python benchmarks/gpu/real_shapes.py --out "$RS" --drafter-config "$DCFG" --quantize
for t in target target-4bit; do
  step 600 dflash-mlx bench --model "$RS/$t" --draft "$RS/drafter" --prompts "$OUT/prompts.jsonl" --oracle \
    --block-size 1,2,4,8,16,auto -m 64 --out "$OUT/bench-oracle-qwen3-4b-$t.json"
done
step 300 python benchmarks/peers/widen.py --pair all
for p in demo widened; do
  step 300 dflash-mlx bench --model "$P/$p/target" --draft "$P/$p/drafter" --prompts "$OUT/prompts.jsonl" \
    --block-size 1,4,8,16,auto -m 64 --out "$OUT/bench-$p.json"
  step 300 python benchmarks/tree.py --pair "$p" --costs --out "$OUT/tree-costs-$p.json"
done
step 900 python benchmarks/serve_load.py --pair "$P/widened" --concurrency 1,4,8,16 --max-tokens 64 --repeats 1 \
  --out "$OUT/serve-load-widened.json"
