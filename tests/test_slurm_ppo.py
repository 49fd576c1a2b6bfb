"""Detached PPO on the real local Slurm cluster (slurm/local_cluster.sh: node1, node2, fake GPUs).

The heterogeneous job of slurm/detached_ppo.sbatch (trainers component on node2, makers component on
node1, one srun across both), the single-component alternative slurm/detached_ppo_single.sbatch
(rank -> role map over a plain allocation), a submitit job through hpcrl.launch (1 trainer : 1 maker)
the scripts' bad-input checks, and the launcher's
check of the role counts against the task count. The three runs are submitted together by module fixtures, so they
queue and run while the first test waits. Skip rules as in tests/test_slurm.py: the Slurm tests skip
only when sbatch is absent outside CI; with CI set they run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from hpcrl.core.conventions import DEFAULT_MAKERS, DEFAULT_TRAINERS
from hpcrl.launch import LaunchError, submit
from hpcrl.launch.roles import ppo_groups

REPO = Path(__file__).resolve().parents[1]
IN_CI = os.environ.get("CI", "").lower() not in ("", "0", "false")

needs_slurm = pytest.mark.skipif(
    shutil.which("sbatch") is None and not IN_CI,
    reason="no Slurm here (sbatch not on PATH); as root: bash slurm/local_cluster.sh start (CI runs these tests)")

STEPS = 4
ROLLOUT = 16  # x 4 envs = 64 env steps per experience batch (one batch per PPO update)
# tiny CartPole: 4 updates; heartbeats and waits short enough that a broken placement fails fast
PPO = ["--workload", "cartpole", "--total-steps", str(STEPS), "--timeout-s", "60",
       "--env.num-envs", "4", "--env.rollout-len", str(ROLLOUT)]
# metrics every run must carry
KEYS = {"env_steps", "policy_version", "episode_return", "lag_mean", "lag_max", "dropped_stale", "weight_publish_ms",
        "samples_per_s"}


def job_env() -> dict[str, str]:
    # a test run inside an allocation must not hand its own job's variables to the jobs it submits
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHON": sys.executable}


@pytest.fixture(scope="module")
def cluster():
    script = REPO / "slurm" / "local_cluster.sh"
    if subprocess.run(["bash", str(script), "status"], capture_output=True).returncode != 0:
        subprocess.run(["bash", str(script), "start"], check=True)


@dataclass
class SbatchWait:
    """``sbatch --wait`` of one of the PPO scripts, running in the background until :meth:`result`."""

    proc: subprocess.Popen
    run_dir: Path
    out_dir: Path

    @classmethod
    def start(cls, tmp: Path, script: str, options: list[str], args: list[str], **env: str) -> "SbatchWait":
        tmp.mkdir(parents=True, exist_ok=True)  # Slurm does not create the log's directory
        exports = ",".join(f"{k}={v}" for k, v in {"RUN_DIR": str(tmp / "run"), **env}.items())
        cmd = ["sbatch", "--wait", "--parsable", "--time=10", f"--output={tmp}/%j.out", f"--export=ALL,{exports}",
               *options, str(REPO / "slurm" / script), *args]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=job_env())
        return cls(proc, tmp / "run", tmp)

    def result(self, timeout_s: float = 150) -> tuple[int, str]:
        """(exit code of the job, its log)."""
        try:
            out, err = self.proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, err = self.proc.communicate()
            job_id = out.strip().split(";")[0]
            subprocess.run(["scancel", job_id], check=False)
            raise AssertionError(f"job {job_id} did not finish in {timeout_s:.0f} s: {self.log(job_id)}") from None
        job_id = out.strip().split(";")[0]
        assert job_id.isdigit(), f"sbatch failed: {err}"
        return self.proc.returncode, self.log(job_id) + err

    def log(self, job_id: str) -> str:
        path = self.out_dir / f"{job_id}.out"
        return path.read_text() if path.exists() else "(no log)"


def check_run(run_dir: Path, trainers: list[str], makers: list[str], launcher: str = "slurm") -> None:
    config = json.loads((run_dir / "config.json").read_text())
    assert config["hosts"] == {"trainers": trainers, "makers": makers}
    assert (config["world_size"], config["launcher"]) == (len(trainers) + len(makers), launcher)
    assert (config["trainers"], config["makers"]) == (len(trainers), len(makers))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps, final = rows[:-1], rows[-1]
    assert [r["policy_version"] for r in steps] == list(range(1, STEPS + 1))
    assert [r["env_steps"] for r in steps] == [4 * ROLLOUT * v for v in range(1, STEPS + 1)]
    assert all(KEYS <= r.keys() for r in rows) and all(0 <= r["lag_max"] <= 1 for r in steps)
    # the closing row: every produced sample was consumed or counted as dropped; no maker was lost
    assert final["policy_version"] == STEPS and final["makers_lost"] == 0
    assert final["samples_produced"] == final["samples_consumed"] + final["dropped_shutdown"] + final["dropped_stale"]
    assert final["samples_consumed"] == STEPS * 4 * ROLLOUT
    assert (run_dir / "checkpoints").is_dir()


# All three are submitted together (each fixture asks for the one before). The het job (node2: 1 CPU,
# node1: 2 CPUs) and the other two (1 task = 1 CPU on each node, side by side) take turns; which goes
# first is up to the scheduler (it starts het jobs only in its backfill pass). 4 virtual CPUs, 2 real cores.
@pytest.fixture(scope="module")
def het_job(cluster, tmp_path_factory) -> SbatchWait:
    # trainers: 1 task with a (fake) GPU on node2; makers: 2 tasks with a fake GPU each on node1.
    # Options before ':' size the trainers component, after it the makers component.
    return SbatchWait.start(tmp_path_factory.mktemp("ppo-het"), "detached_ppo.sbatch",
                            ["--nodelist=node2", "--gpus-per-node=1", ":", "--nodelist=node1", "--gpus-per-node=2",
                             "--ntasks-per-node=2"], PPO)


@pytest.fixture(scope="module")
def submitit_job(cluster, het_job, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ppo-submitit")
    # 2 nodes x 1 task: rank 0 (the trainer) on node1, rank 1 (the maker) on node2
    return submit("ppo", [*PPO, "--trainers", "1", "--makers", "1"], nodes=2, time_min=10,
                  signal_delay_s=60, run_dir=str(tmp / "run-%j"), folder=str(tmp / "logs" / "%j"))


@pytest.fixture(scope="module")
def single_job(cluster, submitit_job, tmp_path_factory) -> SbatchWait:
    # 2 nodes x 1 task, no GPUs: block distribution puts rank 0 (the trainer) on node1, rank 1 on node2
    return SbatchWait.start(tmp_path_factory.mktemp("ppo-single"), "detached_ppo_single.sbatch",
                            ["--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=0"], PPO, TRAINERS="1")


@needs_slurm
@pytest.mark.timeout(200)
def test_het_job_places_trainers_on_node2_makers_on_node1_and_completes(het_job, submitit_job, single_job):
    rc, log = het_job.result()
    assert rc == 0, log
    # rank 0 (trainer 0, the store's host) is on node2, though the step's node list starts with node1
    assert "trainers = ranks 0-0 on node2, makers = ranks 1-2 on node1; rendezvous node2:" in log, log
    assert "2 maker(s) : 1 trainer(s) via slurm" in log
    check_run(het_job.run_dir, trainers=["node2"], makers=["node1", "node1"])


@needs_slurm
@pytest.mark.timeout(200)
def test_single_component_alternative_maps_ranks_to_roles_and_completes(single_job):
    rc, log = single_job.result()
    assert rc == 0, log
    assert "trainers = ranks 0-0, makers = ranks 1-1 (block distribution)" in log, log
    check_run(single_job.run_dir, trainers=["node1"], makers=["node2"])


@needs_slurm
@pytest.mark.timeout(200)
def test_submitit_ppo_job_with_one_trainer_and_one_maker_returns_results(submitit_job):
    results = submitit_job.results()
    assert [r.rank for r in results] == [0, 1]
    run_dir = Path(submitit_job.run_dir)
    check_run(run_dir, trainers=["node1"], makers=["node2"])
    final = results[0].final_metrics  # rank 0 = trainer 0, which writes metrics.jsonl
    assert final["policy_version"] == STEPS and results[1].final_metrics is None


BAD_INPUT = [  # (script, sbatch options, trainer args, environment, message); each exits 2 before srun
    ("detached_ppo.sbatch", ["--gpus-per-node=0", ":", "--gpus-per-node=0"], ["--makers", "3"], {},
     "--makers is set by this script"),
    ("detached_ppo.sbatch", ["--gpus-per-node=1", "--ntasks-per-node=2", ":", "--gpus-per-node=0"], [], {},
     "component 0: --ntasks-per-node=2 but --gpus-per-node=1: use one task per GPU"),
    ("detached_ppo_single.sbatch", ["--gpus-per-node=0"], [], {"TRAINERS": "2"},
     "TRAINERS=2 of 2 tasks: need at least one trainer and one maker"),
]


@needs_slurm
@pytest.mark.timeout(120)
def test_scripts_reject_bad_input_before_starting_ranks(cluster, tmp_path):
    jobs = [SbatchWait.start(tmp_path / str(i), script, options, args, **env)
            for i, (script, options, args, env, _) in enumerate(BAD_INPUT)]  # all at once: each takes ~2 s
    for job, (*_, message) in zip(jobs, BAD_INPUT):
        rc, log = job.result(timeout_s=60)
        assert rc == 2 and message in log, log
        assert not job.run_dir.exists()


def test_launcher_checks_ppo_role_counts_against_the_task_count(tmp_path):
    assert ppo_groups(["--workload", "lm"]) == (DEFAULT_TRAINERS, DEFAULT_MAKERS)  # the trainer's own defaults
    assert ppo_groups(["--workload", "lm", "--trainers=2", "--makers", "3"]) == (2, 3)
    common = dict(local=True, dry_run=True, run_dir=str(tmp_path / "run-%j"), folder=str(tmp_path / "logs"))
    with pytest.raises(LaunchError, match=r"--trainers 1 \+ --makers 2 = 3 ranks, but the job starts 2 task\(s\)"):
        submit("ppo", ["--makers", "2"], tasks_per_node=2, **common)
    with pytest.raises(LaunchError, match=r"--makers 'two' is not an integer"):
        submit("ppo", ["--makers", "two"], tasks_per_node=2, **common)
    assert submit("ppo", ["--makers", "2"], tasks_per_node=3, **common).cluster == "local"
    assert submit("ppo", [], tasks_per_node=DEFAULT_TRAINERS + DEFAULT_MAKERS, **common).cluster == "local"
