"""Tests for hpcrl.envs: gymnasium equivalence, auto-reset semantics, seeding, checkpoints,
EpisodeStats, the gymnasium adapter (incl. MuJoCo HalfCheetah-v5) and make_env errors."""

from __future__ import annotations

import io
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from hpcrl.core.h5io import load_h5, save_h5
from hpcrl.envs import (
    CartPole,
    CartPoleSwingUp,
    EpisodeStats,
    Pendulum,
    StepResult,
    make_env,
)

gym = pytest.importorskip("gymnasium")

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
TORCH_ENVS = [Pendulum, CartPole, CartPoleSwingUp]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # Shared 2-core machines: 2 intra-op threads make small eager ops 10-30x slower.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _random_action(env, gen: torch.Generator) -> torch.Tensor:
    n = env.num_envs
    if env.is_discrete:
        return torch.randint(0, env.num_actions, (n,), generator=gen).to(env.device)
    u = torch.rand(n, env.action_dim, generator=gen).to(env.device, env.dtype)
    return env.action_low + u * (env.action_high - env.action_low)


def _rollout(env, steps: int, seed: int) -> list[StepResult]:
    gen = torch.Generator().manual_seed(seed)
    return [env.step(_random_action(env, gen)) for _ in range(steps)]


def _assert_same_results(a: list[StepResult], b: list[StepResult]) -> None:
    assert len(a) == len(b)
    for ra, rb in zip(a, b):
        for f in ("obs", "next_obs", "reward", "terminated", "truncated"):
            assert torch.equal(getattr(ra, f), getattr(rb, f)), f


# --------------------------------------------------------------------------------------------------
# Equivalence with gymnasium, one step from many shared states


def test_pendulum_matches_gymnasium():
    n = 3000
    g = torch.Generator().manual_seed(1)
    # Out-of-range angles/velocities and torques beyond +-2 exercise wrapping and both clips.
    th = (torch.rand(n, generator=g) * 2 - 1) * 8.0
    thdot = (torch.rand(n, generator=g) * 2 - 1) * 9.0
    u = (torch.rand(n, 1, generator=g) * 2 - 1) * 3.0
    env = Pendulum(n)
    env.reset()
    env.state = torch.stack([th, thdot], dim=-1)
    res = env.step(u)

    ref = gym.make("Pendulum-v1").unwrapped
    ref.reset(seed=0)
    obs, rew = [], []
    for i in range(n):
        ref.state = np.array([float(th[i]), float(thdot[i])])
        o, r, term, trunc, _ = ref.step(u[i].numpy())
        assert not term and not trunc
        obs.append(o)
        rew.append(r)
    obs_t = torch.from_numpy(np.stack(obs))
    rew_t = torch.tensor(rew, dtype=torch.float64)
    assert res.obs.dtype == torch.float32 and res.reward.dtype == torch.float32
    assert (res.next_obs - obs_t).abs().max() <= 1e-5
    assert (res.reward.double() - rew_t).abs().max() <= 1e-5
    assert not res.terminated.any() and not res.truncated.any()
    assert torch.equal(res.obs, res.next_obs)  # no episode ended

    # The float64 option tracks gymnasium's float64 arithmetic even closer.
    env64 = Pendulum(n, dtype=torch.float64)
    env64.reset()
    env64.state = torch.stack([th, thdot], dim=-1).double()
    res64 = env64.step(u.double())
    assert res64.obs.dtype == torch.float64
    assert (res64.next_obs - obs_t.double()).abs().max() <= 1e-6  # gym's obs are float32
    assert (res64.reward - rew_t).abs().max() <= 1e-6


