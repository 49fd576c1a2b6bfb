"""``torchvec:<id>`` (hpcrl/envs/torch_native.py) and ``module:Class`` names in make_env.

No GPU simulator of the IsaacLab / ManiSkill3 / Genesis kind runs on this CPU-only machine (ManiSkill3
installs but needs a Vulkan device), so the adapter is tested against ``BatchedPointMass`` below: a real
gymnasium env registered here that follows that convention (torch batches in and out, auto-reset inside
``step``, the true final observation in ``info["final_observation"]``, ``policy``/``critic`` dict obs)."""

from __future__ import annotations

import gymnasium as gym
import pytest
import torch

from hpcrl.envs import TorchVecEnv, VecEnv, make_env
from hpcrl.envs.pendulum import Pendulum

LIMIT = 7


class BatchedPointMass(gym.Env):
    """N point masses on a line; action = velocity; terminated when |x| > 1, truncated at LIMIT steps.
    The critic also sees the hidden drift that the actor does not."""

    def __init__(self, num_envs: int = 1, final_key: str | None = "final_observation", dict_obs: bool = True):
        self.num_envs, self.final_key, self.dict_obs = num_envs, final_key, dict_obs
        self.single_action_space = gym.spaces.Box(-1.0, 1.0, (1,))
        self.gen = torch.Generator()
        self.actions_seen: list[torch.Tensor] = []

    def _fresh(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.rand(n, generator=self.gen) - 0.5), torch.rand(n, generator=self.gen) * 0.2

    def _obs(self):
        actor = self.x.unsqueeze(-1)
        return {"policy": actor, "critic": torch.stack([self.x, self.drift], -1)} if self.dict_obs else actor

    def reset(self, seed=None, options=None):
        if seed is not None:
            self.gen.manual_seed(seed)
        self.x, self.drift = self._fresh(self.num_envs)
        self.t = torch.zeros(self.num_envs, dtype=torch.int64)
        return self._obs(), {}

    def step(self, action):
        assert isinstance(action, torch.Tensor)  # no numpy round trip
        self.actions_seen.append(action)
        self.x = self.x + 0.3 * action[:, 0] + self.drift
        self.t += 1
        terminated = self.x.abs() > 1.0
        truncated = self.t >= LIMIT  # may coincide with terminated: the adapter makes terminated win
        reward = -self.x.abs()
        final = self._obs()
        done = terminated | truncated
        x, d = self._fresh(self.num_envs)
        self.x, self.drift = torch.where(done, x, self.x), torch.where(done, d, self.drift)
        self.t = self.t.masked_fill(done, 0)
        info = {self.final_key: final} if self.final_key else {}
        return self._obs(), reward, terminated, truncated, info

    def state_dict(self):
        return {"x": self.x.clone(), "drift": self.drift.clone(), "t": self.t.clone(), "gen": self.gen.get_state()}

    def load_state_dict(self, s):
        self.x, self.drift, self.t = s["x"].clone(), s["drift"].clone(), s["t"].clone()
        self.gen.set_state(s["gen"])


if "HpcrlBatchedPointMass-v0" not in gym.registry:  # make_env imports this module again by its name
    gym.register("HpcrlBatchedPointMass-v0", entry_point=BatchedPointMass)


