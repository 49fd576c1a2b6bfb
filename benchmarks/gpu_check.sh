#!/usr/bin/env bash
# The one prepared GPU check (for the `device` tool or any CUDA machine), < 8 minutes:
#   1. build hpcrl._C with its CUDA kernels against the machine's own torch (no package registry there:
#      --no-build-isolation --no-deps; numpy/h5py/pytest/tyro come from the image),
#   2. run the `cuda`-marked tests (CPU/GPU parity of every kernel) and the CPU kernel tests,
#   3. run the kernel benchmark on the GPU,
#   4. run the suite's GPU part (python -m benchmarks --device cuda): JSON + report.md in $OUT/suite,
#   5. run every entry point on the GPU, each to finite metrics: FastSAC pendulum (W = 1; with one GPU no
#      NCCL group of two can exist) at the preset's size and at --num-envs 4096; detached PPO 1:1 with GPU
#      trainer + GPU maker (they share the GPU: weights by gloo staged through host memory) and with GPU
#      trainer + CPU maker; FastSAC with --amp fp16 (GradScaler on the GPU) and clipping; FastSAC resharded on
#      resume onto the GPU (2 CPU ranks write the checkpoint, 1 GPU rank resumes it); detached PPO on
#      the hf workload (a tiny Llama built here) with FSDP bf16 trainer + bf16 maker (packed training
#      forwards in token-budget micro-batches, generation in length buckets), a DCP checkpoint of
#      CUDA shards resumed under ddp, and with FSDP CPU
#      offload (where transformers is installed), multi-turn episodes with a tool, and the vLLM engine (where
#      vLLM is installed; one line says when it is not); then play (and
#      ONNX export where onnx/onnxruntime exist) on the trained policy. $OUT/gpu_check.json: exit code,
#      wall time and last metrics row of each.
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
"$PY" benchmarks/ops/op_kernels.py --device cuda --json "$OUT/kernels_cuda.json" 2>&1 | tee "$OUT/kernels_cuda.txt"
echo "== benchmark suite (GPU part: per-update compute at batch 8192 on the GPU, gloo collective sweep, cost model, report)"
# --quick keeps it short; kernels were run above, so only collectives + cost model here.
timeout 150 "$PY" -m benchmarks --quick --device cuda --only collectives,cost_model --run-dir "$OUT/suite" 2>&1 | tee "$OUT/suite.txt" || echo "suite step failed (see $OUT/suite.txt)"

echo "== entry points on the GPU"
runs=()
entry() {  # entry NAME TIMEOUT_S CMD...: run one entry point into $OUT/runs/NAME, record rc and wall time
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s) rc=0
  timeout "$limit" "$@" --run-dir "$OUT/runs/$name" > "$OUT/runs/$name.log" 2>&1 || rc=$?
  echo "$name rc=$rc $(( $(date +%s) - t0 )) s"; tail -2 "$OUT/runs/$name.log"
  runs+=("$name:$rc:$(( $(date +%s) - t0 ))")
}
mkdir -p "$OUT/runs"
entry sac_pendulum 90 "$PY" -m hpcrl.sac --preset pendulum --total-env-steps 6400 --eval-episodes 4
entry sac_4096_envs 90 "$PY" -m hpcrl.sac --preset pendulum --num-envs 4096 --batch-size 8192 --total-env-steps 409600 --learning-starts 10 --log-every 20 --eval-episodes 4
entry sac_compiled 180 "$PY" -m hpcrl.sac --preset pendulum --compile --total-env-steps 3200 --eval-episodes 2
entry ppo_gpu_trainer_gpu_maker 90 "$PY" -m hpcrl.ppo --workload cartpole --makers 1 --trainers 1 --trainer-device cuda --maker-device cuda --total-steps 30
entry ppo_gpu_trainer_cpu_maker 90 "$PY" -m hpcrl.ppo --workload cartpole --makers 1 --trainers 1 --trainer-device cuda --maker-device cpu --total-steps 30
entry sac_amp_fp16_clipped 90 "$PY" -m hpcrl.sac --preset pendulum --amp fp16 --max-grad-norm 1 --total-env-steps 3200 --eval-episodes 2
# Reshard on resume (docs/elastic.md): one GPU has no W' = 2, so 2 CPU ranks (gloo) write the checkpoint and one
# GPU rank resumes it: envs and replay rings re-dealt 2 -> 1, every tensor mapped onto cuda:0. The entry fails
# (rc 98) when the resume did not say it resharded.
timeout 120 "$PY" -m hpcrl.sac --preset pendulum --nproc 2 --device cpu --threads 1 --total-env-steps 1600 \
  --eval-episodes 0 --run-dir "$OUT/runs/sac_reshard_2cpu_to_1gpu" > "$OUT/runs/sac_reshard_2cpu.log" 2>&1 || \
  echo "sac_reshard: the 2-rank CPU part failed (see $OUT/runs/sac_reshard_2cpu.log)"