def test_pendulum_spec_and_reset_distribution():
    env = make_env("pendulum", 4096, seed=3)
    assert (env.obs_dim, env.action_dim, env.max_episode_steps) == (3, 1, 200)
    assert env.num_actions is None and not env.is_discrete
    assert env.action_low.tolist() == [-2.0] and env.action_high.tolist() == [2.0]
    obs = env.reset()
    assert obs.shape == (4096, 3) and obs.dtype == torch.float32
    th, thdot = env.state[:, 0], env.state[:, 1]
    assert th.abs().max() <= math.pi and thdot.abs().max() <= 1.0
    # Uniform: spread close to the bounds, mean near 0.
    assert th.abs().max() > 3.1 and thdot.abs().max() > 0.99
    assert th.mean().abs() < 0.15 and thdot.mean().abs() < 0.05
    assert torch.allclose(obs, torch.stack([th.cos(), th.sin(), thdot], -1))


def test_cartpole_matches_gymnasium():
    n = 3000
    g = torch.Generator().manual_seed(2)
    # Ranges straddle the termination thresholds (2.4, 12 deg) so both outcomes are frequent.
    scale = torch.tensor([2.6, 3.0, 0.25, 3.0])
    states = (torch.rand(n, 4, generator=g) * 2 - 1) * scale
    actions = torch.randint(0, 2, (n,), generator=g)
    env = CartPole(n)
    env.reset()
    env.state = states.clone()
    res = env.step(actions)

    ref = gym.make("CartPole-v1").unwrapped
    ref.reset(seed=0)
    obs, term, rew = [], [], []
    for i in range(n):
        ref.state = states[i].double().numpy()
        ref.steps_beyond_terminated = None
        o, r, t, _, _ = ref.step(int(actions[i]))
        obs.append(o)
        term.append(t)
        rew.append(r)
    obs_t = torch.from_numpy(np.stack(obs))
    term_t = torch.tensor(term)
    assert 0.1 < term_t.float().mean() < 0.9
    assert (res.next_obs - obs_t).abs().max() <= 1e-5
    assert torch.equal(res.terminated, term_t)
    assert torch.equal(res.reward, torch.tensor(rew, dtype=torch.float32))
    assert not res.truncated.any()
    # Terminated envs were auto-reset: obs is a fresh state, next_obs the true final one.
    assert torch.equal(res.obs[~term_t], res.next_obs[~term_t])
    assert res.obs[term_t].abs().max() <= 0.05


def test_cartpole_spec_and_reset():
    env = make_env("cartpole", 1000, seed=0)
    assert (env.obs_dim, env.num_actions, env.max_episode_steps) == (4, 2, 500)
    assert env.is_discrete and env.action_dim is None and env.action_low is None
    obs = env.reset()
    assert obs.abs().max() <= 0.05 and obs.abs().max() > 0.049
    # Pushing right forever ends every episode by termination well before the time limit.
    first = torch.full((1000,), -1)
    for t in range(1, 100):
        res = env.step(torch.ones(1000, dtype=torch.long))
        assert not res.truncated.any()
        first[res.terminated & (first < 0)] = t
    assert (first > 5).all()


# --------------------------------------------------------------------------------------------------
# Auto-reset semantics


@pytest.mark.parametrize("device", DEVICES)
def test_truncation_exactly_at_limit_and_final_obs(device):
    env = Pendulum(8, device, seed=0, max_episode_steps=5)
    env.reset()
    zero = torch.zeros(8, 1, device=device)
    for step in range(1, 16):
        before = env.state.clone()
        res = env.step(zero)
        assert not res.terminated.any()
        if step % 5 == 0:
            assert res.truncated.all()
            # next_obs is the observation that followed the action from the pre-reset state ...
            probe = Pendulum(8, device, max_episode_steps=5)
            probe.reset()
            probe.state = before
            assert torch.equal(res.next_obs, probe.step(zero).next_obs)
            # ... obs is a freshly reset one (different, and consistent with the new state).
            assert not torch.equal(res.obs, res.next_obs)
            assert torch.equal(res.obs, env.observe())
            assert env.state[:, 1].abs().max() <= 1.0
            assert (env.elapsed == 0).all()
        else:
            assert not res.truncated.any()
            assert torch.equal(res.obs, res.next_obs)
            assert (env.elapsed == step % 5).all()


