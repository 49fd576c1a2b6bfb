"""benchmarks/hf/hf_learning.py: learning curves of hpcrl's PPO / GRPO (and TRL's GRPOTrainer) on the demo task.

The fast tier checks the summary's arithmetic on a hand-made case and the one-line refusal; the
extended tier runs ``--quick`` for real (demo build + 2-rank hpcrl runs + TRL when .venv-trl exists,
~2-3 min on this 2-core VM) and merges them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks" / "hf"))
try:
    import hf_learning as H
finally:
    sys.path.remove(str(REPO / "benchmarks" / "hf"))


def _run(system: str, seed: int, rewards: list[float], dt: float) -> dict:
    return {"system": system, "seed": seed, "tokens_per_s": 100.0, "train_s": dt * len(rewards),
            "process_wall_s": dt * len(rewards) + 5,
            "curve": [{"update": i + 1, "time_s": dt * (i + 1), "reward": r, "tokens": 4} for i, r in enumerate(rewards)],
            "eval": [{"update": 0, "eval_pass_rate": 0.0, "eval_reward": 0.1},
                     {"update": len(rewards), "eval_pass_rate": 0.5, "eval_reward": 0.7}]}


def test_summary_times_each_system_to_trls_final_reward():
    assert H.moving([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    trl = _run("trl-grpo", 0, [0.1] * 10 + [0.5] * 10, dt=1.0)  # final (last 10) = 0.5
    fast = _run("hpcrl-grpo", 0, [0.1, 0.3, 0.9, 0.9, 0.9], dt=2.0)  # 2-mean reaches 0.5 at update 3 (0.6)
    never = _run("hpcrl-ppo", 0, [0.1] * 5, dt=1.0)
    s = H.summarise([trl, fast, never], k=2)
    assert s["target"]["reward_by_seed"] == {"0": pytest.approx(0.5)}
    assert s["hpcrl-grpo"]["time_to_target_s"] == [pytest.approx(6.0)]
    assert s["hpcrl-ppo"]["time_to_target_s"] == [None] and s["hpcrl-ppo"]["reached_target"] == 0
    assert s["trl-grpo"]["time_to_target_s"] == [pytest.approx(12.0)]  # its 2-mean first hits 0.5 at update 12
    [pair] = s["pairs"]["pairs"]  # the same seed and tag: TRL took 12 s, hpcrl GRPO 6 s
    assert pair["trl_over_hpcrl"] == pytest.approx(2.0) and s["pairs"]["median_trl_over_hpcrl"] == pytest.approx(2.0)
    assert s["hpcrl-grpo"]["reward_last"] == pytest.approx(0.9) and s["hpcrl-grpo"]["eval_pass_last"] == 0.5


def test_neither_system_nor_merge_is_one_line_and_exit_2():
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "hf" / "hf_learning.py")], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "--system" in proc.stderr and "--merge" in proc.stderr


@pytest.mark.extended
def test_quick_runs_and_merge_write_curves_and_a_png(tmp_path):
    pytest.importorskip("transformers")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "SBATCH_", "SRUN_")) and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    bench = [sys.executable, str(REPO / "benchmarks" / "hf" / "hf_learning.py"), "--out", str(tmp_path)]
    systems = ["hpcrl-grpo", "hpcrl-ppo"] + (["trl-grpo"] if (REPO / ".venv-trl" / "bin" / "python").exists() else [])
    for system in systems:
        proc = subprocess.run([*bench, "--system", system, "--quick"], capture_output=True, text=True, timeout=400,
                              env=env, cwd=REPO)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        run = json.loads((tmp_path / f"{system}-seed0.json").read_text())
        assert [c["update"] for c in run["curve"]] == list(range(1, H.QUICK["steps"] + 1)), system
        # the same budget: 16 prompts x 4 samples per update, at most 4 new tokens each
        assert run["budget"]["samples_per_update"] == 64 and all(0 < c["tokens"] <= 64 * 4 for c in run["curve"])
        assert all(0 <= c["reward"] <= 1 for c in run["curve"])
        assert [e["update"] for e in run["eval"]] == [0, 6, 12], (system, run["eval"])
        assert run["tokens_per_s"] > 0 and run["process_wall_s"] > run["train_s"] > 0
    base = json.loads(next(tmp_path.glob("demo-seed0-*/baseline.json")).read_text())
    grpo = json.loads((tmp_path / "hpcrl-grpo-seed0.json").read_text())
    assert grpo["eval"][0]["eval_pass_rate"] == base["eval_pass_rate"]
    if "trl-grpo" in systems:  # TRL scores the untrained model itself: the same greedy answers, the same score
        trl = json.loads((tmp_path / "trl-grpo-seed0.json").read_text())
        assert trl["eval"][0]["eval_reward"] == pytest.approx(base["eval_reward"])
    out = tmp_path / "merged.json"
    proc = subprocess.run([*bench, "--merge", "--json", str(out)], capture_output=True, text=True, timeout=120,
                          env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    d = json.loads(out.read_text())
    assert d["quick"] is True and sorted(d["summary"]) == sorted(systems + ["target", "pairs"])
    assert out.with_suffix(".png").stat().st_size > 10_000
