"""Disk faults during a run are errors, not crashes, and nothing a resume needs is lost.

A FastSAC run (real processes, 2 ranks) on a 2 MiB tmpfs fills it at its third checkpoint: every
rank stops with one line naming the path and the free space, no rank dies of a signal, the partial
checkpoint is removed, the committed ones verify, and after moving the run dir to a roomy disk
``--resume`` logs exactly the rows of an uninterrupted run. A torn write of the row at the
checkpoint's step is restored from the checkpoint on resume. Temporary files are private from the
moment they exist.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from hpcrl.run import checkpoint, checkpoint_write
from hpcrl.core.conventions import EXIT_DISK
from hpcrl.core.diskfault import DiskFault, owned_file
from hpcrl.core.h5io import load_h5, save_h5
from hpcrl.core.rundir_files import atomic_path

# 2 ranks x 256 envs: each checkpoint is ~0.45 MiB larger than the one before (replay up to its fill
# level), so with --keep-checkpoints 2 the third (step 75, next to steps 25 and 50) does not fit in 2 MiB.
ARGS = ["--preset", "pendulum", "--nproc", "2", "--num-envs", "512", "--batch-size", "32", "--actor-hidden", "32",
        "--critic-hidden", "32", "--num-atoms", "21", "--learning-starts", "4", "--random-steps", "4",
        "--num-updates", "1", "--log-every", "5", "--checkpoint-every", "25", "--keep-checkpoints", "2",
        "--buffer-size", "4096", "--eval-episodes", "0", "--total-env-steps", "51200"]
# Until a disk fault has its own exit code, it is a run-dir problem: exit 2 with one line.


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    return {**env, "OMP_NUM_THREADS": "1"}


def _run(run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "hpcrl.sac", *ARGS, "--run-dir", str(run_dir), *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=_env())


def _rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [{k: v for k, v in row.items() if k not in ("time", "sps")} for row in rows]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    ref = tmp_path_factory.mktemp("ref") / "run"
    done = _run(ref)
    assert done.returncode == 0, done.stderr[-3000:]
    return ref


def _mount_tmpfs(where: Path, size: str = "2m") -> None:
    where.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {(mounted.stderr or mounted.stdout).strip()}")


@pytest.fixture
def small_disk(tmp_path) -> Path:
    where = tmp_path / "small"
    _mount_tmpfs(where)
    yield where
    subprocess.run(["umount", "-l", str(where)], check=False)


def _fill(disk: Path, leave: int) -> None:
    """Leave about ``leave`` bytes free on ``disk``. Filling it (``leave`` 0) while a run writes there may find
    it full already, the run's writes having taken the rest: that is the state asked for."""
    st = os.statvfs(disk)
    size = max(0, st.f_bavail * st.f_frsize - leave)
    try:
        with open(disk / "filler", "wb") as f:
            f.write(b"\0" * size)
    except OSError as e:
        if e.errno != errno.ENOSPC or leave:
            raise


def test_temp_files_are_private_from_creation(tmp_path):
    old = os.umask(0o022)
    try:
        with atomic_path(tmp_path / "a.json") as tmp:
            assert tmp.stat().st_mode & 0o777 == 0o600  # before a byte is written
            tmp.write_text("{}")
        with owned_file(tmp_path / "b.h5") as f:
            assert os.fstat(f.fileno()).st_mode & 0o777 == 0o600
            f.write(b"x")
        for name in ("a.json", "b.h5"):
            assert (tmp_path / name).stat().st_mode & 0o777 == 0o600
    finally:
        os.umask(old)