def test_terminated_wins_over_truncated():
    env = CartPole(6, max_episode_steps=3)
    env.reset()
    right = torch.ones(6, dtype=torch.long)
    env.step(right)
    env.step(right)
    # Third step: the time limit fires for all; envs 0-2 also terminate (cart far right).
    env.state[:3, 0] = 2.5
    final_x = env.state[:, 0] + env.tau * env.state[:, 1]
    res = env.step(right)
    assert res.terminated.tolist() == [True] * 3 + [False] * 3
    assert res.truncated.tolist() == [False] * 3 + [True] * 3
    assert not (res.terminated & res.truncated).any()
    assert res.done.all()
    assert torch.allclose(res.next_obs[:, 0], final_x)
    assert res.obs.abs().max() <= 0.05  # all reset
    assert (env.elapsed == 0).all()


def test_partial_reset_leaves_other_envs_alone():
    env = CartPole(4)
    env.reset()
    env.state[1, 2] = 0.3  # beyond 12 degrees: env 1 terminates on the next step
    keep = env.state.clone()
    res = env.step(torch.zeros(4, dtype=torch.long))
    assert res.terminated.tolist() == [False, True, False, False]
    assert res.next_obs[1, 2] > 0.2 and res.obs[1].abs().max() <= 0.05
    others = [0, 2, 3]
    assert torch.equal(res.obs[others], res.next_obs[others])
    assert not torch.equal(env.state[others], keep[others])  # they did advance
    assert env.elapsed.tolist() == [1, 0, 1, 1]


def test_step_has_no_host_read(monkeypatch):
    envs = [c(16, seed=0) for c in TORCH_ENVS]
    for e in envs:
        e.reset()
    gen = torch.Generator().manual_seed(0)
    actions = [_random_action(e, gen) for e in envs]
    stats = EpisodeStats(16)

    def boom(*_a, **_k):
        raise AssertionError("host read inside step")

    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, boom)
    for e, a in zip(envs, actions):
        for _ in range(3):
            stats.update(e.step(a))
    monkeypatch.undo()
    with pytest.raises(AssertionError):  # the probe itself works
        monkeypatch.setattr(torch.Tensor, "item", boom)
        torch.zeros(1).item()


@pytest.mark.cuda
def test_cuda_step_without_host_read():
    for cls in TORCH_ENVS:
        env = cls(1024, "cuda", seed=0)
        env.reset()
        gen = torch.Generator().manual_seed(0)
        a = _random_action(env, gen)
        stats = EpisodeStats(1024, "cuda")
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(5):
                stats.update(env.step(a))
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert env.observe().is_cuda


# --------------------------------------------------------------------------------------------------
# Seeding and checkpoints


@pytest.mark.parametrize("cls", TORCH_ENVS)
def test_seed_reproducibility(cls):
    a, b, c = cls(8, seed=5), cls(8, seed=5), cls(8, seed=6)
    assert torch.equal(a.reset(), b.reset())
    assert not torch.equal(a.observe(), c.reset())
    _assert_same_results(_rollout(a, 30, 0), _rollout(b, 30, 0))
    # reset(seed) reseeds: same as a fresh env with that seed.
    d = cls(8, seed=0)
    assert torch.equal(a.reset(seed=11), d.reset(seed=11))
    _assert_same_results(_rollout(a, 10, 1), _rollout(d, 10, 1))


@pytest.mark.parametrize("cls", TORCH_ENVS)
def test_state_dict_round_trip(cls):
    # Short limits so resets (and their RNG draws) happen inside the compared window.
    env = cls(6, seed=0, max_episode_steps=7)
    env.reset()
    _rollout(env, 12, 0)
    buf = io.BytesIO()
    torch.save(env.state_dict(), buf)
    saved_obs = env.observe()
    cont = _rollout(env, 20, 1)
    assert any(r.done.any() for r in cont)

    buf.seek(0)
    resumed = cls(6, seed=999, max_episode_steps=7)
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    assert torch.equal(resumed.observe(), saved_obs)
    _assert_same_results(cont, _rollout(resumed, 20, 1))

    with pytest.raises(ValueError, match="state_dict"):
        cls(3).load_state_dict(env.state_dict())


