#!/usr/bin/env bash
# Through the device tool: run(command="pip install -q -e . && bash scripts/gpu_check.sh", timeout_s=540) -- torch is on that machine; $OUT comes back.
# One prepared GPU check, under 8 minutes on one GPU; everything it writes goes under $OUT (else ./gpu_check_out):
#   1. pytest -m cuda: the fp16/bf16 contract against transformers generate(), CUDA graphs == eager (<= 150 s);
#   2. benchmarks/gpu_bench.py: large-v2 shapes, fp16, eager and CUDA graphs, batch 1/4/16/64, an oracle draft at set
#      acceptance 0.6/0.8/0.9 with K = 3/5/8 next to greedy: gpu_bench.txt (the table) and gpu_bench.json (rewritten
#      after each row, so a cut run keeps what it measured; what is left after 270 s is skipped and says so).
# Usage: bash scripts/gpu_check.sh [OUT_DIR]; PYTHON picks the interpreter.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"
OUT_DIR="${1:-${OUT:-gpu_check_out}}"
mkdir -p "$OUT_DIR"
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA GPU visible')" || exit 2
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$OUT_DIR/gpu.txt"
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)" 2>&1 | tee -a "$OUT_DIR/gpu.txt"
start=$(date +%s)
ASR_SPEC_TEST_THREADS=4 timeout 150 "$PY" -m pytest -q -p no:cacheprovider -m cuda tests/ 2>&1 | tail -60 > "$OUT_DIR/pytest_cuda.txt"
tests_rc=${PIPESTATUS[0]}
tail -3 "$OUT_DIR/pytest_cuda.txt"
timeout 300 "$PY" -m benchmarks.gpu_bench --max-seconds 270 --json "$OUT_DIR/gpu_bench.json" > "$OUT_DIR/gpu_bench.txt" 2>&1
bench_rc=$?
tail -20 "$OUT_DIR/gpu_bench.txt"
echo "pytest -m cuda: rc=$tests_rc; gpu_bench: rc=$bench_rc; $(( $(date +%s) - start )) s" | tee "$OUT_DIR/summary.txt"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
