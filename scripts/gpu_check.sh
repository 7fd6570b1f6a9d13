#!/usr/bin/env bash
# One prepared GPU check (installs nothing; under 8 minutes on one GPU):
#   1. pytest -m cuda (fp16/bf16 contract against transformers generate(), CUDA graphs == eager)
#   2. scripts/gpu_bench.py: large-v2-shaped random weights + a 2-layer draft, batch 1/4/16, greedy vs speculative,
#      eager vs CUDA graphs: a table on stdout and gpu_bench.json.
# Usage: scripts/gpu_check.sh [OUT_DIR]   (default: $OUT when set, else ./gpu_check_out); PYTHON picks the interpreter.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
OUT_DIR="${1:-${OUT:-gpu_check_out}}"
mkdir -p "$OUT_DIR"
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA GPU visible')" || exit 2
nvidia-smi --query-gpu=name,memory.total --format=csv 2>/dev/null | tee "$OUT_DIR/gpu.txt"
start=$(date +%s)
ASR_SPEC_TEST_THREADS=4 timeout 210 "$PY" -m pytest -q -p no:cacheprovider -m cuda tests/ 2>&1 | tail -40 | tee "$OUT_DIR/pytest_cuda.txt"
tests_rc=${PIPESTATUS[0]}
timeout 240 "$PY" scripts/gpu_bench.py --json "$OUT_DIR/gpu_bench.json" 2>&1 | tee "$OUT_DIR/gpu_bench.txt"
bench_rc=${PIPESTATUS[0]}
echo "pytest -m cuda: rc=$tests_rc; gpu_bench: rc=$bench_rc; $(( $(date +%s) - start )) s" | tee "$OUT_DIR/summary.txt"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
