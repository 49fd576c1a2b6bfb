"""A trained FastSAC policy as a standalone object: observation normaliser + actor, deterministic action.

A *policy snapshot* (``policy.pt``) is self-contained: the :class:`Policy` constructor arguments,
its state dict and a ``meta`` dict (env id, env steps, eval return, seed, ...). It loads without the
run's config or the training code paths, so ``play``, ``export`` and users' own scripts need only
this module. Where snapshots live in a run directory (:func:`resolve`)::

    RUN_DIR/best/policy.pt       best eval return so far   (--which best, the default)
    RUN_DIR/final/policy.pt      end of training           (--which final)
    RUN_DIR/checkpoints/step_N/  newest committed training checkpoint (--which latest; the policy
                                 is rebuilt from learner.pt + RUN_DIR/config.json)

The normaliser's statistics are frozen into float32 buffers (``obs_mean``, ``obs_std``) computed
exactly as :class:`~hpcrl.sac.normalizer.ObsNormalizer` computes them on the fly (float64 statistics,
cast to float32), so the policy gives bit-identical actions to the training-time deterministic call
``agent.actor.act(normalizer(obs), deterministic=True)`` on CPU, and the ONNX graph has no float64.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hpcrl.run import checkpoint
from hpcrl.core.config_check import ConfigError
from hpcrl.core.rundir_files import atomic_path

from .networks import Actor

__all__ = ["FORMAT", "Policy", "PolicyError", "load", "load_policy", "policy_from_checkpoint", "refuse_ppo_run",
           "resolve", "save_policy", "SNAPSHOT"]

FORMAT = "hpcrl.sac.policy/1"
SNAPSHOT = "policy.pt"
WHICH = ("best", "final", "latest")


class PolicyError(ConfigError):
    """No policy where one was asked for, or a file that is not a policy snapshot; the message (one
    line) names the path and what exists. A ConfigError: the CLIs exit 2 on it."""


class Policy(nn.Module):
    """Deterministic FastSAC policy: observation normaliser + actor, obs (B, obs_dim) float32 -> action
    (B, action_dim) within the env's action bounds."""

    def __init__(self, obs_dim: int, action_dim: int, hidden: int, action_low: list[float],
                 action_high: list[float], layer_norm: bool = True, log_std_min: float = -5.0,
                 log_std_max: float = 0.0, normalize: bool = True, norm_eps: float = 1e-2) -> None:
        super().__init__()
        # Plain Python values only: they are saved as the snapshot's constructor arguments.
        self.init_args = dict(obs_dim=int(obs_dim), action_dim=int(action_dim), hidden=int(hidden),
                              action_low=[float(v) for v in action_low], action_high=[float(v) for v in action_high],
                              layer_norm=bool(layer_norm), log_std_min=float(log_std_min),
                              log_std_max=float(log_std_max), normalize=bool(normalize), norm_eps=float(norm_eps))
        self.actor = Actor(obs_dim, action_dim, hidden, torch.tensor(action_low), torch.tensor(action_high),
                           layer_norm, log_std_min, log_std_max)
        self.normalize = bool(normalize)
        self.norm_eps = float(norm_eps)
        self.register_buffer("obs_mean", torch.zeros(obs_dim))
        self.register_buffer("obs_std", torch.ones(obs_dim))
        self.requires_grad_(False)  # an inference object: no autograd graph behind its actions
        self.eval()

    @property
    def obs_dim(self) -> int:
        return self.init_args["obs_dim"]

    @property
    def action_dim(self) -> int:
        return self.init_args["action_dim"]

    @classmethod
    def from_agent(cls, agent: Any, normalizer: Any) -> "Policy":
        """A CPU copy (eval mode) of ``agent.actor`` (:class:`~hpcrl.sac.agent.FastSAC`) and the current
        statistics of ``normalizer`` (:class:`~hpcrl.sac.normalizer.ObsNormalizer`); both stay untouched."""
        return cls.from_state(agent.cfg, agent.actor.state_dict(), normalizer.state_dict(),
                              enabled=normalizer.enabled, eps=normalizer.eps)

    @classmethod
    def from_state(cls, cfg: Any, actor_state: dict[str, torch.Tensor], normalizer_state: dict[str, torch.Tensor],
                   enabled: bool, eps: float = 1e-2) -> "Policy":
        """From state dicts (as in ``learner.pt``) and the network settings of ``cfg`` (a SACConfig, or any
        object / dict with ``actor_hidden``, ``layer_norm``, ``log_std_min``, ``log_std_max``)."""
        get = cfg.get if isinstance(cfg, dict) else (lambda k: getattr(cfg, k))
        actor_state = {k: v.detach().to("cpu", copy=True) for k, v in actor_state.items()}
        obs_dim = actor_state["trunk.0.weight"].shape[1]
        action_dim = actor_state["mean.weight"].shape[0]
        scale, bias = actor_state["action_scale"].double(), actor_state["action_bias"].double()
        # The bounds only shape the constructor; the exact scale/bias buffers are loaded just below.
        policy = cls(obs_dim, action_dim, int(get("actor_hidden")), (bias - scale).tolist(), (bias + scale).tolist(),
                     bool(get("layer_norm")), float(get("log_std_min")), float(get("log_std_max")),
                     normalize=False, norm_eps=eps)
        policy.actor.load_state_dict(actor_state)
        count = normalizer_state["count"].detach().cpu()
        # ObsNormalizer is the identity when disabled or before its first update.
        if enabled and float(count) > 0:
            mean = normalizer_state["mean"].detach().cpu().to(torch.float64)
            m2 = normalizer_state["m2"].detach().cpu().to(torch.float64)
            std = (m2 / count.to(torch.float64).clamp(min=1)).sqrt()  # ObsNormalizer.std, same ops
            policy.obs_mean.copy_(mean.to(torch.float32))
            policy.obs_std.copy_(std.to(torch.float32))
            policy.normalize = True
            policy.init_args["normalize"] = True
        return policy.eval()

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        if self.normalize:
            obs = (obs - self.obs_mean) / (self.obs_std + self.norm_eps)
        mean, _ = self.actor(obs)
        return torch.tanh(mean) * self.actor.action_scale + self.actor.action_bias


