"""Slurm launch layer against a real local cluster (slurm/local_cluster.sh: 2 virtual nodes, fake GPUs).

sbatch script (2 CPU ranks), preemption (USR2 -> checkpoint -> requeue -> exact resume) through both
the sbatch script and the submitit launcher, a cancelled submitit job, submitit's local executor,
golden batch scripts and bad input; without a cluster, the batch scripts' use of hpcrl.core.conventions (the
stop exit code that triggers a requeue, the exported port). Slurm tests skip only when sbatch is absent
outside CI; with CI set they run (and the session fixture installs and starts the cluster if needed).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from submitit.core.utils import FailedJobError, UncompletedJobError

from hpcrl.core.conventions import EXIT_BAD_CONFIG, EXIT_STOPPED, rendezvous_port
from hpcrl.launch import JobRequest, LaunchError, TrainerTask, render, submit
from hpcrl.launch.__main__ import main as launch_main
from hpcrl.launch.cluster import Node, parse_sinfo

REPO = Path(__file__).resolve().parents[1]
GOLDEN = Path(__file__).parent / "golden"
IN_CI = os.environ.get("CI", "").lower() not in ("", "0", "false")

needs_slurm = pytest.mark.skipif(
    shutil.which("sbatch") is None and not IN_CI,
    reason="no Slurm here (sbatch not on PATH); as root: bash slurm/local_cluster.sh start (CI runs these tests)")

# 2 ranks x 2 envs, 40 env steps, updates from step 4 on, a metrics row every 5 steps, checkpoints every 10
TINY = ["--preset", "pendulum", "--num-envs", "4", "--batch-size", "32", "--actor-hidden", "32",
        "--critic-hidden", "32", "--num-atoms", "21", "--learning-starts", "4", "--random-steps", "4",
        "--num-updates", "2", "--total-env-steps", "160", "--log-every", "5", "--checkpoint-every", "10",
        "--eval-episodes", "0", "--threads", "1"]


def job_env() -> dict[str, str]:
    # a test run inside an allocation must not hand its own job's variables to the jobs it submits
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHON": sys.executable}


def metrics(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if k not in ("time", "sps")} for row in rows]


def same(a, b) -> bool:
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)  # NaN == NaN here, as wanted


def wait_for(predicate, timeout_s: float, what: str, poll_s: float = 0.05):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def first_row_written(run_dir: Path) -> bool:
    path = Path(run_dir) / "metrics.jsonl"
    return path.exists() and bool(path.read_text().strip())


def job_fields(job_id: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True,
                         check=True).stdout
    return dict(f.split("=", 1) for f in out.split() if "=" in f)


FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL"}


@dataclass(frozen=True)
class SbatchRun:
    """A submitted run of slurm/fastsac.sbatch: 2 CPU ranks on one node, the TINY config."""

    job_id: str
    run_dir: Path
    log: Path

    @classmethod
    def submit(cls, tmp: Path) -> "SbatchRun":
        cmd = ["sbatch", "--parsable", "--gpus-per-node=0", "--ntasks-per-node=2", "--time=10",
               f"--output={tmp}/%j.out", f"--export=ALL,RUN_DIR={tmp / 'run'}",
               str(REPO / "slurm" / "fastsac.sbatch"), *TINY]
        job_id = subprocess.run(cmd, capture_output=True, text=True, env=job_env(), check=True).stdout.strip()
        return cls(job_id, tmp / "run", tmp / f"{job_id}.out")

    def wait(self, timeout_s: float = 180) -> dict[str, str]:
        """scontrol's fields of the finished job (requeues included)."""
        return wait_for(lambda: (f := job_fields(self.job_id))["JobState"] in FINAL_STATES and f, timeout_s,
                        f"job {self.job_id} to finish", poll_s=0.5)


@pytest.fixture(scope="session")
def cluster():
    script = REPO / "slurm" / "local_cluster.sh"
    if subprocess.run(["bash", str(script), "status"], capture_output=True).returncode != 0:
        subprocess.run(["bash", str(script), "start"], check=True)


@pytest.fixture(scope="module")
def reference(cluster, tmp_path_factory) -> SbatchRun:
    """The uninterrupted run, submitted early: it runs while the first test drives its own job."""
    return SbatchRun.submit(tmp_path_factory.mktemp("sbatch-ref"))


