"""``python -m hpcrl.sac.export RUN_DIR --out policy.onnx [--which best|final|latest]``

Writes the deterministic FastSAC policy (observation normaliser + actor + tanh squash into the
action box) as ONE ONNX graph: input ``obs`` float32 ``[batch, obs_dim]`` (dynamic batch), output
``action`` float32 ``[batch, action_dim]``. Then it runs the file with onnxruntime against the torch
:class:`~hpcrl.sac.policy.Policy` on random observations (batch sizes other than the export's too)
and prints the largest absolute difference; above ``--tolerance`` (1e-5) it exits 1 and leaves
``--out`` as it was. The file is written under a temporary name and renamed only once verified.

This runs off the training path, on a finished (or running) run's snapshot: training never pays
for an export, and a rank never dies of an exporter bug.

Exporter: ``torch.onnx.export(..., dynamo=True)`` is torch 2.13's default and the maintained one
(torch.export graph -> onnxscript); the TorchScript exporter (``--exporter torchscript``) is
deprecated but needs no onnxscript and exports in a fraction of a second. Both give the same graph
here (Gemm, LayerNormalization, SiLU as Sigmoid*Mul, Tanh; the unused log-std head is dropped) and
both are verified the same way. The normaliser's statistics are float32 buffers of the Policy, so
the graph holds no float64. Needs ``pip install 'hpcrl[export]'`` (onnx, onnxruntime, onnxscript).

Exit codes: 0 exported and verified, 1 verification failed, 2 bad input (one line).
"""

from __future__ import annotations

import logging
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import torch
import tyro

from hpcrl.run.cli import cli
from hpcrl.core.config_check import Check, ConfigError
from hpcrl.core.conventions import EXIT_BAD_CONFIG, EXIT_FAILED
from hpcrl.core.rundir_files import atomic_path

from .policy import Policy, load

__all__ = ["ExportConfig", "ExportMismatch", "export_onnx", "main", "verify_onnx"]

EXPORT_BATCH = 8  # example batch at export time; >= 2 so torch.export does not specialise the batch axis to 1
VERIFY_BATCHES = (64, 1, 3)  # the checked batch sizes, all different from EXPORT_BATCH


class ExportMismatch(RuntimeError):
    """onnxruntime's actions differ from the torch policy's by more than the tolerance."""


@dataclass
class ExportConfig:
    """Export a trained FastSAC policy to ONNX and verify it with onnxruntime."""

    run_dir: Annotated[str, tyro.conf.Positional] = "runs/fastsac"
    """Run directory (or a policy.pt snapshot, or a checkpoints/step_N directory)."""
    out: str = "policy.onnx"
    """Where to write the ONNX file (a path ending in .onnx)."""
    which: Literal["best", "final", "latest"] = "best"
    """Which policy of the run: best eval return, end of training, or the newest training checkpoint."""
    exporter: Literal["dynamo", "torchscript"] = "dynamo"
    """torch.onnx exporter: dynamo (torch's default, needs onnxscript) or the older torchscript one."""
    opset: int = 18
    """ONNX opset version (>= 17: LayerNormalization is a single op from 17 on)."""
    tolerance: float = 1e-5
    """Largest allowed |onnxruntime - torch| over the verification actions (> 0)."""
    seed: int = 0
    """Seed of the random verification observations (>= 0)."""

    def check(self) -> None:
        c = Check(self)
        c.text("run_dir")
        c.text("out")
        if not self.out.lower().endswith(".onnx"):
            c.fail("out", "a path ending in .onnx", f"e.g. --out {Path(self.out).stem or 'policy'}.onnx")
        c.integer("opset", 17, hint="LayerNormalization needs 17")
        c.real("tolerance", 0.0, lo_open=True, hint="max abs difference")
        c.integer("seed", 0)


def _onnx_modules():
    try:
        import onnx
        import onnxruntime
    except ImportError:
        raise ConfigError("export needs onnx and onnxruntime: pip install 'hpcrl[export]'") from None
    return onnx, onnxruntime