entry sac_reshard_2cpu_to_1gpu 90 "$PY" -m hpcrl.sac --preset pendulum --device cuda --resume --total-env-steps 3200 --eval-episodes 2
grep -q "resharded 2 → 1 ranks" "$OUT/runs/sac_reshard_2cpu_to_1gpu.log" || runs[${#runs[@]}-1]="sac_reshard_2cpu_to_1gpu:98:0"
if "$PY" -c "import transformers, tokenizers" 2>/dev/null; then  # RLHF on a tiny Llama built here (no network)
  PYTHONPATH=tests "$PY" -c "import hf_fixtures as F, pathlib as p; d = p.Path('$OUT/hf'); F.build_causal_lm(d / 'llama'); F.write_prompts(d / 'prompts.jsonl')" > /dev/null 2>&1
  HF=(--workload hf --hf.model "$OUT/hf/llama" --hf.prompts "$OUT/hf/prompts.jsonl" --hf.reward-fn hf_fixtures:target_fraction --hf.max-prompt-tokens 8 --hf.max-new-tokens 16 --makers 1 --trainers 1 --trainer-device cuda --maker-device cuda --total-steps 10)
  PYTHONPATH=tests entry ppo_hf_fsdp_bf16 120 "$PY" -m hpcrl.ppo "${HF[@]}" --strategy fsdp --trainer-dtype bf16 --hf.maker-dtype bf16 --ppo.pack-sequences True --hf.micro-batch-tokens 64 --hf.generate-buckets 2
  PYTHONPATH=tests entry ppo_hf_fsdp_offload 120 "$PY" -m hpcrl.ppo "${HF[@]}" --strategy fsdp --offload
  # DCP checkpoints from CUDA shards (staged to host, written by the writer thread), then a resume that
  # loads them back onto the GPU under ddp (a strategy change; one GPU has no second trainer): rc 98
  # when the resume did not continue from the checkpoint
  PYTHONPATH=tests timeout 120 "$PY" -m hpcrl.ppo "${HF[@]}" --strategy fsdp --checkpoint-every 2 --total-steps 4 \
    --run-dir "$OUT/runs/ppo_hf_dcp_fsdp_to_ddp" > "$OUT/runs/ppo_hf_dcp_fsdp.log" 2>&1 || \
    echo "ppo_hf_dcp: the fsdp part failed (see $OUT/runs/ppo_hf_dcp_fsdp.log)"
  PYTHONPATH=tests entry ppo_hf_dcp_fsdp_to_ddp 120 "$PY" -m hpcrl.ppo "${HF[@]}" --strategy ddp --resume --total-steps 6
  grep -q "resuming at v4" "$OUT/runs/ppo_hf_dcp_fsdp_to_ddp.log" || runs[${#runs[@]}-1]="ppo_hf_dcp_fsdp_to_ddp:98:0"
  # multi-turn episodes with a tool (calls in the maker's worker processes), GPU maker and trainer
  PYTHONPATH=tests entry ppo_hf_tools 120 "$PY" -m hpcrl.ppo "${HF[@]}" --hf.tools add=episode_fixtures:add --hf.max-turns 3 --hf.max-episode-tokens 48
  # the vLLM engine on the GPU beside the trainer (a memory fraction each), where vLLM is installed
  if "$PY" -c "import vllm" 2>/dev/null; then
    PYTHONPATH=tests "$PY" -c "import test_vllm_engine as V, pathlib as p; V.build_llama(p.Path('$OUT/hf/llama64'))" > /dev/null 2>&1
    PYTHONPATH=tests entry ppo_hf_vllm 240 "$PY" -m hpcrl.ppo "${HF[@]}" --hf.model "$OUT/hf/llama64" --hf.engine vllm --hf.vllm-gpu-memory-utilization 0.3 --hf.algo grpo --hf.group-size 4
  else
    echo "ppo_hf_vllm: skipped, vLLM is not installed in this Python (pip install -e '.[vllm]')"
  fi
fi
echo "== tools on the trained policy (play on the GPU; ONNX export where onnx/onnxruntime are installed)"
tools=()
tool() {  # tool NAME TIMEOUT_S CMD...: an entry point that trains nothing; rc and wall time only
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s) rc=0
  timeout "$limit" "$@" > "$OUT/runs/$name.log" 2>&1 || rc=$?
  echo "$name rc=$rc $(( $(date +%s) - t0 )) s"; tail -2 "$OUT/runs/$name.log"
  tools+=("$name:$rc:$(( $(date +%s) - t0 ))")
}
tool sac_play 60 "$PY" -m hpcrl.sac.play "$OUT/runs/sac_pendulum" --episodes 4 --device cuda
if "$PY" -c "import onnx, onnxruntime" 2>/dev/null; then
  tool sac_export 120 "$PY" -m hpcrl.sac.export "$OUT/runs/sac_pendulum" --out "$OUT/runs/policy.onnx"
fi
"$PY" - "$OUT" "${runs[@]}" -- "${tools[@]}" <<'PYEOF'
import json, math, sys
from pathlib import Path
out, summary, ok = Path(sys.argv[1]), {}, True
split = sys.argv.index("--")
for item in sys.argv[split + 1:]:  # tools: the exit code is the check
    name, rc, wall = item.split(":")
    ok &= rc == "0"
    summary[name] = {"rc": int(rc), "wall_s": int(wall), "rows": 0, "finite_losses": rc == "0", "last_row": {}}
for item in sys.argv[2:split]:
    name, rc, wall = item.split(":")
    path = out / "runs" / name / "metrics.jsonl"
    rows = [json.loads(l) for l in path.read_text().splitlines() if l.strip()] if path.exists() else []
    trained = [r for r in rows if any(k.endswith("loss") for k in r)]  # eval rows carry no losses
    last = trained[-1] if trained else (rows[-1] if rows else {})
    losses = {k: v for k, v in last.items() if k.endswith("loss") and isinstance(v, (int, float))}
    finite = bool(losses) and all(math.isfinite(v) for v in losses.values())
    ok &= rc == "0" and finite
    summary[name] = {"rc": int(rc), "wall_s": int(wall), "rows": len(rows), "finite_losses": finite, "last_row": last}
(out / "gpu_check.json").write_text(json.dumps(summary, indent=2))
print(json.dumps({k: {x: v[x] for x in ("rc", "wall_s", "rows", "finite_losses")} for k, v in summary.items()}, indent=1))
sys.exit(0 if ok else 1)
PYEOF
echo "== gpu_check done in $(( $(date +%s) - start )) s"
