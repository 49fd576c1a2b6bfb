"""MuJoCo Playground behind hpcrl's VecEnv (hpcrl/envs/playground.py), on the real simulator: shapes,
auto-reset and truncation against Playground's own wrapper and its raw step, the final observation of a
truncated episode, exact resume, the menagerie error, and a 2-rank FastSAC run through the CLI.

JAX compiles for tens of seconds: the env functions are compiled once per process and config and
shared by the tests here (hpcrl.envs.playground caches them), and the CLI ranks share a persistent XLA
cache with this process."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from hpcrl.envs import make_env

# Playground and JAX load only where this module runs (about 4 s): every pytest worker collects it.
if importlib.util.find_spec("mujoco_playground") is None:
    pytest.skip("mujoco_playground is not installed (the `playground` extra)", allow_module_level=True)

N, LIMIT = 8, 40
NAME = f"playground:CartpoleBalance?impl=jax&episode_length={LIMIT}"
CACHE = os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", "/tmp/hpcrl-jax-cache")


@pytest.fixture(scope="module", autouse=True)
def jax():
    import jax

    jax.config.update("jax_compilation_cache_dir", CACHE)  # also where jax was imported before the variable was set
    return jax


def _actions(steps: int, n: int, seed: int = 0) -> torch.Tensor:
    return torch.rand(steps, n, 1, generator=torch.Generator().manual_seed(seed)) * 2 - 1


@pytest.mark.slow
def test_flags_and_final_obs_match_playground(jax):
    from mujoco_playground import wrapper

    env = make_env(NAME, N, seed=1)
    obs = env.reset()
    assert obs.shape == (N, env.obs_dim) == (N, 5) and obs.dtype == torch.float32 and obs.device == env.device
    assert env.action_dim == 1 and env.max_episode_steps == LIMIT and env.critic_obs_dim is None
    raw_step = jax.jit(jax.vmap(env.env.step))
    # Playground's own training wrapper: its info["truncation"] and done are the reference flags. (With
    # full_reset=True it overwrites info, truncation included, with the reset's where done: use False.)
    ref = wrapper.wrap_for_brax_training(env.env, episode_length=LIMIT, full_reset=False)
    ref_reset, ref_step = jax.jit(ref.reset), jax.jit(ref.step)
    ref_state = ref_reset(jax.random.split(jax.random.PRNGKey(0), N))
    raw = env.state  # the raw env, stepped by hand from our state: the true next obs and reward
    acts = _actions(3 * LIMIT + 5, N)
    ends = 0
    for t, a in enumerate(acts, 1):
        res = env.step(a)
        ja = jax.numpy.asarray(a.numpy())
        raw = raw_step(raw, ja)
        ref_state = ref_step(ref_state, ja)
        for f in ("obs", "next_obs", "reward"):
            assert getattr(res, f).dtype == torch.float32
        assert res.terminated.dtype == res.truncated.dtype == torch.bool and res.reward.shape == (N,)
        trunc = np.asarray(ref_state.info["truncation"]) > 0
        term = (np.asarray(ref_state.done) > 0) & ~trunc
        assert np.array_equal(res.truncated.numpy(), trunc), t
        assert np.array_equal(res.terminated.numpy(), term), t
        assert res.truncated.numpy().all() == (t % LIMIT == 0)
        # next_obs is what the physics produced; at a time limit that is the final obs, which differs
        # from the post-reset obs that Playground's wrapper puts in its place.
        np.testing.assert_array_equal(res.next_obs.numpy(), np.asarray(raw.obs))
        np.testing.assert_array_equal(res.reward.numpy(), np.asarray(raw.reward))
        if res.done.any():
            ends += 1
            assert res.done.all()  # DM-suite episodes end together at the limit
            assert (res.obs - res.next_obs).abs().amax(-1).min() > 1e-3
            raw = env.state  # continue the reference from the fresh reset states
            assert torch.equal(env.observe(), res.obs)
        else:
            assert torch.equal(res.obs, res.next_obs)
    assert ends == 3


@pytest.mark.slow
def test_seed_and_exact_resume(tmp_path):
    from hpcrl.core.h5io import load_h5, save_h5

    a, b = make_env(NAME, N, seed=5), make_env(NAME, N, seed=5)
    assert torch.equal(a.reset(), b.reset())
    assert not torch.equal(a.reset(seed=6), b.observe())
    acts = _actions(LIMIT + 10, N, seed=2)
    for x in acts[:LIMIT - 5]:
        a.step(x)
    save_h5(tmp_path / "env.h5", a.state_dict(), 1)  # through the checkpoint format (HDF5 tree)
    saved = load_h5(tmp_path / "env.h5", 1)
    first = [a.step(x) for x in acts[LIMIT - 5:]]
    b.load_state_dict(saved)
    second = [b.step(x) for x in acts[LIMIT - 5:]]
    assert any(r.truncated.any() for r in first)  # the resumed stretch crosses an auto-reset
    for r1, r2 in zip(first, second):
        for f in ("obs", "next_obs", "reward", "terminated", "truncated"):
            assert torch.equal(getattr(r1, f), getattr(r2, f)), f
    with pytest.raises(ValueError, match="num_envs"):
        make_env(NAME, N + 1).load_state_dict(saved)


def test_bad_names_are_one_line_errors():
    for name, words in [("playground:NoSuchEnv", "unknown Playground env"),
                        ("playground:Go1JoystickFlatTerrain", "mujoco_menagerie"),
                        ("playground:CartpoleBalance?impl=cuda", "impl must be"),
                        ("playground:CartpoleBalance?no_such_key=1", "config keys")]:
        from mujoco_playground._src import mjx_env

        if "menagerie" in words and mjx_env.MENAGERIE_PATH.exists():
            continue  # a machine with the robot files loads it
        with pytest.raises(ValueError, match=words) as err:
            make_env(name, 2)
        assert "\n" not in str(err.value)


def test_menagerie_task_exits_2_through_cli(tmp_path):
    from mujoco_playground._src import mjx_env

    if mjx_env.MENAGERIE_PATH.exists():
        pytest.skip("this machine has the menagerie files")
    done = subprocess.run([sys.executable, "-m", "hpcrl.sac", "--env", "playground:Go1JoystickFlatTerrain",
                           "--num-envs", "2", "--total-env-steps", "4", "--run-dir", str(tmp_path / "r")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "mujoco_menagerie" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.slow
@pytest.mark.extended  # the one-rank tests above keep the simulator in the fast tier
def test_two_rank_fastsac_on_playground(tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "hpcrl.sac", "--env", NAME, "--nproc", "2", "--num-envs", str(2 * N),
           "--total-env-steps", str(2 * N * 120), "--batch-size", "64", "--buffer-size", "256",
           "--actor-hidden", "32", "--critic-hidden", "32", "--num-atoms", "21", "--learning-starts", "10",
           "--random-steps", "10", "--num-updates", "1", "--log-every", "20", "--eval-episodes", "0",
           "--run-dir", str(run)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "JAX_COMPILATION_CACHE_DIR": CACHE}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["env_steps"] == 2 * N * 120
    losses = [r[k] for r in rows for k in ("critic_loss", "actor_loss") if k in r]
    assert losses and all(np.isfinite(losses)), rows[-1]
    assert any(r.get("episodes", r.get("episode_count", 0)) for r in rows) or "episode_return" in rows[-1]
