"""Checkpoint integrity: manifest, verification, fallback to the previous checkpoint, identity, modes,
metrics repair."""

from __future__ import annotations

import json
import os
import re
import stat
import sys
from pathlib import Path

import pytest
import torch

from hpcrl.run import checkpoint
from hpcrl.run.checkpoint import CheckpointError, CorruptCheckpoint
from hpcrl.comm import SpawnError, init_distributed, shutdown, spawn
from hpcrl.run.metrics import RunLogger, truncate_rows
from hpcrl.run.rundir import RunDirError

CPU = torch.device("cpu")
IDENTITY = {"world_size": 1, "seed": 0, "env": "pendulum", "num_envs": 4, "actor_hidden": 32}


def no_barrier(name: str) -> None:
    pass


def save(run_dir, step, world=1, identity=IDENTITY, keep=3):
    """A checkpoint of ``world`` ranks written by one process (rank files written rank by rank)."""
    ident = {**identity, "world_size": world}
    if world == 1:
        return checkpoint.save(run_dir, step, 0, 1, {"step": torch.tensor(step)}, {"r": torch.full((64,), 0.0 + step)},
                               no_barrier, keep=keep, identity=ident)
    # Simulate the collective with one process: every rank's part, then rank 0's commit.
    root = checkpoint.checkpoint_root(run_dir)
    import threading

    barrier = threading.Barrier(world)
    out = []

    def rank(r):
        out.append(checkpoint.save(run_dir, step, r, world, {"step": torch.tensor(step)} if r == 0 else None,
                                   {"r": torch.full((64,), float(r))}, lambda name: barrier.wait(), keep=keep,
                                   identity=ident))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert root.exists()
    return out[0]


def test_manifest_lists_every_file_and_restore_round_trips(tmp_path):
    path = save(tmp_path, 10)
    manifest = json.loads((path / "manifest.json").read_text())
    assert set(manifest["files"]) == {"learner.pt", "rank0.h5"}
    for name, entry in manifest["files"].items():
        assert entry["size"] == (path / name).stat().st_size and len(entry["crc32"]) == 8
    assert manifest["identity"] == IDENTITY and manifest["step"] == 10 and manifest["world_size"] == 1
    assert not list(path.glob(".*"))  # the per-rank checksum notes are gone
    got = checkpoint.restore(tmp_path, 0, 1, CPU, identity=IDENTITY)
    assert got.path == path and got.step == 10 and int(got.learner["step"]) == 10
    assert got.rank_state["r"].tolist() == [10.0] * 64
    assert checkpoint.latest(tmp_path) == path


def _truncate(p: Path) -> None:
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def _garble(p: Path) -> None:  # same size, other bytes
    data = bytearray(p.read_bytes())
    for i in range(0, len(data), 97):
        data[i] ^= 0xFF
    p.write_bytes(bytes(data))


CORRUPTIONS = {
    "truncated h5": (lambda d: _truncate(d / "rank0.h5"), "rank0.h5 has"),
    "empty h5": (lambda d: (d / "rank0.h5").write_bytes(b""), "rank0.h5 has 0 bytes"),
    "garbled h5": (lambda d: _garble(d / "rank0.h5"), "rank0.h5: checksum mismatch"),
    "garbage learner.pt": (lambda d: _garble(d / "learner.pt"), "learner.pt: checksum mismatch"),
    "truncated learner.pt": (lambda d: _truncate(d / "learner.pt"), "learner.pt has"),
    "missing rank file": (lambda d: (d / "rank0.h5").unlink(), "rank0.h5 is missing"),
    "garbage manifest": (lambda d: (d / "manifest.json").write_bytes(os.urandom(64).replace(b"{", b"x")),
                         "manifest.json is not valid JSON"),
    "empty manifest": (lambda d: (d / "manifest.json").write_text(""), "manifest.json is empty"),
    "truncated manifest": (lambda d: _truncate(d / "manifest.json"), "manifest.json is not valid JSON"),
    "manifest without a file": (
        lambda d: (d / "manifest.json").write_text(json.dumps(
            {**json.loads((d / "manifest.json").read_text()), "files": {}})),
        "no valid entry for learner.pt, rank0.h5"),
    "manifest without files": (
        lambda d: (d / "manifest.json").write_text(json.dumps(
            {k: v for k, v in json.loads((d / "manifest.json").read_text()).items() if k != "files"})),
        "manifest.json is incomplete: no files"),
    "missing manifest": (lambda d: (d / "manifest.json").unlink(), "no manifest.json"),
    "legacy (meta.json only)": (lambda d: ((d / "manifest.json").unlink(), (d / "meta.json").write_text("{}")),
                                "no manifest.json (a checkpoint from before manifests)"),
}


