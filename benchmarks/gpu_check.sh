#!/usr/bin/env bash
# The one prepared GPU check (for the `device` tool or any CUDA machine), < 8 minutes:
#   1. build hpcrl._C with its CUDA kernels against the machine's own torch (no package registry there:
#      --no-build-isolation --no-deps; numpy/h5py/pytest/tyro come from the image),
#   2. run the `cuda`-marked tests (CPU/GPU parity of every kernel) and the CPU kernel tests,
#   3. run the kernel benchmark on the GPU,
#   4. run the suite's GPU part (python -m benchmarks --device cuda): JSON + report.md in $OUT/suite.
# Results land in $OUT (the device tool's output folder) or benchmarks/results/.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export HPCRL_CUDA=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu_info.txt" || true
start=$(date +%s)
echo "== build (CUDA)"
"$PY" -m pip install --no-build-isolation --no-deps -e . > "$OUT/gpu_build.log" 2>&1 || { tail -40 "$OUT/gpu_build.log"; exit 1; }
"$PY" -c "import torch, hpcrl.ops as o; assert o.with_cuda(), 'built without CUDA'; print('torch', torch.__version__, '| hpcrl._C CUDA:', o.with_cuda(), '| GPU:', torch.cuda.get_device_name())"
echo "== build took $(( $(date +%s) - start )) s; tests"
"$PY" -m pytest -q -p no:cacheprovider tests/test_ops.py tests/test_replay.py tests/test_envs.py -m cuda 2>&1 | tee "$OUT/gpu_tests.txt"
echo "== benchmarks"
"$PY" benchmarks/kernels.py --device cuda --json "$OUT/kernels_cuda.json" 2>&1 | tee "$OUT/kernels_cuda.txt"
echo "== benchmark suite (GPU part: per-update compute at batch 8192 on the GPU, gloo collective sweep, cost model, report)"
# --quick keeps it short; kernels were run above, so only collectives + cost model here.
timeout 240 "$PY" -m benchmarks --quick --device cuda --only collectives,cost_model --run-dir "$OUT/suite" 2>&1 | tee "$OUT/suite.txt" || echo "suite step failed (see $OUT/suite.txt)"
echo "== gpu_check done in $(( $(date +%s) - start )) s"
