"""Envs that already step batches of torch tensors, behind hpcrl's VecEnv: ``make_env("torchvec:<Id>", N)``.

The IsaacLab / ManiSkill3 / Genesis convention: ``gym.make(Id, num_envs=N, **options)`` returns one env
whose ``step(actions [N, A] tensor)`` returns ``(obs, reward, terminated, truncated, info)`` as torch
tensors of leading size N on the simulator's own device, and resets finished envs inside ``step``.
Nothing goes through numpy. ``Id`` may be ``module:Id`` (gymnasium imports ``module`` first, e.g.
``torchvec:mani_skill.envs:PickCube-v1``).

Mapping onto the VecEnv contract:

* ``obs`` is what ``step`` returned (post-reset where done). ``next_obs`` is ``info["final_observation"]``
  (ManiSkill3, gymnasium < 1) or ``info["final_obs"]`` where done: a full-batch tensor (or dict of them),
  selected per env with ``torch.where`` (no host read). An env that gives no final observation
  (IsaacLab's ``ManagerBasedRLEnv`` does not) raises on the first step where an episode ends, unless
  ``missing_final_obs="reset_obs"`` accepts the post-reset observation as ``next_obs`` (what IsaacLab
  users of FastTD3 get; a truncated episode then bootstraps from the wrong state).
* Dict observations: the actor part is ``policy`` (IsaacLab), ``state`` or ``obs``; the critic part,
  where present, ``critic`` (IsaacLab) or ``privileged_state`` (``obs_key=``/``critic_key=`` choose).
* ``truncated`` is made False where ``terminated`` (terminated wins); rewards become float32, flags bool.
* Action bounds come from ``single_action_space`` (else ``action_space``); unbounded ones need
  ``action_bound=<float>`` (IsaacLab's are infinite; its policies act in about [-1, 1]).
* ``wrapper="module:callable"`` wraps the made env first, e.g. ManiSkill3's auto-resetting
  ``mani_skill.vector.wrappers.gymnasium:ManiSkillVectorEnv``.
* Checkpoints: the env's own ``state_dict``/``load_state_dict`` where it has them, plus the current
  observation. Without them ``state_dict`` still saves the observation, and ``load_state_dict``
  raises a one-line ValueError, since the simulator state cannot be restored.

Tensors come back on ``device``; if the simulator runs elsewhere they are moved (one copy per step).
"""

from __future__ import annotations

import importlib
import math
from typing import Any

import torch
from torch import Tensor

from .base import StepResult, VecEnv, check_num_envs, resolve_device

PREFIX = "torchvec:"
_ACTOR_KEYS = ("policy", "state", "obs")
_CRITIC_KEYS = ("critic", "privileged_state")
_FINAL_KEYS = ("final_observation", "final_obs")


def _resolve(spec: str, what: str) -> Any:
    module, _, attr = spec.partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError) as err:
        raise ValueError(f"{what}={spec!r}: expected 'module:callable' ({err})") from None


def _unwrap_attr(env: Any, name: str) -> Any:
    for obj in (env, getattr(env, "unwrapped", None)):
        if obj is not None and getattr(obj, name, None) is not None:
            return getattr(obj, name)
    return None


