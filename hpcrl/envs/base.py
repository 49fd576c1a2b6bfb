"""The batched VecEnv protocol, the shared machinery of the pure-torch envs, and EpisodeStats.

Conventions every env in hpcrl.envs follows:

* Tensors in, tensors out, all on ``env.device``. A step is batched over ``num_envs``; the pure-torch
  envs use only masked tensor ops (no ``.item()``, no Python loop over envs), so a step never forces
  a host read and runs unchanged on CPU and GPU.
* Auto-reset happens inside ``step``. ``StepResult.obs`` is what the policy sees next (the fresh
  reset observation where an episode ended); ``StepResult.next_obs`` is the observation that truly
  followed the action (the final observation of an ended episode), so a learner can bootstrap on
  truncation from the right state.
* ``terminated`` (a terminal state: do not bootstrap) and ``truncated`` (the time limit hit: do
  bootstrap) are separate. If both would fire on the same step, **terminated wins and truncated is
  False**, so ``terminated & truncated`` is always all-False and ``done = terminated | truncated``.
* ``reset`` must be called once before the first ``step``. Randomness comes from one
  ``torch.Generator`` on the env's device: the same seed gives the same run on the same device
  (CPU and CUDA generators produce different streams). ``state_dict``/``load_state_dict`` cover the
  physical state, the step counters and the generator, so a checkpointed run resumes exactly.

Optional parts of the contract (defaults: absent; a learner that does not use them sees no change):

* **Privileged critic observations** (IsaacLab's ``critic`` group, Playground's ``privileged_state``):
  an env that has them sets ``critic_obs_dim`` (None = none) and fills ``StepResult.critic_obs``
  (aligned with ``obs``: post-reset where done) and ``StepResult.next_critic_obs`` (aligned with
  ``next_obs``: the true final one where done), [N, critic_obs_dim] on ``env.device``.
  ``observe_critic()`` returns the current critic observation (after ``reset`` /
  ``load_state_dict``); ``reset`` keeps returning the actor observation only.
* **Mirror maps** (symmetry augmentation): ``mirror_obs(obs)``, ``mirror_action(action)`` and, with
  critic observations, ``mirror_critic_obs(critic_obs)`` return the mirrored batch (pure, batched);
  the default implementations return None (no known symmetry). A mirrored transition (mirrored obs,
  mirrored action, same reward, mirrored next obs) must be a valid transition of the env.
* **Shared state** (curriculum levels, penalty scales): ``shared_state()`` returns a dict of float
  tensors on ``env.device`` that a learner reduces across ranks (episode-weighted mean) and feeds
  back through ``load_shared_state``; the default is ``{}``.
"""

from __future__ import annotations

import numbers
from abc import ABC, abstractmethod
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor


@dataclass
class StepResult:
    """One batched transition. Shapes: obs/next_obs [N, obs_dim], critic_obs/next_critic_obs
    [N, critic_obs_dim] or None (the env has no privileged critic observations); the rest [N]."""

    obs: Tensor  # observation the policy acts on next (post-reset where done)
    next_obs: Tensor  # observation that followed the action (true final obs where done)
    reward: Tensor  # [N], env dtype (float32 by default)
    terminated: Tensor  # [N] bool: terminal state reached
    truncated: Tensor  # [N] bool: time limit reached and not terminated
    critic_obs: Tensor | None = None  # privileged critic obs aligned with obs (post-reset where done)
    next_critic_obs: Tensor | None = None  # aligned with next_obs (true final critic obs where done)

    @property
    def done(self) -> Tensor:
        """[N] bool: the episode ended on this step (and the env was auto-reset)."""
        return self.terminated | self.truncated

    def to(self, device: torch.device | str) -> StepResult:
        return StepResult(**{f.name: None if getattr(self, f.name) is None else getattr(self, f.name).to(device)
                             for f in fields(self)})


def _positive_int(value: Any, name: str) -> int:
    # Integral admits numpy ints; bool is an int subclass but never a meaningful size.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return int(value)


def check_num_envs(num_envs: int) -> int:
    return _positive_int(num_envs, "num_envs")


