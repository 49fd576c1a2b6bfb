"""Disk faults in detached PPO's writes: a full disk during a trainer checkpoint (its learner and rank
files, its DCP shards) or an hf actor export is exit 74 with one line naming the path and the free space;
the partial checkpoint is removed, the previous one stays, and ``--resume`` after freeing space goes on.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hpcrl.core.conventions import EXIT_DISK
from hpcrl.core.diskfault import DiskFault
from hpcrl.run import checkpoint

TESTS = Path(__file__).resolve().parent
# 1 maker : 1 trainer, a checkpoint every 5 updates, ~0.5 s apart: time to fill the disk after the first
ARGS = ["--workload", "ppo_toy:ToyWorkload", "--makers", "1", "--trainers", "1", "--total-steps", "30",
        "--rollout-s", "0.1", "--checkpoint-every", "5", "--timeout-s", "60"]
COUNTED = ("env_steps", "updates", "policy_version", "episode_return", "dropped_stale", "checksum_mismatches", "loss")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(TESTS), *sys.path])}


def _cmd(run_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "hpcrl.ppo", *ARGS, "--run-dir", str(run_dir), *extra]


def _rows(run_dir: Path) -> list[dict]:
    """The update rows' counts (timings, lags and rates depend on the machine's load; the closing row aside)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [{k: row.get(k) for k in COUNTED} for row in rows if "samples_produced" not in row]


@pytest.fixture
def small_disk(tmp_path) -> Path:
    """A 1 MiB tmpfs (skips where mounting is not allowed)."""
    where = tmp_path / "small"
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {(mounted.stderr or mounted.stdout).strip()}")
    yield where
    subprocess.run(["umount", "-l", str(where)], check=False)