def test_step_before_reset_and_bad_action_shape():
    env = Pendulum(4)
    with pytest.raises(RuntimeError, match="before reset"):
        env.step(torch.zeros(4, 1))
    env.reset()
    with pytest.raises(ValueError, match="action shape"):
        env.step(torch.zeros(5, 1))
    cp = CartPole(4)
    cp.reset()
    with pytest.raises(ValueError, match="action shape"):
        cp.step(torch.zeros(4, 2, dtype=torch.long))
    # [N] and [N, 1] actions are both accepted for 1-D continuous actions.
    env.reset(seed=0)
    r1 = env.step(torch.full((4,), 0.5))
    env.reset(seed=0)
    r2 = env.step(torch.full((4, 1), 0.5))
    assert torch.equal(r1.obs, r2.obs)


# --------------------------------------------------------------------------------------------------
# EpisodeStats


def test_episode_stats_matches_python_reference():
    n = 5
    env = CartPole(n, seed=0, max_episode_steps=40)  # mix of terminations and truncations
    env.reset()
    stats = EpisodeStats(n)
    gen = torch.Generator().manual_seed(0)
    run_ret, run_len = [0.0] * n, [0] * n
    done_rets, done_lens = [], []
    saw_term = saw_trunc = False
    for _ in range(150):
        # Biased random pushes: some episodes terminate, some hit the 40-step limit.
        a = (torch.rand(n, generator=gen) < 0.5).long()
        res = env.step(a)
        done, ep_ret, ep_len = stats.update(res)
        saw_term |= bool(res.terminated.any())
        saw_trunc |= bool(res.truncated.any())
        for i in range(n):
            run_ret[i] += float(res.reward[i])
            run_len[i] += 1
            if bool(res.done[i]):
                assert ep_ret[i] == run_ret[i] and ep_len[i] == run_len[i]
                done_rets.append(run_ret[i])
                done_lens.append(run_len[i])
                run_ret[i], run_len[i] = 0.0, 0
            else:
                assert ep_ret[i] == 0 and ep_len[i] == 0
        assert torch.equal(done, res.done)
    assert saw_term and saw_trunc
    s = stats.pop()
    assert s.count.item() == len(done_rets) > 5
    assert s.return_sum.item() == pytest.approx(sum(done_rets))
    assert s.length_sum.item() == sum(done_lens)
    assert s.mean_return() == pytest.approx(sum(done_rets) / len(done_rets))
    assert torch.equal(s.as_tensor(), torch.stack([s.return_sum, s.length_sum, s.count]))
    # pop() clears the sums but keeps the running episodes.
    empty = stats.pop()
    assert empty.count.item() == 0 and math.isnan(empty.mean_return())
    assert stats.running_length.tolist() == run_len


def test_episode_stats_pendulum_sums():
    env = Pendulum(3, seed=1, max_episode_steps=4)
    env.reset()
    stats = EpisodeStats(3)
    rewards = []
    for r in _rollout(env, 10, 0):
        stats.update(r)
        rewards.append(r.reward.double())
    s = stats.pop()
    assert s.count.item() == 6 and s.length_sum.item() == 24  # episodes ended at steps 4 and 8
    assert s.return_sum.item() == pytest.approx(torch.stack(rewards[:8]).sum().item(), rel=1e-9)
    assert s.return_sum.item() < 0


# --------------------------------------------------------------------------------------------------
# CartPoleSwingUp


