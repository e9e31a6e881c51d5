#!/usr/bin/env bash
# The test suite with MLX's CUDA backend as the default device, and each kernel's self-check.
#   bash benchmarks/gpu/run_tests.sh OUT_DIR [SECONDS]
# Needs `pip install "mlx[cuda13]"` (or cuda12) and this package installed. pytest is
# interrupted (SIGINT) at SECONDS, so it still prints each failure's reason.
set -u
OUT=${1:?output folder}; SECONDS_LEFT=${2:-900}; mkdir -p "$OUT"
cd "$(dirname "$0")/../.."
python -c "import mlx.core as mx; assert mx.cuda.is_available(), 'MLX has no CUDA backend here'" || exit 1
python benchmarks/gpu/self_checks.py | tee "$OUT/self-checks.txt"
timeout -s INT "$SECONDS_LEFT" python -m pytest -n "${WORKERS:-8}" --dist loadfile -o addopts="" -v --tb=line -rfE tests/ \
  > "$OUT/pytest.log" 2>&1
tail -n 80 "$OUT/pytest.log"
