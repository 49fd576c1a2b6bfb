#!/usr/bin/env bash
# .venv-trl: TRL's own venv for benchmarks/peers/run_trl.py (the GRPOTrainer peer of
# benchmarks/hf/hf_learning.py), so TRL's pins (transformers, accelerate, datasets) never touch .venv.
# Usage: bash tools/trl_venv.sh   (idempotent: a complete venv is left as it is; offline: pip's config
# reads the local wheels and the local PyPI mirror, as tools/setup_env.sh does)
set -euo pipefail
cd "$(dirname "$0")/.."
V=${TRL_VENV:-.venv-trl}
STAMP=$V/.complete
[ -f "$STAMP" ] && exit 0
PY=${PYTHON:-python3}
[ -x $V/bin/python ] || "$PY" -m venv $V
# torch first and pinned: pip's config finds the local CPU wheel of 2.13.0 (TRL would otherwise pull a CUDA one)
$V/bin/pip install -q torch==2.13.0
# tokenizers + matplotlib-free: the peer only trains and writes JSON; hpcrl.ppo.demo_task is imported by
# path (pure python + transformers + tokenizers), not installed
$V/bin/pip install -q "trl==1.16.0" "torch==2.13.0"
$V/bin/python -c 'import trl, transformers, torch; from trl import GRPOConfig, GRPOTrainer; print("trl venv: trl", trl.__version__, "| transformers", transformers.__version__, "| torch", torch.__version__)'
touch "$STAMP"
