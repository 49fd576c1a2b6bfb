"""Soak (extended tier): 20 random fault events, seeded (the seed is printed; ``HPCRL_SOAK_SEED`` replays
one), on real processes with ``--nproc``: half across a 2-maker : 2-trainer detached PPO run, half
across a 2-rank FastSAC run, each continued with ``--resume`` after every event that stops it.

* PPO events: a maker frozen (SIGSTOP) past the heartbeat timeout then woken, a maker SIGKILLed (both:
  dropped and counted, the run goes on; the frozen one is SIGKILLed by the parent once dropped, or
  leaves on its own if woken first), SIGTERM to the parent
  (checkpoint, exit 75). Every job ends 0 or 75 (within 120 s of its event: a maker lost in the end
  phase once held trainer 0 for --timeout-s, seed 597737) and the run's accounts (a finished job's
  closing row, a stopped job's ``accounts.json`` by its last checkpoint: over every job so far) account
  for every sample; a maker fault sent after the last update's row may land after that maker finished,
  and then need not count as lost.
* FastSAC events: a rank frozen (every other rank exits 1 naming it within the heartbeat timeout), a
  rank SIGKILLed (exit 1), SIGTERM to the parent (exit 75). After each, ``--resume`` continues; the
  final run finishes and its rows are consistent (env steps strictly increasing, ending at the total).
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

from hpcrl.run.checkpoint import committed
from hpcrl.run.rundir_reuse import committed_steps

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))

from rank_procs import ranks_of  # noqa: E402
from test_spawn import TINY  # noqa: E402
from test_spawn import _finish as _end  # noqa: E402  (communicate, then SIGKILL the group)

pytestmark = [pytest.mark.extended, pytest.mark.timeout(480)]

HEARTBEAT_S = 3.0
EVENTS_EACH = 10


def _rng() -> random.Random:
    seed = int(os.environ.get("HPCRL_SOAK_SEED", time.time_ns() % 1_000_000))
    print(f"soak seed {seed} (HPCRL_SOAK_SEED={seed} replays it)", flush=True)
    return random.Random(seed)


def _env(tmp: Path) -> dict[str, str]:
    scratch = tmp / "scratch"
    scratch.mkdir(exist_ok=True)
    return {**{k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}, "TMPDIR": str(scratch),
            "OMP_NUM_THREADS": "1"}


def _rows(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _start(module: str, args: list[str], tmp: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", module, *args], env=_env(tmp), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _wait_rows(run: Path, n: int, proc: subprocess.Popen, timeout: float = 180) -> bool:
    """True once ``run`` has ``n`` rows; False if the job ended first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if len(_rows(run)) >= n:
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.02)
    raise AssertionError(f"no {n} rows within {timeout} s")


def _accounts(run: Path, rc: int) -> dict:
    """The run's sample accounts after a job: its closing row (finished), or those kept by the last
    checkpoint of a stopped job (no closing row then)."""
    if rc == 0:
        return _rows(run)[-1]
    return json.loads((committed(run)[0] / "accounts.json").read_text())


def _ppo_job(rng: random.Random, run: Path, tmp: Path, resume: bool, budget: int) -> tuple[int, list[str]]:
    """One PPO job with up to ``budget`` (<= 2) events: a maker fault, then maybe SIGTERM; (rc, events)."""
    lost_before = _accounts(run, 75)["makers_lost"] if resume else 0.0  # the jobs before this one's
    args = ["--workload", "cartpole", "--makers", "2", "--trainers", "2", "--total-steps", "100",
            "--heartbeat-timeout-s", str(HEARTBEAT_S), "--checkpoint-every", "10", "--run-dir", str(run)]
    proc = _start("hpcrl.ppo", args + (["--resume"] if resume else []), tmp)
    done: list[str] = []
    late = 0  # maker faults sent once the last update's row was out: the maker may have finished already
    try:
        if budget and _wait_rows(run, len(_rows(run)) + rng.randint(2, 6), proc):
            makers = ranks_of(proc.pid)[2:]  # ranks 2, 3
            at_end = bool(_rows(run)) and _rows(run)[-1]["updates"] >= 100
            kind = rng.choice(["freeze", "kill", "sigterm"])
            if kind == "freeze":
                os.kill(makers[rng.randrange(2)], signal.SIGSTOP)
                time.sleep(HEARTBEAT_S + rng.uniform(1.5, 3.0))  # past the timeout: dropped
                for pid in makers:
                    try:
                        os.kill(pid, signal.SIGCONT)  # woken: it must leave on its own
                    except ProcessLookupError:  # the parent stopped it already: frozen, and dropped
                        pass
            elif kind == "kill":
                os.kill(makers[rng.randrange(2)], signal.SIGKILL)
            done.append(kind)
            late += kind != "sigterm" and at_end
            if kind != "sigterm" and len(done) < budget and rng.random() < 0.5:
                time.sleep(HEARTBEAT_S + rng.uniform(1.0, 2.0))  # the fault is counted before the stop
                done.append("sigterm")
            if "sigterm" in done and proc.poll() is None:
                os.kill(proc.pid, signal.SIGTERM)
        out, err = _end(proc, 120)
    finally:
        _end(proc, 1)
    assert proc.returncode in (0, 75), f"{done}: rc {proc.returncode}\n{err[-3000:]}"
    final = _accounts(run, proc.returncode)
    assert final["samples_produced"] == (final["samples_consumed"] + final["dropped_stale"]
                                         + final["dropped_shutdown"] + final["lost_in_flight"]), (done, final)
    assert final["accounts_since_update"] == 0  # every job before ended 0 or 75: the accounts cover them all
    faults = sum(k in ("freeze", "kill") for k in done)
    assert faults - late <= final["makers_lost"] - lost_before <= faults, (done, late, final, out[-2000:])
    return proc.returncode, done


