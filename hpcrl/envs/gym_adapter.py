"""Adapter from a gymnasium 1.x vector env to the hpcrl VecEnv protocol.

The wrapped env must use ``AutoresetMode.SAME_STEP``: then gymnasium resets an env inside the step
that ended its episode and reports the true final observation in ``info["final_obs"]`` (mask
``info["_final_obs"]``), which is exactly our ``next_obs``/``obs`` split. (The default NEXT_STEP
mode instead spends one extra, reward-less step on the reset.)

Observations and rewards are converted to ``dtype`` (float32 by default) tensors on ``device``;
actions go back to NumPy on the host (this is a host read, unavoidable for CPU simulators).
Continuous actions are passed through unclipped, as gymnasium would receive them; discrete ones
are 0..n-1 (shifted by the space's ``start``). When gymnasium reports both ``terminated`` and
``truncated`` for an env, ``truncated`` is cleared (terminated wins).

``state_dict`` is best effort and needs a ``SyncVectorEnv``: it captures, per sub-env, the NumPy
RNG, the ``TimeLimit`` step counter and the physics (MuJoCo: ``mj_getState`` of the full
integration state; classic control: ``unwrapped.state``), plus the current observation. Envs with
neither raise ``NotImplementedError``; envs with further hidden state (custom wrappers, tasks
with internal goals) are not fully restored.

Seeding: gymnasium seeds sub-env i with ``seed + i``, so ranks that each own ``num_envs`` sub-envs
should use seeds ``base + rank * num_envs`` to keep their streams disjoint.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import numpy as np
import torch
from torch import Tensor

from .base import StepResult, VecEnv, check_num_envs, resolve_device


def _import_gym():
    try:
        import gymnasium
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ImportError(
            "the gymnasium adapter needs gymnasium (pip install 'hpcrl[gym]' or 'gymnasium[mujoco]')"
        ) from e
    return gymnasium


def _quiet_mujoco_warnings() -> None:
    """MuJoCo prints its C-level warnings once per model compile (gymnasium's HalfCheetah XML: 'settotalmass
    is deprecated' for every sub-env, with blank lines): show each distinct warning once, on one line."""
    try:
        import mujoco
    except ImportError:
        return
    if getattr(mujoco.get_mju_user_warning(), "_hpcrl", False):
        return
    seen: set[str] = set()

    def once(message: str) -> None:
        if message not in seen:
            seen.add(message)
            print(f"hpcrl: MuJoCo warning (shown once): {message.strip()}", file=sys.stderr, flush=True)

    once._hpcrl = True  # type: ignore[attr-defined]
    mujoco.set_mju_user_warning(once)


def _same_step_vec(
    gym: Any, env: str | Any, num_envs: int | None, vectorization_mode: str, make_kwargs: dict[str, Any]
) -> Any:
    """``env`` as a SAME_STEP ``VectorEnv`` of ``num_envs`` envs: made from an id, or a built one checked."""
    same_step = gym.vector.AutoresetMode.SAME_STEP
    if isinstance(env, str):
        _quiet_mujoco_warnings()
        n = check_num_envs(num_envs if num_envs is not None else 1)
        try:
            env = gym.make_vec(
                env,
                num_envs=n,
                vectorization_mode=vectorization_mode,
                vector_kwargs={"autoreset_mode": same_step},
                **make_kwargs,
            )
        except gym.error.Error as e:
            raise ValueError(f"gymnasium could not make {env!r}: {e}") from e
    elif not isinstance(env, gym.vector.VectorEnv):
        raise TypeError(f"expected a gymnasium env id or VectorEnv, got {type(env).__name__}")
    elif make_kwargs or vectorization_mode != "sync":
        raise TypeError("make arguments apply only when env is an id, not a built VectorEnv")
    mode = getattr(env, "autoreset_mode", env.metadata.get("autoreset_mode"))
    if mode != same_step:
        raise ValueError(
            f"GymVecEnv needs autoreset_mode=SAME_STEP (to get the final observation), got {mode}"
        )
    if num_envs is not None and num_envs != env.num_envs:
        raise ValueError(f"num_envs={num_envs} but the vector env has {env.num_envs}")
    return env


class GymVecEnv(VecEnv):
    """Wrap ``env`` (a gymnasium env id or a SAME_STEP ``gymnasium.vector.VectorEnv``)."""

    def __init__(
        self,
        env: str | Any,
        num_envs: int | None = None,
        device: torch.device | str = "cpu",
        *,
        seed: int = 0,
        dtype: torch.dtype = torch.float32,
        vectorization_mode: str = "sync",
        **make_kwargs: Any,
    ) -> None:
        gym = _import_gym()
        env = _same_step_vec(gym, env, num_envs, vectorization_mode, make_kwargs)
        obs_space = env.single_observation_space
        if not isinstance(obs_space, gym.spaces.Box) or len(obs_space.shape) != 1:
            raise ValueError(f"only flat Box observations are supported, got {obs_space}")

        self.env = env
        self.num_envs = env.num_envs
        self.obs_dim = int(obs_space.shape[0])
        self.device = resolve_device(device)
        self.dtype = dtype
        self.seed = int(seed)
        self._set_action_space(gym, env.single_action_space)
        spec = getattr(env, "spec", None)
        if spec is None and getattr(env, "envs", None):  # SyncVectorEnv built from env_fns
            spec = getattr(env.envs[0], "spec", None)
        self.max_episode_steps = getattr(spec, "max_episode_steps", None)
        self._obs: Tensor | None = None
        self._seeded = False

    def _set_action_space(self, gym: Any, act_space: Any) -> None:
        """Discrete: ``num_actions``; flat Box: ``action_dim`` and its bounds as tensors on ``device``."""
        if isinstance(act_space, gym.spaces.Discrete):
            self.num_actions = int(act_space.n)
            self._action_start = int(act_space.start)
        elif isinstance(act_space, gym.spaces.Box) and len(act_space.shape) == 1:
            self.action_dim = int(act_space.shape[0])
            self.action_low = torch.as_tensor(act_space.low, dtype=self.dtype, device=self.device)
            self.action_high = torch.as_tensor(act_space.high, dtype=self.dtype, device=self.device)
            self._np_action_dtype = act_space.dtype
        else:
            raise ValueError(f"only Discrete or flat Box actions are supported, got {act_space}")

    def _to_torch(self, x: np.ndarray) -> Tensor:
        # Always a copy: a vector env made with copy=False reuses its observation buffer.
        return torch.tensor(np.asarray(x), dtype=self.dtype, device=self.device)

    def reset(self, seed: int | None = None) -> Tensor:
        # First reset without a seed uses the constructor's seed: gymnasium would otherwise seed
        # from the OS and the run would not be reproducible.
        if seed is None and not self._seeded:
            seed = self.seed
        obs, _ = self.env.reset(seed=seed)
        self._seeded = True
        self._obs = self._to_torch(obs)
        return self._obs

    def step(self, action: Tensor) -> StepResult:
        if self._obs is None:
            raise RuntimeError("GymVecEnv.step() called before reset()")
        a = torch.as_tensor(action).detach().cpu()
        if self.is_discrete:
            # Protocol actions are 0..num_actions-1; gymnasium's Discrete may start elsewhere.
            a = a.reshape(self.num_envs).numpy().astype(np.int64) + self._action_start
        else:
            a = a.reshape(self.num_envs, self.action_dim).numpy().astype(self._np_action_dtype)
        obs, reward, terminated, truncated, info = self.env.step(a)
        terminated = np.asarray(terminated, dtype=bool)
        truncated = np.asarray(truncated, dtype=bool) & ~terminated
        next_obs = np.array(obs, copy=True)
        mask = info.get("_final_obs")
        if mask is not None and mask.any():
            idx = np.nonzero(mask)[0]
            next_obs[idx] = np.stack([info["final_obs"][i] for i in idx])
        self._obs = self._to_torch(obs)
        return StepResult(
            obs=self._obs,
            next_obs=self._to_torch(next_obs),
            reward=self._to_torch(reward),
            terminated=torch.as_tensor(terminated, device=self.device),
            truncated=torch.as_tensor(truncated, device=self.device),
        )

    def observe(self) -> Tensor:
        if self._obs is None:
            raise RuntimeError("GymVecEnv.observe() called before reset()")
        return self._obs

    # -- best-effort checkpointing ----------------------------------------------------------------
    def _sub_envs(self) -> list[Any]:
        envs = getattr(self.env, "envs", None)
        if envs is None:
            raise NotImplementedError("state_dict needs a SyncVectorEnv (sub-envs in this process)")
        return list(envs)

    @staticmethod
    def _time_limit(env: Any) -> Any | None:
        while env is not None:
            if hasattr(env, "_elapsed_steps"):
                return env
            env = getattr(env, "env", None)
        return None

    def state_dict(self) -> dict[str, Any]:
        subs = []
        for e in self._sub_envs():
            u = e.unwrapped
            # JSON: numpy's PCG64 state holds 128-bit ints, which HDF5 attributes cannot
            item: dict[str, Any] = {"rng": json.dumps(u.np_random.bit_generator.state)}
            tl = self._time_limit(e)
            if tl is not None:
                item["elapsed"] = tl._elapsed_steps
            if hasattr(u, "model") and hasattr(u, "data"):
                import mujoco

                spec = mujoco.mjtState.mjSTATE_INTEGRATION
                buf = np.empty(mujoco.mj_stateSize(u.model, spec), dtype=np.float64)
                mujoco.mj_getState(u.model, u.data, buf, spec)
                item["mujoco"] = torch.from_numpy(buf)
            elif getattr(u, "state", None) is not None:
                item["state"] = torch.as_tensor(np.asarray(u.state, dtype=np.float64))
                if hasattr(u, "steps_beyond_terminated"):
                    item["steps_beyond_terminated"] = u.steps_beyond_terminated
            else:
                raise NotImplementedError(f"no known way to save the state of {u}")
            subs.append(item)
        obs = None if self._obs is None else self._obs.cpu().clone()
        # a dict keyed by index, not a list: checkpoints store nested dicts (hpcrl.core.h5io)
        return {"envs": {f"{i:05d}": item for i, item in enumerate(subs)}, "obs": obs, "seeded": self._seeded}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        subs = self._sub_envs()
        saved = [state["envs"][k] for k in sorted(state["envs"])]
        if len(saved) != len(subs):
            raise ValueError(f"state_dict has {len(saved)} envs, this one {len(subs)}")
        for e, item in zip(subs, saved):
            u = e.unwrapped
            u.np_random.bit_generator.state = json.loads(item["rng"])
            tl = self._time_limit(e)
            if tl is not None and "elapsed" in item:
                tl._elapsed_steps = item["elapsed"]
            if "mujoco" in item:
                import mujoco

                buf = item["mujoco"].numpy().astype(np.float64)
                mujoco.mj_setState(u.model, u.data, buf, mujoco.mjtState.mjSTATE_INTEGRATION)
                mujoco.mj_forward(u.model, u.data)
            else:
                u.state = item["state"].numpy().copy()
                if "steps_beyond_terminated" in item:
                    u.steps_beyond_terminated = item["steps_beyond_terminated"]
            # OrderEnforcing refuses step() before reset(); a restored env counts as reset.
            w = e
            while w is not None:
                if hasattr(w, "_has_reset"):
                    w._has_reset = True
                w = getattr(w, "env", None)
        self._obs = None if state["obs"] is None else state["obs"].to(self.device, self.dtype)
        self._seeded = bool(state["seeded"])

    def close(self) -> None:
        self.env.close()
