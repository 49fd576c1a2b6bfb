"""SIGKILL at random points of FastSAC checkpoint writes: every trial leaves a run that
resumes, and the run resumed after all the kills logs exactly the metrics of an uninterrupted run.

One run is killed over and over: start (or ``--resume``), wait until a checkpoint write is under way
(its ``.tmp-step_*`` directory exists; in half of the trials the second write after the start, so
that the run makes progress), sleep a random fraction of a write, SIGKILL the whole process
group (spawn parent and both ranks at once, what a node failure or ``scancel -s KILL`` does). The
kills land in the rank files, the checksums, the manifest, the rename or the pruning after it. A
write's length depends on the machine and on how full the replay is (checkpoints hold only filled
slots), so the sleep's bound follows the writes: it shrinks after a kill that came too late and grows
back after one that landed.

The fast tier kills 3 times in a 240-step run, the extended tier (``-m extended``) 20 times in a
1200-step run; both end with the exact comparison against the uninterrupted run.
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

from hpcrl.run import checkpoint

MAX_SLEEP = 0.04  # seconds; the most a kill waits after a write began
# 2 ranks x 2 envs, a 4096-slot buffer per env (~0.5 MB of replay per rank file), a checkpoint every
# 5 vector steps: 60 checkpoints in 300 vector steps (1200 env steps), more than 20 trials can use up (each
# advances the run by at most two checkpoints); 12 in 240 env steps for 3 trials.
ARGS = ["--preset", "pendulum", "--nproc", "2", "--num-envs", "4", "--batch-size", "32", "--actor-hidden", "32",
        "--critic-hidden", "32", "--num-atoms", "21", "--learning-starts", "4", "--random-steps", "4",
        "--num-updates", "1", "--log-every", "5", "--checkpoint-every", "5", "--keep-checkpoints", "2",
        "--buffer-size", "4096", "--eval-episodes", "0"]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    return {**env, "OMP_NUM_THREADS": "1"}


def _cli(run_dir: Path, steps: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "hpcrl.sac", *ARGS, "--total-env-steps", str(steps), "--run-dir", str(run_dir),
            *extra]


def _rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [{k: v for k, v in row.items() if k not in ("time", "sps")} for row in rows]


def _writing(run_dir: Path) -> str | None:
    """The checkpoint being written now (its .tmp- directory's name), if any."""
    try:
        return next((p.name for p in checkpoint.checkpoint_root(run_dir).iterdir() if p.name.startswith(".tmp-")),
                    None)
    except FileNotFoundError:
        return None


def _wait_write(run_dir: Path, proc: subprocess.Popen, other_than: str | None = None) -> str | None:
    deadline = time.time() + 120
    while proc.poll() is None and time.time() < deadline:
        name = _writing(run_dir)
        if name is not None and name != other_than:
            return name
        time.sleep(0.001)
    return None


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.extended  # 20 kills; the fast tier keeps one (tests/test_sac_train.py, exact resume after a kill)
@pytest.mark.parametrize("trials, steps", [(20, 1200)])
def test_sigkill_during_checkpoints_always_resumes_to_identical_metrics(tmp_path, trials, steps):
    ref = tmp_path / "ref"
    done = subprocess.run(_cli(ref, steps), capture_output=True, text=True, timeout=300, env=_env())
    assert done.returncode == 0, done.stderr[-3000:]
    expected = _rows(ref)
    run = tmp_path / "killed"
    seed = int(time.time())
    rng = random.Random(seed)
    seed_note = f"(kill times drawn with random.Random({seed}))"
    killed_while_writing = 0
    bound = MAX_SLEEP
    for trial in range(trials):
        resume = ["--resume", "--resume-missing", "fresh"] if trial else []
        proc = subprocess.Popen(_cli(run, steps, *resume), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                start_new_session=True, env=_env())
        first = _wait_write(run, proc)
        if trial == 0 or rng.random() < 0.5:  # let this write commit; kill during the next one
            _wait_write(run, proc, other_than=first)
        assert proc.poll() is None, (f"trial {trial}: the run ended before a checkpoint write began (rc "
                                     f"{proc.returncode}) {seed_note}: {proc.stderr.read()[-2000:]}")
        time.sleep(rng.uniform(0.0, bound))
        landed = _writing(run) is not None
        killed_while_writing += landed
        bound = min(MAX_SLEEP, bound * 1.25) if landed else bound * 0.5
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        proc.stderr.close()
        # What a kill leaves must be usable: every committed checkpoint verifies (a kill never commits a
        # damaged one; an interrupted write stays a .tmp- directory that never counts).
        for committed in checkpoint.committed(run):
            checkpoint.verify(committed)

    landed_enough = killed_while_writing >= max(1, trials // 2)
    assert landed_enough, f"only {killed_while_writing} kills landed inside a write {seed_note}"
    resumed = subprocess.run(_cli(run, steps, "--resume"), capture_output=True, text=True, timeout=300, env=_env())
    assert resumed.returncode == 0, f"{seed_note}: {resumed.stderr[-3000:]}"
    assert _rows(run) == expected, f"the resumed run's metrics differ from the uninterrupted run's {seed_note}"
