#!/usr/bin/env bash
# .venv-peers: the peers' own venv for benchmarks/sac/vs_cleanrl.py (CleanRL's SAC and LeanRL's compiled fork
# need gymnasium 0.29's vector-env API and numpy<2, which the main venv's gymnasium 1.x cannot give; LeanRL
# also tensordict, torchrl, tqdm and wandb, which it imports and runs disabled).
# The peers' scripts themselves are not installed: benchmarks/peers/sources.py gets them at run time.
# Usage: bash tools/peer_venv.sh   (idempotent: a complete venv is left as it is)
set -euo pipefail
cd "$(dirname "$0")/.."
V=${PEER_VENV:-.venv-peers}
STAMP=$V/.complete
WANT="2 (LeanRL's packages)"  # bump when the packages below change: an older venv is completed
[ "$(cat "$STAMP" 2>/dev/null)" = "$WANT" ] && exit 0
PY=${PYTHON:-python3}
[ -x $V/bin/python ] || "$PY" -m venv $V
# torch first and pinned: pip's config finds the local CPU wheel of 2.13.0
$V/bin/pip install -q torch==2.13.0
# gymnasium[mujoco] brings imageio (its MuJoCo envs import it); mujoco<3.2: gymnasium 0.29.1's viewer reads
# MjData.solver_iter, which mujoco 3.2 renamed
# tensordict 0.8 / torchrl 0.8: LeanRL's policy module returns three tensors for its one out_key, which tensordict
# allows with a warning up to 0.8 and refuses from 0.9 on
$V/bin/pip install -q "numpy<2" "gymnasium[mujoco]==0.29.1" "mujoco<3.2" tyro tensorboard "torch==2.13.0" \
  tensordict==0.8.3 torchrl==0.8.1 tqdm wandb
$V/bin/python -c 'import gymnasium as gym; gym.make("HalfCheetah-v4").reset(seed=0); gym.make("Hopper-v4").reset(seed=0); import tensordict, torchrl; print("peer venv: gymnasium", gym.__version__, "tensordict", tensordict.__version__)'
echo "$WANT" > "$STAMP"