@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_corrupt_newest_checkpoint_is_reported_and_the_previous_one_used(tmp_path, capsys, case):
    corrupt, reason = CORRUPTIONS[case]
    good = save(tmp_path, 10)
    bad = save(tmp_path, 20)
    corrupt(bad)
    got = checkpoint.restore(tmp_path, 0, 1, CPU, identity=IDENTITY)
    err = capsys.readouterr().err
    assert got.path == good and int(got.learner["step"]) == 10, case
    assert str(bad) in err and reason in err, err  # the path and what is wrong
    assert got.skipped and reason in got.skipped[0]
    assert checkpoint.latest(tmp_path) == good
    with pytest.raises(CorruptCheckpoint, match=re.escape(reason)):
        checkpoint.load(bad, 0, 1, CPU)
    # none usable: a RunDirError (exit 2) naming both paths
    corrupt(good)
    with pytest.raises(CheckpointError) as info:
        checkpoint.restore(tmp_path, 0, 1, CPU, identity=IDENTITY)
    assert isinstance(info.value, RunDirError) and isinstance(info.value, ValueError)
    assert str(good) in str(info.value) and str(bad) in str(info.value) and "no usable checkpoint" in str(info.value)
    assert checkpoint.latest(tmp_path) is None


def test_no_checkpoint_is_none_and_tmp_dirs_never_count(tmp_path):
    assert checkpoint.restore(tmp_path, 0, 1, CPU) is None
    (checkpoint.checkpoint_root(tmp_path) / ".tmp-step_000000000010").mkdir(parents=True)
    assert checkpoint.restore(tmp_path, 0, 1, CPU) is None and checkpoint.latest(tmp_path) is None


def test_another_runs_checkpoint_is_refused_naming_the_field(tmp_path):
    save(tmp_path, 10)
    with pytest.raises(CheckpointError, match=r"belongs to another run: seed is 0 in the checkpoint but 1 in this run"):
        checkpoint.restore(tmp_path, 0, 1, CPU, identity={**IDENTITY, "seed": 1})
    with pytest.raises(CheckpointError, match=r"env is \"pendulum\" in the checkpoint but \"cartpole\" in this run "
                                              r"\(also different: actor_hidden\)"):
        checkpoint.restore(tmp_path, 0, 1, CPU, identity={**IDENTITY, "env": "cartpole", "actor_hidden": 64})
    with pytest.raises(CheckpointError, match="new_field is absent in the checkpoint but 3 in this run"):
        checkpoint.load(checkpoint.latest(tmp_path), 0, 1, CPU, identity={**IDENTITY, "new_field": 3})
    with pytest.raises(CheckpointError, match="written by 1 ranks but this job has 2"):
        checkpoint.restore(tmp_path, 0, 2, CPU)
    checkpoint.save(tmp_path / "anon", 5, 0, 1, {}, {}, no_barrier)  # no identity recorded
    with pytest.raises(CheckpointError, match="records no run identity"):
        checkpoint.restore(tmp_path / "anon", 0, 1, CPU, identity=IDENTITY)


def test_prune_keeps_the_newest_and_drops_an_abandoned_future(tmp_path):
    for step in (10, 20, 30):
        save(tmp_path, step, keep=2)
    assert [p.name for p in checkpoint.committed(tmp_path)] == ["step_000000000030", "step_000000000020"]
    save(tmp_path, 25, keep=2)  # resumed from 20 (30 was unusable), then checkpointed at 25
    assert [p.name for p in checkpoint.committed(tmp_path)] == ["step_000000000025", "step_000000000020"]
    assert [p.name for p in checkpoint.clear(tmp_path)] == ["step_000000000025", "step_000000000020"]
    assert checkpoint.committed(tmp_path) == [] and not checkpoint.checkpoint_root(tmp_path).exists()


def test_modes_private_by_default_and_group_readable_when_shared(tmp_path, monkeypatch):
    def mode(p):
        return stat.S_IMODE(p.stat().st_mode)

    path = save(tmp_path / "private", 10)
    assert mode(path.parent) == 0o700 and mode(path) == 0o700
    assert {mode(p) for p in path.iterdir()} == {0o600}
    monkeypatch.setenv("HPCRL_SHARED_RUN_DIR", "1")
    path = save(tmp_path / "shared", 10)
    assert mode(path) == 0o750 and {mode(p) for p in path.iterdir()} == {0o640}


