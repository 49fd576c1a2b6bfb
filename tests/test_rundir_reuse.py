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

from hpcrl.run import rundir_reuse
from hpcrl.run.rundir import RunDirError

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


# -- --resume --resume-missing fresh never starts fresh over a previous run (but a requeued job does) ---
def _torn_run(run: Path) -> None:
    """A run stopped before its first checkpoint committed: rows, best/, an uncommitted checkpoint."""
    (run / "checkpoints" / ".tmp-step_000000000010").mkdir(parents=True)
    (run / "best").mkdir()
    (run / "best" / "policy.pt").write_text("the old run's best policy")
    (run / "metrics.jsonl").write_text('{"env_steps": 999}\n{"env_steps": 1000}\n')


def test_resume_missing_fresh_refuses_a_previous_run_with_nothing_to_resume(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    rundir_reuse.check_start(tmp_path / "new", True, "fresh", False)  # nothing there: starts fresh
    (tmp_path / "config.json").write_text("{}")
    rundir_reuse.check_start(tmp_path, True, "fresh", False)  # a start that failed before its first row
    _torn_run(tmp_path)
    with pytest.raises(RunDirError, match=r"--resume --resume-missing fresh: no checkpoint in .*\(only an uncommitted "
                                          r"one.*holds a previous run \(2 metrics row\(s\), best/\).*--overwrite to "
                                          r"replace it, or another --run-dir"):
        rundir_reuse.check_start(tmp_path, True, "fresh", False)
    rundir_reuse.check_start(tmp_path, False, "error", True)  # --overwrite replaces it
    for restart in ("0", "", "x"):
        monkeypatch.setenv("SLURM_RESTART_COUNT", restart)
        assert not rundir_reuse.requeued()
        with pytest.raises(RunDirError):
            rundir_reuse.check_start(tmp_path, True, "fresh", False)
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")  # a requeued job: its first start wrote these rows
    assert rundir_reuse.requeued()
    rundir_reuse.check_start(tmp_path, True, "fresh", False)
    monkeypatch.delenv("SLURM_RESTART_COUNT")
    (tmp_path / "checkpoints" / "step_000000000010").mkdir()  # committed: --resume continues it
    rundir_reuse.check_start(tmp_path, True, "fresh", False)


@pytest.mark.parametrize("module", ["hpcrl.sac", "hpcrl.ppo"])
def test_resume_missing_fresh_cli_leaves_a_previous_run_byte_identical(tmp_path, module):
    run = tmp_path / "run"
    _torn_run(run)
    before = snapshot(run)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    proc = subprocess.run([sys.executable, "-m", module, "--run-dir", str(run), "--resume", "--resume-missing", "fresh"],
                          capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and f"run dir {run} holds a previous run" in lines[0] and "--overwrite" in lines[0], lines
    assert snapshot(run) == before


def test_a_requeued_job_restarts_over_its_own_rows_when_nothing_committed(tmp_path):
    # what the batch scripts and the launcher pass to a job Slurm requeued before its first checkpoint
    run = tmp_path / "run"
    _torn_run(run)
    proc = run_cli(TINY + ["--total-env-steps", "40", "--checkpoint-every", "10", "--run-dir", str(run), "--resume",
                           "--resume-missing", "fresh"], timeout=60, env={"SLURM_RESTART_COUNT": "1"})
    assert proc.returncode == 0, proc.stderr
    assert "starting fresh (--resume-missing fresh)" in proc.stdout
    assert [r["env_steps"] for r in metrics(run)] == [20, 40]  # the first attempt's rows are gone, not mixed in
    assert not (run / "best" / "policy.pt").exists()


# -- the refusal comes before torch is imported ------------------------------------------------------
@pytest.mark.parametrize("module", ["hpcrl.sac", "hpcrl.ppo"])
def test_the_run_dir_refusal_imports_no_torch(tmp_path, module):
    import re
    import time

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"env_steps": 8}\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", module, "--run-dir", str(run)],
                          capture_output=True, text=True, timeout=60, env=env)
    took = time.monotonic() - t0
    imports = [line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")]
    said = [line for line in proc.stderr.splitlines() if not line.startswith("import time:")]
    assert proc.returncode == 2 and len(said) == 1 and f"run dir {run} holds a previous run" in said[0], said
    assert "hpcrl.run.rundir_reuse" in imports  # the import log is read as intended
    heavy = [m for m in imports if re.match(r"(torch|numpy|jax|transformers|gymnasium|mujoco)(\.|$)", m)]
    assert not heavy, heavy
    print(f"{module}: refused in {took:.2f} s")
    assert took < 10, took  # ~0.2 s here; torch alone took 20-30 s to import on a loaded node


def test_the_ppo_early_check_reads_the_flags_as_the_parser_does(tmp_path):
    from hpcrl.ppo.__main__ import DEFAULT_RUN_DIR, check_run_dir_early
    from hpcrl.ppo.config import DetachedConfig

    assert DEFAULT_RUN_DIR == DetachedConfig.__dataclass_fields__["run_dir"].default
    run = tmp_path / "run"
    _torn_run(run)
    for argv in (["--run-dir", str(run)], [f"--run-dir={run}"], ["--run-dir", str(run), "--overwrite", "--no-overwrite"],
                 ["--run-dir", str(run), "--resume", "--resume-missing", "fresh"]):
        with pytest.raises(RunDirError):
            check_run_dir_early(argv)
    for argv in (["--run-dir", str(run), "--overwrite"], ["--run-dir", str(run), "--help"],
                 ["--run-dir", str(run), "--resume", "--overwrite"],  # the parser's own one-line refusal
                 ["--run-dir"], ["--run-dir", str(tmp_path / "new")]):
        check_run_dir_early(argv)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    (tmp_path / "runs").mkdir()
    run.rename(tmp_path / DEFAULT_RUN_DIR)  # the default run dir, relative to the working dir
    proc = subprocess.run([sys.executable, "-m", "hpcrl.ppo"], capture_output=True, text=True, timeout=60, env=env,
                          cwd=tmp_path)
    assert proc.returncode == 2 and "run dir runs/ppo holds a previous run" in proc.stderr, proc.stderr


def test_the_lazy_packages_keep_their_names():
    code = ("import types, hpcrl.sac.loop, hpcrl.sac as s, hpcrl.ppo as p\n"
            "from hpcrl.sac import FastSAC, SACConfig, train, plan, preset, PRESETS, ConfigError, UpdateNoise\n"
            "from hpcrl.ppo import DetachedConfig, PPOConfig, Topology\n"
            "from hpcrl.ppo import train as ppo_train\n"
            "import hpcrl.sac.run as r\n"
            "assert isinstance(train, types.FunctionType) and s.train is train and r.train is train, (train, s.train)\n"
            "assert train.__module__ == 'hpcrl.sac.run'\n"
            "assert ppo_train.__module__ == 'hpcrl.ppo.run' and FastSAC.__module__ == 'hpcrl.sac.agent'\n"
            "from hpcrl.sac import events, reshard\n"
            "assert isinstance(events, types.ModuleType)\n"
            "for pkg in (s, p):\n"
            "    try:\n"
            "        pkg.nope\n"
            "    except AttributeError:\n"
            "        pass\n"
            "    else:\n"
            "        raise AssertionError(pkg)\n"
            "print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
