#!/usr/bin/env bash
# The GPU check, in one command, on a machine with a CUDA device:
#   1. the CUDA tests (pytest -m cuda): the Triton kernel against the CPU kernel, training on CUDA, ...
#   2. the debugging-size suite on the GPU (tools/bench.py --suite debug --device cuda): eager and
#      torch.compile, forward and forward + backward, kernels per observed node from the profiler;
#   3. torch.compile with the statistics fused into Inductor's kernels (FXDEBUG_COMPILE_STATS=inline);
#   4. the kernel check: the same suite's models with FXDEBUG_KERNEL=torch (the pure-torch path).
# Writes gpu-check/{tests.txt,bench-cuda*.md,summary.md}; paste summary.md into
# docs/performance.md ("GPU" section). Usage: tools/gpu_check.sh [--quick] [OUT_DIR]
set -u -o pipefail
cd "$(dirname "$0")/.."
QUICK=0
if [ "${1:-}" = "--quick" ]; then QUICK=1; shift; fi
OUT="${1:-gpu-check}"
mkdir -p "$OUT"
if ! python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check: no CUDA device here; nothing measured" | tee "$OUT/summary.md"
  exit 2
fi
export OMP_NUM_THREADS=1
python - <<'PY' > "$OUT/summary.md"
import torch, triton, platform
print(f"# GPU check: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, triton {triton.__version__}, "
      f"Python {platform.python_version()}\n")
PY
echo "## CUDA tests" >> "$OUT/summary.md"
python -m pytest -q -m cuda tests/test_triton_kernel.py tests/test_runtime.py tests/test_training_cuda.py \
    tests/test_compile_fusion.py -p no:cacheprovider 2>&1 | tee "$OUT/tests.txt" | tail -3 >> "$OUT/summary.md"
if [ "$QUICK" = 1 ]; then
  ARGS=(--models "resnet18-style 1x3x64x64,hf gpt2 2L d64 2x16,mlp 20x256 batch 2" --repeats 2 --runs 7 --warmup 2)
else
  ARGS=(--repeats 3 --runs 15 --warmup 3)
fi
python tools/bench.py --suite debug --device cuda --compile "${ARGS[@]}" --out "$OUT/bench-cuda.md" \
    > "$OUT/bench-cuda.log" 2>&1
echo >> "$OUT/summary.md"; cat "$OUT/bench-cuda.md" >> "$OUT/summary.md"
FXDEBUG_COMPILE_STATS=inline python tools/bench.py --suite debug --device cuda --compile --no-backward "${ARGS[@]}" \
    --out "$OUT/bench-cuda-fused-compile.md" > "$OUT/bench-cuda-fused-compile.log" 2>&1
{ echo; echo "## torch.compile with the statistics fused into Inductor's kernels (FXDEBUG_COMPILE_STATS=inline)"; echo;
  cat "$OUT/bench-cuda-fused-compile.md"; } >> "$OUT/summary.md"
FXDEBUG_KERNEL=torch python tools/bench.py --suite debug --device cuda --no-backward "${ARGS[@]}" \
    --out "$OUT/bench-cuda-torch-path.md" > "$OUT/bench-cuda-torch-path.log" 2>&1
{ echo; echo "## The same, FXDEBUG_KERNEL=torch (pure-torch path)"; echo; cat "$OUT/bench-cuda-torch-path.md"; } >> "$OUT/summary.md"
echo "gpu_check: wrote $OUT/summary.md"