def test_multi_rank_save_and_a_rank_file_corrupt_on_one_rank(tmp_path):
    good = save(tmp_path, 10, world=2)
    bad = save(tmp_path, 20, world=2)
    assert set(json.loads((bad / "manifest.json").read_text())["files"]) == {"learner.pt", "rank0.h5", "rank1.h5"}
    _garble(bad / "rank1.h5")
    rows = spawn(_restore_worker, 2, args=(str(tmp_path),), timeout_s=120)
    # every rank falls back to the same checkpoint, and knows which rank found what
    assert [r["path"] for r in rows] == [str(good)] * 2
    assert [r["value"] for r in rows] == [0.0, 1.0]
    assert all("rank 1: rank1.h5: checksum mismatch" in r["skipped"][0] for r in rows)
    (good / "rank0.h5").unlink()
    with pytest.raises(SpawnError, match="no usable checkpoint"):
        spawn(_restore_worker, 2, args=(str(tmp_path),), timeout_s=120)


def _restore_worker(run_dir: str) -> dict:
    ctx = init_distributed(timeout_s=60)
    try:
        got = checkpoint.restore(run_dir, ctx.rank, ctx.world_size, CPU, identity={**IDENTITY, "world_size": 2},
                                 agree=checkpoint.store_agree(ctx))
        return {"path": str(got.path), "value": float(got.rank_state["r"][0]), "skipped": got.skipped}
    finally:
        shutdown(timeout_s=10)


def test_torn_last_metrics_line_is_repaired_and_rows_after_the_checkpoint_dropped(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    rows = [{"time": i, "env_steps": 20 * i, "x": float(i)} for i in range(1, 6)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"time": 6, "env_ste')
    logger = RunLogger(tmp_path, True, 200, resume_env_steps=60, tensorboard=False)
    logger.log({"env_steps": 80, "x": 9.0})
    logger.close()
    got = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["env_steps"] for r in got] == [20, 40, 60, 80] and got[-1]["x"] == 9.0
    assert "dropped a torn last line" in capsys.readouterr().err
    # a line broken in the middle (not by a crash) is dropped too, with its line number
    path.write_text('{"env_steps": 20}\nnot json\n{"env_steps": 40}\n')
    assert truncate_rows(path, 100) == 2
    assert "1 unreadable line(s) (line 2)" in capsys.readouterr().err
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_checksum_cost_is_small_next_to_the_write(tmp_path):
    """The manifest's CRC-32 must stay a small fraction of writing the checkpoint (measured, printed)."""
    import time

    state = {"replay": {"obs": torch.randn(64, 2**16)}}  # 16 MiB rank file
    t0 = time.perf_counter()
    checkpoint.save_h5(tmp_path / "x.h5", state)
    write_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    checkpoint.file_entry(tmp_path / "x.h5")
    crc_s = time.perf_counter() - t0
    print(f"16 MiB: write+fsync {write_s * 1e3:.1f} ms, crc32 {crc_s * 1e3:.1f} ms", file=sys.stderr)
    assert crc_s < max(write_s, 0.05)


def test_preflight_gives_every_rank_the_same_verdict_from_the_manifests(tmp_path):
    assert checkpoint.preflight(tmp_path, 1, identity=IDENTITY) is None
    assert "no checkpoint in" in checkpoint.nothing_to_resume(tmp_path)
    good = save(tmp_path, 10)
    bad = save(tmp_path, 20)
    (bad / "manifest.json").write_text("{")
    assert checkpoint.preflight(tmp_path, 1, identity=IDENTITY) == good  # unreadable manifests are skipped
    with pytest.raises(CheckpointError, match="seed is 0 in the checkpoint but 5 in this run"):
        checkpoint.preflight(tmp_path, 1, identity={**IDENTITY, "seed": 5})
    (good / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="no usable checkpoint"):
        checkpoint.preflight(tmp_path, 1, identity=IDENTITY)
    checkpoint.clear(tmp_path)
    (checkpoint.checkpoint_root(tmp_path) / ".tmp-step_000000000010").mkdir(parents=True)
    assert "only an uncommitted one" in checkpoint.nothing_to_resume(tmp_path)