def test_swingup_step_matches_plain_formulas():
    # The env folds constants for speed; recompute one step the plain way (float64) and compare.
    n = 2000
    g = torch.Generator().manual_seed(3)
    env = CartPoleSwingUp(n)
    env.reset()
    s0 = (torch.rand(n, 4, generator=g) * 2 - 1) * torch.tensor([1.9, 3.0, math.pi, 8.0])
    env.state = s0.clone()
    a = (torch.rand(n, 1, generator=g) * 2 - 1) * 1.5  # beyond [-1, 1]: clipped
    res = env.step(a)

    x, xd, th, thd = s0.double().unbind(-1)
    u = a.double().squeeze(-1).clamp(-1, 1)
    mc, mp, l, grav, dt, lim = 1.0, 0.1, 0.5, 9.81, 0.01, 1.8
    temp = (10.0 * u + mp * l * thd**2 * th.sin()) / (mc + mp)
    thacc = (grav * th.sin() - th.cos() * temp) / (l * (4 / 3 - mp * th.cos() ** 2 / (mc + mp)))
    xacc = temp - mp * l * thacc * th.cos() / (mc + mp)
    xd, thd = xd + dt * xacc, thd + dt * thacc
    x, th = x + dt * xd, th + dt * thd
    xd = torch.where((x > lim) & (xd > 0) | (x < -lim) & (xd < 0), 0.0, xd)
    x = x.clamp(-lim, lim)

    def tol(v, margin):  # dm_control rewards.tolerance, bounds (0, 0), gaussian, 0.1 at margin
        return torch.exp(-0.5 * (v.abs() / margin * math.sqrt(-2 * math.log(0.1))) ** 2)

    quad = torch.where(u.abs() < 1, 1 - u**2, 0.0)
    reward = (th.cos() + 1) / 2 * (1 + tol(x, 2)) / 2 * (4 + quad) / 5 * (1 + tol(thd, 5)) / 2
    expected_obs = torch.stack([x, th.cos(), th.sin(), xd, thd], -1)
    assert (res.next_obs.double() - expected_obs).abs().max() < 1e-5
    assert (res.reward.double() - reward).abs().max() < 1e-6
    assert (x.abs() == lim).sum() > 10  # the rail was exercised


def test_swingup_is_a_real_task():
    n = 16
    env = make_env("cartpole_swingup", n, seed=0)
    assert (env.obs_dim, env.action_dim, env.max_episode_steps) == (5, 1, 1000)
    obs = env.reset()
    assert (obs[:, 1] < -0.99).all()  # hanging down: cos(theta) ~ -1

    # Scripted controller: energy pumping far from upright, LQR near it (gains from the linearised
    # model, computed offline). It should score high; random actions should score low.
    k = torch.tensor([-0.9262, -1.1424, -7.4810, -1.7994])
    mp, l, g = env.masspole, env.length, env.gravity

    def scripted(s: torch.Tensor) -> torch.Tensor:
        x, xd, th, thd = s.unbind(-1)
        energy = 0.5 * (4 / 3) * mp * l * l * thd**2 + mp * g * l * (torch.cos(th) - 1)
        pump = 8.0 * energy * torch.cos(th) * thd - 0.5 * x - 0.5 * xd
        u = torch.where(torch.cos(th) > 0.85, -(s @ k), pump)
        return u.clamp(-1, 1).unsqueeze(-1)

    gen = torch.Generator().manual_seed(0)
    for policy, lo, hi in [(scripted, 700, 1000), (None, 0, 100)]:
        env.reset(seed=1)
        stats = EpisodeStats(n)
        rewards, xs = [], []
        for _ in range(1000):
            a = scripted(env.state) if policy else torch.rand(n, 1, generator=gen) * 2 - 1
            res = env.step(a)
            stats.update(res)
            rewards.append(res.reward)
            xs.append(res.next_obs[:, 0])
        assert res.truncated.all() and not res.terminated.any()
        rewards = torch.stack(rewards)
        assert (rewards >= 0).all() and (rewards <= 1).all()
        assert torch.stack(xs).abs().max() <= env.x_limit
        s = stats.pop()
        assert s.count.item() == n
        assert lo < s.mean_return() < hi