@needs_slurm
def test_sbatch_usr2_checkpoints_requeues_and_resumes_exactly(reference, tmp_path):
    run = SbatchRun.submit(tmp_path)
    wait_for(lambda: first_row_written(run.run_dir), 120, "the first metrics row")
    # to the job steps (not --batch): every rank gets it, as with --signal=USR2@<s> before the time limit
    subprocess.run(["scancel", "--signal=USR2", run.job_id], check=True)
    fields = run.wait()
    logs = run.log.read_text()
    assert (fields["JobState"], fields["Restarts"]) == ("COMPLETED", "1"), logs
    assert "stop requested (SIGUSR2)" in logs and "requeueing job" in logs and "resuming from" in logs
    assert reference.wait()["JobState"] == "COMPLETED"
    assert same(metrics(run.run_dir), metrics(reference.run_dir))


@needs_slurm
def test_sbatch_two_cpu_ranks_complete(reference):
    fields = reference.wait()
    logs = reference.log.read_text()
    assert (fields["JobState"], fields["ExitCode"], fields["Restarts"]) == ("COMPLETED", "0:0", "0"), logs
    config = json.loads((reference.run_dir / "config.json").read_text())
    assert (config["world_size"], config["envs_per_rank"], config["launcher"]) == (2, 2, "slurm")
    assert "2 rank(s) via slurm" in logs and "0 GPU(s)/node" in logs
    rows = metrics(reference.run_dir)
    # one row per 5 env steps of the 4 global envs (2 per rank): every rank's envs advanced
    assert [r["env_steps"] for r in rows] == list(range(20, 161, 20))
    assert rows[-1]["updates"] == 72 and rows[-1]["critic_loss"] == rows[-1]["critic_loss"]  # not NaN