def fill(disk: Path, leave: int) -> None:
    """Leave about ``leave`` bytes free on ``disk``."""
    st = os.statvfs(disk)
    with open(disk / "filler", "wb") as f:
        f.write(b"\0" * max(0, st.f_bavail * st.f_frsize - leave))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_full_disk_during_a_ppo_checkpoint_exits_74_and_resumes(small_disk, tmp_path):
    run_dir = small_disk / "run"
    proc = subprocess.Popen(_cmd(run_dir), env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        root, deadline = checkpoint.checkpoint_root(run_dir), time.monotonic() + 120
        while not (root.is_dir() and any(p.name.startswith("step_") for p in root.iterdir())):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.02)
        fill(small_disk, 16 << 10)  # room for a few metrics rows, not for a checkpoint
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == EXIT_DISK, err[-3000:]
    errors = [line for line in err.splitlines() if "error" in line]
    assert len(errors) == 1 and "Traceback" not in err, err[-3000:]
    line = errors[0]
    assert "not written" in line and "No space left on device" in line and "free of 1.0 MiB" in line, line
    failed = int(line.split("checkpoint of step ")[1].split()[0])
    assert f"checkpoints/.tmp-step_{failed:012d}/" in line, line
    kept = sorted(p.name for p in root.iterdir())
    assert kept and all(name.startswith("step_") and int(name[5:]) < failed for name in kept), kept  # no .tmp-
    checkpoint.verify(root / kept[-1])

    moved = tmp_path / "moved"  # space freed: the run dir on a roomy disk
    shutil.copytree(run_dir, moved, symlinks=True)
    resumed = subprocess.run(_cmd(moved, "--resume"), env=_env(), capture_output=True, text=True, timeout=180)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    reference = tmp_path / "reference"
    done = subprocess.run(_cmd(reference), env=_env(), capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _rows(moved) == _rows(reference) and [r["policy_version"] for r in _rows(moved)] == list(range(1, 31))
    final = json.loads((moved / "metrics.jsonl").read_text().splitlines()[-1])
    # the faulted job stored no accounts: the closing row's run from the checkpoint resumed
    assert final["accounts_since_update"] == int(kept[-1][5:]) and final["env_steps"] == 30 * 8
    assert final["samples_consumed"] == (30 - final["accounts_since_update"]) * 8


def test_dcp_shards_on_a_full_disk_are_one_line_with_the_free_space(small_disk):
    """DCP wraps a rank's write failure in a CheckpointException (a BaseException; torch's zip writer
    turns the disk error into a position mismatch): the line names the shards' dir and the free space."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from hpcrl.ppo.trainer_checkpoint import dcp_fault_line

    where = small_disk / "dcp"
    with pytest.raises(CheckpointException) as caught, pytest.warns(UserWarning):  # no process group: one process
        dcp.save({"w": torch.ones(1 << 19)}, storage_writer=dcp.FileSystemWriter(str(where)), no_dist=True)
    line = dcp_fault_line(where, caught.value)
    assert line.startswith(f"{where}: No space left on device (") and "free of 1.0 MiB on its filesystem" in line


def test_an_hf_export_shard_on_a_full_disk_is_a_disk_fault(small_disk):
    from hpcrl.ppo.workloads.hf_export import save_shard

    path = small_disk / "model.safetensors"
    with pytest.raises(DiskFault) as err:
        save_shard({"w": torch.ones(1 << 19)}, path)
    assert str(err.value).startswith(f"{path}: No space left on device (") and "free of 1.0 MiB" in str(err.value)
    assert not path.exists()


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.extended
def test_the_hf_export_tool_on_a_full_disk_exits_74_with_one_line(small_disk, tmp_path):
    import hf_fixtures as F

    model, prompts, run = F.build_causal_lm(tmp_path / "llama"), F.write_prompts(tmp_path / "p.jsonl"), tmp_path / "run"
    done = F.run_ppo(["--workload", "hf", "--hf.model", str(model), "--hf.reward-fn", "hf_fixtures:target_fraction",
                      "--hf.prompts", str(prompts), "--hf.max-prompt-tokens", "8", "--hf.max-new-tokens", "4",
                      "--hf.batch-size", "8", "--makers", "1", "--trainers", "1", "--total-steps", "2",
                      "--timeout-s", "60", "--run-dir", str(run)], tmp_path, 300)
    assert done.returncode == 0, done.stderr[-3000:]
    fill(small_disk, 32 << 10)  # the config files fit, the weights do not
    out = small_disk / "actor"
    export = subprocess.run([sys.executable, "-m", "hpcrl.ppo.export", str(run), "--out", str(out)], env=_env(),
                            capture_output=True, text=True, timeout=120)
    assert export.returncode == EXIT_DISK, export.stderr[-3000:]
    lines = [line for line in export.stderr.splitlines() if "error" in line]
    assert len(lines) == 1 and "Traceback" not in export.stderr, export.stderr[-3000:]
    line = lines[0]
    assert line.startswith("hpcrl.ppo.export: error: ") and "model.safetensors: No space left on device (" in line
    assert "free of 1.0 MiB" in line, line
    assert sorted(p.name for p in small_disk.iterdir()) == ["filler"]  # nothing half-written left


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.extended
def test_a_full_disk_under_the_per_checkpoint_hf_export_exits_74_with_one_line(small_disk, tmp_path):
    """Trainer 0 exports the actor to --hf.save-dir after each checkpoint's commit: a full disk there stops
    the run with one line; the checkpoint it exported is committed and verifies."""
    import hf_fixtures as F

    model, prompts, run = F.build_causal_lm(tmp_path / "llama"), F.write_prompts(tmp_path / "p.jsonl"), tmp_path / "run"
    fill(small_disk, 32 << 10)
    done = F.run_ppo(["--workload", "hf", "--hf.model", str(model), "--hf.reward-fn", "hf_fixtures:target_fraction",
                      "--hf.prompts", str(prompts), "--hf.max-prompt-tokens", "8", "--hf.max-new-tokens", "4",
                      "--hf.batch-size", "8", "--hf.save-dir", str(small_disk), "--makers", "1", "--trainers", "1",
                      "--total-steps", "4", "--checkpoint-every", "1", "--timeout-s", "60", "--run-dir", str(run)],
                     tmp_path, 300)
    assert done.returncode == EXIT_DISK, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if "error" in line]
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "model.safetensors: No space left on device (" in lines[0] and "free of 1.0 MiB" in lines[0], lines[0]
    assert sorted(p.name for p in small_disk.iterdir()) == ["filler"]  # no half-written actor
    root = checkpoint.checkpoint_root(run)
    checkpoint.verify(max(root.glob("step_*")))


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.extended
def test_a_full_disk_under_fsdp_dcp_shards_exits_74_and_resumes(tmp_path):
    """--strategy fsdp on a 4 MiB tmpfs: the first checkpoint (~2.1 MiB) fits, the second's DCP shards do
    not (nothing is pruned before a commit). DCP loses the disk error on its way over the ranks: the line
    names the shards' dir and the free space."""
    import hf_fixtures as F

    disk = tmp_path / "small"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        model, prompts = F.build_causal_lm(tmp_path / "llama"), F.write_prompts(tmp_path / "p.jsonl")
        args = ["--workload", "hf", "--hf.model", str(model), "--hf.reward-fn", "hf_fixtures:target_fraction",
                "--hf.prompts", str(prompts), "--hf.max-prompt-tokens", "8", "--hf.max-new-tokens", "4",
                "--hf.batch-size", "8", "--strategy", "fsdp", "--makers", "1", "--trainers", "1", "--total-steps",
                "4", "--checkpoint-every", "1", "--timeout-s", "60"]
        done = F.run_ppo([*args, "--run-dir", str(disk / "run")], tmp_path, 300)
        assert done.returncode == EXIT_DISK, done.stderr[-3000:]
        lines = [line for line in done.stderr.splitlines() if "error" in line]
        assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
        assert "checkpoint of step 2 not written" in lines[0], lines[0]
        assert ".tmp-step_000000000002/dcp: No space left on device (0 B free of 4.0 MiB" in lines[0], lines[0]
        root = checkpoint.checkpoint_root(disk / "run")
        assert sorted(p.name for p in root.iterdir()) == ["step_000000000001"]
        checkpoint.verify(root / "step_000000000001")
        moved = tmp_path / "moved"  # space freed
        shutil.copytree(disk / "run", moved, symlinks=True)
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
    resumed = F.run_ppo([*args, "--run-dir", str(moved), "--resume"], tmp_path, 300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows = [json.loads(line) for line in (moved / "metrics.jsonl").read_text().splitlines()]
    assert [r["policy_version"] for r in rows if "samples_produced" not in r] == [1, 2, 3, 4]
