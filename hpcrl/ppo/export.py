"""``python -m hpcrl.ppo.export RUN_DIR --out DIR``: the hf actor of a detached-PPO checkpoint (LoRA
merged) as a directory ``transformers`` loads (``AutoModelForCausalLM.from_pretrained(DIR)``).

The actor's tensors are read from the checkpoint's DCP shards alone (``model.actor.*``: no optimizer
moments, no critic), in this process, without a process group, whatever trainer count and strategy
wrote them, one safetensors file's worth at a time (``--max-shard-size``, default 2GB), LoRA merged per
module, written, dropped (:mod:`hpcrl.ppo.workloads.hf_export`: no model is built); an older gathered
checkpoint (``learner.pt`` with the full model) works too, from its tensors in memory. Trainer 0's
per-checkpoint ``hf/actor`` export goes through :func:`save_artifacts` the same way, after the commit,
on the checkpoint writer thread.

Bad input (no run dir, no checkpoint, not an hf run, a step that does not exist) exits 2 with one line; a
full disk while writing the export exits 74 with one line (the file, the free space).

``--out`` is replaced only when it is absent, empty, or an earlier export of this tool (its
:data:`MARKER` lists the files it wrote, and nothing else is there); any other non-empty directory
needs ``--overwrite``, and a run dir (or a directory holding the run being exported) is never replaced.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import tyro

from hpcrl.run import checkpoint
from hpcrl.run.cli import spell_bools
from hpcrl.core.config_check import ConfigError
from hpcrl.core.conventions import EXIT_DISK
from hpcrl.core.diskfault import DiskFault, fault_line, is_disk_error
from hpcrl.run.rundir import RunDirError
from hpcrl.run.rundir_reuse import previous_run

from .trainer_checkpoint import DCP_DIR, read_full
from .workload import Workload

__all__ = ["MARKER", "actor_state", "check_out", "export", "install", "main", "save_artifacts"]

MARKER = ".hpcrl-export.json"
"""Written into every export: the files it holds, so that a later export may replace exactly that."""


def actor_state(path: Path) -> dict[str, torch.Tensor]:
    """The ``actor.*`` entries of the model state of checkpoint ``path`` (full tensors)."""
    full = read_full(path, keys=lambda key: key.startswith("model.actor."))
    return {k: v for k, v in full["model"].items() if k.startswith("actor.")}


def save_artifacts(workload: Workload, path: Path, out_dir: Path | None = None) -> Any:
    """Export the model of committed checkpoint ``path``: streamed from its DCP shards through the workload's
    ``export_checkpoint(dcp_dir, out_dir)`` where it can (``capabilities().exports_from_shards``; the hf
    workload: one safetensors file's tensors at a time, nothing kept); else ``workload.save_artifacts`` of
    the actor's tensors read in full (an older gathered ``learner.pt``: already one file in memory), then
    released."""
    dcp_dir = Path(path) / DCP_DIR
    try:
        if workload.capabilities().exports_from_shards and (dcp_dir / ".metadata").is_file():  # not a learner.pt
            return workload.export_checkpoint(dcp_dir, out_dir)
        state = actor_state(path)
        try:
            return workload.save_artifacts(state, out_dir)
        finally:
            del state
    except OSError as err:  # a full disk while writing the export: one line, not a traceback
        if not is_disk_error(err):
            raise
        raise DiskFault(fault_line(err.filename or out_dir or path, err)) from None


@dataclass
class ExportArgs:
    run_dir: tyro.conf.Positional[Path]
    """A detached-PPO run dir of --workload hf."""
    out: Path
    """The directory to write: config, weights (safetensors), tokenizer. An earlier export there is replaced;
    any other non-empty directory needs --overwrite; a run dir is never replaced."""
    step: int | None = None
    """The checkpoint's step (policy version); default the newest verified one."""
    overwrite: bool = False
    """Replace --out although it is not an earlier export of this tool (never a run dir)."""
    max_shard_size: str = "2GB"
    """The largest safetensors file (save_pretrained's max_shard_size; e.g. 500MB): the export reads, merges
    and writes one file's tensors at a time, so this bounds its memory."""


def _checkpoint_of(run_dir: Path, step: int | None) -> Path:
    if step is None:
        found = checkpoint.latest(run_dir)
        if found is None:
            raise RunDirError(f"{checkpoint.checkpoint_root(run_dir)}: no verified checkpoint; run the job until "
                              "its first checkpoint (--checkpoint-every N, or the end of the run)")
        return found
    for path in checkpoint.committed(run_dir):
        if int(checkpoint.read_manifest(path)["step"]) == step:
            checkpoint.verify(path)
            return path
    steps = [int(p.name.split("_")[-1]) for p in checkpoint.committed(run_dir)]
    raise RunDirError(f"--step {step}: no such checkpoint in {checkpoint.checkpoint_root(run_dir)} (there: "
                      f"{', '.join(map(str, steps)) or 'none'})")


def _workload(run_dir: Path) -> Workload:
    try:
        saved = json.loads((run_dir / "config.json").read_text())
    except (OSError, ValueError) as err:
        raise RunDirError(f"{run_dir}: no readable config.json ({err}); pass a detached-PPO run dir") from None
    if saved.get("workload") != "hf":
        raise RunDirError(f"{run_dir}: a --workload {saved.get('workload')!r} run; export writes the actor of "
                          "--workload hf runs (its checkpoints hold the other workloads' weights as they are)")
    from .workloads import make_workload
    from .workloads.hf_options import HFOptions

    names = {f for f in HFOptions.__dataclass_fields__}
    options = {k: v for k, v in saved["hf"].items() if k in names}
    return make_workload("hf", **{**options, "save_dir": None})


def _shard_size(value: int | str) -> int:
    from huggingface_hub.serialization._base import parse_size_to_int  # what save_pretrained parses it with

    try:
        size = value if isinstance(value, int) else parse_size_to_int(value)
    except ValueError:
        size = 0
    if size <= 0:
        raise ConfigError(f"--max-shard-size {value}: not a size; pass e.g. 500MB or 2GB")
    return size


def _export_files(out: Path) -> set[str] | None:
    """The files an earlier export of this tool wrote into ``out`` (its marker), or None without one."""
    try:
        files = json.loads((out / MARKER).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return {str(f) for f in files} if isinstance(files, list) else None


def check_out(out: Path, run_dir: Path, overwrite: bool = False) -> None:
    """:class:`RunDirError` (one line) unless ``out`` may be (re)placed by an export of ``run_dir``: absent,
    an empty directory, an earlier export of this tool with nothing added, or (``overwrite``) another
    non-empty directory. A run dir, the run being exported or a directory around it: never."""
    out, run = Path(out).absolute(), Path(run_dir).resolve()
    resolved = out.resolve()
    if resolved == run or resolved in run.parents:
        raise RunDirError(f"--out {out} holds the run being exported ({run_dir}); pass another --out")
    if run in resolved.parents:
        raise RunDirError(f"--out {out} is inside the run dir {run_dir}; pass a directory outside it")
    if not os.path.lexists(out):
        return
    if out.is_symlink() or not out.is_dir():
        raise RunDirError(f"--out {out}: not a directory; pass another --out (a new or empty directory, or an "
                          "earlier export)")
    if (what := previous_run(out)) is not None:
        raise RunDirError(f"--out {out} holds a run ({what}); exporting there would delete it: pass another --out")
    names = {p.name for p in out.iterdir()}
    if not names or overwrite:
        return
    files = _export_files(out)
    if files is None or names - files - {MARKER} or any(not (out / n).is_file() or (out / n).is_symlink()
                                                        for n in names):
        extra = sorted(names - (files or set()) - {MARKER})[:3] or sorted(names)[:3]
        raise RunDirError(f"--out {out} is not empty and not an earlier export of python -m hpcrl.ppo.export (it "
                          f"holds {', '.join(extra)}{', ...' if len(names) > 3 else ''}); pass --overwrite to "
                          "replace it, or another --out")


def install(written: Path, out: Path) -> Path:
    """Move the export ``written`` (a directory) to ``out``, replacing what :func:`check_out` allowed there,
    with the :data:`MARKER` that lets a later export replace it."""
    written = Path(written)
    files = sorted(p.name for p in written.iterdir() if p.name != MARKER)
    (written / MARKER).write_text(json.dumps({"files": files, "by": "python -m hpcrl.ppo.export"}) + "\n")
    if os.path.lexists(out):
        old = out.with_name(f".{out.name}.old{os.getpid()}")
        out.rename(old)  # then the new one in place, then the old one deleted: never half of either
        written.rename(out)
        shutil.rmtree(old)
    else:
        written.rename(out)
    return out


def export(run_dir: Path, out: Path, step: int | None = None, overwrite: bool = False,
           max_shard_size: int | str | None = None) -> Path:
    """Write the actor of ``run_dir``'s checkpoint (default the newest) to ``out`` (:func:`check_out` says
    when it may be replaced), in safetensors files of at most ``max_shard_size`` (default the workload's);
    returns ``out``."""
    run_dir, out = Path(run_dir), Path(out)
    if not run_dir.is_dir():
        raise RunDirError(f"{run_dir}: no such run dir")
    check_out(out, run_dir, overwrite)  # before the model is built: a refusal in seconds
    if max_shard_size is not None:
        _shard_size(max_shard_size)
    workload = _workload(run_dir)
    if max_shard_size is not None:
        workload.export_max_shard_size = max_shard_size
    path = _checkpoint_of(run_dir, step)
    parent = out.with_name(f".{out.name}.export")
    shutil.rmtree(parent, ignore_errors=True)
    try:
        written = save_artifacts(workload, path, parent)
        check_out(out, run_dir, overwrite)  # again, right before replacing it
        install(Path(written), out)
    finally:
        shutil.rmtree(parent, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    try:
        argv = spell_bools(ExportArgs, sys.argv[1:] if argv is None else argv)  # --overwrite True as elsewhere
    except ConfigError as err:
        print(f"hpcrl.ppo.export: {err}", file=sys.stderr, flush=True)
        return 2
    args = tyro.cli(ExportArgs, args=argv, prog="python -m hpcrl.ppo.export")
    try:
        out = export(args.run_dir, args.out, args.step, args.overwrite, args.max_shard_size)
    except DiskFault as err:  # a RunDirError too, with its own exit code
        print(f"hpcrl.ppo.export: error: {err}", file=sys.stderr, flush=True)
        return EXIT_DISK
    except (RunDirError, ConfigError) as err:
        print(f"hpcrl.ppo.export: {err}", file=sys.stderr, flush=True)
        return 2
    print(f"hpcrl.ppo.export: wrote {out} (AutoModelForCausalLM.from_pretrained loads it)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
