#!/usr/bin/env bash
# Pendulum-v1, time to solve on both clocks (training; from launch): CleanRL's SAC and LeanRL's compiled SAC at
# their defaults, hpcrl eager on 1 rank, with --compile, and on 2 ranks; 3 seeds; one run at a time, the
# configurations interleaved seed by seed; then merged (benchmarks/sac/vs_cleanrl.py).
#   bash benchmarks/sac/pendulum_solve.sh [OUT]      (default OUT: benchmarks/results/vs_cleanrl_pendulum_clocks)
# Needs the peer venv (bash tools/peer_venv.sh) and the peers' sources (benchmarks/peers/sources.py: fetched, or
# HPCRL_CLEANRL_SRC / HPCRL_LEANRL_SRC). The compiled systems run once untimed first: their compile caches
# (inductor's; hpcrl's graph store) are then as warm as on a user's second run.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-benchmarks/results/vs_cleanrl_pendulum_clocks}
PY=${PYTHON:-.venv/bin/python}
COMMON=(--task pendulum --env-steps 12000 --eval-every 500 --eval-episodes 5)
part() {  # label system [flags...]
  local label=$1 system=$2; shift 2
  "$PY" benchmarks/sac/vs_cleanrl.py "${COMMON[@]}" --system "$system" --label "$label" "$@"
}
warm=$(mktemp -d)
part leanrl leanrl --seed 99 --env-steps 1000 --eval-every 1000 --leanrl-flags="--learning-starts 256" --out "$warm"
part hpcrl-compile hpcrl --seed 99 --env-steps 1000 --eval-every 1000 --hpcrl-flags=--compile --out "$warm"
rm -rf "$warm"
for seed in 0 1 2; do
  part cleanrl cleanrl --seed "$seed" --out "$OUT"
  part leanrl leanrl --seed "$seed" --out "$OUT"
  part hpcrl hpcrl --seed "$seed" --out "$OUT"
  part hpcrl-compile hpcrl --seed "$seed" --hpcrl-flags=--compile --out "$OUT"
  part hpcrl-nproc-2 hpcrl --seed "$seed" --hpcrl-flags="--nproc 2" --out "$OUT"
done
"$PY" benchmarks/sac/vs_cleanrl.py --merge --out "$OUT"