def _sac_job(rng: random.Random, run: Path, tmp: Path, resume: bool, fault: bool) -> tuple[int, str | None]:
    args = [*TINY, "--nproc", "2", "--total-env-steps", "1600", "--checkpoint-every", "10",
            "--heartbeat-timeout-s", str(HEARTBEAT_S), "--run-dir", str(run)]
    if resume:  # a job killed before its first checkpoint left rows only: starting over must say --overwrite
        args += ["--resume", "--resume-missing", "fresh"] if committed_steps(run) else ["--overwrite"]
    proc = _start("hpcrl.sac", args, tmp)
    kind = None
    try:
        if fault and _wait_rows(run, len(_rows(run)) + rng.randint(2, 8), proc):
            ranks, kind = ranks_of(proc.pid), rng.choice(["freeze", "kill", "sigterm"])
            t0 = time.monotonic()
            if kind == "freeze":
                os.kill(ranks[rng.randrange(2)], signal.SIGSTOP)
            elif kind == "kill":
                os.kill(ranks[rng.randrange(2)], signal.SIGKILL)
            else:
                os.kill(proc.pid, signal.SIGTERM)
        out, err = _end(proc, 60)
        if kind == "freeze":
            assert time.monotonic() - t0 < HEARTBEAT_S + 15, err[-2000:]
    finally:
        _end(proc, 1)
    expected = {None: 0, "freeze": 1, "kill": 1, "sigterm": 75}[kind]
    assert proc.returncode == expected or (proc.returncode == 0 and kind is not None), \
        f"{kind}: rc {proc.returncode}\n{err[-3000:]}"  # 0: the event came after the last step
    if kind == "freeze" and proc.returncode == 1:
        assert "frozen" in err or "heartbeat" in err, err[-2000:]
    return proc.returncode, kind


def _check_sac_rows(run: Path, total: int) -> None:
    steps = [r["env_steps"] for r in _rows(run)]
    assert steps == sorted(set(steps)), steps  # strictly increasing: every resume dropped what it redid
    assert steps[-1] == total


def _count(events: list, role: str) -> int:
    return sum(e[0] == role for e in events)


def test_soak_20_random_faults_across_ppo_and_fastsac(tmp_path):
    rng = _rng()
    t0 = time.monotonic()
    events: list[tuple[str, str, int]] = []
    ppo, resume, rc = tmp_path / "ppo0", False, 0
    while _count(events, "ppo") < EVENTS_EACH:
        rc, done = _ppo_job(rng, ppo, tmp_path, resume, min(2, EVENTS_EACH - _count(events, "ppo")))
        events += [("ppo", kind, rc) for kind in done]
        resume = rc == 75  # 0: finished, the next events go to a fresh run
        if not resume:
            ppo = tmp_path / f"ppo{len(events)}"
    if resume:  # the last job stopped at a SIGTERM: the resumed one finishes it, every sample accounted for
        assert _ppo_job(rng, ppo, tmp_path, True, 0)[0] == 0
    sac, resume = tmp_path / "sac0", False
    while _count(events, "sac") < EVENTS_EACH:
        rc, kind = _sac_job(rng, sac, tmp_path, resume, fault=True)
        events += [("sac", kind, rc)] if kind is not None else []
        resume = rc != 0
        if not resume:  # finished despite it (the event came late): its rows hold, then a fresh run
            _check_sac_rows(sac, 1600)
            sac = tmp_path / f"sac{len(events)}"
    if resume:
        assert _sac_job(rng, sac, tmp_path, True, fault=False)[0] == 0
    _check_sac_rows(sac, 1600)
    print(f"soak: {len(events)} events in {time.monotonic() - t0:.0f} s: {events}", flush=True)
    assert len(events) == 2 * EVENTS_EACH
