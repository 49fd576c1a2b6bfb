#!/usr/bin/env bash
# Fresh machine -> .venv with torch, hpcrl (C++ extension built in place) and every test dependency.
# Usage: bash tools/setup_env.sh   (idempotent; rerunning rebuilds the extension)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
pip install -q --upgrade pip
# torch first and pinned (a local wheel provides 2.13.0 CPU); build tools because we build without
# isolation, so the extension compiles against this exact torch.
# numpy too: torch initialises its numpy bridge while the extension builds (a warning without it)
pip install -q torch==2.13.0 numpy setuptools wheel ninja pybind11
# The build's output is kept: torch failing to load numpy while the extension builds means a broken
# numpy in this venv (the build goes on and prints BuildBackendWarning), so setup stops there.
build_log=$(mktemp); trap 'rm -f "$build_log"' EXIT
pip install -q --no-build-isolation -e ".[dev,tb,gym,mpi,export,video,plot,wandb,playground,hf,docs]" "torch==2.13.0" \
  2>&1 | tee "$build_log"
if grep -q "Failed to initialize NumPy" "$build_log"; then
  echo "setup_env: torch could not load numpy while hpcrl._C built (see above); fix numpy in .venv" \
       "(.venv/bin/pip install --force-reinstall numpy), then rerun bash tools/setup_env.sh" >&2
  exit 1
fi
python -c "import hpcrl.ops as o; assert o.backend() == 'extension', 'hpcrl._C did not build'; print('hpcrl._C:', o.backend(), '| CUDA kernels:', o.with_cuda())"