def test_full_disk_is_a_disk_fault_and_the_previous_file_stays(small_disk):
    path = small_disk / "rank0.h5"
    save_h5(path, {"x": torch.ones(10)})
    _fill(small_disk, 64 << 10)
    with pytest.raises(DiskFault) as err:
        save_h5(path, {"x": torch.ones(1 << 18), "g": {"y": np.ones(1 << 16, np.float32), "s": "a"}})
    assert str(err.value).startswith(f"{path}: No space left on device (") and "free of" in str(err.value)
    with pytest.raises(DiskFault):
        with owned_file(small_disk / "learner.pt") as f:
            torch.save({"w": torch.ones(1 << 18)}, f)
    assert sorted(p.name for p in small_disk.iterdir()) == ["filler", "rank0.h5"]  # no temp file left
    assert torch.equal(load_h5(path)["x"], torch.ones(10))


@pytest.mark.timeout(600)
def test_disk_full_during_a_checkpoint_stops_every_rank_and_resumes_exactly(small_disk, reference, tmp_path):
    run_dir = small_disk / "run"
    done = _run(run_dir)
    assert done.returncode not in (-11, 139), done.stderr[-3000:]  # no SIGSEGV
    assert done.returncode == EXIT_DISK, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if "error" in line]
    assert len(errors) == 1, done.stderr[-3000:]
    line = errors[0]
    assert "checkpoint of step 75 not written" in line and "No space left on device" in line
    assert "checkpoints/.tmp-step_000000000075/rank" in line and "free of 2.0 MiB" in line
    assert "Traceback" not in done.stderr
    warnings = [line for line in done.stderr.splitlines() if "warning:" in line and "next checkpoint" in line]
    assert len(warnings) == 1, done.stderr[-3000:]  # the low-space warning came first, once
    root = checkpoint.checkpoint_root(run_dir)
    assert sorted(p.name for p in root.iterdir()) == ["step_000000000025", "step_000000000050"]  # no .tmp-/.fault-
    checkpoint.verify(root / "step_000000000050")

    moved = tmp_path / "moved"  # space freed: the run dir on a roomy disk
    shutil.copytree(run_dir, moved, symlinks=True)
    resumed = _run(moved, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _rows(moved) == _rows(reference)


@pytest.mark.timeout(600)
def test_a_torn_row_at_the_checkpoint_step_is_restored_on_resume(reference, tmp_path):
    """What a kill right after the checkpoint of step 75 leaves when the row of that step was torn (or
    lost with the page cache): that checkpoint the newest, the metrics cut in the middle of its row."""
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir, symlinks=True)
    root = checkpoint.checkpoint_root(run_dir)
    shutil.rmtree(root / "step_000000000100")
    lines = (run_dir / "metrics.jsonl").read_text().splitlines(keepends=True)
    at = next(i for i, line in enumerate(lines) if json.loads(line)["env_steps"] == 75 * 512)
    (run_dir / "metrics.jsonl").write_text("".join(lines[:at]) + lines[at][: len(lines[at]) // 2])
    resumed = _run(run_dir, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "dropped a torn last line" in resumed.stderr and "restored 1 row(s)" in resumed.stderr
    assert _rows(run_dir) == _rows(reference)


def test_a_metrics_write_on_a_full_disk_is_a_disk_fault(small_disk):
    from hpcrl.run.metrics import RunLogger

    logger = RunLogger(small_disk / "run", True, 10**9, tensorboard=False, stream=open(os.devnull, "w"))
    _fill(small_disk, 0)
    with pytest.raises(DiskFault) as err:
        for step in range(10_000):  # the file's current page takes a few rows before the disk refuses
            logger.log({"env_steps": step, "updates": step, "loss": 0.5})
    assert str(err.value).startswith(f"{logger.path}: No space left on device (0 B free of 2.0 MiB")


def test_a_tensorboard_write_on_a_full_disk_is_a_disk_fault_without_a_traceback(tmp_path, capfd):
    """TensorBoard writes its events from its own thread: the disk error it meets there comes back at the
    next row (or at close) as one DiskFault line naming the events dir, and the thread prints no traceback."""
    from hpcrl.run.metrics import RunLogger

    run, tb = tmp_path / "run", tmp_path / "run" / "tb"
    _mount_tmpfs(tb, "1m")  # the events alone on a small disk: metrics.jsonl keeps room
    try:
        logger = RunLogger(run, True, 10**9, stream=open(os.devnull, "w"))
        _fill(tb, 0)
        with pytest.raises(DiskFault) as err:
            for step in range(100_000):
                logger.log({"env_steps": step, "updates": step, "loss": 0.5})
            logger.close()
        assert str(err.value).startswith(f"{tb}: No space left on device (0 B free of 1.0 MiB"), str(err.value)
        assert json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["updates"] == step
        logger.close()  # after the fault: nothing more to raise
        assert "Traceback" not in capfd.readouterr().err
    finally:
        subprocess.run(["umount", "-l", str(tb)], check=False)


def test_one_rank_failing_stops_both_with_the_same_line(tmp_path, monkeypatch):
    """Two ranks as threads: rank 1's write fails on the disk, rank 0's succeeds; both raise the same
    line naming rank 1's path, rank 0 commits nothing and the previous checkpoint stays."""
    import errno
    import threading

    real = checkpoint_write.save_h5

    def save_h5_failing_on_rank1(path, tree, version):
        if Path(path).name == "rank1.h5" and step_now[0] == 2:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real(path, tree, version)

    monkeypatch.setattr(checkpoint_write, "save_h5", save_h5_failing_on_rank1)
    gate = threading.Barrier(2, timeout=60)
    outcome: dict[int, BaseException | None] = {}
    step_now = [1]

    def rank(r: int) -> None:
        try:
            checkpoint.save(tmp_path, step_now[0], r, 2, {"w": torch.ones(3)} if r == 0 else None,
                            {"x": torch.full((4,), float(r))}, lambda name: gate.wait())
            outcome[r] = None
        except BaseException as err:  # noqa: BLE001
            outcome[r] = err

    for step in (1, 2):
        step_now[0] = step
        threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
    assert all(isinstance(outcome[r], DiskFault) for r in range(2)), outcome
    assert str(outcome[0]) == str(outcome[1])
    assert str(outcome[0]).startswith("checkpoint of step 2 not written") and "rank 1: " in str(outcome[0])
    assert "rank1.h5: No space left on device (" in str(outcome[0]) and "rank 0:" not in str(outcome[0])
    root = checkpoint.checkpoint_root(tmp_path)
    assert sorted(p.name for p in root.iterdir()) == ["step_000000000001"]
    checkpoint.verify(root / "step_000000000001")


def test_wandb_offline_files_on_a_full_disk_exit_74_with_one_line(tmp_path):
    """W&B writes its offline files from its own process and only logs its write errors there: a FastSAC
    run whose W&B dir fills up stops at its next row with exit 74 and one line naming that dir (no traceback,
    no W&B logging errors), every row up to it in metrics.jsonl."""
    pytest.importorskip("wandb")
    import time

    from test_spawn import TINY

    wdir = tmp_path / "wandb"
    _mount_tmpfs(wdir, "4m")
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "hpcrl.sac", *TINY, "--total-env-steps", "400000", "--run-dir", str(run),
           "--wandb-project", "p", "--wandb-mode", "offline"]
    env = {**{k: v for k, v in _env().items() if not k.startswith("WANDB_")}, "WANDB_DIR": str(wdir),
           "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 120
        while not ((run / "metrics.jsonl").exists() and (run / "metrics.jsonl").read_text().count("\n") >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.1)
        _fill(wdir, 0)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
        subprocess.run(["umount", "-l", str(wdir)], check=False)
    assert proc.returncode == EXIT_DISK, err[-3000:]
    faults = [line for line in err.splitlines() if f"{wdir}:" in line and "No space left on device" in line]
    assert len(faults) == 1 and "W&B" in faults[0], err[-3000:]
    assert "Traceback" not in err and "Logging error" not in err, err[-3000:]
    assert json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["env_steps"] < 400000
