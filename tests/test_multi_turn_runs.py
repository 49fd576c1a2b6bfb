"""Multi-turn episodes in real runs (``python -m hpcrl.ppo --workload hf --hf.env ...``): rows report the
episodes, held-out records are evaluated as whole episodes, and ``--resume`` continues with the episodes of
the first batch the trainers had not trained on, as an uninterrupted run plays them. The frozen-maker case
is in tests/test_ppo_frozen_hf.py; a bad factory refused before ranks start, here."""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("transformers")

import hf_fixtures as F  # noqa: E402
from hpcrl.ppo.workloads.hf_prompts import epoch_order  # noqa: E402

LOG = "HPCRL_TEST_EPISODE_LOG"


@pytest.fixture(scope="module")
def art(tmp_path_factory):
    d = tmp_path_factory.mktemp("multi_turn_runs")
    return {"llama": F.build_causal_lm(d / "llama"), "prompts": F.write_prompts(d / "prompts.jsonl", n=24)}


def _args(art, run, *extra: str) -> list[str]:
    return ["--workload", "hf", "--hf.model", str(art["llama"]), "--hf.env", "episode_fixtures:LoggedUntilYes",
            "--hf.max-turns", "3", "--hf.prompts", str(art["prompts"]), "--hf.max-prompt-tokens", "8",
            "--hf.max-new-tokens", "4", "--hf.batch-size", "4", "--makers", "1", "--trainers", "1",
            "--ppo.lr", "1e-3", "--run-dir", str(run), *extra]


@pytest.mark.slow
def test_run_reports_episodes_and_evaluates_them(art, tmp_path):
    run = tmp_path / "run"
    proc = F.run_ppo(_args(art, run, "--total-steps", "4", "--hf.eval-prompts", str(art["prompts"]),
                           "--hf.eval-every", "2"), tmp_path, 180, env={LOG: str(tmp_path / "log.jsonl")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    updates = [r for r in rows if "turns" in r]
    assert len({r["updates"] for r in updates}) == 4
    for r in updates:
        assert 1 <= r["turns"] <= 3 and 0 < r["observation_token_frac"] < 1 and r["tool_call_rate"] == 0, r
        assert r["episode_error_frac"] == 0 and 0 <= r["truncated_frac"] <= 1 and 0 <= r["score"] <= 1, r
    evals = [r for r in rows if "eval_pass_rate" in r]
    assert [r["updates"] for r in evals] == [2, 4] and all(math.isfinite(r["eval_reward"]) for r in evals)
    steps = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert any(s["what"] == "step" for s in steps)


@pytest.mark.slow
def test_resume_replays_the_episodes_of_the_next_batch(art, tmp_path):
    run, log = tmp_path / "run", tmp_path / "log.jsonl"
    first = F.run_ppo(_args(art, run, "--total-steps", "3"), tmp_path, 180, env={LOG: str(log)})
    assert first.returncode == 0, first.stderr[-2000:]
    second = F.run_ppo(_args(art, run, "--total-steps", "5", "--resume"), tmp_path, 180, env={LOG: str(log)})
    assert second.returncode == 0, second.stderr[-2000:]
    resets = [json.loads(line) for line in log.read_text().splitlines()]
    pids = list(dict.fromkeys(r["pid"] for r in resets))
    # every process that builds the workload probes record 0's episode first (before ranks start, and in each rank)
    by_pid = {p: [r["id"] for r in resets if r["pid"] == p and r["what"] == "reset"][1:] for p in pids}
    makers = [ids for ids in by_pid.values() if len(ids) >= 8]
    assert len(makers) == 2, {p: len(v) for p, v in by_pid.items()}
    order = epoch_order(24, 0, 0)  # batch b of the run (--seed 0) is records order[4b : 4b + 4]
    batch = [[order[i] for i in range(4 * b, 4 * b + 4)] for b in range(6)]
    assert makers[0][:12] == sum(batch[:3], [])  # the first run trained on batches 0-2
    assert makers[1][:8] == sum(batch[3:5], [])  # the resumed run's maker plays batch 3 next, then 4


def test_a_factory_that_does_not_import_exits_2_before_ranks_start(art, tmp_path):
    proc = F.run_ppo(["--workload", "hf", "--hf.model", str(art["llama"]), "--hf.env", "nope_pkg.envs:Env",
                      "--hf.prompts", str(art["prompts"]), "--hf.max-prompt-tokens", "8", "--total-steps", "2", "--run-dir", str(tmp_path / "run")],
                     tmp_path, 120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert "--hf.env nope_pkg.envs:Env: cannot import 'nope_pkg.envs'" in lines[0], lines[0]
    assert not (tmp_path / "run").exists()


@pytest.mark.extended  # an exactness-under-kills run: the extended tier
def test_fsdp_trainers_sigterm_and_resume_over_tool_episodes(tmp_path):
    """2 makers : 2 fsdp trainers on tool episodes: SIGTERM to the job checkpoints and exits 75, --resume
    finishes the run, and every update is logged once, in order."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from hpcrl.ppo import demo_tools

    built = demo_tools.build(tmp_path / "demo", pretrain_steps=50)
    run = tmp_path / "run"
    args = ["--workload", "hf", "--hf.model", str(built.model), "--hf.prompts", str(built.train),
            "--hf.tools", "add=hpcrl.ppo.demo_tools:add", "--hf.reward-fn", "hpcrl.ppo.demo_tools:reward",
            "--hf.max-turns", "2", "--hf.max-prompt-tokens", "3", "--hf.max-new-tokens", "6",
            "--hf.max-episode-tokens", "12", "--hf.batch-size", "4", "--hf.algo", "grpo", "--hf.group-size", "2",
            "--makers", "2", "--trainers", "2", "--strategy", "fsdp", "--checkpoint-every", "2",
            "--total-steps", "12", "--ppo.lr", "1e-3", "--run-dir", str(run)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "hpcrl.ppo", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 240
        while len(_score_rows(run)) < 3:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 75, err[-3000:]
    stopped_at = max(r["updates"] for r in _score_rows(run))
    assert stopped_at < 12
    again = subprocess.run([sys.executable, "-m", "hpcrl.ppo", *args, "--resume"], env=env, capture_output=True,
                           text=True, cwd=tmp_path, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    updates = [r["updates"] for r in _score_rows(run)]
    assert updates == sorted(set(updates)) and updates[-1] == 12, updates  # each once, in order
    assert all(r["tool_calls"] > 0 for r in _score_rows(run))


def _score_rows(run) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in rows if "score" in r and "samples_produced" not in r]
