"""A frozen FastSAC rank (real SIGSTOP on real processes) is named, and every other rank exits within
the heartbeat timeout plus a step: under ``--nproc`` (the parent blames and kills the frozen rank) and
under a torchrun-style launch (no parent: the healthy rank exits on its own)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcrl.core.conventions import EXIT_FAILED
from rank_procs import ranks_of
from torchrun_style import torchrun_style

pytestmark = pytest.mark.timeout(120)

HEARTBEAT_S = 5.0
MARGIN_S = 8.0  # one env step, the watch's poll, the parent's reaping; a loaded 2-core machine
TINY = ["--preset", "pendulum", "--num-envs", "4", "--batch-size", "32", "--actor-hidden", "32",
        "--critic-hidden", "32", "--num-atoms", "21", "--learning-starts", "4", "--random-steps", "4",
        "--num-updates", "1", "--log-every", "100000", "--checkpoint-every", "0", "--eval-episodes", "0",
        "--total-env-steps", "100000000", "--heartbeat-timeout-s", str(HEARTBEAT_S)]


def _env(**extra: str) -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}, "OMP_NUM_THREADS": "1", **extra}


def _started(run: Path, procs: list[subprocess.Popen], timeout: float = 90.0) -> None:
    """Until rank 0 wrote config.json (the learner is broadcast: training has started), then a second more."""
    deadline = time.time() + timeout
    while time.time() < deadline and not (run / "config.json").exists():
        if any(p.poll() is not None for p in procs):
            raise AssertionError("a rank exited before training: " + "".join(p.communicate()[1][-2000:] for p in procs))
        time.sleep(0.05)
    assert (run / "config.json").exists(), "training did not start"
    time.sleep(1.0)


def _gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True  # dead; its new parent has not reaped it yet
        except (FileNotFoundError, ProcessLookupError):
            return True
        time.sleep(0.1)
    return False


def _freeze_and_wait(frozen: int, healthy: subprocess.Popen) -> tuple[float, str]:
    """SIGSTOP ``frozen``; the seconds until ``healthy`` exited, and its stderr."""
    os.kill(frozen, signal.SIGSTOP)
    t0 = time.time()
    try:
        _, err = healthy.communicate(timeout=HEARTBEAT_S + 60)
    except subprocess.TimeoutExpired:
        healthy.kill()
        raise AssertionError(f"still running {HEARTBEAT_S + 60:g} s after rank froze: " + healthy.communicate()[1][-2000:])
    return time.time() - t0, err


def _kill_and_wait(killed: subprocess.Popen, healthy: subprocess.Popen) -> tuple[float, str]:
    """SIGKILL ``killed``; the seconds until ``healthy`` exited, and its stderr."""
    killed.send_signal(signal.SIGKILL)
    t0 = time.time()
    _, err = healthy.communicate(timeout=HEARTBEAT_S + 60)
    return time.time() - t0, err


@pytest.mark.parametrize("timeout_args", [pytest.param(["--timeout-s", "30"], marks=pytest.mark.extended), []],
                         ids=["timeout-30", "default-timeout"])  # the fast tier keeps the default users run
def test_frozen_rank_under_nproc_is_named_and_the_run_exits(tmp_path, timeout_args):
    """With the default --timeout-s (300) too: the heartbeat, not the collective timeout, ends the run."""
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "hpcrl.sac", *TINY, *timeout_args, "--nproc", "2",
                             "--run-dir", str(run)], env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    ranks: list[int] = []
    try:
        _started(run, [proc])
        ranks = ranks_of(proc.pid)
        assert len(ranks) == 2, ranks
        took, err = _freeze_and_wait(ranks[1], proc)
    finally:
        for pid in ranks:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.kill()
    assert proc.returncode == EXIT_FAILED, err[-3000:]
    assert took < HEARTBEAT_S + MARGIN_S, f"exit took {took:.1f} s after the freeze"
    lines = [line for line in err.splitlines() if "stopped responding" in line]
    # the healthy rank's line first, the parent's last; both name the frozen rank, never the healthy one
    assert lines and all("rank 1 " in line and "no heartbeat for 5 s" in line for line in lines), err[-3000:]
    assert err.rstrip().splitlines()[-1].startswith("hpcrl.sac: error: rank 1 "), err[-3000:]
    assert "gloo" not in err.lower() and "Traceback" not in err, err[-3000:]
    assert all(_gone(pid) for pid in ranks), "a rank outlived the run"
    assert not list((run / "checkpoints").glob("step_*")) if (run / "checkpoints").exists() else True


def _torchrun_style(run: Path) -> list[subprocess.Popen]:
    """Two ranks started as torchrun does (RANK, WORLD_SIZE, MASTER_*), no supervising parent."""
    return torchrun_style("hpcrl.sac", [*TINY, "--run-dir", str(run)], 2)


def test_frozen_rank_under_torchrun_style_launch_is_named_by_the_other(tmp_path):
    """No supervising parent: the healthy rank (rank 0, which hosts the store) exits on its own."""
    run = tmp_path / "run"
    procs = _torchrun_style(run)
    try:
        _started(run, procs)
        took, err = _freeze_and_wait(procs[1].pid, procs[0])
    finally:
        for p in procs:
            p.kill()
    assert procs[0].returncode == EXIT_FAILED, err[-3000:]
    assert took < HEARTBEAT_S + MARGIN_S, f"exit took {took:.1f} s after the freeze"
    assert "hpcrl: rank 1 " in err and "stopped responding: no heartbeat for 5 s" in err, err[-3000:]
    assert "Traceback" not in err, err[-3000:]


def test_a_killed_rank_is_named_in_one_line_by_the_rank_waiting_in_a_shared_memory_sum(tmp_path):
    """Rank 1 SIGKILLed mid-training: rank 0 (same host, so its sums go through shared memory) sees the
    process gone at once, and the heartbeat watch names it in one line, as for a gloo error: no traceback."""
    run = tmp_path / "run"
    procs = _torchrun_style(run)
    try:
        _started(run, procs)
        took, err = _kill_and_wait(procs[1], procs[0])
    finally:
        for p in procs:
            p.kill()
    assert procs[0].returncode == EXIT_FAILED, err[-3000:]
    assert took < HEARTBEAT_S + MARGIN_S, f"exit took {took:.1f} s"
    assert "hpcrl: rank 1 " in err and "Traceback" not in err, err[-3000:]


@pytest.mark.parametrize("sig", [signal.SIGSTOP, signal.SIGKILL], ids=["frozen", "killed"])
def test_lost_store_host_is_named_in_one_line_and_its_frames_go_to_the_log(tmp_path, sig):
    """Rank 0 hosts the store (torchrun-style): frozen or killed, rank 1 names it in one line; the C++
    frames of the broken store connection land in RUN_DIR/logs/rank1.log, not on the terminal."""
    run = tmp_path / "run"
    procs = _torchrun_style(run)
    try:
        _started(run, procs)
        if sig == signal.SIGSTOP:
            took, err = _freeze_and_wait(procs[0].pid, procs[1])
        else:
            took, err = _kill_and_wait(procs[0], procs[1])
    finally:
        for p in procs:
            p.kill()
    assert procs[1].returncode == EXIT_FAILED, err[-3000:]
    assert took < HEARTBEAT_S + MARGIN_S, f"exit took {took:.1f} s"
    assert len(err.strip().splitlines()) == 1, err[-3000:]
    assert "hpcrl: rank 0 " in err and "which hosts the rendezvous store, stopped responding" in err, err
    assert "frame #" not in err and "Traceback" not in err
    assert (run / "logs" / "rank1.log").exists()


def test_a_run_that_ends_is_not_taken_for_a_freeze(tmp_path):
    """Ranks leave at different moments: a finished rank's silence is an exit (it says so), never a freeze."""
    run = tmp_path / "run"
    args = [a if a != "100000000" else "800" for a in TINY]
    done = subprocess.run([sys.executable, "-m", "hpcrl.sac", *args, "--heartbeat-timeout-s", "2", "--nproc", "2",
                           "--checkpoint-every", "50", "--log-every", "50", "--run-dir", str(run)], env=_env(), capture_output=True,
                          text=True, timeout=100)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "stopped responding" not in done.stderr
    assert sorted(p.name for p in (run / "logs").iterdir()) == ["rank0.log", "rank1.log"]