def export_onnx(policy: Policy, path: str | Path, *, exporter: str = "dynamo", opset: int = 18,
                metadata: dict[str, str] | None = None) -> None:
    """Write ``policy`` as a single-file ONNX graph ``obs [batch, obs_dim] -> action [batch, action_dim]``."""
    onnx, _ = _onnx_modules()
    policy = policy.cpu().eval()
    example = (torch.zeros(EXPORT_BATCH, policy.obs_dim),)
    names = dict(input_names=["obs"], output_names=["action"], opset_version=opset)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # exporter chatter (deprecations, torchvision absent) is not the user's
        if exporter == "dynamo":
            try:
                import onnxscript  # noqa: F401  (the dynamo exporter's backend)
            except ImportError:
                raise ConfigError("--exporter dynamo needs onnxscript: pip install 'hpcrl[export]', "
                                  "or pass --exporter torchscript") from None
            quiet = logging.getLogger("torch.onnx")
            level = quiet.level
            quiet.setLevel(logging.ERROR)
            try:
                torch.onnx.export(policy, example, str(path), dynamo=True, external_data=False,
                                  dynamic_shapes={"obs": {0: torch.export.Dim("batch")}}, verbose=False, **names)
            finally:
                quiet.setLevel(level)
        else:
            torch.onnx.export(policy, example, str(path), dynamo=False,
                              dynamic_axes={"obs": {0: "batch"}, "action": {0: "batch"}}, **names)
    model = onnx.load(str(path))
    onnx.checker.check_model(model)
    if metadata:
        onnx.helper.set_model_props(model, {k: str(v) for k, v in metadata.items()})
    onnx.save(model, str(path))


def verification_obs(policy: Policy, batch: int, generator: torch.Generator) -> torch.Tensor:
    """Random observations around the normaliser's statistics, tails included (3 std)."""
    z = 3.0 * torch.randn(batch, policy.obs_dim, generator=generator)
    return policy.obs_mean + policy.obs_std * z if policy.normalize else z


@torch.no_grad()
def verify_onnx(path: str | Path, policy: Policy, *, seed: int = 0, batches=VERIFY_BATCHES) -> tuple[float, int]:
    """(max |onnxruntime - torch| over the actions, observations checked) for random observations in
    each batch size of ``batches`` (none of them the export's)."""
    _, ort = _onnx_modules()
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    generator = torch.Generator().manual_seed(seed)
    worst, count = 0.0, 0
    for batch in batches:
        obs = verification_obs(policy, batch, generator)
        (got,) = session.run(["action"], {"obs": obs.numpy()})
        want = policy.cpu()(obs)
        if tuple(got.shape) != tuple(want.shape):
            raise ExportMismatch(f"{path}: onnxruntime gave shape {tuple(got.shape)} for batch {batch}, "
                                 f"torch {tuple(want.shape)}")
        worst = max(worst, float((torch.from_numpy(got) - want).abs().max()))
        count += batch
    return worst, count


def export(cfg: ExportConfig) -> float:
    """Export and verify; returns the max abs difference. :class:`ExportMismatch` above the tolerance."""
    cfg.check()
    policy, meta, where = load(cfg.run_dir, cfg.which)
    out = Path(cfg.out)
    if not out.parent.is_dir():
        raise ConfigError(f"--out {cfg.out}: directory {out.parent} does not exist; create it or choose another path")
    metadata = {"producer": "hpcrl.sac.export", "source": str(where), "obs_dim": policy.obs_dim,
                "action_dim": policy.action_dim, **{k: v for k, v in meta.items() if v is not None and k != "source"}}
    with atomic_path(out) as tmp:  # renamed onto --out only if verification passes (else removed)
        export_onnx(policy, tmp, exporter=cfg.exporter, opset=cfg.opset, metadata=metadata)
        worst, count = verify_onnx(tmp, policy, seed=cfg.seed)
        verdict = "ok" if worst <= cfg.tolerance else "FAILED"
        print(f"hpcrl.sac.export: {where} -> {out} ({cfg.exporter} exporter, opset {cfg.opset}); onnxruntime vs "
              f"torch on {count} random observations (batch sizes {', '.join(map(str, VERIFY_BATCHES))}; "
              f"exported at {EXPORT_BATCH}): max abs diff {worst:.3g} (tolerance {cfg.tolerance:g}) {verdict}",
              flush=True)
        if worst > cfg.tolerance:
            raise ExportMismatch(f"{out}: onnxruntime differs from the torch policy by {worst:.3g} > "
                                 f"--tolerance {cfg.tolerance:g}; nothing written")
    return worst


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = cli(ExportConfig, sys.argv[1:] if argv is None else argv, "python -m hpcrl.sac.export")
        export(cfg)
    except ConfigError as err:
        print(f"hpcrl.sac.export: error: {err}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    except ExportMismatch as err:
        print(f"hpcrl.sac.export: error: {err}", file=sys.stderr)
        return EXIT_FAILED
    return 0


if __name__ == "__main__":
    sys.exit(main())
