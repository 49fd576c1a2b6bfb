"""``python -m hpcrl.ppo.export RUN --out DIR`` deletes nothing it did not write: a run dir, the run being
exported, or a non-empty directory that is not an earlier export is refused (exit 2, one line, every
file left as it was) before any model is built; an earlier export is replaced whole."""

from __future__ import annotations

import json
import re
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpcrl.run.rundir import RunDirError

from hpcrl.ppo import export as ex


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _export_cli(run: Path, out: Path, *extra: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    return subprocess.run([sys.executable, "-m", "hpcrl.ppo.export", str(run), "--out", str(out), *extra],
                          capture_output=True, text=True, timeout=120, env={**env, "HF_HUB_OFFLINE": "1"}, cwd=cwd)


def _model_dir(path: Path, weights: bytes) -> Path:
    """What save_pretrained writes for a small model and its tokenizer."""
    path.mkdir(parents=True)
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        (path / name).write_text("{}")
    (path / "model.safetensors").write_bytes(weights)
    return path


def test_an_out_dir_holding_a_run_or_other_files_is_refused_in_one_line(tmp_path):
    runs = tmp_path / "runs"
    run = runs / "hf"  # the run being exported (not read: --out is checked first)
    run.mkdir(parents=True)
    other = runs / "pendulum"  # another run: `--out runs/pendulum` must not delete it
    (other / "best").mkdir(parents=True)
    (other / "metrics.jsonl").write_text('{"env_steps": 8}\n')
    (other / "best" / "policy.pt").write_text("weights")
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("mine")
    before = snapshot(tmp_path)
    cases = {other: "holds a run (1 metrics row(s), best/)", runs: "holds the run being exported",
             run: "holds the run being exported", run / "hf": "is inside the run dir",
             notes: "is not empty and not an earlier export"}
    proc = _export_cli(run, other)  # the command as typed: exit 2, one line
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [f"hpcrl.ppo.export: --out {other} {cases[other]}; exporting there "
                                                "would delete it: pass another --out"]
    for out, said in cases.items():  # the same check, in this process
        with pytest.raises(RunDirError, match=re.escape(said)):
            ex.export(run, out)
    assert ex.main([str(run), "--out", str(notes)]) == 2
    with pytest.raises(RunDirError, match="holds a run"):
        ex.export(run, other, overwrite=True)  # --overwrite never replaces a run
    assert snapshot(tmp_path) == before  # every file as it was
    assert not (run / "hf").exists()
    ex.check_out(notes, run, overwrite=True)  # another non-empty directory: only with --overwrite
    ex.check_out(tmp_path / "new", run)
    (tmp_path / "empty").mkdir()
    ex.check_out(tmp_path / "empty", run)
    (tmp_path / "file").write_text("x")
    with pytest.raises(RunDirError, match="not a directory"):
        ex.check_out(tmp_path / "file", run, overwrite=True)


def test_an_earlier_export_is_replaced_whole_and_anything_added_to_it_is_refused(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    out = tmp_path / "export"
    ex.install(_model_dir(tmp_path / ".w1", b"first"), out)
    marker = json.loads((out / ex.MARKER).read_text())
    assert marker["files"] == ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                               "tokenizer_config.json"]
    ex.check_out(out, run)  # an earlier export: replaced without --overwrite
    ex.install(_model_dir(tmp_path / ".w2", b"second"), out)
    assert (out / "model.safetensors").read_bytes() == b"second"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export", "run"]  # no old copy or temporary left
    (out / "README.md").write_text("my notes on this model")  # added by hand: not the tool's to delete
    with pytest.raises(RunDirError, match=r"not an earlier export .*holds README.md.*--overwrite to replace it"):
        ex.check_out(out, run)
    ex.check_out(out, run, overwrite=True)
    (out / "README.md").unlink()
    (out / "model.safetensors").unlink()
    (out / "model.safetensors").mkdir()  # a directory where the export wrote a file
    with pytest.raises(RunDirError, match="not an earlier export"):
        ex.check_out(out, run)
    old = tmp_path / "old-export"  # written before the marker existed: --overwrite
    _model_dir(old, b"old")
    with pytest.raises(RunDirError, match="not an earlier export"):
        ex.check_out(old, run)


def test_a_bad_max_shard_size_is_refused_in_one_line_before_the_model(tmp_path, capsys):
    run = tmp_path / "run"  # not read: the size is checked before the run's config
    run.mkdir()
    for bad in ("abc", "0MB", "-5KB"):
        assert ex.main([str(run), "--out", str(tmp_path / "out"), "--max-shard-size", bad]) == 2
        assert capsys.readouterr().err.strip().splitlines() == [
            f"hpcrl.ppo.export: --max-shard-size {bad}: not a size; pass e.g. 500MB or 2GB"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
