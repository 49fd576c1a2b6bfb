"""Nothing a user types loses a run: a second fresh start in a run dir that holds a previous run is
refused (exit 2, one line, every file byte-identical after); --overwrite replaces it completely;
--resume continues it; a failed start leaves no directory behind. FastSAC and detached PPO."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpcrl import rundir_reuse
from hpcrl.rundir import RunDirError

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_sac_train import TINY, metrics, run_cli  # noqa: E402

BASE = TINY + ["--checkpoint-every", "10", "--eval-episodes", "1", "--eval-every", "10"]
SHORT = BASE + ["--total-env-steps", "80"]
PPO = ["--workload", "cartpole", "--makers", "1", "--trainers", "1", "--total-steps", "2", "--env.num-envs", "4",
       "--env.rollout-len", "8", "--trainer-device", "cpu", "--maker-device", "cpu"]


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def run_ppo(args: list[str], timeout: int = 180) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    return subprocess.run([sys.executable, "-m", "hpcrl.ppo", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def assert_refused(proc: subprocess.CompletedProcess, run: Path) -> None:
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert f"run dir {run} holds a previous run" in lines[0]
    assert "--resume" in lines[0] and "--overwrite" in lines[0] and "another --run-dir" in lines[0]


# -- the rules, in one process ----------------------------------------------------------------------
def test_what_counts_as_a_previous_run(tmp_path):
    assert rundir_reuse.previous_run(tmp_path / "absent") is None
    assert rundir_reuse.previous_run(tmp_path) is None  # empty
    (tmp_path / ".lock").write_text("")
    (tmp_path / "config.json").write_text("{}")  # a start that failed before its first row
    (tmp_path / "metrics.jsonl").write_text("\n")
    (tmp_path / "notes.txt").write_text("mine")
    assert rundir_reuse.previous_run(tmp_path) is None
    rundir_reuse.check_fresh_start(tmp_path, resume=False, overwrite=False)
    (tmp_path / "metrics.jsonl").write_text('{"env_steps": 8}\n')
    (tmp_path / "checkpoints" / "step_000000000001").mkdir(parents=True)
    (tmp_path / "best").mkdir()
    assert rundir_reuse.previous_run(tmp_path) == "1 checkpoint(s), 1 metrics row(s), best/"
    with pytest.raises(RunDirError, match="holds a previous run .* pass --resume to continue it, --overwrite"):
        rundir_reuse.check_fresh_start(tmp_path, resume=False, overwrite=False)
    rundir_reuse.check_fresh_start(tmp_path, resume=True, overwrite=False)
    assert rundir_reuse.remove_run(tmp_path) == ["config.json", "metrics.jsonl", "checkpoints", "best"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "notes.txt"]  # only hpcrl's files go


def test_an_unfinished_overwrite_still_counts_and_is_finished_by_the_next(tmp_path):
    (tmp_path / ".overwritten-123" / "checkpoints").mkdir(parents=True)
    assert rundir_reuse.previous_run(tmp_path) == "an unfinished --overwrite"
    assert rundir_reuse.remove_run(tmp_path) == []
    assert list(tmp_path.iterdir()) == []


def test_resume_with_nothing_to_resume_is_refused_before_any_rank(tmp_path):
    with pytest.raises(RunDirError, match="--resume: no checkpoint in"):
        rundir_reuse.check_resumable(tmp_path / "new", True, "error")
    rundir_reuse.check_resumable(tmp_path / "new", True, "fresh")
    assert not (tmp_path / "new").exists()


# -- FastSAC -----------------------------------------------------------------------------------------
@pytest.mark.timeout(300)
def test_sac_second_start_refused_overwrite_replaces_resume_continues(tmp_path):
    run = tmp_path / "run"
    first = run_cli(SHORT + ["--run-dir", str(run)])
    assert first.returncode == 0, first.stderr
    before = snapshot(run)
    assert {"config.json", "metrics.jsonl", "best/policy.pt", "final/policy.pt"} <= set(before)

    again = run_cli(SHORT + ["--run-dir", str(run)], timeout=60)
    assert_refused(again, run)
    assert snapshot(run) == before  # byte-identical

    (run / "best" / "stale.txt").write_text("a file only the old run had")  # must not survive
    over = run_cli(SHORT + ["--run-dir", str(run), "--overwrite", "--seed", "3"])
    assert over.returncode == 0, over.stderr
    assert f"--overwrite: removed the previous run in {run}" in over.stderr
    after = snapshot(run)
    assert "best/stale.txt" not in after
    assert json.loads(after["config.json"])["seed"] == 3
    assert len(metrics(run)) == len([line for line in before["metrics.jsonl"].splitlines() if line.strip()])

    longer = run_cli(BASE + ["--total-env-steps", "120", "--run-dir", str(run), "--resume", "--seed", "3"])
    assert longer.returncode == 0, longer.stderr
    assert [r["env_steps"] for r in metrics(run)][-1] == 120


def test_sac_seed_sweep_refuses_before_the_first_seed_runs(tmp_path):
    (tmp_path / "seed_1" / "checkpoints" / "step_000000000010").mkdir(parents=True)
    proc = run_cli(SHORT + ["--run-dir", str(tmp_path), "--seeds", "0,1"], timeout=60)
    assert_refused(proc, tmp_path / "seed_1")
    assert not (tmp_path / "seed_0").exists()


@pytest.mark.parametrize("extra", [["--env", "pendulm"], ["--resume"]])
def test_a_failed_start_leaves_no_run_dir(tmp_path, extra):
    run = tmp_path / "runs" / "new"
    proc = run_cli(SHORT + ["--run-dir", str(run), *extra], timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not run.exists() and not run.parent.exists()


# -- detached PPO ------------------------------------------------------------------------------------
@pytest.mark.timeout(400)
def test_ppo_second_start_refused_and_overwrite_replaces(tmp_path):
    run = tmp_path / "ppo"
    first = run_ppo(PPO + ["--run-dir", str(run)])
    assert first.returncode == 0, first.stderr
    before = snapshot(run)
    again = run_ppo(PPO + ["--run-dir", str(run)], timeout=60)
    assert_refused(again, run)
    assert snapshot(run) == before
    over = run_ppo(PPO + ["--run-dir", str(run), "--overwrite"])
    assert over.returncode == 0, over.stderr
    assert f"--overwrite: removed the previous run in {run}" in over.stderr
    rows = (run / "metrics.jsonl").read_bytes()
    assert rows != before["metrics.jsonl"] and rows.count(b"\n") == before["metrics.jsonl"].count(b"\n")


def test_the_launcher_refuses_a_named_run_dir_holding_a_run_unless_overwrite(tmp_path):
    from hpcrl.launch import LaunchError, submit

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"env_steps": 8}\n')
    common = dict(run_dir=str(run), folder=str(tmp_path / "logs" / "%j"), local=True, dry_run=True)
    with pytest.raises(LaunchError, match=f"run dir {run} holds a previous run"):
        submit("sac", [], **common)
    with pytest.raises(LaunchError, match="trainer argument --overwrite is set by the launcher"):
        submit("sac", ["--overwrite"], **common)
    assert submit("sac", [], overwrite=True, **common).request.overwrite
    assert submit("sac", [], run_dir=str(tmp_path / "run-%j"), folder=common["folder"], local=True, dry_run=True)