@needs_slurm
@pytest.mark.extended  # the same requeue as the sbatch test above, through submitit
def test_submitit_job_requeues_on_usr2_resumes_exactly_and_returns(reference, tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    # 2 virtual nodes x 1 (fake) GPU = one task per GPU; torch sees no GPU, so the ranks use gloo on CPU
    sub = submit("sac", TINY, nodes=2, gpus_per_node=1, time_min=15, run_dir=str(tmp_path / "run-%j"),
                 folder=str(tmp_path / "logs" / "%j"))
    assert sub.cluster == "slurm" and sub.run_dir == str(tmp_path / f"run-{sub.job_id}")
    assert f"submitted job {sub.job_id}" in sub.summary() and sub.run_dir in sub.summary()
    assert sub.sbatch == render(sub.request)  # what --dry-run prints is what was submitted
    wait_for(lambda: first_row_written(sub.run_dir), 120, "the first metrics row")
    subprocess.run(["scancel", "--signal=USR2", sub.job_id], check=True)
    results = sub.results()
    assert [r.rank for r in results] == [0, 1]
    assert job_fields(sub.job_id)["Restarts"] == "1"
    log = sub.job.paths.stdout.read_text()  # task 0's: submitit's own messages and the trainer's stdout
    assert "this job is preempted" in log and "Calling checkpoint method" in log and "Requeued job" in log
    run_dir = Path(sub.run_dir)
    config = json.loads((run_dir / "config.json").read_text())
    assert (config["world_size"], config["launcher"], config["resume"]) == (2, "slurm", True)
    assert reference.wait()["JobState"] == "COMPLETED"
    assert same(metrics(run_dir), metrics(reference.run_dir))
    final = {k: v for k, v in results[0].final_metrics.items() if k not in ("time", "sps")}
    assert same(final, metrics(reference.run_dir)[-1]) and results[1].final_metrics is None


@needs_slurm
@pytest.mark.timeout(120)
def test_cancelled_submitit_job_raises_instead_of_hanging(cluster, tmp_path):
    sub = submit("sac", [*TINY, "--total-env-steps", "100000"], tasks_per_node=2, time_min=15,
                 run_dir=str(tmp_path / "run-%j"), folder=str(tmp_path / "logs" / "%j"))
    wait_for(lambda: job_fields(sub.job_id)["JobState"] == "RUNNING", 60, "the job to start", poll_s=0.5)
    sub.job.cancel()
    # Slurm TERMs every process of the step: either the task dies with its trainer (no result), or the
    # task outlives a trainer still starting up (no SIGTERM handler yet) and reports how it died.
    with pytest.raises((UncompletedJobError, FailedJobError),
                       match="has not produced any output|was killed by SIGTERM .job cancelled"):
        sub.results()
    # COMPLETING is Slurm's transitional state while the step's processes are reaped
    wait_for(lambda: job_fields(sub.job_id)["JobState"] == "CANCELLED", 30, "the job to be CANCELLED", poll_s=0.5)


@pytest.mark.timeout(180)
def test_local_executor_runs_the_ranks_on_this_host(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    # as if submitted from inside a requeued job: none of this may reach the ranks
    for name, value in dict(SLURM_JOB_ID="424242", SLURM_PROCID="3", SLURM_NTASKS="8", SLURM_LOCALID="3",
                            SLURM_STEP_ID="0", SLURM_JOB_NODELIST="node9", SLURM_RESTART_COUNT="2").items():
        monkeypatch.setenv(name, value)
    sub = submit("sac", TINY, tasks_per_node=2, local=True, time_min=15, run_dir=str(tmp_path / "run-%j"),
                 folder=str(tmp_path / "logs" / "%j"))
    assert sub.cluster == "local" and sub.sbatch is None and f"submitted job {sub.job_id}" in sub.summary()
    results = sub.results()
    run_dir = Path(sub.run_dir)
    config = json.loads((run_dir / "config.json").read_text())
    assert (config["world_size"], config["launcher"], config["resume"]) == (2, "local", False)
    rows = metrics(run_dir)
    assert [r["env_steps"] for r in rows] == list(range(20, 161, 20))
    assert [r.rank for r in results] == [0, 1]
    assert same({k: v for k, v in results[0].final_metrics.items() if k not in ("time", "sps")}, rows[-1])


@needs_slurm
@pytest.mark.parametrize("kwargs, message", [
    (dict(partition="nope"), r"unknown partition 'nope'; this cluster has \['debug'\]"),
    (dict(gpus_per_node=3), r"gpus_per_node=3 but nodes of partition debug .* have at most 2 GPUs"),
    (dict(nodes=3), r"3 node\(s\) .* requested, but only 2 of partition debug"),
    (dict(tasks_per_node=2, cpus_per_task=2), r"4 CPUs .* but only 0 of partition debug"),
])
def test_requests_that_do_not_fit_the_cluster_fail_before_submission(cluster, tmp_path, kwargs, message):
    with pytest.raises(LaunchError, match=message):
        submit("sac", TINY, folder=str(tmp_path / "logs"), run_dir=str(tmp_path / "run"), **kwargs)
    assert not (tmp_path / "logs").exists()  # nothing was submitted


@pytest.mark.parametrize("kwargs, message", [
    (dict(algo="dqn"), r"no trainer 'python -m hpcrl.dqn'; choose one of \[.*'sac'"),
    (dict(resume=True), r"nothing to resume: .*missing/checkpoints does not exist"),
    (dict(run_dir="{tmp}/file/run-%j"), r"run directory .* cannot be created: .*file is not a writable directory"),
    (dict(gpus_per_node=2, tasks_per_node=1), r"one task \(rank\) per GPU"),
    (dict(trainer_args=("--run-dir", "x")), r"--run-dir is set by the launcher; use run_dir"),
    (dict(time_min=2), r"signal_delay_s=180 is not shorter than the time limit"),
    (dict(nodes=2, local=True), r"the local executor runs on this host only"),
])
def test_bad_requests_fail_with_clear_errors(tmp_path, kwargs, message):
    (tmp_path / "file").write_text("")
    kwargs.setdefault("run_dir", str(tmp_path / "missing"))
    kwargs["run_dir"] = kwargs["run_dir"].format(tmp=tmp_path)
    with pytest.raises(LaunchError, match=message):
        submit(kwargs.pop("algo", "sac"), kwargs.pop("trainer_args", TINY), folder=str(tmp_path / "logs"),
               dry_run=True, **kwargs)


def test_checkpoint_resubmits_the_same_task_with_resume():
    task = TrainerTask("hpcrl.sac", tuple(TINY), "/runs/sac-%j")
    again = task.checkpoint()  # what submitit stores for the requeued job
    assert again.function == TrainerTask("hpcrl.sac", tuple(TINY), "/runs/sac-%j", resume=True)
    assert (again.args, again.kwargs) == ((), {})


def test_sinfo_gres_and_default_partition_are_parsed():
    parts = parse_sinfo("gpu*|g1|64|gpu:a100:4(S:0-1)\ngpu*|g2|64|gpu:8,shard:16\ncpu|c1|128|(null)\n")
    assert parts["gpu"].default and not parts["cpu"].default
    assert parts["gpu"].nodes == (Node("g1", 64, 4), Node("g2", 64, 8))
    assert parts["cpu"].nodes == (Node("c1", 128, 0),)


GOLDEN_REQUESTS = {
    "cpu_2tasks.sbatch": JobRequest(tasks_per_node=2, time_min=30, folder="/shared/hpcrl/logs/%j"),
    "gpu_2nodes_x4.sbatch": JobRequest(nodes=2, gpus_per_node=4, cpus_per_task=8, partition="gpu", time_min=240,
                                       signal_delay_s=300, folder="/shared/hpcrl/logs/%j"),
}


@pytest.mark.parametrize("name", sorted(GOLDEN_REQUESTS))
def test_batch_script_matches_golden_file(name):
    text = render(GOLDEN_REQUESTS[name], python="/opt/hpcrl/.venv/bin/python")
    if os.environ.get("HPCRL_UPDATE_GOLDEN"):
        (GOLDEN / name).write_text(text)
    assert text == (GOLDEN / name).read_text(), f"set HPCRL_UPDATE_GOLDEN=1 to rewrite tests/golden/{name}"


def test_cli_dry_run_prints_the_batch_script_and_bad_input_exits_2(tmp_path, capsys):
    folder = str(tmp_path / "logs" / "%j")
    assert launch_main(["sac", "--tasks-per-node", "2", "--time", "30", "--folder", folder, "--dry-run",
                        "--", *TINY]) == 0
    request = JobRequest(trainer_args=tuple(TINY), tasks_per_node=2, time_min=30, folder=folder)
    assert capsys.readouterr().out == render(request) + "\n"
    assert launch_main(["sac", "--gpus-per-node", "2", "--tasks-per-node", "1", "--dry-run"]) == 2
    assert "hpcrl.launch: error: tasks_per_node=1 but gpus_per_node=2" in capsys.readouterr().err


def test_trainer_exit_status_in_words():
    from hpcrl.launch.task import describe_exit

    assert describe_exit(-15) == "was killed by SIGTERM (job cancelled or past its time limit)"
    assert describe_exit(-9) == "was killed by SIGKILL" and describe_exit(-200) == "was killed by signal 200"
    assert describe_exit(2) == "exited with 2 (bad configuration)" and describe_exit(1) == "exited with 1 (a rank failed)"
    assert describe_exit(3) == "exited with 3"


# The batch scripts' own logic, without a cluster: bash runs them with the variables Slurm would set and
# stand-ins for srun (records its environment, exits $FAKE_RC) and scontrol (records requeues).
SCRIPT_ENV = {
    "fastsac.sbatch": dict(SLURM_JOB_ID="4321", SLURM_JOB_NODELIST="node1", SLURM_NTASKS="2",
                           SLURM_NTASKS_PER_NODE="2", SLURM_TASKS_PER_NODE="2", SLURM_JOB_NUM_NODES="1"),
    "detached_ppo_single.sbatch": dict(SLURM_JOB_ID="4321", SLURM_JOB_NODELIST="node[1-2]", SLURM_NTASKS="2"),
    "detached_ppo.sbatch": dict(SLURM_JOB_ID="4321", SLURM_HET_SIZE="2", SLURM_NTASKS_HET_GROUP_0="1",
                                SLURM_NTASKS_HET_GROUP_1="2", SLURM_JOB_NODELIST_HET_GROUP_0="node2",
                                SLURM_JOB_NODELIST_HET_GROUP_1="node1"),
}
FAKE_SRUN = '#!/bin/bash\nenv > "$FAKE_DIR/srun.env"\necho "$*" > "$FAKE_DIR/srun.args"\nexit "${FAKE_RC:-0}"\n'
FAKE_SCONTROL = ('#!/bin/bash\nif [ "$1 $2" = "show hostnames" ]; then echo "${3%%,*}"; '
                 'else echo "$*" >> "$FAKE_DIR/scontrol"; fi\n')


def run_script(tmp: Path, script: str, **env: str) -> tuple[subprocess.CompletedProcess, Path]:
    bin_dir = tmp / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    base = {k: v for k, v in job_env().items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    env = {**base, **SCRIPT_ENV[script], "PATH": f"{bin_dir}:{base['PATH']}", "FAKE_DIR": str(tmp),
           "RUN_DIR": str(tmp / "run"), **env}
    proc = subprocess.run(["bash", str(REPO / "slurm" / script)], env=env, capture_output=True, text=True,
                          timeout=60, cwd=tmp)
    return proc, tmp


def srun_env(tmp: Path) -> dict[str, str]:
    lines = (tmp / "srun.env").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if "=" in line)


@pytest.mark.parametrize("script", sorted(SCRIPT_ENV))
def test_scripts_requeue_on_the_stop_exit_code_from_conventions(tmp_path, script):
    proc, tmp = run_script(tmp_path / "stopped", script, FAKE_RC=str(EXIT_STOPPED))
    assert proc.returncode == EXIT_STOPPED, proc.stderr
    assert (tmp / "scontrol").read_text() == "requeue 4321\n" and "requeueing job 4321" in proc.stdout
    port = srun_env(tmp).get("MASTER_PORT")
    if script == "detached_ppo.sbatch":
        # exported for both components: the port their one srun step (step 0) would derive, on trainer 0's node
        assert port == str(rendezvous_port(4321, 0)) and srun_env(tmp)["MASTER_ADDR"] == "node2"
        assert f"rendezvous node2:{port};" in proc.stdout
    else:
        assert port is None  # each rank derives it from its own step id
    for rc in (0, 1):
        proc, tmp = run_script(tmp_path / f"rc{rc}", script, FAKE_RC=str(rc))
        assert proc.returncode == rc and not (tmp / "scontrol").exists(), proc.stderr


@pytest.mark.parametrize("script", sorted(SCRIPT_ENV))
def test_scripts_exit_2_when_python_cannot_read_conventions(tmp_path, script):
    proc, tmp = run_script(tmp_path, script, PYTHON=str(tmp_path / "no-such-python"))
    assert proc.returncode == EXIT_BAD_CONFIG and not (tmp / "srun.env").exists()
    assert f"{script}: cannot read EXIT_STOPPED from hpcrl.core.conventions with PYTHON={tmp_path}/no-such-python" \
        in proc.stderr, proc.stderr



# A requeued job resized with `scontrol update NumNodes=...` starts with SLURM_NTASKS from its submission
# (checked on the local cluster: still 2 after a 2 -> 1 node update) and a fresh SLURM_TASKS_PER_NODE.
def test_srun_gets_the_task_count_of_this_starts_allocation(tmp_path):
    from hpcrl.launch.sbatch import ALLOC_TASKS_LINE

    assert ALLOC_TASKS_LINE in (REPO / "slurm" / "fastsac.sbatch").read_text().splitlines()
    assert ALLOC_TASKS_LINE in render(GOLDEN_REQUESTS["cpu_2tasks.sbatch"]).splitlines()
    for tasks_per_node, stale, ntasks in (("1", "2", "1"), ("1(x2)", "1", "2")):  # shrunk, grown
        proc, tmp = run_script(tmp_path / tasks_per_node, "fastsac.sbatch", SLURM_NTASKS=stale,
                               SLURM_TASKS_PER_NODE=tasks_per_node, SLURM_NTASKS_PER_NODE="1")
        assert proc.returncode == 0, proc.stderr
        assert (srun_env(tmp)["SLURM_NTASKS"], srun_env(tmp)["SLURM_NPROCS"]) == (ntasks, ntasks)
        assert f": {ntasks} rank(s) on 1 node(s)" in proc.stdout
    # a resubmit (restart 0) at another size, RUN_DIR naming a run with checkpoints: it resumes
    (tmp_path / "again" / "run" / "checkpoints").mkdir(parents=True)
    proc, tmp = run_script(tmp_path / "again", "fastsac.sbatch", SLURM_TASKS_PER_NODE="1")
    assert proc.returncode == 0 and (tmp / "srun.args").read_text().endswith(" --resume --resume-missing fresh\n")
    assert srun_env(tmp)["SLURM_NTASKS"] == "1"
    for tasks_per_node, ntasks in (("2(x3),1", "7"), ("4,2(x2)", "8"), ("", "3")):  # "": keep SLURM_NTASKS
        out = subprocess.run(["bash", "-uc", ALLOC_TASKS_LINE + '; echo "$SLURM_NTASKS"'], capture_output=True,
                             text=True, env={"PATH": os.environ["PATH"], "SLURM_NTASKS": "3",
                                             "SLURM_TASKS_PER_NODE": tasks_per_node})
        assert out.stdout == ntasks + "\n", (tasks_per_node, out.stderr)


def test_requeue_hold_requeues_held_and_a_bad_value_exits_2(tmp_path):
    proc, tmp = run_script(tmp_path / "held", "fastsac.sbatch", FAKE_RC=str(EXIT_STOPPED), REQUEUE_HOLD="1")
    assert proc.returncode == EXIT_STOPPED, proc.stderr
    assert (tmp / "scontrol").read_text() == "requeuehold 4321\n"
    assert "requeueing job 4321 held" in proc.stdout and "scontrol release 4321" in proc.stdout
    proc, tmp = run_script(tmp_path / "bad", "fastsac.sbatch", REQUEUE_HOLD="yes")
    assert proc.returncode == EXIT_BAD_CONFIG and not (tmp / "srun.env").exists()
    assert proc.stderr == "fastsac.sbatch: REQUEUE_HOLD=yes: set it to 0 or 1\n"
