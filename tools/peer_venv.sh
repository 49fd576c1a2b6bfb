#!/usr/bin/env bash
# .venv-peers: the peers' own venv for benchmarks/sac/vs_cleanrl.py (CleanRL's SAC needs gymnasium 0.29's
# vector-env API and numpy<2, which the main venv's gymnasium 1.x cannot give).
# CleanRL's script itself is not installed: benchmarks/peers/cleanrl_source.py gets it at run time.
# Usage: bash tools/peer_venv.sh   (idempotent: a complete venv is left as it is)
set -euo pipefail
cd "$(dirname "$0")/.."
V=${PEER_VENV:-.venv-peers}
STAMP=$V/.complete
[ -f "$STAMP" ] && exit 0
PY=${PYTHON:-python3}
[ -x $V/bin/python ] || "$PY" -m venv $V
# torch first and pinned: pip's config finds the local CPU wheel of 2.13.0
$V/bin/pip install -q torch==2.13.0
# gymnasium[mujoco] brings imageio (its MuJoCo envs import it); mujoco<3.2: gymnasium 0.29.1's viewer reads
# MjData.solver_iter, which mujoco 3.2 renamed
$V/bin/pip install -q "numpy<2" "gymnasium[mujoco]==0.29.1" "mujoco<3.2" tyro tensorboard "torch==2.13.0"
$V/bin/python -c 'import gymnasium as gym; gym.make("HalfCheetah-v4").reset(seed=0); gym.make("Hopper-v4").reset(seed=0); print("peer venv: gymnasium", gym.__version__)'
touch "$STAMP"