def _run(env, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [env.step(torch.rand(env.num_envs, 1, generator=g) * 2.4 - 1.2) for _ in range(steps)]


def test_torchvec_maps_the_convention_onto_vecenv():
    env = make_env("torchvec:HpcrlBatchedPointMass-v0", 16, seed=3)
    assert (env.obs_dim, env.critic_obs_dim, env.action_dim, env.max_episode_steps) == (1, 2, 1, None)
    obs = env.reset()
    assert obs.shape == (16, 1) and env.observe_critic().shape == (16, 2)
    raw = env.env.unwrapped
    results = _run(env, 40)
    assert all(a.abs().max() <= 1.0 for a in raw.actions_seen)  # clipped to the action space, as tensors
    ends = terminated = 0
    for r in results:
        assert r.reward.dtype == torch.float32 and r.terminated.dtype == r.truncated.dtype == torch.bool
        assert not (r.terminated & r.truncated).any()
        done = r.done
        # not done: next_obs is obs; done: next_obs is the final obs (x beyond the bound when terminated)
        assert torch.equal(r.next_obs[~done], r.obs[~done])
        assert torch.equal(r.next_critic_obs[:, :1], r.next_obs) and torch.equal(r.critic_obs[:, :1], r.obs)
        assert (r.next_obs[r.terminated].abs() > 1).all()
        assert (r.obs[done].abs() <= 0.5).all()  # fresh resets
        ends += int(done.sum())
        terminated += int(r.terminated.sum())
    assert ends > terminated > 0


def test_torchvec_resume_is_exact_and_seeded():
    a = make_env("torchvec:HpcrlBatchedPointMass-v0", 8, seed=1)
    b = make_env("torchvec:HpcrlBatchedPointMass-v0", 8, seed=1)
    assert torch.equal(a.reset(), b.reset())
    _run(a, 5)
    saved = a.state_dict()
    first = _run(a, 12, seed=9)
    b.load_state_dict(saved)
    second = _run(b, 12, seed=9)
    for r1, r2 in zip(first, second):
        for f in ("obs", "next_obs", "reward", "terminated", "truncated", "critic_obs"):
            assert torch.equal(getattr(r1, f), getattr(r2, f)), f


def test_torchvec_missing_final_obs_and_bad_input():
    env = make_env("torchvec:HpcrlBatchedPointMass-v0?final_key=none&dict_obs=false", 4)
    env.reset()
    with pytest.raises(RuntimeError, match="missing_final_obs=reset_obs"):
        _run(env, LIMIT)
    env = make_env("torchvec:HpcrlBatchedPointMass-v0?final_key=none&dict_obs=false&missing_final_obs=reset_obs", 4)
    env.reset()
    assert env.critic_obs_dim is None
    assert all(torch.equal(r.obs, r.next_obs) for r in _run(env, LIMIT + 1))
    for name, words in [("torchvec:NoSuch-v0", "NoSuch"), ("torchvec:Pendulum-v1", "num_envs"),
                        ("torchvec:HpcrlBatchedPointMass-v0?wrapper=nosuchmod:f", "module:callable"),
                        ("torchvec:HpcrlBatchedPointMass-v0?x", "key=value")]:
        with pytest.raises(ValueError, match=words) as err:
            make_env(name, 2)
        assert "\n" not in str(err.value)


class TinyUserEnv(Pendulum):
    """A user VecEnv subclass: make_env("tests.test_torch_native_env:TinyUserEnv", ...)."""

    def __init__(self, num_envs, device="cpu", seed=0, max_episode_steps=9):
        super().__init__(num_envs, device, seed=seed, max_episode_steps=max_episode_steps)


def test_module_class_names():
    env = make_env("tests.test_torch_native_env:TinyUserEnv?max_episode_steps=3", 5, seed=2)
    # (pytest imported this file under another module name: compare by name)
    assert type(env).__name__ == "TinyUserEnv" and isinstance(env, VecEnv) and env.max_episode_steps == 3
    env.reset()
    assert sum(int(r.truncated.sum()) for r in _run(env, 3)) == 5
    assert issubclass(TinyUserEnv, TorchVecEnv)
    for name, words in [("nosuchpkg.mod:Env", "cannot import module"),
                        ("tests.test_torch_native_env:Missing", "has no attribute"),
                        ("tests.test_torch_native_env:BatchedPointMass", "not a VecEnv subclass"),
                        ("tests.test_torch_native_env:TinyUserEnv?bogus=1", "must take these arguments"),
                        ("nocolon", "unknown env")]:
        with pytest.raises(ValueError, match=words) as err:
            make_env(name, 2)
        assert "\n" not in str(err.value)
