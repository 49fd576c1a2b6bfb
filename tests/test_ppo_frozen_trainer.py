"""A trainer frozen for good (SIGSTOP), or every maker lost, ends a detached-PPO run: real processes,
cartpole, 2 makers, ``--heartbeat-timeout-s 3``. Under ``python -m hpcrl.ppo`` spawning its ranks, the
parent exits 1 within a bound of the heartbeat timeout with one line naming the frozen trainer, and no
process of the run is left (the frozen one SIGKILLed: it never acts on SIGTERM); torchrun-style, every
other rank decides for itself and exits 1 naming it. The last checkpoint stays loadable."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from rank_procs import ranks_of  # noqa: E402
from torchrun_style import clean_env, finish, torchrun_style  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

HEARTBEAT_S = 3.0
BOUND_S = 60.0  # freeze -> every rank gone; measured: the heartbeat timeout plus a few seconds


def _args(run: Path, trainers: int) -> list[str]:
    return ["--workload", "cartpole", "--makers", "2", "--trainers", str(trainers), "--heartbeat-timeout-s",
            str(HEARTBEAT_S), "--timeout-s", "120", "--total-steps", "400", "--checkpoint-every", "2",
            "--run-dir", str(run)]


def _rows(run: Path) -> int:
    path = run / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def _wait_rows(run: Path, n: int, procs: list[subprocess.Popen], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and _rows(run) < n:
        if any(p.poll() is not None for p in procs):
            ends = "".join(p.communicate()[1][-2000:] for p in procs)
            raise AssertionError(f"a rank ended before the freeze: {ends}")
        time.sleep(0.02)
    assert _rows(run) >= n, "the run did not log enough rows"


def _group(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group ``pgid``."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(stat[3]) == pgid and stat[0] != "Z":
            out.append(int(entry.name))
    return out


def _gone(pgid: int, timeout: float = 10.0) -> list[int]:
    """What is left of group ``pgid`` once it settled (the forkserver leaves right after its launcher)."""
    deadline = time.monotonic() + timeout
    while (left := _group(pgid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def _resume(run: Path, trainers: int) -> None:
    version = max(json.loads(line)["policy_version"] for line in (run / "metrics.jsonl").read_text().splitlines())
    args = [a if a != "400" else str(int(version) + 2) for a in _args(run, trainers)]
    done = subprocess.run([sys.executable, "-m", "hpcrl.ppo", *args, "--resume"], env=clean_env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resuming at v" in done.stdout, done.stdout[-2000:]


def _launch_and_fault(run: Path, trainers: int, fault, env: dict) -> tuple[int, str, float, list[int]]:
    """Launch a local run, ``fault(ranks)`` once it logged 5 rows; ``(exit code, stderr, seconds from the fault
    to the launcher's exit, what was left of its process group)``. Nothing outlives the call."""
    proc = subprocess.Popen([sys.executable, "-m", "hpcrl.ppo", *_args(run, trainers)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _wait_rows(run, 5, [proc])
        fault(ranks_of(proc.pid))
        t0 = time.monotonic()
        _, err = proc.communicate(timeout=BOUND_S + 30)
        elapsed = time.monotonic() - t0
        left = _gone(proc.pid)
    finally:
        if proc.poll() is None or _group(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode, err, elapsed, left


@pytest.mark.parametrize("trainers,frozen", [pytest.param(1, 0, marks=pytest.mark.extended), (2, 1)],
                         ids=["1-of-1", "1-of-2"])
def test_under_local_spawn_a_frozen_trainer_ends_the_run_with_its_name(tmp_path, trainers, frozen):
    run = tmp_path / "run"
    short = Path(tempfile.mkdtemp(prefix="hs", dir="/tmp"))  # the launcher's scratch and socket dirs land here
    try:
        freeze = lambda ranks: os.kill(ranks[frozen], signal.SIGSTOP)  # noqa: E731
        rc, err, elapsed, left = _launch_and_fault(run, trainers, freeze, clean_env(TMPDIR=str(short)))
    finally:
        scratch = sorted(p.name for p in short.glob("hpcrl-spawn-*"))
        shutil.rmtree(short, ignore_errors=True)
    print(f"{trainers} trainer(s), trainer {frozen} frozen: the launcher exited {elapsed:.1f} s later")
    assert rc == 1, err[-3000:]
    assert elapsed < BOUND_S, elapsed
    last = err.rstrip().splitlines()[-1]
    assert last.startswith("hpcrl.ppo: error: ") and f"trainer rank {frozen} (" in last, err[-3000:]
    assert "stopped responding" in last and "Traceback" not in err, err[-3000:]
    assert not left, left  # the frozen trainer included
    assert scratch == [], scratch
    if trainers == 1:  # the last checkpoint is intact: a resume continues from it
        _resume(run, trainers)


@pytest.mark.parametrize("trainers,frozen", [pytest.param(1, 0, marks=pytest.mark.extended), (2, 1)],
                         ids=["1-of-1", "1-of-2"])
def test_torchrun_style_every_other_rank_exits_naming_the_frozen_trainer(tmp_path, trainers, frozen):
    run = tmp_path / "run"
    procs = torchrun_style("hpcrl.ppo", _args(run, trainers), trainers + 2)
    try:
        _wait_rows(run, 5, procs)
        procs[frozen].send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        others = [p for r, p in enumerate(procs) if r != frozen]
        ends = finish(others, BOUND_S + 30)
        elapsed = time.monotonic() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    print(f"torchrun-style, {trainers} trainer(s), trainer {frozen} frozen: every other rank out {elapsed:.1f} s later")
    assert elapsed < BOUND_S, elapsed
    for rank, (rc, out, err) in zip([r for r in range(len(procs)) if r != frozen], ends):
        assert rc == 1, err[-3000:]
        last = err.rstrip().splitlines()[-1]
        assert "Traceback" not in err, err[-3000:]
        # The frozen trainer, by its heartbeat or (trainer 0) as the store's host. A maker may first see trainer
        # 0 leave, the store with it, once trainer 0 noticed the frozen trainer 1: that is its line then.
        named = f"trainer rank {frozen} (" in last
        assert named or (rank >= trainers and "lost the rendezvous store hosted by trainer rank 0" in last), \
            err[-3000:]
        if rank < trainers:
            assert "stopped responding" in last, err[-3000:]


def test_under_local_spawn_losing_every_maker_ends_the_run_in_one_line(tmp_path):
    """Both makers SIGKILLed: the trainer cannot go on; the parent exits 1 with the trainer's one line (no
    traceback: an expected loss, as under a launcher) and nothing of the run is left."""
    def kill_makers(ranks: list[int]) -> None:
        for pid in ranks[1:]:
            os.kill(pid, signal.SIGKILL)

    rc, err, elapsed, left = _launch_and_fault(tmp_path / "run", 1, kill_makers, clean_env())
    print(f"every maker killed: the launcher exited {elapsed:.1f} s later")
    assert rc == 1, err[-3000:]
    assert elapsed < BOUND_S, elapsed
    last = err.rstrip().splitlines()[-1]
    assert last.startswith("hpcrl.ppo: error: trainer 0: every maker is dead"), err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    assert not left, left
