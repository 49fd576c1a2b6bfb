"""holosoma's training recipe in FastSAC: privileged critic observations, gradient clipping,
fp16 with a GradScaler across ranks, symmetry augmentation, env shared state, stop within one env step."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hpcrl.run import checkpoint
from hpcrl.comm import Plane
from hpcrl.comm.local import spawn
from hpcrl.envs import make_env
from hpcrl.replay import ReplayShard
from hpcrl.sac import FastSAC, UpdateNoise, preset
from hpcrl.sac.agent import mirror_batch
from hpcrl.sac.run import reduce_shared_state

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sac_workers  # noqa: E402


# -- critic observations ---------------------------------------------------------------------------

def test_replay_round_trip_keeps_critic_obs_with_final_obs_rules(tmp_path):
    from hpcrl.replay.hdf5 import load_shard, save_shard

    sac_workers.register_toy()
    env = make_env("toy_privileged", 3, seed=1, max_episode_steps=4)
    obs = env.reset()
    cobs = env.observe_critic()
    assert env.critic_obs_dim == 3 and torch.equal(cobs[:, :2], obs)
    shard = ReplayShard(3, 16, 2, 1, n_step=1, gamma=0.9, critic_obs_dim=3)
    finals = []
    for _ in range(10):
        r = env.step(torch.rand(3, 1) * 2 - 1)
        shard.add(obs, torch.zeros(3, 1), r.reward, r.next_obs, r.terminated, r.truncated,
                  critic_obs=cobs, next_critic_obs=r.next_critic_obs)
        finals.append((r.done.clone(), r.next_critic_obs.clone(), r.critic_obs.clone()))
        obs, cobs = r.obs, r.critic_obs
    # every transition: critic next obs is the true final one where the episode ended, else the next critic obs
    env_idx = torch.arange(3).repeat(10)
    slot_idx = torch.arange(10).repeat_interleave(3)
    b = shard.gather(env_idx, slot_idx)
    want_next = torch.cat([f[1] for f in finals])
    assert torch.equal(b.next_critic_obs, want_next)
    assert torch.equal(b.next_critic_obs[:, :2], b.next_obs)  # the toy's critic obs start with the actor's
    assert torch.equal(b.critic_obs[:, :2], b.obs)
    assert bool(torch.cat([f[0] for f in finals]).any()), "no episode ended: the final-obs path was not tested"
    # the goal column (hidden from the actor) really differs between envs
    assert b.critic_obs[:, 2].unique().numel() > 1
    path = tmp_path / "shard.h5"
    save_shard(shard, path)
    copy = ReplayShard(3, 16, 2, 1, n_step=1, gamma=0.9, critic_obs_dim=3)
    load_shard(copy, path)
    g = torch.Generator().manual_seed(0)
    a, c = shard.sample(32, torch.Generator().manual_seed(0)), copy.sample(32, g)
    for x, y in zip(a, c):
        assert torch.equal(x, y)
    with pytest.raises(ValueError, match="critic_obs_dim"):
        load_shard(ReplayShard(3, 16, 2, 1, n_step=1, gamma=0.9), path)
    with pytest.raises(ValueError, match="critic_obs and next_critic_obs"):
        shard.add(obs, torch.zeros(3, 1), r.reward, r.next_obs, r.terminated, r.truncated)


def _agent(cfg, cdim):
    torch.manual_seed(0)
    return FastSAC(cfg, sac_workers.OBS, sac_workers.ACT, -torch.ones(2), torch.ones(2), torch.device("cpu"),
                   plane=Plane.local("device"), critic_obs_dim=cdim)


def test_without_critic_obs_nothing_changes_and_with_them_the_critic_reads_them():
    cfg = sac_workers.small_config("flat")
    plain, same = _agent(cfg, None), _agent(cfg, sac_workers.OBS)
    other = _agent(cfg, sac_workers.OBS)
    for step in range(4):
        batch, noise = sac_workers.global_data(step)
        plain.update(batch, noise)
        # critic obs equal to the actor's: bit-identical to no critic obs at all
        same.update(batch._replace(critic_obs=batch.obs.clone(), next_critic_obs=batch.next_obs.clone()), noise)
        other.update(batch._replace(critic_obs=batch.obs.flip(0), next_critic_obs=batch.next_obs.flip(0)), noise)
    for name, p in plain.critic.state_dict().items():
        assert torch.equal(p, same.critic.state_dict()[name]), name
    for name, p in plain.actor.state_dict().items():
        assert torch.equal(p, same.actor.state_dict()[name]), name
    assert not torch.equal(plain.critic.heads[0][0].weight, other.critic.heads[0][0].weight)


def test_grad_clipping_bounds_the_applied_update():
    cfg = dataclasses.replace(sac_workers.small_config("flat"), max_grad_norm=1e-3, weight_decay=0.0)
    agent = _agent(cfg, None)
    batch, noise = sac_workers.global_data(0)
    grads = {}
    real = agent.critic_opt.step

    def record(*a, **k):
        grads.update({n: p.grad.clone() for n, p in agent.critic.named_parameters()})
        return real(*a, **k)

    agent.critic_opt.step = record
    out = agent.update(batch, noise)
    total = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads.values()]))
    assert float(out["critic_grad_norm"]) > 1e-2  # the pre-clip norm is logged ...
    assert float(total) == pytest.approx(1e-3, rel=1e-4)  # ... and the step saw the clipped one


@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_amp_updates_run_and_stay_finite(amp):
    cfg = dataclasses.replace(sac_workers.small_config("flat"), amp=amp, max_grad_norm=10.0)
    agent = _agent(cfg, None)
    assert (agent.scaler is not None) == (amp == "fp16")
    for step in range(6):
        out = agent.update(*sac_workers.global_data(step))
        assert all(torch.isfinite(v).all() for v in out.values())
    assert all(torch.isfinite(p).all() for p in agent.critic.parameters())


def test_bf16_flag_is_an_alias_of_amp_bf16():
    from hpcrl.sac.agent import amp_mode

    assert amp_mode(dataclasses.replace(preset("pendulum"), bf16=True)) == "bf16"
    assert amp_mode(dataclasses.replace(preset("pendulum"), bf16=True, amp="fp16")) == "fp16"
    assert amp_mode(preset("pendulum")) == "none"


# -- two ranks: critic obs + fp16 + clipping equal one rank; an inf on one rank is skipped by both --------

OPTS = [{"amp": "none", "max_grad_norm": 0.5}, {"amp": "fp16", "inf_rank": 1, "inf_step": 2},
        {"amp": "fp16", "max_grad_norm": 0.5}]


@pytest.fixture(scope="module")
def recipe_two_ranks():
    return spawn(sac_workers.recipe_rank, 2, args=(OPTS,), timeout_s=100)


@pytest.mark.slow
@pytest.mark.parametrize("which,tol", [(0, 1e-5), (2, 5e-3)], ids=["fp32", "fp16"])
def test_two_ranks_equal_one_rank_with_critic_obs_and_clipping(recipe_two_ranks, which, tol):
    # fp16: weight gradients summed in half precision over 16 rows twice vs over 32 once round
    # differently, and Adam amplifies that in small gradients: close, not equal. fp32: tight.
    single = sac_workers.recipe_updates(OPTS[which])
    results = [r[which] for r in recipe_two_ranks]
    for rank, res in enumerate(results):
        for group in ("actor", "critic", "critic_target"):
            for name, value in single[group].items():
                torch.testing.assert_close(res[group][name], value, rtol=tol * 10, atol=tol,
                                           msg=lambda m: f"rank {rank}: {group}.{name}: {m}")
        assert res["counters"] == single["counters"]
        assert res["norms"] == pytest.approx(single["norms"], rel=1e-3)
    assert max(single["norms"]) > 0.5  # clipping was active
    for group in ("actor", "critic", "critic_target"):  # ranks agree bit for bit
        for name in single[group]:
            assert torch.equal(results[0][group][name], results[1][group][name]), f"{group}.{name}"


@pytest.mark.slow
def test_inf_on_one_rank_skips_the_step_on_every_rank(recipe_two_ranks):
    results = [r[1] for r in recipe_two_ranks]
    clean = sac_workers.recipe_updates({"amp": "fp16"})
    for res in results:
        assert res["critic_unchanged_at_inf"] is True  # the step with the inf was skipped ...
        assert res["scales"][2] == clean["scales"][2] / 2  # ... and the scale halved, on both ranks
    assert results[0]["scales"] == results[1]["scales"]
    for group in ("actor", "critic", "critic_target"):
        for name in results[0][group]:
            assert torch.equal(results[0][group][name], results[1][group][name]), f"{group}.{name}"
    for res in results:
        assert all(torch.isfinite(v).all() for v in res["critic"].values())


# -- symmetry ----------------------------------------------------------------------------------------

def test_cartpole_mirrored_transitions_are_transitions_of_the_env():
    env = make_env("cartpole_swingup", 64, seed=3)
    twin = make_env("cartpole_swingup", 64, seed=3)
    assert env.has_symmetry and not make_env("pendulum", 2).has_symmetry
    env.reset()
    twin.reset()
    g = torch.Generator().manual_seed(0)
    env.state = torch.randn(64, 4, generator=g) * torch.tensor([0.8, 1.0, 2.0, 3.0])
    for _ in range(20):
        obs = env.observe()
        action = torch.rand(64, 1, generator=g) * 2 - 1
        twin.state = env.state * torch.tensor([-1.0, -1.0, -1.0, -1.0])  # the mirrored state
        twin.elapsed = env.elapsed.clone()
        assert torch.allclose(twin.observe(), env.mirror_obs(obs), atol=1e-6)
        r = env.step(action)
        m = twin.step(env.mirror_action(action))
        torch.testing.assert_close(m.next_obs, env.mirror_obs(r.next_obs), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(m.reward, r.reward, atol=1e-6, rtol=1e-6)
        assert torch.equal(m.terminated, r.terminated) and torch.equal(m.truncated, r.truncated)
    batch, _ = sac_workers.global_data(0)
    doubled = mirror_batch(batch._replace(obs=batch.obs[:, :5], next_obs=batch.next_obs[:, :5],
                                          action=batch.action[:, :1]), env.mirror_obs, env.mirror_action)
    assert doubled.obs.shape[0] == 2 * batch.obs.shape[0] and doubled.critic_obs is None
    assert torch.equal(doubled.action[32:], -doubled.action[:32])
    assert torch.equal(doubled.reward[32:], doubled.reward[:32])


# -- shared state ------------------------------------------------------------------------------------

def test_shared_state_reduction_is_the_episode_weighted_mean():
    out = reduce_shared_state({"level": torch.tensor(2.0), "scale": torch.tensor([1.0, 3.0])}, torch.tensor(4))
    assert float(out["level"]) == 2.0 and out["scale"].tolist() == [1.0, 3.0]
    # two ranks simulated through the sum: values 1 (3 episodes) and 5 (1 episode) -> 2; none -> plain mean 3
    parts = [({"v": torch.tensor(1.0)}, torch.tensor(3)), ({"v": torch.tensor(5.0)}, torch.tensor(1))]

    def fake_world(weights):
        packed = []
        for (state, _), w in zip(parts, weights):
            captured = {}
            reduce_shared_state(state, torch.tensor(w), lambda t: captured.setdefault("t", t.clone()))
            packed.append(captured["t"])
        total = sum(packed)
        return reduce_shared_state(parts[0][0], torch.tensor(weights[0]), lambda t: t.copy_(total))["v"]

    assert float(fake_world([3, 1])) == pytest.approx(2.0)
    assert float(fake_world([0, 0])) == pytest.approx(3.0)


TOY = dict(env="toy_privileged", num_envs=4, batch_size=32, actor_hidden=32, critic_hidden=32, num_atoms=21,
           learning_starts=4, random_steps=4, num_updates=2, log_every=10, eval_episodes=0, checkpoint_every=0,
           check_replicas_every=1, max_grad_norm=1.0)


@pytest.mark.slow
def test_two_rank_train_with_critic_obs_and_shared_state_resumes_exactly(tmp_path):
    full = preset("pendulum", **TOY, total_env_steps=240, run_dir=str(tmp_path / "full"))
    ranks = spawn(sac_workers.train_rank, 2, args=(full,), timeout_s=200)
    levels = [r["level"] for r in ranks]
    assert levels[0] == levels[1]  # reduced, not each rank's own drift (rank 1 drifts 3x faster alone)
    assert levels[0] > 0.5
    half = dataclasses.replace(full, total_env_steps=120, run_dir=str(tmp_path / "split"))
    spawn(sac_workers.train_rank, 2, args=(half,), timeout_s=200)
    rest = dataclasses.replace(full, run_dir=str(tmp_path / "split"), resume=True)
    resumed = spawn(sac_workers.train_rank, 2, args=(rest,), timeout_s=200)
    assert [r["level"] for r in resumed] == levels
    assert _metrics(tmp_path / "split") == _metrics(tmp_path / "full")
    learner = torch.load(next((checkpoint.latest(tmp_path / "full")).glob("learner*")), weights_only=False) \
        if list(checkpoint.latest(tmp_path / "full").glob("learner*.pt")) else None
    if learner is not None:
        assert "critic_normalizer" in learner


def _metrics(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if k not in ("time", "sps")} for row in rows]


# -- stop within one env step ------------------------------------------------------------------------

STOP = ["--preset", "pendulum", "--num-envs", "4", "--batch-size", "32", "--actor-hidden", "32",
        "--critic-hidden", "32", "--num-atoms", "21", "--learning-starts", "4", "--random-steps", "4",
        "--num-updates", "2", "--log-every", "100000", "--checkpoint-every", "0", "--eval-episodes", "0",
        "--total-env-steps", "1600", "--nproc", "2"]


def _cli(args, **kw):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    return subprocess.run([sys.executable, "-m", "hpcrl.sac", *args], capture_output=True, text=True,
                          timeout=240, env=env, **kw)


@pytest.mark.slow
@pytest.mark.extended  # a long run; the fast tier's stop-and-exact-resume: test_sac_train.py's SIGUSR2 test
@pytest.mark.timeout(400)
def test_sigterm_stops_within_a_step_checkpoints_mid_window_and_resumes_exactly(tmp_path):
    ref = tmp_path / "ref"
    done = _cli(STOP + ["--run-dir", str(ref)])
    assert done.returncode == 0, done.stderr
    run = tmp_path / "stopped"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    proc = subprocess.Popen([sys.executable, "-m", "hpcrl.sac", *STOP, "--run-dir", str(run)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None and not (run / "config.json").exists():
        time.sleep(0.05)
    time.sleep(1.0)  # into the run, far from any metrics row (there is none before the end)
    sent = time.time()
    os.killpg(proc.pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    latency = time.time() - sent
    assert proc.returncode == 75, err
    assert "stop requested (SIGTERM)" in out
    latest = checkpoint.latest(run)
    step = int(latest.name.rsplit("_", 1)[1])
    assert 0 < step < 400, f"stopped at vector step {step} of 400"
    assert not (run / "metrics.jsonl").exists() or not (run / "metrics.jsonl").read_text().strip()
    assert latency < 30, f"stop took {latency:.1f} s"
    resumed = _cli(STOP + ["--run-dir", str(run), "--resume"])
    assert resumed.returncode == 0, resumed.stderr
    assert _metrics(run) == _metrics(ref)
