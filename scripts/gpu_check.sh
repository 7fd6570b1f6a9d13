#!/usr/bin/env bash
# The GPU check, for the GPU machine as it is: offline, its own Python 3.12 / torch / transformers / pytest /
# pytest-timeout, and no install step (the repository root goes on PYTHONPATH; nothing on the check's path imports
# soundfile, jiwer, librosa, platformdirs or silero-vad). docs/gpu.md has the one-line command and what each file
# holds. About 6 minutes at most on the GPU, each stage under its own time limit:
#   1. env.txt          versions (Python, torch, CUDA, cuDNN, transformers), the GPU, the SDPA backends as the
#                       engine leaves them (cuDNN attention off), TF32 flags  (<= 60 s)
#   2. pytest_cuda.txt  the cuda-marked tests, files named: tests/test_cuda.py, test_sampling.py, test_features.py:
#                       fp16/bf16 speculative == greedy, fp32 == transformers (TF32 off), CUDA graphs == eager
#                       (<= 110 s; 60 s a test, a hung test prints its stack: pytest-timeout, faulthandler)
#   3. gpu_bench.txt / gpu_bench.json  benchmarks/gpu_bench.py --plan check: CUDA graphs at batch 64/16/4/1 with the
#                       oracle at acceptance 0.8/0.9, K = 5 first; eager at batch 1; then the rest of the grid. The
#                       JSON is rewritten after each row, so a run cut short keeps its rows  (<= 190 s)
#   summary.txt         each stage's exit code and seconds, appended as each ends
# Usage: bash scripts/gpu_check.sh [OUT_DIR]   (default $OUT, else ./gpu_check_out); PYTHON picks the interpreter.
# GPU_CHECK_DEVICE=cpu runs every stage on the CPU at tiny shapes (the dry run CI takes: .ci/run).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
# the CPU attention kernel (asr_spec/engine/cpu_attention.py) is compiled at a CPU decoder's first use (20-60 s):
# not on the GPU machine's clock, where a CPU decoder is only ever a reference (torch's products serve it)
export ASR_SPEC_NO_CPU_KERNELS=1
# the GPU machine's torch lives behind a plain `python3` (docs/gpu.md): `python` where there is one, else that
PY="${PYTHON:-$(command -v python || command -v python3 || echo python)}"
DEVICE="${GPU_CHECK_DEVICE:-cuda}"
OUT_DIR="${1:-${OUT:-gpu_check_out}}"
mkdir -p "$OUT_DIR"
: > "$OUT_DIR/summary.txt"
start=$(date +%s)
failed=0

# stage NAME LIMIT_S LOG COMMAND...: run it under `timeout` (SIGABRT: faulthandler prints every thread's stack; a
# KILL 10 s later), output to OUT_DIR/LOG as it comes; its exit code and seconds appended to summary.txt
stage() {
  local name=$1 limit=$2 log=$3 t0 rc
  shift 3
  t0=$(date +%s)
  timeout -s ABRT -k 10 "$limit" "$@" > "$OUT_DIR/$log" 2>&1
  rc=$?
  [ "$rc" -eq 0 ] || failed=1
  echo "$name: rc=$rc ($([ "$rc" -eq 124 ] || [ "$rc" -eq 134 ] && echo "cut at $limit s, " || true)$(( $(date +%s) - t0 )) s)" \
    | tee -a "$OUT_DIR/summary.txt"
  tail -n 4 "$OUT_DIR/$log"
}

if [ "$DEVICE" = cuda ]; then
  "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA GPU visible')" || exit 2
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT_DIR/nvidia_smi.txt" 2>&1
  BENCH=(--plan check --json "$OUT_DIR/gpu_bench.json" --max-seconds 170)
else  # the dry run: the same stages at tiny shapes, on the CPU
  # (every stage a few seconds on an idle CPU; --max-seconds ends it with what it has on a loaded one)
  BENCH=(--plan check --device cpu --tiny --batches 2 --new-tokens 16 --json "$OUT_DIR/gpu_bench.json" --max-seconds 90)
fi

stage env 60 env.txt "$PY" -X faulthandler - "$DEVICE" <<'EOF'
import platform, sys
import torch, transformers
from asr_spec.engine.capture import pin_attention
device = torch.device(sys.argv[1])
pin_attention(device)  # what every Engine on this device does
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "transformers", transformers.__version__)
print("cudnn", torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None)
if device.type == "cuda":
    props = torch.cuda.get_device_properties(device)
    print("gpu", props.name, f"{props.total_memory / 2**30:.0f} GiB", "capability", f"{props.major}.{props.minor}")
    b = torch.backends.cuda
    print("sdpa backends: flash", b.flash_sdp_enabled(), "mem_efficient", b.mem_efficient_sdp_enabled(),
          "math", b.math_sdp_enabled(), "cudnn", b.cudnn_sdp_enabled())
print("tf32: matmul", torch.backends.cuda.matmul.allow_tf32, "cudnn", torch.backends.cudnn.allow_tf32)
EOF

# --timeout: pytest-timeout (an unknown option, so a failed stage, where it is missing)
stage pytest_cuda 110 pytest_cuda.txt env ASR_SPEC_TEST_THREADS=4 "$PY" -X faulthandler -m pytest -q -rs \
  -p no:cacheprovider --timeout 60 -m cuda tests/test_cuda.py tests/test_sampling.py tests/test_features.py

stage gpu_bench 190 gpu_bench.txt "$PY" -X faulthandler -m benchmarks.gpu_bench "${BENCH[@]}"

echo "total: $(( $(date +%s) - start )) s" | tee -a "$OUT_DIR/summary.txt"
exit "$failed"
