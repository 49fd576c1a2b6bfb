"""``python -m hpcrl.ppo.export RUN_DIR --out DIR``: the hf actor of a detached-PPO checkpoint (LoRA
merged) as a directory ``transformers`` loads (``AutoModelForCausalLM.from_pretrained(DIR)``).

The actor's tensors are read from the checkpoint's DCP shards alone (``model.actor.*``: no optimizer
moments, no critic), in this process, without a process group, whatever trainer count and strategy
wrote them; an older gathered checkpoint (``learner.pt`` with the full model) works too. Trainer 0's
per-checkpoint ``hf/actor`` export goes through :func:`save_artifacts` the same way, after the commit,
on the checkpoint writer thread; the tensors are dropped once the directory is written.

Bad input (no run dir, no checkpoint, not an hf run, a step that does not exist) exits 2 with one line.
"""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import tyro

from hpcrl import checkpoint
from hpcrl.config_check import ConfigError
from hpcrl.rundir import RunDirError

from .trainer_checkpoint import read_full

__all__ = ["actor_state", "export", "main", "save_artifacts"]


def actor_state(path: Path) -> dict[str, torch.Tensor]:
    """The ``actor.*`` entries of the model state of checkpoint ``path`` (full tensors)."""
    full = read_full(path, keys=lambda key: key.startswith("model.actor."))
    return {k: v for k, v in full["model"].items() if k.startswith("actor.")}


def save_artifacts(workload: Any, path: Path, out_dir: Path | None = None) -> Any:
    """``workload.save_artifacts`` with the model state of committed checkpoint ``path`` read back from its
    shards (only what the actor needs), then released."""
    state = actor_state(path)
    try:
        return workload.save_artifacts(state) if out_dir is None else workload.save_artifacts(state, out_dir)
    finally:
        del state


@dataclass
class ExportArgs:
    run_dir: tyro.conf.Positional[Path]
    """A detached-PPO run dir of --workload hf."""
    out: Path
    """The directory to write (replaced if it exists): config, weights (safetensors), tokenizer."""
    step: int | None = None
    """The checkpoint's step (policy version); default the newest verified one."""


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


def _workload(run_dir: Path) -> Any:
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


def export(run_dir: Path, out: Path, step: int | None = None) -> Path:
    """Write the actor of ``run_dir``'s checkpoint (default the newest) to ``out``; returns ``out``."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise RunDirError(f"{run_dir}: no such run dir")
    workload = _workload(run_dir)
    path = _checkpoint_of(run_dir, step)
    parent = out.with_name(f".{out.name}.export")
    shutil.rmtree(parent, ignore_errors=True)
    written = save_artifacts(workload, path, parent)
    if out.exists():
        shutil.rmtree(out)
    Path(written).rename(out)
    shutil.rmtree(parent, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    args = tyro.cli(ExportArgs, args=argv, prog="python -m hpcrl.ppo.export")
    try:
        out = export(args.run_dir, args.out, args.step)
    except (RunDirError, ConfigError) as err:
        print(f"hpcrl.ppo.export: {err}", file=sys.stderr, flush=True)
        return 2
    print(f"hpcrl.ppo.export: wrote {out} (AutoModelForCausalLM.from_pretrained loads it)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