# --------------------------------------------------------------------------------------------------
# Gymnasium adapter


def test_gym_adapter_pendulum_matches_torch_env_and_final_obs():
    n = 4
    env = make_env("gym:Pendulum-v1", n, seed=3)
    assert (env.obs_dim, env.action_dim, env.max_episode_steps) == (3, 1, 200)
    obs = env.reset()
    assert obs.shape == (n, 3) and obs.dtype == torch.float32
    # Same seed -> same reset; the first reset without a seed uses the constructor seed.
    assert torch.equal(obs, make_env("gym:Pendulum-v1", n, seed=3).reset())

    ref = Pendulum(n)
    ref.reset()
    subs = [e.unwrapped for e in env.env.envs]
    gen = torch.Generator().manual_seed(0)
    for step in range(1, 201):
        # gymnasium's angle grows unboundedly; wrap it (obs and reward are invariant) before the
        # float32 cast, which would otherwise lose ~1e-5 of a large angle.
        th_dot = torch.tensor(np.stack([s.state for s in subs]))
        th_dot[:, 0] = (th_dot[:, 0] + math.pi) % (2 * math.pi) - math.pi
        ref.state = th_dot.float()
        expected = ref.step(a := _random_action(env, gen))
        res = env.step(a)
        assert res.reward.dtype == torch.float32 and res.terminated.dtype == torch.bool
        assert (res.next_obs - expected.next_obs).abs().max() <= 1e-5
        assert (res.reward - expected.reward).abs().max() <= 1e-5
        assert not res.terminated.any()
        if step < 200:
            assert not res.truncated.any() and torch.equal(res.obs, res.next_obs)
    # Step 200: truncated everywhere; next_obs is the final obs, obs the reset obs.
    assert res.truncated.all()
    assert not torch.allclose(res.obs, res.next_obs)
    reset_obs = torch.tensor(np.stack([s._get_obs() for s in subs]))
    assert torch.equal(res.obs, reset_obs)
    env.close()


def test_gym_adapter_cartpole_discrete_final_obs():
    env = make_env("gym:CartPole-v1", 4, seed=0)
    assert env.is_discrete and env.num_actions == 2 and env.max_episode_steps == 500
    env.reset()
    gen = torch.Generator().manual_seed(0)
    ended = 0
    results = []
    for step in range(200):
        if step == 100:
            saved = env.state_dict()
        res = env.step(torch.randint(0, 2, (4,), generator=gen))
        results.append(res)
        t = res.terminated
        if t.any():
            ended += int(t.sum())
            final = res.next_obs[t]
            out = (final[:, 0].abs() > 2.4) | (final[:, 2].abs() > 12 * 2 * math.pi / 360)
            assert out.all()  # the true terminal state ...
            assert res.obs[t].abs().max() <= 0.05  # ... and a fresh reset obs
        assert torch.equal(res.obs[~res.done], res.next_obs[~res.done])
    assert ended > 4
    # Best-effort checkpoint of classic-control sub-envs: exact resume, resets included.
    other = make_env("gym:CartPole-v1", 4, seed=7)
    other.reset()
    other.load_state_dict(saved)
    gen = torch.Generator().manual_seed(0)
    actions = [torch.randint(0, 2, (4,), generator=gen) for _ in range(200)][100:]
    replay = [other.step(a) for a in actions]
    _assert_same_results(results[100:], replay)
    env.close()


