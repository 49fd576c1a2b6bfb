"""Chaos under Slurm: the detached-PPO heterogeneous job (slurm/detached_ppo.sbatch, 1
trainer on node2 : 3 makers on node1 of the local cluster) with one maker frozen (SIGSTOP past the
heartbeat timeout, then woken) and another SIGKILLed at random moments. The job must finish with
exit 0, drop exactly the faulty makers, and account for every sample.

The local cluster has 2 CPUs per node, so the 3 makers share node1 with --overcommit, which Slurm
accepts only without --ntasks-per-node: the test submits a copy of the script whose makers line
lacks it (everything else as shipped).

The makers' PIDs are found from /proc (the local cluster's slurmd run on this host): the processes
whose environment carries the job's id and SLURM_PROCID >= 1 (ranks [0, T) are the trainers).
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_slurm_ppo import IN_CI, REPO, cluster, job_env, needs_slurm  # noqa: F401  (cluster: a fixture)

TESTS = Path(__file__).resolve().parent


def _task_pids(job_id: str) -> dict[int, int]:
    """SLURM_PROCID -> pid of this job's hpcrl.ppo processes (on this host)."""
    found: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
            if b"hpcrl.ppo" not in cmd:
                continue
            env = dict(item.split(b"=", 1) for item in (entry / "environ").read_bytes().split(b"\0") if b"=" in item)
        except OSError:
            continue
        if env.get(b"SLURM_JOB_ID") == job_id.encode() and b"SLURM_PROCID" in env:
            found[int(env[b"SLURM_PROCID"])] = int(entry.name)
    return found


def _job_state(job_id: str) -> tuple[str, str]:
    """(JobState, ExitCode) of a job; the job stays visible for MinJobAge (300 s) after it ends."""
    out = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True).stdout
    fields = dict(f.split("=", 1) for f in out.split() if "=" in f)
    return fields.get("JobState", "?"), fields.get("ExitCode", "?")


@needs_slurm
@pytest.mark.slow
@pytest.mark.extended  # chaos at random moments; the fast tier runs the het job plain (test_slurm_ppo.py)
@pytest.mark.timeout(300)
def test_het_job_survives_a_frozen_and_a_killed_maker(cluster, tmp_path):  # noqa: F811
    seed = int(time.time())
    rng = random.Random(seed)
    run_dir = tmp_path / "run"
    ppo = ["--workload", "ppo_toy:ToyWorkload", "--total-steps", "300", "--timeout-s", "30",
           "--heartbeat-timeout-s", "3", "--rollout-s", "0.03"]
    exports = f"ALL,RUN_DIR={run_dir},PYTHONPATH={TESTS},SLURM_OVERCOMMIT=1"  # srun -O for the step too
    shipped = (REPO / "slurm" / "detached_ppo.sbatch").read_text()
    makers_line = "#SBATCH --nodes=1 --gpus-per-node=2 --ntasks-per-node=2"
    assert shipped.count(makers_line) == 1, "the makers component line changed: update this test"
    script = tmp_path / "detached_ppo.sbatch"
    script.write_text(shipped.replace(makers_line, "#SBATCH --nodes=1"))
    submitted = subprocess.run(
        ["sbatch", "--parsable", "--time=10", f"--output={tmp_path}/%j.out", f"--export={exports}",
         "--nodelist=node2", "--gpus-per-node=0", ":", "--nodelist=node1", "--ntasks=3", "--overcommit",
         "--gpus-per-node=0", str(script), *ppo],
        capture_output=True, text=True, env=job_env())
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip().split(";")[0].split("+")[0]
    log = tmp_path / f"{job_id}.out"
    try:
        deadline = time.time() + 150
        rows = run_dir / "metrics.jsonl"
        want = rng.randint(2, 8)
        while time.time() < deadline and not (rows.exists() and len(rows.read_text().splitlines()) >= want):
            assert _job_state(job_id)[0] in ("PENDING", "RUNNING", "CONFIGURING"), log.read_text()
            time.sleep(0.1)
        pids = _task_pids(job_id)
        assert sorted(pids) == [0, 1, 2, 3], f"ranks found: {pids}; {log.read_text() if log.exists() else ''}"
        frozen, killed = pids[1], pids[3]
        os.kill(frozen, signal.SIGSTOP)
        time.sleep(rng.uniform(0.0, 1.0))
        os.kill(killed, signal.SIGKILL)
        time.sleep(3 + 2.0)  # past the heartbeat timeout: the trainer drops both
        os.kill(frozen, signal.SIGCONT)  # wakes up dropped: must leave on its own, cleanly
        while _job_state(job_id)[0] in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING") and time.time() < deadline + 60:
            time.sleep(0.2)
    finally:
        if _job_state(job_id)[0] in ("PENDING", "RUNNING"):
            subprocess.run(["scancel", job_id], check=False)
    text = log.read_text()
    state, code = _job_state(job_id)
    assert (state, code) == ("COMPLETED", "0:0"), f"seed {seed}: {state} {code}\n{text[-4000:]}"
    assert "no job secret" not in text  # the batch script gave every task one
    final = json.loads(rows.read_text().splitlines()[-1])
    assert final["policy_version"] == 300
    assert final["makers_lost"] == 2, text[-3000:]  # the killed one, and the frozen one past its heartbeat timeout
    assert final["samples_produced"] == (final["samples_consumed"] + final["dropped_stale"] + final["dropped_shutdown"]
                                         + final["lost_in_flight"])