class TorchNativeVecEnv(VecEnv):
    """A gymnasium-registered env that steps torch batches itself (see module doc)."""

    def __init__(self, env_id: str, num_envs: int, device: torch.device | str = "cpu", seed: int = 0, *,
                 wrapper: str | None = None, missing_final_obs: str = "error", action_bound: float | None = None,
                 obs_key: str | None = None, critic_key: str | None = None, **make_kwargs: Any) -> None:
        try:
            import gymnasium as gym
        except ImportError:
            raise ValueError("env 'torchvec:...' needs gymnasium: pip install gymnasium") from None
        if missing_final_obs not in ("error", "reset_obs"):
            raise ValueError(f"missing_final_obs={missing_final_obs!r}: must be 'error' or 'reset_obs'")
        self.name = env_id
        self.num_envs = check_num_envs(num_envs)
        self.device = resolve_device(device)
        self._missing = missing_final_obs
        # gymnasium's passive checker expects numpy spaces and observations: off for tensor envs.
        make_kwargs.setdefault("disable_env_checker", True)
        try:
            env = gym.make(env_id, num_envs=self.num_envs, **make_kwargs)
        except (gym.error.Error, TypeError) as err:  # unknown id or module; no num_envs/option argument
            msg = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise ValueError(f"torchvec:{env_id}: gym.make(id, num_envs=N, ...) failed: {msg}") from None
        if wrapper is not None:
            env = _resolve(wrapper, "wrapper")(env)
        self.env = env
        n = _unwrap_attr(env, "num_envs")
        if n != self.num_envs:
            raise ValueError(f"torchvec:{env_id} made {n} envs for num_envs={self.num_envs}; it must accept "
                             "gym.make(id, num_envs=N)")
        space = _unwrap_attr(env, "single_action_space") or env.action_space
        low, high = torch.as_tensor(space.low, dtype=torch.float32), torch.as_tensor(space.high, dtype=torch.float32)
        if space.shape is None or len(space.shape) != 1:
            raise ValueError(f"torchvec:{env_id}: action space {space} is not a 1-d Box")
        if not (torch.isfinite(low).all() and torch.isfinite(high).all()):
            if action_bound is None or not math.isfinite(action_bound) or action_bound <= 0:
                raise ValueError(f"torchvec:{env_id}: unbounded action space; pass e.g. torchvec:{env_id}?action_bound=1")
            low, high = torch.full_like(low, -action_bound), torch.full_like(high, action_bound)
        self.action_dim = int(space.shape[0])
        self.action_low, self.action_high = low.to(self.device), high.to(self.device)
        spec = getattr(env, "spec", None)
        self.max_episode_steps = (getattr(spec, "max_episode_steps", None)
                                  or _unwrap_attr(env, "max_episode_steps"))
        self._seed = int(seed)
        self._obs_key, self._critic_key = obs_key, critic_key
        self._sim_device: torch.device | None = None
        self._obs: Tensor | None = None
        self._critic: Tensor | None = None
        # Shapes from one reset: the contract needs obs_dim before the first reset() call.
        obs, _ = env.reset(seed=self._seed)
        self._set_current(obs)
        self.obs_dim = int(self._obs.shape[-1])
        self.critic_obs_dim = None if self._critic is None else int(self._critic.shape[-1])

    # -- observations -----------------------------------------------------------------------------
    def _pick(self, obs: Any, keys: tuple[str, ...], chosen: str | None, what: str) -> Any:
        if chosen is not None:
            if chosen not in obs:
                raise ValueError(f"torchvec:{self.name}: {what} {chosen!r} not in observations {sorted(obs)}")
            return obs[chosen]
        return next((obs[k] for k in keys if k in obs), None)

    def _split(self, obs: Any) -> tuple[Tensor, Tensor | None]:
        if isinstance(obs, dict):
            actor = self._pick(obs, _ACTOR_KEYS, self._obs_key, "obs_key")
            if actor is None:
                raise ValueError(f"torchvec:{self.name}: no actor entry ({'/'.join(_ACTOR_KEYS)}) in "
                                 f"observations {sorted(obs)}; pass obs_key=")
            critic = self._pick(obs, _CRITIC_KEYS, self._critic_key, "critic_key")
        else:
            actor, critic = obs, None
        for t in (actor, critic):
            if t is not None and not isinstance(t, Tensor):
                raise ValueError(f"torchvec:{self.name} returned {type(t).__name__} observations, not torch "
                                 f"tensors; use gym:{self.name} for numpy envs")
        if actor.dim() != 2 or actor.shape[0] != self.num_envs:
            raise ValueError(f"torchvec:{self.name}: observation shape {tuple(actor.shape)}, expected "
                             f"({self.num_envs}, obs_dim)")
        return self._move(actor), None if critic is None else self._move(critic)

    def _move(self, t: Tensor) -> Tensor:
        if self._sim_device is None:
            self._sim_device = t.device
        t = t.to(self.device, non_blocking=True)
        return t.float() if t.is_floating_point() and t.dtype != torch.float32 else t

    def _set_current(self, obs: Any) -> None:
        self._obs, self._critic = self._split(obs)

    # -- protocol ---------------------------------------------------------------------------------
    def reset(self, seed: int | None = None) -> Tensor:
        obs, _ = self.env.reset(seed=self._seed if seed is None else int(seed))
        if seed is not None:
            self._seed = int(seed)
        self._set_current(obs)
        return self._obs

    def step(self, action: Tensor) -> StepResult:
        if tuple(action.shape) != (self.num_envs, self.action_dim):
            raise ValueError(f"action shape {tuple(action.shape)} != ({self.num_envs}, {self.action_dim})")
        action = torch.maximum(torch.minimum(action, self.action_high), self.action_low)
        obs_raw, reward, terminated, truncated, info = self.env.step(action.to(self._sim_device))
        terminated = torch.as_tensor(terminated, device=self._sim_device).reshape(self.num_envs).bool()
        truncated = torch.as_tensor(truncated, device=self._sim_device).reshape(self.num_envs).bool() & ~terminated
        obs, critic = self._split(obs_raw)
        done = self._move(terminated | truncated)
        final_raw = next((info[k] for k in _FINAL_KEYS if k in info), None) if isinstance(info, dict) else None
        if final_raw is None:
            if self._missing == "error" and bool(done.any()):
                raise RuntimeError(
                    f"torchvec:{self.name}: an episode ended but info has no {' / '.join(_FINAL_KEYS)}; "
                    f"pass torchvec:{self.name}?missing_final_obs=reset_obs to bootstrap from the reset obs")
            next_obs, next_critic = obs, critic
        else:
            f_obs, f_critic = self._split(final_raw)
            next_obs = torch.where(done.unsqueeze(-1), f_obs, obs)
            next_critic = None if critic is None else torch.where(done.unsqueeze(-1), f_critic, critic)
        self._obs, self._critic = obs, critic
        reward = self._move(torch.as_tensor(reward, device=self._sim_device).reshape(self.num_envs)).float()
        return StepResult(obs, next_obs, reward, self._move(terminated), self._move(truncated),
                          critic_obs=critic, next_critic_obs=next_critic)

    def observe(self) -> Tensor:
        return self._obs

    def observe_critic(self) -> Tensor | None:
        return self._critic

    def _native(self) -> Any:
        for obj in (self.env, getattr(self.env, "unwrapped", None)):
            if obj is not None and callable(getattr(obj, "state_dict", None)) \
                    and callable(getattr(obj, "load_state_dict", None)):
                return obj
        return None

    def state_dict(self) -> dict[str, Any]:
        native = self._native()
        return {"env": None if native is None else native.state_dict(), "obs": self._obs.cpu().clone(),
                "critic_obs": None if self._critic is None else self._critic.cpu().clone(), "seed": self._seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        native = self._native()
        if native is None or state.get("env") is None:
            raise ValueError(f"torchvec:{self.name}: the env has no state_dict/load_state_dict, so a checkpoint "
                             "cannot restore it; resume is not possible with this env")
        native.load_state_dict(state["env"])
        self._obs = state["obs"].to(self.device)
        self._critic = None if state["critic_obs"] is None else state["critic_obs"].to(self.device)
        self._seed = int(state["seed"])

    def close(self) -> None:
        self.env.close()