# -- snapshots --------------------------------------------------------------------------------------
def save_policy(path: str | os.PathLike, policy: Policy, meta: dict) -> None:
    """Write a self-contained snapshot atomically (temp file, fsync, rename; mode
    :func:`hpcrl.run.rundir.file_mode`); the parent directory must exist."""
    state = {k: v.detach().cpu().clone() for k, v in policy.state_dict().items()}
    blob = {"format": FORMAT, "init_args": dict(policy.init_args), "state_dict": state, "meta": dict(meta)}
    with atomic_path(path) as tmp:
        torch.save(blob, tmp)


def load_policy(path: str | os.PathLike, device: str | torch.device = "cpu") -> tuple[Policy, dict]:
    """(policy in eval mode on ``device``, meta) of a snapshot written by :func:`save_policy`."""
    path = Path(path)
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise PolicyError(f"{path}: no such file") from None
    except Exception as err:  # noqa: BLE001  (any unpickling failure means the same: not a snapshot)
        raise PolicyError(f"{path}: not a policy snapshot ({type(err).__name__}: {str(err).splitlines()[0]})") from None
    if not isinstance(blob, dict) or blob.get("format") != FORMAT:
        found = blob.get("format") if isinstance(blob, dict) else type(blob).__name__
        raise PolicyError(f"{path}: not a policy snapshot (format {found!r}, expected {FORMAT!r}); "
                          "pass a policy.pt from RUN_DIR/best or RUN_DIR/final, or the run dir itself")
    policy = Policy(**blob["init_args"])
    policy.load_state_dict(blob["state_dict"])
    return policy.to(device).eval(), dict(blob["meta"])


