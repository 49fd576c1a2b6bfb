"""A run directory belongs to one run: the lock (live, stale, other host, no flock), modes, and the
FastSAC CLI on a shared run dir (second start, killed holder, refused multi-rank start, resume refusals,
a corrupt newest checkpoint, a torn metrics line)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hpcrl.run import checkpoint, rundir
from hpcrl.run.rundir import RunDirError, acquire

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_sac_train import TINY, metrics, run_cli  # noqa: E402
from torchrun_style import free_port  # noqa: E402

HOST = socket.gethostname()


def lock_record(run_dir: Path) -> dict:
    return json.loads((run_dir / rundir.LOCK_NAME).read_text())


def write_record(run_dir: Path, **fields) -> None:
    """A holder's record, written as a holder does (in place, one fixed-size block)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    record = {"host": HOST, "pid": 1, "pid_start": "", "started": time.time() - 60, "slurm_job": "", "beat": 0,
              **fields}
    fd = os.open(run_dir / rundir.LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.pwrite(fd, rundir._encode(record), 0)
    finally:
        os.close(fd)


# -- the lock, in process ---------------------------------------------------------------------------
def test_second_acquire_refuses_naming_the_holder_and_release_frees_it(tmp_path):
    run = tmp_path / "run"
    lock = acquire(run)
    assert lock.held and lock.flock and lock_record(run)["pid"] == os.getpid()
    with pytest.raises(RunDirError, match=rf"run dir {run} is in use by pid {os.getpid()} on host {HOST} since "
                                          r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d; use another --run-dir or stop that run"):
        acquire(run)
    lock.release()
    assert not (run / rundir.LOCK_NAME).exists()
    with acquire(run):
        pass
    assert not (run / rundir.LOCK_NAME).exists()


def test_heartbeat_moves_while_held(tmp_path, monkeypatch):
    monkeypatch.setattr(rundir, "HEARTBEAT_S", 0.02)
    with acquire(tmp_path) as lock:
        time.sleep(0.3)
        assert lock_record(tmp_path)["beat"] > 0
        assert lock.record["slurm_job"] == os.environ.get("SLURM_JOB_ID", "")


def test_sigkilled_holder_leaves_a_stale_lock_that_is_taken_over(tmp_path, capsys):
    code = ("import sys, time; from hpcrl.run.rundir import acquire; "
            "lock = acquire(sys.argv[1]); print('held', flush=True); time.sleep(120)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunDirError, match=f"in use by pid {holder.pid} on host {HOST}"):
            acquire(tmp_path)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert (tmp_path / rundir.LOCK_NAME).exists()  # a SIGKILL cleans nothing up
    with acquire(tmp_path) as lock:
        assert lock_record(tmp_path)["pid"] == os.getpid()
    assert f"took over the stale lock of pid {holder.pid} on host {HOST}" in capsys.readouterr().err


def test_a_killed_holder_whose_flock_outlives_it_for_a_while_is_waited_for(tmp_path, capsys):
    """A SIGKILLed rank drops its flock only when its teardown ends (seconds for a big torch process under
    load; CI saw "in use" right after killing a job). Stand-in for that slow teardown: a forked child keeps
    the holder's flock for 1.5 s after the holder is dead."""
    code = ("import os, sys, time; from hpcrl.run.rundir import acquire; lock = acquire(sys.argv[1]); "
            "os.fork() or (time.sleep(1.5), os._exit(0)); print('held', flush=True); time.sleep(120)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    fd = os.open(tmp_path / rundir.LOCK_NAME, os.O_RDONLY)
    assert rundir._try_flock(fd) is False  # still held
    os.close(fd)
    rundir.probe(tmp_path)  # no refusal before spawning: the holder is dead
    started = time.monotonic()
    with acquire(tmp_path) as lock:
        assert lock_record(tmp_path)["pid"] == os.getpid()
    assert 0.5 < time.monotonic() - started < rundir.DYING_WAIT_S
    assert f"took over the stale lock of pid {holder.pid}" in capsys.readouterr().err


def test_a_lock_of_another_host_is_judged_by_its_heartbeat(tmp_path, monkeypatch, capsys):
    """flock may be node-local (Lustre localflock): a record from another host is alive while its heartbeat moves."""
    monkeypatch.setattr(rundir, "STALE_S", 2.0)
    write_record(tmp_path, host="node-elsewhere", pid=4242)
    stop = threading.Event()

    def beat():
        n = 0
        while not stop.is_set():
            n += 1
            write_record(tmp_path, host="node-elsewhere", pid=4242, beat=n)
            time.sleep(0.02)

    t = threading.Thread(target=beat)
    t.start()
    try:
        with pytest.raises(RunDirError, match=r"in use by pid 4242 on host node-elsewhere since .*"
                                              r"\(its heartbeat is live\)"):
            acquire(tmp_path)
    finally:
        stop.set()
        t.join()
    t0 = time.monotonic()
    with acquire(tmp_path):  # heartbeat stopped: the holder is gone
        assert time.monotonic() - t0 >= 2.0
    assert "took over the stale lock of pid 4242 on host node-elsewhere" in capsys.readouterr().err


def test_without_flock_same_host_pid_decides_and_an_unreadable_record_names_the_file(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(rundir, "_try_flock", lambda fd: None)  # e.g. an NFS mount without lock support
    with acquire(tmp_path / "fresh") as lock:  # a plain O_EXCL lock file
        assert lock.held and not lock.flock
        with pytest.raises(RunDirError, match=f"in use by pid {os.getpid()} on host {HOST}"):
            acquire(tmp_path / "fresh")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    write_record(tmp_path / "dead", pid=dead.pid, pid_start="1")
    with acquire(tmp_path / "dead"):
        pass
    assert f"took over the stale lock of pid {dead.pid}" in capsys.readouterr().err
    # a live pid whose start time differs is a reused pid: stale too
    write_record(tmp_path / "reused", pid=os.getpid(), pid_start="1")
    with acquire(tmp_path / "reused"):
        pass
    (tmp_path / "garbage").mkdir()
    (tmp_path / "garbage" / rundir.LOCK_NAME).write_bytes(b"\x00garbage")
    with pytest.raises(RunDirError, match=f"if no run uses .*, delete {tmp_path / 'garbage' / rundir.LOCK_NAME}"):
        acquire(tmp_path / "garbage")


def test_run_dirs_are_private_unless_shared(tmp_path, monkeypatch):
    def mode(p):
        return stat.S_IMODE(p.stat().st_mode)

    with acquire(tmp_path / "a" / "run"):
        assert mode(tmp_path / "a" / "run") == 0o700 and mode(tmp_path / "a" / "run" / rundir.LOCK_NAME) == 0o600
    monkeypatch.setenv("HPCRL_SHARED_RUN_DIR", "1")
    with acquire(tmp_path / "b"):
        assert mode(tmp_path / "b") == 0o750 and mode(tmp_path / "b" / rundir.LOCK_NAME) == 0o640
    (tmp_path / "c").mkdir(mode=0o755)
    os.chmod(tmp_path / "c", 0o755)
    with acquire(tmp_path / "c"):
        assert mode(tmp_path / "c") == 0o755  # an existing directory keeps its mode
    (tmp_path / "file").write_text("")
    with pytest.raises(RunDirError, match="cannot create run dir"):
        acquire(tmp_path / "file")


# -- the FastSAC CLI on one run dir -------------------------------------------------------------------
SHORT = TINY + ["--total-env-steps", "120", "--checkpoint-every", "10"]


@pytest.mark.timeout(180)
def test_second_start_refuses_with_exit_2_and_a_killed_run_is_taken_over(tmp_path):
    run = tmp_path / "run"
    first = subprocess.Popen([sys.executable, "-m", "hpcrl.sac", *TINY, "--total-env-steps", "1000000",
                              "--checkpoint-every", "10", "--run-dir", str(run)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.time() + 60
        while not ((run / "metrics.jsonl").exists() and (run / "metrics.jsonl").read_text().count("\n") >= 2):
            assert time.time() < deadline and first.poll() is None, first.stderr.read() if first.poll() else "slow"
            time.sleep(0.05)
        assert lock_record(run)["pid"] == first.pid
        second = run_cli(SHORT + ["--run-dir", str(run)], timeout=60)
        assert second.returncode == 2, second.stderr
        assert f"run dir {run} is in use by pid {first.pid} on host {HOST} since" in second.stderr
        assert "Traceback" not in second.stderr
        assert json.loads((run / "config.json").read_text())["total_env_steps"] == 1000000  # untouched
        rows = [r["env_steps"] for r in metrics(run)]
        assert rows == sorted(rows) and len(set(rows)) == len(rows)  # one run's rows, no interleaving
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    third = run_cli(SHORT + ["--run-dir", str(run), "--overwrite"], timeout=60)
    assert third.returncode == 0, third.stderr
    assert f"took over the stale lock of pid {first.pid} on host {HOST}" in third.stderr
    assert f"--overwrite: removed the previous run in {run} (config.json, metrics.jsonl, checkpoints" in third.stderr
    assert [r["env_steps"] for r in metrics(run)] == list(range(20, 121, 20))
    assert not (run / rundir.LOCK_NAME).exists()  # released at the end


@pytest.mark.timeout(120)
def test_every_rank_of_a_refused_multi_rank_start_exits_2(tmp_path):
    port = free_port()
    with acquire(tmp_path):
        procs = []
        t0 = time.time()
        for rank in range(2):
            env = {**{k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}, "RANK": str(rank),
                   "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                   "OMP_NUM_THREADS": "1"}
            procs.append(subprocess.Popen([sys.executable, "-m", "hpcrl.sac", *SHORT, "--run-dir", str(tmp_path)],
                                          env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        try:
            for p in procs:
                _, err = p.communicate(timeout=90)
                assert p.returncode == 2, err[-3000:]
                assert f"in use by pid {os.getpid()} on host {HOST}" in err and "Traceback" not in err
        finally:
            for p in procs:
                p.kill()
        assert time.time() - t0 < 60


@pytest.mark.timeout(180)
def test_resume_refuses_what_it_cannot_resume_and_falls_back_past_a_corrupt_checkpoint(tmp_path):
    ref = tmp_path / "ref"
    done = run_cli(SHORT + ["--run-dir", str(ref)])
    assert done.returncode == 0, done.stderr
    rows = metrics(ref)

    nothing = run_cli(SHORT + ["--run-dir", str(tmp_path / "empty"), "--resume"], timeout=60)
    assert nothing.returncode == 2 and "--resume: no checkpoint in" in nothing.stderr, nothing.stderr
    assert "Traceback" not in nothing.stderr

    other = run_cli(SHORT + ["--run-dir", str(ref), "--resume", "--seed", "1"], timeout=60)
    assert other.returncode == 2, other.stderr
    assert "belongs to another run: seed is 0 in the checkpoint but 1 in this run" in other.stderr
    assert "Traceback" not in other.stderr

    # newest checkpoint garbled, a torn last metrics line: resume from the previous one, rows repaired
    run = tmp_path / "run"
    shutil.copytree(ref, run)
    newest, previous = checkpoint.committed(run)
    (newest / "learner.pt").write_bytes(b"garbage" * 10)
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"time": 1.0, "env_st')
    resumed = run_cli(SHORT + ["--run-dir", str(run), "--resume"])
    assert resumed.returncode == 0, resumed.stderr
    assert f"skipping unusable checkpoint {newest}: learner.pt has 70 bytes" in resumed.stderr
    assert f"resuming from {previous}" in resumed.stdout
    assert "dropped a torn last line" in resumed.stderr
    assert metrics(run) == rows  # exact resume from the older checkpoint
    assert [p.name for p in checkpoint.committed(run)] == [newest.name, previous.name]

    # none usable: exit 2 naming every path
    for p in checkpoint.committed(run):
        (p / "rank0.h5").unlink()
    broken = run_cli(SHORT + ["--run-dir", str(run), "--resume"], timeout=60)
    assert broken.returncode == 2, broken.stderr
    assert "no usable checkpoint" in broken.stderr and all(str(p) in broken.stderr for p in checkpoint.committed(run))
    assert "Traceback" not in broken.stderr


def test_resume_missing_fresh_starts_over_when_there_is_nothing(tmp_path, capsys, monkeypatch):
    from hpcrl.sac.__main__ import parse
    from hpcrl.sac.run import RunDirConfigError, train

    for k in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(k)
    cfg = parse(TINY + ["--total-env-steps", "40", "--checkpoint-every", "0", "--run-dir", str(tmp_path), "--resume"])
    with pytest.raises(RunDirConfigError, match="--resume: no checkpoint in") as info:
        train(cfg)
    assert isinstance(info.value, RunDirError)
    cfg.resume_missing = "fresh"  # the documented flag (read with a default until SACConfig has it)
    row = train(cfg)
    assert row["env_steps"] == 40
    out = capsys.readouterr().out
    assert "--resume: no checkpoint in" in out and "starting fresh (--resume-missing fresh)" in out
    assert not (tmp_path / rundir.LOCK_NAME).exists()


def test_outcome_record_is_this_jobs_and_read_by_the_batch_scripts(tmp_path, monkeypatch):
    # The PPO batch scripts believe trainer 0's record over srun's exit code only when it is this job's.
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    assert rundir.finished_by_this_job(tmp_path) is None
    rundir.record_outcome(tmp_path, "finished", policy_version=5, makers_lost=1)
    assert rundir.finished_by_this_job(tmp_path)["makers_lost"] == 1
    cli = [sys.executable, "-m", "hpcrl.run.rundir", "finished", str(tmp_path)]
    done = subprocess.run(cli, capture_output=True, text=True, env={**os.environ})
    assert done.returncode == 0 and "policy_version=5" in done.stdout and "makers_lost=1" in done.stdout
    for job, restart in (("78", "1"), ("77", "2")):  # another job, or a later attempt of this one
        other = subprocess.run(cli, capture_output=True, text=True,
                               env={**os.environ, "SLURM_JOB_ID": job, "SLURM_RESTART_COUNT": restart})
        assert other.returncode == 1
    rundir.record_outcome(tmp_path, "stopped")
    assert rundir.finished_by_this_job(tmp_path) is None
    rundir.clear_outcome(tmp_path)
    assert not (tmp_path / rundir.OUTCOME).exists()
