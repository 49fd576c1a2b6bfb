"""Detached PPO keeps training while a maker is frozen: real SIGSTOP on real processes (cartpole, 2 makers :
1 trainer, ``--heartbeat-timeout-s 3``). The frozen maker is dropped and counted, the weights go to the
live maker alone, the run finishes rc 0 with every sample accounted for, and it made updates while the
maker was frozen; woken after being dropped, the maker leaves on its own with exit 0 and a message."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from torchrun_style import free_port  # noqa: E402

pytestmark = pytest.mark.timeout(90)

HEARTBEAT_S = 3.0
ARGS = ["--workload", "cartpole", "--makers", "2", "--heartbeat-timeout-s", str(HEARTBEAT_S), "--timeout-s", "60"]


def _launch(run: Path, steps: int, trainers: int = 1, args: list[str] = ARGS,
            extra_env: dict[str, str] | None = None) -> list[subprocess.Popen]:
    """Independent processes, torchrun-style variables (ranks 0 trainer, 1-2 makers; with ``trainers=2``,
    ranks 0-1 trainers, 2-3 makers): a frozen maker is then the test's to end, and each process's exit
    code is its own."""
    port, procs, world = free_port(), [], trainers + 2
    for rank in range(world):
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}, "RANK": str(rank),
               "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", **(extra_env or {})}
        procs.append(subprocess.Popen([sys.executable, "-m", "hpcrl.ppo", *args, "--trainers", str(trainers),
                                       "--total-steps", str(steps), "--run-dir", str(run)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    return procs


def _rows(run: Path) -> list[dict]:
    """The complete rows so far (read while the run writes: a row being written is left for the next look)."""
    path = run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().split("\n")[:-1] if line.strip()] if path.exists() else []


def _wait_rows(run: Path, n: int, procs: list[subprocess.Popen], timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if len(_rows(run)) >= n:
            return
        if any(p.poll() is not None for p in procs):
            break
        time.sleep(0.02)
    raise AssertionError("the run did not log enough rows: " + "".join(p.communicate()[1][-2000:] for p in procs))


def _updates(run: Path) -> int:
    rows = _rows(run)
    return int(rows[-1]["updates"]) if rows else 0


def _check_accounts(final: dict) -> None:
    assert final["makers_lost"] == 1
    assert final["samples_produced"] == (final["samples_consumed"] + final["dropped_stale"]
                                         + final["dropped_shutdown"] + final["lost_in_flight"])


def test_a_maker_frozen_for_good_is_dropped_and_the_run_finishes(tmp_path):
    run = tmp_path / "run"
    procs = _launch(run, 80)  # frozen at version 5: the drop comes within the 3 s heartbeat timeout, long before 80
    trainer, healthy, frozen = procs
    try:
        _wait_rows(run, 5, procs)
        frozen.send_signal(signal.SIGSTOP)
        at_freeze, t0 = _updates(run), time.monotonic()
        out, err = trainer.communicate(timeout=60)
        assert trainer.returncode == 0, err[-3000:]
        assert time.monotonic() - t0 < 40
        assert healthy.wait(timeout=30) == 0
    finally:
        for p in procs:
            p.kill()
    rows = _rows(run)
    final = rows[-1]
    assert final["policy_version"] == 80 and final["updates"] > at_freeze
    _check_accounts(final)
    assert "weights go point-to-point to the 1 live maker(s)" in out, out[-2000:]
    assert "maker rank 1" not in out + err  # the healthy maker is never blamed


@pytest.mark.extended  # a 300-update run around a 10 s freeze; the fast tier keeps the maker frozen for good
def test_a_maker_frozen_for_10_s_is_dropped_trained_around_and_leaves_when_woken(tmp_path):
    run = tmp_path / "run"
    procs = _launch(run, 300)
    trainer, healthy, frozen = procs
    try:
        _wait_rows(run, 5, procs)
        frozen.send_signal(signal.SIGSTOP)
        at_freeze = _updates(run)
        time.sleep(10.0)
        before_wake = _updates(run)
        frozen.send_signal(signal.SIGCONT)  # dropped by now: it must leave on its own, cleanly
        woke_out, woke_err = frozen.communicate(timeout=30)
        out, err = trainer.communicate(timeout=60)
        assert trainer.returncode == 0, err[-3000:]
        assert healthy.wait(timeout=30) == 0
    finally:
        for p in procs:
            p.kill()
    # progress while the maker was frozen: the trainer went on with the live one
    print(f"updates during the 10 s freeze: {before_wake - at_freeze} (at the freeze: {at_freeze})")
    assert before_wake > at_freeze, (at_freeze, before_wake)
    assert frozen.returncode == 0, woke_err[-2000:]
    assert "maker 1: the trainers dropped this maker" in woke_out, woke_out[-2000:]
    final = _rows(run)[-1]
    assert final["policy_version"] == 300
    _check_accounts(final)
    assert "to the 1 live maker(s)" in out, out[-2000:]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fault", ["freeze", pytest.param("kill", marks=pytest.mark.extended)])
def test_a_maker_lost_after_trainer_0_drained_is_dropped_not_waited_for(tmp_path, fault):
    """The soak's end-of-run hang (seed 597737): 2 makers : 2 trainers, maker 1 feeds trainer 1 only, and is
    frozen (or killed) once the last update's row is out. Trainer 0 has drained its own maker, so it
    learns of the loss only in its end phase (or from trainer 1's drop): it used to wait --timeout-s
    for the maker's done mark and fail. Now the maker is dropped within the heartbeat timeout, by both
    trainers, and counted; the run ends rc 0 with every sample accounted for."""
    run, steps = tmp_path / "run", 20
    procs = _launch(run, steps, trainers=2)
    lost = procs[3]  # maker 1
    try:
        _wait_rows(run, steps, procs, timeout=180)  # the last update's row: the trainers are in their end phase
        lost.send_signal(signal.SIGSTOP if fault == "freeze" else signal.SIGKILL)
        t0 = time.monotonic()
        ends = [p.communicate(timeout=45) for p in procs[:3]]
        elapsed = time.monotonic() - t0
    finally:
        for p in procs:
            p.kill()
    for p, (_, err) in zip(procs[:3], ends):
        assert p.returncode == 0, err[-3000:]
    print(f"{fault} of maker 1 after the last update: every rank done {elapsed:.1f} s later")
    assert elapsed < HEARTBEAT_S + 20, elapsed  # was --timeout-s (60 s), then exit 1
    final = _rows(run)[-1]
    assert final["policy_version"] == steps
    _check_accounts(final)


@pytest.mark.extended
@pytest.mark.timeout(300)
def test_under_local_spawn_a_maker_frozen_for_good_does_not_hold_the_parent(tmp_path):
    """``python -m hpcrl.ppo`` spawning its ranks: once the trainer finished, the parent stops the frozen,
    dropped maker at once (it used to grant it a 30 s grace, then SIGTERM it to no effect, then SIGKILL)."""
    from rank_procs import ranks_of

    run = tmp_path / "run"
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "hpcrl.ppo", *ARGS, "--trainers", "1", "--total-steps", "40",
                             "--run-dir", str(run)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    lines: list[tuple[float, str]] = []
    reader = threading.Thread(target=lambda: lines.extend((time.monotonic(), line) for line in proc.stderr),
                              daemon=True)
    reader.start()
    try:
        _wait_rows(run, 5, [proc], timeout=180)
        os.kill(ranks_of(proc.pid)[2], signal.SIGSTOP)  # rank 2: maker 1, for good
        proc.wait(timeout=120)
        exited = time.monotonic()
        reader.join(timeout=10)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    err = "".join(line for _, line in lines)
    assert proc.returncode == 0, err[-3000:]
    done = next(t for t, line in lines if line.startswith("hpcrl: done in"))
    assert "expendable rank 2 is stopped (SIGSTOP) and was dropped by the run: stopped at once" in err, err[-2000:]
    assert exited - done < 20, exited - done  # the grace was 30 s (then 3 s more for a SIGTERM it cannot act on)
    final = _rows(run)[-1]
    assert final["policy_version"] == 40
    _check_accounts(final)


FRAMES = ("frame #", "Exception raised from", "c10::", "Traceback", "[W", "[E", "terminate called")


@pytest.mark.timeout(300)
def test_store_host_killed_makers_say_one_line_and_keep_cxx_frames_in_their_logs(tmp_path):
    """Trainer 0 (it hosts the rendezvous store) SIGKILLed, torchrun-style: each maker exits 1 at once with
    one line on its terminal naming the lost store host (first and last: nothing else); what torch's C++
    side writes (c10d warnings with their frames) goes to RUN_DIR/logs/rank<N>.log."""
    run = tmp_path / "run"
    procs = _launch(run, 300, extra_env={"HPCRL_JOB_SECRET": "ab" * 32})  # a secret: no unauthenticated warning
    try:
        _wait_rows(run, 5, procs, timeout=180)
        procs[0].send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        ends = [p.communicate(timeout=60) for p in procs[1:]]
        elapsed = time.monotonic() - t0
    finally:
        for p in procs:
            p.kill()
    assert elapsed < HEARTBEAT_S + 10, elapsed
    for m, (p, (out, err)) in enumerate(zip(procs[1:], ends)):
        assert p.returncode == 1, err[-2000:]
        lines = [line for line in (out + err).splitlines() if line.strip()]
        assert len(lines) == 1, lines  # the reason is the first line and the last
        assert lines[0].startswith(f"hpcrl.ppo: error: maker {m}: lost the rendezvous store hosted by trainer rank 0"), \
            lines
        assert not any(f in out + err for f in FRAMES), out + err
        assert (run / "logs" / f"rank{m + 1}.log").is_file()  # where the native side's lines went
