"""Elastic FastSAC on the local Slurm cluster: a job stopped by USR2 is resized while it waits in the queue
(`scontrol update NumNodes=... NumTasks=...`) and resumes at the new rank count, the trainer resharding its
checkpoint (docs/elastic.md). Through slurm/fastsac.sbatch (REQUEUE_HOLD=1: 2 nodes -> 1 -> 2) and through
the submitit launcher (its plain requeue, held by hand: 2 nodes -> 1, the job's results then one rank's;
then a resubmit with --nodes 2 --resume training further: 1 -> 2).

Both are extended (minutes: each start imports torch and rendezvouses under a shared host's load); the fast
tier checks the batch scripts' task count and hold logic without a cluster (tests/test_slurm.py).
"""

from __future__ import annotations

import itertools
import json
import re
import subprocess
from pathlib import Path

import pytest

from hpcrl.launch import submit
from test_slurm import REPO, TINY, cluster, job_env, job_fields, metrics, needs_slurm, wait_for  # noqa: F401

TOTAL = 960  # env steps: 4 envs, a metrics row every 20, so 48 rows


def trainer_args(total: int = TOTAL) -> list[str]:
    return [*TINY, "--total-env-steps", str(total), "--checkpoint-every", "20", "--keep-checkpoints", "100"]


def rows_after(run_dir: Path, n: int) -> bool:
    path = run_dir / "metrics.jsonl"
    return path.exists() and len(path.read_text().splitlines()) > n


def n_rows(run_dir: Path) -> int:
    return len((run_dir / "metrics.jsonl").read_text().splitlines())


def pending(job_id: str, held: bool = False) -> bool:
    f = job_fields(job_id)
    return f["JobState"] == "PENDING" and (not held or "held" in f["Reason"].lower())


def resize(job_id: str, nodes: int) -> None:
    """What a user types for a stopped, held job (one task per node here), then lets it start."""
    subprocess.run(["scontrol", "update", f"jobid={job_id}", f"NumNodes={nodes}-{nodes}", f"NumTasks={nodes}"],
                   check=True)
    subprocess.run(["scontrol", "release", job_id], check=True)


def checkpoint_worlds(run_dir: Path) -> list[int]:
    """The world size of every kept checkpoint, in step order."""
    manifests = sorted((run_dir / "checkpoints").glob("step_*/manifest.json"))
    return [json.loads(m.read_text())["world_size"] for m in manifests]


def assert_continuous(run_dir: Path, total: int = TOTAL) -> None:
    # every row once: a resume drops rows written after its checkpoint
    assert [r["env_steps"] for r in metrics(run_dir)] == list(range(20, total + 1, 20))


@needs_slurm
@pytest.mark.extended
@pytest.mark.timeout(900)
def test_sbatch_job_resized_on_requeue_reshards_2_to_1_to_2_nodes(cluster, tmp_path):
    run_dir = tmp_path / "run"
    cmd = ["sbatch", "--parsable", "--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=0", "--time=15",
           f"--output={tmp_path}/%j.out", f"--export=ALL,RUN_DIR={run_dir},REQUEUE_HOLD=1",
           str(REPO / "slurm" / "fastsac.sbatch"), *trainer_args()]
    job_id = subprocess.run(cmd, capture_output=True, text=True, env=job_env(), check=True).stdout.strip()
    log = tmp_path / f"{job_id}.out"
    seen = 0
    for nodes, resharded in ((1, "resharded 2 → 1 ranks: 4 envs per rank, batch 32 per rank"),
                             (2, "resharded 1 → 2 ranks: 2 envs per rank, batch 16 per rank")):
        wait_for(lambda: rows_after(run_dir, seen), 300, f"a metrics row past row {seen}", poll_s=0.2)
        subprocess.run(["scancel", "--signal=USR2", job_id], check=True)
        wait_for(lambda: pending(job_id, held=True), 120, "the stopped job to be requeued held", poll_s=0.2)
        seen = n_rows(run_dir)
        resize(job_id, nodes)
        wait_for(lambda: resharded in log.read_text(), 300, f"'{resharded}' in {log}", poll_s=0.5)
    fields = wait_for(lambda: (f := job_fields(job_id))["JobState"] not in ("PENDING", "RUNNING", "COMPLETING")
                      and f, 300, "the job to finish", poll_s=0.5)
    text = log.read_text()
    assert (fields["JobState"], fields["Restarts"]) == ("COMPLETED", "2"), text
    assert re.findall(r"^fastsac.sbatch: job .*?: (\d+ rank\(s\) on \d+ node\(s\))", text, re.M) == [
        "2 rank(s) on 2 node(s)", "1 rank(s) on 1 node(s)", "2 rank(s) on 2 node(s)"]
    assert text.count("requeueing job") == 2
    assert_continuous(run_dir)
    assert [w for w, _ in itertools.groupby(checkpoint_worlds(run_dir))] == [2, 1, 2]
    assert json.loads((run_dir / "config.json").read_text())["world_size"] == 2


@needs_slurm
@pytest.mark.extended
@pytest.mark.timeout(900)
def test_submitit_job_resized_on_requeue_then_resubmitted_on_more_nodes(cluster, tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    sub = submit("sac", trainer_args(), nodes=2, time_min=15, run_dir=str(tmp_path / "run-%j"),
                 folder=str(tmp_path / "logs" / "%j"))
    run_dir = Path(sub.run_dir)
    wait_for(lambda: rows_after(run_dir, 0), 300, "the first metrics row", poll_s=0.2)
    subprocess.run(["scancel", "--signal=USR2", sub.job_id], check=True)
    # submitit requeues plainly: the job waits the credential lifetime (10 s here) before it may start,
    # time for the user's hold
    wait_for(lambda: pending(sub.job_id), 120, "the job to be requeued", poll_s=0.1)
    subprocess.run(["scontrol", "hold", sub.job_id], check=True)
    resize(sub.job_id, 1)
    (result,) = sub.results()  # one rank finished the run, not the two submitted
    assert (result.rank, result.world_size, result.final_metrics["env_steps"]) == (0, 1, TOTAL)
    assert job_fields(sub.job_id)["Restarts"] == "1"
    log = sub.job.paths.stdout.read_text()
    assert "Requeued job" in log and "resharded 2 → 1 ranks: 4 envs per rank, batch 32 per rank" in log
    assert_continuous(run_dir)
    assert [w for w, _ in itertools.groupby(checkpoint_worlds(run_dir))] == [2, 1]

    # a resubmit on other nodes: --nodes 2 --resume --run-dir <the run>, training further
    again = submit("sac", trainer_args(TOTAL + 240), nodes=2, time_min=15, resume=True, run_dir=str(run_dir),
                   folder=str(tmp_path / "logs" / "%j"))
    results = again.results()
    assert [(r.rank, r.world_size) for r in results] == [(0, 2), (1, 2)]
    assert results[0].final_metrics["env_steps"] == TOTAL + 240
    assert "resharded 1 → 2 ranks: 2 envs per rank, batch 16 per rank" in again.job.paths.stdout.read_text()
    assert_continuous(run_dir, TOTAL + 240)
    assert [w for w, _ in itertools.groupby(checkpoint_worlds(run_dir))] == [2, 1, 2]