def test_gym_adapter_halfcheetah(tmp_path):
    env = make_env("gym:HalfCheetah-v5", 2, seed=0)
    assert (env.obs_dim, env.action_dim, env.max_episode_steps) == (17, 6, 1000)
    assert env.action_low.tolist() == [-1.0] * 6
    env.reset()
    gen = torch.Generator().manual_seed(0)
    _rollout(env, 10, 0)
    # Through the checkpoint format itself (HDF5 via hpcrl.core.h5io: nested dicts, no lists, no 128-bit ints).
    path = tmp_path / "env.h5"
    save_h5(path, {"env": env.state_dict()})
    cont = _rollout(env, 10, 1)
    assert cont[-1].obs.dtype == torch.float32 and cont[-1].reward.shape == (2,)
    assert all(torch.isfinite(r.reward).all() for r in cont)

    # Exact resume from the checkpoint, in a fresh adapter with another seed.
    other = make_env("gym:HalfCheetah-v5", 2, seed=123)
    other.reset()
    other.load_state_dict(load_h5(path)["env"])
    _assert_same_results(cont, _rollout(other, 10, 1))
    other.close()

    # HalfCheetah never terminates: truncation exactly at step 1000, with the final obs kept.
    for step in range(21, 1001):
        res = env.step(_random_action(env, gen))
        assert bool(res.truncated.all()) == (step == 1000) and not res.terminated.any()
    assert not torch.allclose(res.obs, res.next_obs)
    assert res.obs[:, 8:].abs().max() < 1.0  # reset velocities are small noise
    env.close()


def test_gym_adapter_wraps_vector_env_and_terminated_wins():
    from hpcrl.envs import GymVecEnv

    vec = gym.vector.SyncVectorEnv(
        [lambda: gym.make("CartPole-v1", max_episode_steps=3)] * 2,
        autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
    )
    env = GymVecEnv(vec, seed=0)
    assert env.num_envs == 2 and env.max_episode_steps == 3
    env.reset()
    right = torch.ones(2, dtype=torch.long)
    env.step(right)
    env.step(right)
    # Env 0 also terminates on the step where the time limit fires: gymnasium reports both flags.
    vec.envs[0].unwrapped.state = np.array([2.39, 1.0, 0.0, 0.0])
    res = env.step(right)
    assert res.terminated.tolist() == [True, False]
    assert res.truncated.tolist() == [False, True]
    assert res.next_obs[0, 0] > 2.4 and res.obs.abs().max() <= 0.05
    env.close()


def test_gym_adapter_rejects_next_step_autoreset():
    vec = gym.make_vec("Pendulum-v1", 2, vectorization_mode="sync")  # default NEXT_STEP
    from hpcrl.envs import GymVecEnv

    with pytest.raises(ValueError, match="SAME_STEP"):
        GymVecEnv(vec)
    vec.close()


# --------------------------------------------------------------------------------------------------
# make_env errors


def test_make_env_errors():
    with pytest.raises(ValueError, match="unknown env 'pendulm'.*cartpole.*cartpole_swingup.*pendulum"):
        make_env("pendulm", 4)
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="num_envs"):
            make_env("pendulum", bad)
    with pytest.raises(ValueError, match="num_envs"):
        make_env("gym:Pendulum-v1", 0)
    with pytest.raises(ValueError, match="max_episode_steps"):
        make_env("cartpole", 2, max_episode_steps=0)
    with pytest.raises(ValueError, match="gymnasium id"):
        make_env("gym:", 2)
    with pytest.raises(ValueError, match="NoSuchEnv"):
        make_env("gym:NoSuchEnv-v0", 2)
    assert isinstance(make_env("cartpole_swingup", 2), CartPoleSwingUp)


def test_mujoco_warnings_are_shown_once_per_process():
    """gymnasium's HalfCheetah XML makes MuJoCo warn ('settotalmass is deprecated') at every sub-env's
    compile: a process prints each distinct warning once, on one line."""
    code = ("from hpcrl.envs import make_env\n"
            "for n in (4, 2):\n"
            "    make_env('gym:HalfCheetah-v5', n, seed=0).close()\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    text = out.stdout + out.stderr
    assert text.count("settotalmass") == 1, text
    assert "hpcrl: MuJoCo warning (shown once): compiler attribute 'settotalmass'" in text
    assert "\n\n" not in text.strip()