class _SlowQueries:
    """A real store whose watcher queries take ``delay_s``: the watch thread is inside one most of the time."""

    def __init__(self, store, delay_s: float) -> None:
        self.store, self.delay_s = store, delay_s

    def clone(self):
        return _SlowQueries(self.store.clone(), self.delay_s)

    def multi_get(self, keys):
        time.sleep(self.delay_s)
        return self.store.multi_get(keys)

    def __getattr__(self, name):  # set, get, check, set_timeout: the real store's
        return getattr(self.store, name)


def test_a_closed_watch_leaves_no_store_call_in_flight():
    """After ``close()`` no thread of the watch is inside a store call: one that returns from C++ into an
    exiting interpreter aborts the process (rc 134, "terminate called without an active exception"), as a
    Slurm rank once did after "hpcrl: done"."""
    import threading
    from datetime import timedelta

    import torch

    from hpcrl.comm import DistContext
    from hpcrl.comm.heartbeat import PeerWatch
    from hpcrl.comm.local import _loopback_store

    server = _loopback_store(1)
    store = _SlowQueries(server.clone(), delay_s=0.4)
    for rank in (0, 1):  # as the bootstrap registers them
        store.set(f"host/{rank}", f"host{rank}")
    store.set("hb/1", "1")  # the peer beats once: from then on the watcher reads it with multi_get
    ctx = DistContext(0, 2, 0, torch.device("cpu"), "gloo", True, "torchrun", timedelta(seconds=30), "host0",
                      store=store)
    lost: list[str] = []
    watch = PeerWatch(ctx, timeout_s=30.0, say=lost.append, record=lambda line, peer: None, poll_s=0.05)
    deadline = time.time() + 10
    while not any(t.name == "store-query" for t in threading.enumerate()):
        assert time.time() < deadline, "the watch never queried the store"
        time.sleep(0.01)
    watch.close(done=True)
    busy = [t.name for t in threading.enumerate() if t.name in ("store-query", "peer-watch") and t.is_alive()]
    assert busy == [] and lost == []