def policy_from_checkpoint(step_dir: str | os.PathLike, device: str | torch.device = "cpu") -> tuple[Policy, dict]:
    """The policy inside a committed training checkpoint (``RUN_DIR/checkpoints/step_N``): actor and
    normaliser from its ``learner.pt``, network sizes from ``RUN_DIR/config.json``."""
    step_dir = Path(step_dir)
    run_dir = step_dir.parent.parent
    try:
        manifest = checkpoint.verify(step_dir, [checkpoint.LEARNER])
    except checkpoint.CheckpointError as err:
        raise PolicyError(f"unusable checkpoint {err}") from None
    try:
        cfg = json.loads((run_dir / "config.json").read_text())
    except (OSError, ValueError) as err:
        raise PolicyError(f"{run_dir / 'config.json'}: cannot read the run's config ({err}); the network "
                          f"sizes of {step_dir} come from it") from None
    refuse_ppo_run(run_dir, cfg)
    learner = torch.load(step_dir / checkpoint.LEARNER, map_location="cpu", weights_only=True)
    policy = Policy.from_state(cfg, learner["agent"]["actor"], learner["normalizer"],
                               enabled=bool(cfg.get("obs_normalization", True)))
    vector_steps = int(learner["agent"]["counters"][0])
    meta = {"env": cfg.get("env"), "env_steps": vector_steps * int(cfg.get("num_envs", 1)),
            "vector_steps": vector_steps,
            "seed": cfg.get("seed"), "eval_return": None, "source": str(step_dir), "step": manifest["step"]}
    return policy.to(device).eval(), meta


# -- finding one ------------------------------------------------------------------------------------
def refuse_ppo_run(run_dir: Path, cfg: dict | None = None) -> None:
    """:class:`PolicyError` when ``run_dir`` is a detached-PPO run (its config.json names a
    ``--workload``): its checkpoints hold no FastSAC actor. Says what to use instead."""
    if cfg is None:
        try:
            cfg = json.loads((run_dir / "config.json").read_text())
        except (OSError, ValueError):
            return
    workload = cfg.get("workload") if isinstance(cfg, dict) else None
    if not isinstance(workload, str):
        return
    actor = run_dir / "hf" / "actor"
    if workload == "hf" or actor.is_dir():
        use = (f"its actor is the transformers directory {actor} (AutoModelForCausalLM.from_pretrained"
               + (")" if actor.is_dir() else "; written at the run's first checkpoint)"))
    else:
        use = (f"its PPO weights are the checkpoints in {checkpoint.checkpoint_root(run_dir)} (DCP shards: "
               "hpcrl.ppo.trainer_checkpoint.read_full(step_dir) gives full tensors)")
    raise PolicyError(f"{run_dir}: a PPO run (--workload {workload}), not a FastSAC run; play and export read "
                      f"FastSAC runs (python -m hpcrl.sac) only; {use}")


def _available(run_dir: Path) -> str:
    found = [f"{w} ({run_dir / w / SNAPSHOT})" for w in ("best", "final") if (run_dir / w / SNAPSHOT).is_file()]
    newest = checkpoint.committed(run_dir)
    if newest:
        found.append(f"latest ({newest[0]})")
    return ", ".join(found) if found else "nothing (no best/, final/ or checkpoints/)"


def resolve(run_dir_or_file: str | os.PathLike, which: str = "best") -> Path:
    """Where the ``which`` policy of a run lives: ``best`` -> RUN_DIR/best/policy.pt, ``final`` ->
    RUN_DIR/final/policy.pt, ``latest`` -> the newest committed checkpoint directory whose files verify.
    A file path is returned as it is; a checkpoint directory (``.../step_N``) too. Missing ->
    :class:`PolicyError` listing what the run dir has."""
    path = Path(run_dir_or_file)
    if which not in WHICH:
        raise PolicyError(f"--which {which!r}: must be one of {', '.join(WHICH)}")
    if path.is_file():
        return path
    if not path.is_dir():
        raise PolicyError(f"{path}: no such run dir or policy file")
    is_step = (path / checkpoint.MANIFEST).is_file()  # a checkpoint directory given directly
    refuse_ppo_run(path.parent.parent if is_step else path)
    if is_step:
        return path
    if which == "latest":
        found = checkpoint.latest(path)
        if found is None:
            raise PolicyError(f"{path}: no usable checkpoint in {checkpoint.checkpoint_root(path)}; "
                              f"available: {_available(path)}")
        return found
    snap = path / which / SNAPSHOT
    if not snap.is_file():
        raise PolicyError(f"{path}: no {which} policy ({snap} does not exist); available: {_available(path)}; "
                          "choose with --which best|final|latest")
    return snap


def load(run_dir_or_file: str | os.PathLike, which: str = "best",
         device: str | torch.device = "cpu") -> tuple[Policy, dict, Path]:
    """:func:`resolve` then load: (policy, meta, where it came from) from a snapshot or a checkpoint."""
    where = resolve(run_dir_or_file, which)
    policy, meta = policy_from_checkpoint(where, device) if where.is_dir() else load_policy(where, device)
    return policy, meta, where
