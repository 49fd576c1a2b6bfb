"""MuJoCo Playground behind hpcrl's VecEnv: ``make_env("playground:<EnvName>[?k=v&...]", N, device)``.

Any env of ``mujoco_playground.registry`` (DM-control-suite ports, locomotion, manipulation). The batch is
one ``jax.vmap`` of the env's own ``reset``/``step``, jit-compiled together with hpcrl's auto-reset, so a
vector step is one XLA call; observations, rewards and flags cross to torch through DLPack (zero-copy on
GPU; on CPU too where XLA's buffer alignment allows, else one copy) and actions go the other way.

Semantics (hpcrl's contract, not Playground's ``wrap_for_brax_training``): Playground's raw ``State.done``
is the env's *termination* (e.g. NaN physics); the time limit is ``episode_length`` of the env's config
(in env steps; with ``action_repeat`` > 1 each vector step is ``action_repeat`` env steps with summed
rewards, as in brax's ``EpisodeWrapper``), so ``truncated = steps >= episode_length & ~terminated``,
matching brax's ``info["truncation"]``. Where an episode ended, the envs are reset with a fresh key
(Playground's ``full_reset=True``; its default instead re-uses each env's first state) and
``next_obs`` is the true final observation, which Playground's wrapper overwrites. The fresh reset is
computed only on vector steps where some env ended (``lax.cond``: no host read).

Options after ``?`` (or as ``make_env`` keyword arguments): ``impl=jax|warp`` (the MJX backend; default
``jax`` on CPU, where it measured ~13x faster than Warp's CPU device, and the env's own default on GPU)
and any other key of the env's config (``episode_length=200``, ``action_repeat=2``, ...), passed to
``registry.load(config_overrides=...)``.

Dict observations: ``obs["state"]`` is the actor observation and ``obs["privileged_state"]`` (where
present) the critic observation (``critic_obs_dim``, ``StepResult.critic_obs``/``next_critic_obs``).

Checkpoints: ``state_dict`` holds the whole JAX state pytree (mjx Data, obs, info incl. the env's own
rng), the step counters and the adapter's PRNG key, as CPU tensors: a run resumes bit-exactly on the
same device kind and ``impl``. Not portable: across ``impl`` (a different pytree) or devices (the
physics float results differ), and a jit recompile happens on load like on any start.

Menagerie robots (Go1, G1, T1, Berkeley humanoid, LEAP hand, ...) load their assets from
``mujoco_playground/external_deps/mujoco_menagerie`` inside the installed package, which Playground
git-clones on first use. Such a machine needs that checkout (at Playground's
``mjx_env.MENAGERIE_COMMIT_SHA``); without it ``make_env`` raises a one-line ValueError saying so.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
from torch import Tensor

from .base import StepResult, VecEnv, check_num_envs, resolve_device

PREFIX = "playground:"
# JAX grabs 75% of GPU memory at first use by default, starving torch on the same GPU.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

_FNS: dict[tuple, tuple[Any, Any, Any]] = {}  # (name, overrides, device) -> (env, reset, step)


def _imports() -> tuple[Any, Any]:
    try:
        import jax
        from mujoco_playground import registry
    except ImportError as err:
        raise ValueError(
            f"env 'playground:...' needs MuJoCo Playground: pip install playground ({err})"
        ) from None
    return jax, registry


def _jax_device(jax: Any, device: torch.device) -> Any:
    if device.type == "cpu":
        return jax.devices("cpu")[0]
    if device.type == "cuda":
        try:
            gpus = jax.devices("cuda")
        except RuntimeError:
            gpus = []
        if device.index >= len(gpus):
            raise ValueError(
                f"playground env on {device}: JAX sees {len(gpus)} CUDA device(s); "
                "install jax[cuda12] or use --device cpu"
            )
        return gpus[device.index]
    raise ValueError(f"playground env: device {device} not supported (cpu or cuda)")


def _load(registry: Any, name: str, overrides: dict[str, Any]) -> Any:
    from mujoco_playground._src import locomotion, manipulation, mjx_env

    if name not in registry.ALL_ENVS:
        suite = ", ".join(sorted(registry.dm_control_suite.ALL_ENVS)[:6])
        raise ValueError(
            f"unknown Playground env {name!r} ({len(registry.ALL_ENVS)} known, e.g. {suite}); "
            "see mujoco_playground.registry.ALL_ENVS"
        )
    if name in locomotion.ALL_ENVS + manipulation.ALL_ENVS and not mjx_env.MENAGERIE_PATH.exists():
        raise ValueError(
            f"playground:{name} needs the mujoco_menagerie robot files at {mjx_env.MENAGERIE_PATH} "
            f"(commit {mjx_env.MENAGERIE_COMMIT_SHA[:12]}), which Playground git-clones on first use "
            "and this machine does not have; copy a checkout there or pick a DM-suite env such as "
            "playground:CartpoleBalance"
        )
    try:
        return registry.load(name, config_overrides=overrides or None)
    except (KeyError, AttributeError, TypeError) as err:  # ml_collections: unknown/ill-typed key
        keys = ", ".join(sorted(registry.get_default_config(name).keys()))
        raise ValueError(f"playground:{name}: bad option in {overrides} ({err}); config keys: {keys}") from None


def _split(obs: Any, name: str) -> tuple[Any, Any]:
    """(actor obs, critic obs or None) of a Playground observation (array or dict)."""
    if isinstance(obs, dict):
        if "state" not in obs:
            raise ValueError(f"playground:{name}: dict observations {sorted(obs)} have no 'state' entry")
        return obs["state"], obs.get("privileged_state")
    return obs, None


def _build(jax: Any, env: Any, name: str) -> tuple[Any, Any]:
    jnp = jax.numpy
    cfg = env._config
    repeat = int(cfg.get("action_repeat", 1) or 1)
    limit = int(cfg.episode_length)
    vreset, vstep = jax.vmap(env.reset), jax.vmap(env.step)

    def fresh(key: Any, n: int) -> Any:
        return vreset(jax.random.split(key, n))

    def reset(key: Any, n: int) -> tuple[Any, Any]:
        key, sub = jax.random.split(key)
        state = fresh(sub, n)
        return state, jnp.zeros(n, jnp.int32), key

    def step(state: Any, steps: Any, key: Any, action: Any) -> tuple[Any, ...]:
        n = action.shape[0]
        if repeat == 1:
            nstate = vstep(state, action)
            reward = nstate.reward
        else:
            nstate, rewards = jax.lax.scan(lambda s, _: (vstep(s, action),) * 2, state, None, repeat)
            reward = rewards.reward.sum(0)
        steps = steps + repeat
        terminated = nstate.done > 0
        truncated = (steps >= limit) & ~terminated
        done = terminated | truncated
        key, sub = jax.random.split(key)

        def do_reset(_: Any) -> Any:
            f = fresh(sub, n)
            return jax.tree.map(lambda a, b: a.astype(b.dtype), f, nstate)

        reset_state = jax.lax.cond(done.any(), do_reset, lambda _: nstate, None)

        def where(a: Any, b: Any) -> Any:
            return jnp.where(done.reshape((n,) + (1,) * (a.ndim - 1)), a, b)

        new_state = jax.tree.map(where, reset_state, nstate)
        steps = jnp.where(done, 0, steps)
        next_obs, next_critic = _split(nstate.obs, name)
        obs, critic = _split(new_state.obs, name)
        out = (obs, next_obs, reward.astype(jnp.float32), terminated, truncated, critic, next_critic)
        return new_state, steps, key, out

    return jax.jit(reset, static_argnums=1), jax.jit(step)


def _to_torch(x: Any, device: torch.device) -> Tensor:
    t = torch.from_dlpack(x)
    return t if t.device == device else t.to(device)


class PlaygroundVecEnv(VecEnv):
    """``num_envs`` copies of one MuJoCo Playground env, vmapped and jit-compiled (see module doc)."""

    def __init__(self, env_name: str, num_envs: int, device: torch.device | str = "cpu", seed: int = 0,
                 impl: str | None = None, **config_overrides: Any) -> None:
        jax, registry = _imports()
        self._jax = jax
        self.name = env_name
        self.num_envs = check_num_envs(num_envs)
        self.device = resolve_device(device)
        self._jdev = _jax_device(jax, self.device)
        if impl is None:
            impl = "jax" if self.device.type == "cpu" else None
        elif impl not in ("jax", "warp"):
            raise ValueError(f"playground:{env_name}?impl={impl}: impl must be 'jax' or 'warp'")
        overrides = dict(config_overrides, **({"impl": impl} if impl is not None else {}))
        key = (env_name, tuple(sorted((k, repr(v)) for k, v in overrides.items())), str(self._jdev))
        if key not in _FNS:  # one compile per process for training + eval envs of one config
            env = _load(registry, env_name, overrides)
            _FNS[key] = (env, *_build(jax, env, env_name))
        self.env, self._reset_fn, self._step_fn = _FNS[key]
        cfg = self.env._config
        self.impl = str(cfg.get("impl", "jax"))
        repeat = int(cfg.get("action_repeat", 1) or 1)
        self.max_episode_steps = -(-int(cfg.episode_length) // repeat)
        size = self.env.observation_size
        if isinstance(size, dict):
            if "state" not in size:
                raise ValueError(f"playground:{env_name}: dict observations {sorted(size)} have no 'state'")
            self.obs_dim = int(np.prod(size["state"]))
            priv = size.get("privileged_state")
            self.critic_obs_dim = None if priv is None else int(np.prod(priv))
        else:
            self.obs_dim, self.critic_obs_dim = int(size), None
        self.action_dim = int(self.env.action_size)
        self.action_low = -torch.ones(self.action_dim, device=self.device)
        self.action_high = torch.ones(self.action_dim, device=self.device)
        self._seed = int(seed)
        self._key = self._put(jax.random.PRNGKey(self._seed))
        self.state: Any = None  # the JAX State pytree (batched); None before reset
        self._steps: Any = None

    def _put(self, x: Any) -> Any:
        return self._jax.device_put(x, self._jdev)

    def reset(self, seed: int | None = None) -> Tensor:
        if seed is not None:
            self._key = self._put(self._jax.random.PRNGKey(int(seed)))
        with self._jax.default_device(self._jdev):
            self.state, self._steps, self._key = self._reset_fn(self._key, self.num_envs)
        return self.observe()

    def step(self, action: Tensor) -> StepResult:
        if self.state is None:
            raise RuntimeError(f"{type(self).__name__}.step() called before reset()")
        if tuple(action.shape) != (self.num_envs, self.action_dim):
            raise ValueError(f"action shape {tuple(action.shape)} != ({self.num_envs}, {self.action_dim})")
        a = action.to(self.device, torch.float32).clamp(-1.0, 1.0).contiguous()
        self.state, self._steps, self._key, out = self._step_fn(
            self.state, self._steps, self._key, self._jax.dlpack.from_dlpack(a))
        obs, next_obs, reward, term, trunc, critic, next_critic = (
            None if x is None else _to_torch(x, self.device) for x in out)
        return StepResult(obs, next_obs, reward, term, trunc, critic_obs=critic, next_critic_obs=next_critic)

    def observe(self) -> Tensor:
        return _to_torch(_split(self.state.obs, self.name)[0], self.device)

    def observe_critic(self) -> Tensor | None:
        if self.state is None or self.critic_obs_dim is None:
            return None
        return _to_torch(_split(self.state.obs, self.name)[1], self.device)

    def state_dict(self) -> dict[str, Any]:
        def save(x: Any) -> dict[str, Any]:
            a = np.asarray(x)
            # torch has no unsigned 32/64-bit ops worth relying on: keep the bits, remember the dtype
            view = {np.dtype(np.uint32): np.int32, np.dtype(np.uint64): np.int64}.get(a.dtype)
            return {"dtype": str(a.dtype), "data": torch.from_numpy((a.view(view) if view else a).copy())}

        # A dict, not a list: checkpoints are HDF5 trees (hpcrl.core.h5io) of dicts, tensors and scalars.
        leaves = {} if self.state is None else {
            f"{i:05d}": save(x) for i, x in enumerate(self._jax.tree.leaves(self.state))}
        return {"leaves": leaves, "key": save(self._key),
                "steps": None if self._steps is None else save(self._steps), "impl": self.impl}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        jax = self._jax
        if state.get("impl") != self.impl:
            raise ValueError(f"state_dict is for impl={state.get('impl')}, this env has impl={self.impl}")

        def load(item: dict[str, Any]) -> Any:
            a = item["data"].numpy().view(np.dtype(item["dtype"]))
            return self._put(a)

        self._key = load(state["key"])
        if not state["leaves"]:
            self.state = self._steps = None
            return
        if self.state is None:
            self.reset()  # only for the pytree structure; every leaf is overwritten below
        leaves, treedef = jax.tree.flatten(self.state)
        saved = [state["leaves"][k] for k in sorted(state["leaves"])]
        if len(saved) != len(leaves) or any(tuple(s["data"].shape) != x.shape for s, x in zip(saved, leaves)):
            raise ValueError(f"state_dict does not fit playground:{self.name} with num_envs={self.num_envs}")
        self.state = jax.tree.unflatten(treedef, [load(s) for s in saved])
        self._steps = load(state["steps"])

    def __repr__(self) -> str:
        return f"{super().__repr__()[:-1]}, env=playground:{self.name}, impl={self.impl})"