def check_max_episode_steps(max_episode_steps: int) -> int:
    return _positive_int(max_episode_steps, "max_episode_steps")


def resolve_device(device: torch.device | str) -> torch.device:
    """``torch.device`` with the index filled in ("cuda" -> "cuda:<current>"), so that
    ``tensor.device == env.device`` holds for the tensors the env makes."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


class VecEnv(ABC):
    """A batch of ``num_envs`` independent copies of one task.

    Action spec: continuous envs set ``action_dim``, ``action_low``, ``action_high`` ([action_dim]
    tensors on ``device``) and leave ``num_actions`` None; discrete envs set ``num_actions`` and take
    integer actions of shape [N] (``action_dim``/bounds None).
    """

    num_envs: int
    obs_dim: int
    device: torch.device
    dtype: torch.dtype = torch.float32
    max_episode_steps: int | None  # None only for adapters whose env has no known limit
    action_dim: int | None = None
    action_low: Tensor | None = None
    action_high: Tensor | None = None
    num_actions: int | None = None
    critic_obs_dim: int | None = None  # None = no privileged critic observations

    @property
    def is_discrete(self) -> bool:
        return self.num_actions is not None

    @abstractmethod
    def reset(self, seed: int | None = None) -> Tensor:
        """Reset every env; ``seed`` (if given) reseeds first. Returns obs [N, obs_dim]."""

    @abstractmethod
    def step(self, action: Tensor) -> StepResult:
        """Advance every env by one step, auto-resetting the ones whose episode ended."""

    @abstractmethod
    def observe(self) -> Tensor:
        """The current observation [N, obs_dim] (e.g. to continue after ``load_state_dict``)."""

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume exactly: tensors and plain Python values only."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def observe_critic(self) -> Tensor | None:
        """The current critic observation [N, critic_obs_dim] (after ``reset`` / ``load_state_dict``);
        None when the env has none (``critic_obs_dim is None``)."""
        return None

    def mirror_obs(self, obs: Tensor) -> Tensor | None:
        """The mirrored observation batch, or None (no known symmetry)."""
        return None

    def mirror_action(self, action: Tensor) -> Tensor | None:
        """The mirrored action batch, or None (no known symmetry)."""
        return None

    def mirror_critic_obs(self, critic_obs: Tensor) -> Tensor | None:
        """The mirrored critic observation batch, or None."""
        return None

    @property
    def has_symmetry(self) -> bool:
        """True when the env overrides ``mirror_obs`` and ``mirror_action`` (and ``mirror_critic_obs``
        if it has critic observations)."""
        cls = type(self)
        base = VecEnv
        ok = cls.mirror_obs is not base.mirror_obs and cls.mirror_action is not base.mirror_action
        if self.critic_obs_dim is not None:
            ok = ok and cls.mirror_critic_obs is not base.mirror_critic_obs
        return ok

    def shared_state(self) -> dict[str, Tensor]:
        """Env-side scalars (curriculum levels, penalty scales) a learner reduces across ranks each
        iteration (episode-weighted mean) and loads back with ``load_shared_state``; ``{}`` = none.
        Float tensors on ``env.device``; the keys and shapes never change during a run."""
        return {}

    def load_shared_state(self, state: dict[str, Tensor]) -> None:
        """Adopt the reduced shared state (the same on every rank)."""

    def close(self) -> None:
        """Release external resources (adapters); a no-op for the pure-torch envs."""

    def __repr__(self) -> str:
        spec = (
            f"num_actions={self.num_actions}" if self.is_discrete else f"action_dim={self.action_dim}"
        )
        return (
            f"{type(self).__name__}(num_envs={self.num_envs}, obs_dim={self.obs_dim}, {spec}, "
            f"max_episode_steps={self.max_episode_steps}, device={self.device})"
        )


class TorchVecEnv(VecEnv):
    """Shared step/reset/seed/checkpoint logic for the pure-torch envs.

    A subclass describes one task by four pure, batched functions of a state tensor [N, state_dim]:
    ``_initial_state``, ``_transition`` (returns new state, reward, terminated), ``_observation`` and
    ``_prepare_action``. The physical state lives in ``self.state`` (public, so tests and tools can
    set it) and the per-env step counter in ``self.elapsed`` [N] int64.
    """

    state_dim: int

    def __init__(
        self,
        num_envs: int,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
        max_episode_steps: int,
    ) -> None:
        self.num_envs = check_num_envs(num_envs)
        self.max_episode_steps = check_max_episode_steps(max_episode_steps)
        if dtype not in (torch.float32, torch.float64):
            raise ValueError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
        self.device = resolve_device(device)
        self.dtype = dtype
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(int(seed))
        self.state = torch.zeros(self.num_envs, self.state_dim, device=self.device, dtype=dtype)
        self.elapsed = torch.zeros(self.num_envs, device=self.device, dtype=torch.int64)
        self._started = False  # host-side flag: step before reset is a usage error

    # -- task definition (subclasses) -------------------------------------------------------------
    @abstractmethod
    def _initial_state(self) -> Tensor:
        """A fresh initial state for every env, [N, state_dim], drawn from ``self.generator``."""

    @abstractmethod
    def _transition(self, state: Tensor, action: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(new_state [N, S], reward [N], terminated [N] bool) for one step from ``state``."""

    @abstractmethod
    def _observation(self, state: Tensor) -> Tensor: ...

    @abstractmethod
    def _prepare_action(self, action: Tensor) -> Tensor:
        """Move/reshape/clip the action; validates shapes only (values would need a host read)."""

    # -- protocol ---------------------------------------------------------------------------------
    def _rand(self, *shape: int) -> Tensor:
        return torch.rand(shape, generator=self.generator, device=self.device, dtype=self.dtype)

    def _randn(self, *shape: int) -> Tensor:
        return torch.randn(shape, generator=self.generator, device=self.device, dtype=self.dtype)

    def reset(self, seed: int | None = None) -> Tensor:
        if seed is not None:
            self.generator.manual_seed(int(seed))
        self.state = self._initial_state()
        self.elapsed = torch.zeros_like(self.elapsed)
        self._started = True
        return self._observation(self.state)

    def step(self, action: Tensor) -> StepResult:
        if not self._started:
            raise RuntimeError(f"{type(self).__name__}.step() called before reset()")
        action = self._prepare_action(action)
        new_state, reward, terminated = self._transition(self.state, action)
        elapsed = self.elapsed + 1
        truncated = (elapsed >= self.max_episode_steps) & ~terminated
        done = terminated | truncated
        next_obs = self._observation(new_state)
        # Draw fresh states for every env each step and keep them only where done: a data-dependent
        # "reset only if any done" would need a host read. As a bonus the RNG stream does not
        # depend on which envs finished.
        fresh = self._initial_state()
        self.state = torch.where(done.unsqueeze(-1), fresh, new_state)
        self.elapsed = elapsed.masked_fill(done, 0)
        obs = self._observation(self.state)
        return StepResult(obs, next_obs, reward, terminated, truncated)

    def observe(self) -> Tensor:
        return self._observation(self.state)

    def state_dict(self) -> dict[str, Any]:
        return {
            "state": self.state.clone(),
            "elapsed": self.elapsed.clone(),
            "generator": self.generator.get_state(),  # CPU uint8 tensor, also for CUDA generators
            "started": self._started,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        s = state["state"]
        if tuple(s.shape) != (self.num_envs, self.state_dim):
            raise ValueError(
                f"state_dict is for {tuple(s.shape)} states, env has ({self.num_envs}, {self.state_dim})"
            )
        self.state = s.to(self.device, self.dtype).clone()
        self.elapsed = state["elapsed"].to(self.device, torch.int64).clone()
        self.generator.set_state(state["generator"].cpu())
        self._started = bool(state["started"])


def check_action_shape(action: Tensor, shapes: tuple[tuple[int, ...], ...], name: str) -> None:
    if tuple(action.shape) not in shapes:
        raise ValueError(f"{name}: action shape {tuple(action.shape)} not in {list(shapes)}")


@dataclass
class EpisodeSummary:
    """Sums over the episodes completed since the last ``EpisodeStats.pop()`` (0-d tensors)."""

    return_sum: Tensor
    length_sum: Tensor
    count: Tensor

    def as_tensor(self) -> Tensor:
        """[return_sum, length_sum, count] in one tensor: one all_reduce across ranks."""
        return torch.stack([self.return_sum, self.length_sum, self.count])

    @classmethod
    def from_tensor(cls, t: Tensor) -> EpisodeSummary:
        return cls(t[0], t[1], t[2])

    def mean_return(self) -> float:
        """Host-side mean (reads the device); NaN when no episode finished."""
        c = float(self.count)
        return float(self.return_sum) / c if c > 0 else float("nan")

    def mean_length(self) -> float:
        c = float(self.count)
        return float(self.length_sum) / c if c > 0 else float("nan")


class EpisodeStats:
    """Device-side running episode returns/lengths; no host read until the caller reads a value.

    Call ``update(result)`` after every ``env.step``; ``pop()`` returns the summed returns, lengths
    and the number of episodes completed since the previous pop, and clears them.
    """

    def __init__(self, num_envs: int, device: torch.device | str = "cpu") -> None:
        self.num_envs = check_num_envs(num_envs)
        self.device = resolve_device(device)
        # float64 keeps long sums exact enough; MPS has no float64.
        self.dtype = torch.float32 if self.device.type == "mps" else torch.float64
        self.running_return = torch.zeros(num_envs, device=self.device, dtype=self.dtype)
        self.running_length = torch.zeros(num_envs, device=self.device, dtype=torch.int64)
        self._sum = torch.zeros(3, device=self.device, dtype=self.dtype)  # return, length, count

    def update(self, result: StepResult) -> tuple[Tensor, Tensor, Tensor]:
        """Account one step. Returns (done [N] bool, episode_return [N], episode_length [N]) for
        this step; the last two are meaningful only where ``done`` is True (0 elsewhere)."""
        done = result.done
        ret = self.running_return + result.reward  # promotes to the stats dtype
        length = self.running_length + 1
        done_f = done.to(self.dtype)
        # One [3, N] tensor masked by done and summed once: (return, length, 1) per finished env.
        vals = torch.stack([ret, length.to(self.dtype), done_f]).mul_(done_f)
        self._sum.add_(vals.sum(dim=1))
        self.running_return = ret.masked_fill_(done, 0.0)
        self.running_length = length.masked_fill_(done, 0)
        return done, vals[0], vals[1].to(torch.int64)

    def pop(self) -> EpisodeSummary:
        s = self._sum.clone()
        self._sum.zero_()
        return EpisodeSummary(s[0], s[1], s[2])

    def reset(self) -> None:
        """Forget running episodes (call after ``env.reset``)."""
        self.running_return.zero_()
        self.running_length.zero_()
        self._sum.zero_()

    def state_dict(self) -> dict[str, Tensor]:
        return {
            "running_return": self.running_return.clone(),
            "running_length": self.running_length.clone(),
            "sum": self._sum.clone(),
        }

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        self.running_return = state["running_return"].to(self.device, self.dtype).clone()
        self.running_length = state["running_length"].to(self.device, torch.int64).clone()
        self._sum = state["sum"].to(self.device, self.dtype).clone()


@torch.no_grad()
def first_episode_returns(env: VecEnv, obs: Tensor, act: Any, max_steps: int = 1000) -> Tensor:
    """The return of each env's first episode from ``obs`` (the env freshly reset), stepping with
    ``act(obs) -> action``; an episode still running after ``env.max_episode_steps`` (or ``max_steps``)
    steps counts with the return it has so far. What evaluation (training's and ``hpcrl.sac.play``'s)
    measures; one host read per step (the all-finished check)."""
    stats = EpisodeStats(env.num_envs, env.device)
    finished = torch.zeros(env.num_envs, dtype=torch.bool, device=env.device)
    returns = torch.zeros(env.num_envs, dtype=stats.running_return.dtype, device=env.device)
    for _ in range(env.max_episode_steps or max_steps):
        result = env.step(act(obs))
        done, episode_return, _ = stats.update(result)
        returns = torch.where(done & ~finished, episode_return, returns)
        finished |= done
        obs = result.obs
        if bool(finished.all()):
            break
    return torch.where(finished, returns, stats.running_return)
