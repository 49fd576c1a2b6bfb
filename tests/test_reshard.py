"""Resharding a FastSAC checkpoint to another world size: the pure re-deal (envs, replay rings, streams)
and real runs resumed at W' != W (2 -> 1 -> 4 ranks) keeping every stored transition and the learner."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from hpcrl import checkpoint
from hpcrl.checkpoint_manifest import rank_file
from hpcrl.checkpoint_write import FORMAT_VERSION
from hpcrl.h5io import load_h5
from hpcrl.replay import ReplayShard
from hpcrl.sac import reshard

TINY = ["--preset", "pendulum", "--num-envs", "4", "--batch-size", "32", "--actor-hidden", "32",
        "--critic-hidden", "32", "--num-atoms", "21", "--learning-starts", "4", "--random-steps", "4",
        "--num-updates", "2", "--log-every", "5", "--eval-episodes", "0", "--checkpoint-every", "0",
        "--keep-checkpoints", "10", "--buffer-size", "64"]


def run_cli(args, timeout=180):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    return subprocess.run([sys.executable, "-m", "hpcrl.sac", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def env_transitions(replay: dict) -> list[list[tuple]]:
    """Per env, its stored one-step transitions oldest first: (obs, action, reward, next obs, flags)."""
    ptr, cap = int(replay["ptr"]), int(replay["capacity"])
    filled = min(ptr, cap)
    obs, ref, pool = replay["obs"], replay["final_ref"], replay["final_pool"]
    out = []
    for e in range(obs.shape[1]):
        seq = []
        for t in range(filled):
            slot = (ptr - filled + t) % cap
            if int(ref[slot, e]) >= 0:
                nxt = pool[int(ref[slot, e])]
            else:
                nxt = replay["head_next_obs"][e] if t == filled - 1 else obs[(slot + 1) % cap, e]
            seq.append((tuple(obs[slot, e].tolist()), tuple(replay["action"][slot, e].tolist()),
                        float(replay["reward"][slot, e]), tuple(nxt.tolist()), int(replay["flags"][slot, e])))
        out.append(seq)
    return out


def global_envs(replays: list[dict]) -> list[list[tuple]]:
    """Every env's transitions in global env order (rank r holds envs [r*E/W, (r+1)*E/W))."""
    return [seq for rep in replays for seq in env_transitions(rep)]


def fill(shard: ReplayShard, steps: int, gen: torch.Generator, episode: int) -> None:
    E, D, A = shard.num_envs, shard.obs_dim, shard.action_dim
    obs = torch.randn(E, D, generator=gen)
    for t in range(steps):
        nxt = torch.randn(E, D, generator=gen)
        ended = (torch.arange(E) + t) % episode == 0
        shard.add(obs, torch.randn(E, A, generator=gen), torch.randn(E, generator=gen), nxt,
                  ended & (torch.arange(E) % 2 == 0), ended & (torch.arange(E) % 2 == 1))
        obs = torch.where(ended[:, None], torch.randn(E, D, generator=gen), nxt)


def _target(num_envs, old, new, rank):
    return reshard.Target(num_envs, old, new, rank, seed=3, step=50,
                          generator_state=lambda s: torch.Generator().manual_seed(s).get_state())


def _rank_states(num_envs: int, world: int, steps: int, capacity: int) -> dict[int, dict]:
    gen = torch.Generator().manual_seed(0)
    out = {}
    for r in range(world):
        n = num_envs // world
        shard = ReplayShard(n, capacity, 3, 2, n_step=3)
        fill(shard, steps, gen, episode=5)
        out[r] = {"replay": shard.state_dict(), "obs": torch.randn(n, 3, generator=gen),
                  "env": {"state": torch.randn(n, 2, generator=gen), "elapsed": torch.arange(n) + 10 * r,
                          "generator": torch.Generator().manual_seed(r).get_state(), "started": True},
                  "episode_stats": {"running_return": torch.randn(n, dtype=torch.float64, generator=gen),
                                    "running_length": torch.arange(n), "sum": torch.tensor([1.0, 2.0, 1.0 + r],
                                                                                           dtype=torch.float64)},
                  "generator": torch.Generator().manual_seed(r).get_state(), "sampler": {"seed": r, "offset": 64},
                  "window": {"critic_loss": torch.tensor([1.0, 2.0]) * (r + 1)}, "window_iters": 2, "dropped": r}
    return out


@pytest.mark.parametrize("old,new", [(2, 1), (1, 4), (4, 2), (2, 3), (3, 2)])
@pytest.mark.parametrize("steps,capacity", [(7, 16), (40, 16)])  # partly filled, wrapped around
def test_reshard_keeps_every_env_and_transition(old, new, steps, capacity):
    E = 12
    olds = _rank_states(E, old, steps, capacity)
    news = [reshard.rank_state({r: olds[r] for r in checkpoint.source_ranks(old, new, k)}, _target(E, old, new, k))
            for k in range(new)]
    assert global_envs([news[k]["replay"] for k in range(new)]) == global_envs([olds[r]["replay"] for r in range(old)])
    for key in ("obs",):
        assert torch.equal(torch.cat([n[key] for n in news]), torch.cat([o[key] for o in olds.values()]))
    for key in ("state", "elapsed"):
        assert torch.equal(torch.cat([n["env"][key] for n in news]), torch.cat([o["env"][key] for o in olds.values()]))
    for key in ("running_return", "running_length"):
        assert torch.equal(torch.cat([n["episode_stats"][key] for n in news]),
                           torch.cat([o["episode_stats"][key] for o in olds.values()]))
    # per-rank sums land once each; the window's mean over ranks and the dropped total are kept
    assert torch.equal(sum(n["episode_stats"]["sum"] for n in news), sum(o["episode_stats"]["sum"] for o in olds.values()))
    assert sum(n["dropped"] for n in news) == sum(o["dropped"] for o in olds.values())
    if old % new == 0 or new % old == 0:
        mean = lambda states: torch.stack([s["window"]["critic_loss"] for s in states]).mean(0)  # noqa: E731
        assert torch.allclose(mean(news), mean(list(olds.values())))
    # the re-dealt shards load, and keep sampling the same content (n-step windows included)
    for n in news:
        shard = ReplayShard(E // new, capacity, 3, 2, n_step=3)
        shard.load_state_dict(n["replay"])
        fill(shard, 20, torch.Generator().manual_seed(1), episode=3)  # the pool keeps working past the reshard
        assert len(shard) == E // new * min(steps + 20, capacity)
    seeds = {n["sampler"]["seed"] for n in news} | {reshard.stream_seed(3, k, new, 50) for k in range(new)}
    assert len(seeds) == 2 * new  # sampler and generator streams differ from each other and between ranks


def test_streams_and_world_sizes_are_stated_functions():
    assert reshard.stream_seed(1, 0, 2, 10) == reshard.stream_seed(1, 0, 2, 10) != reshard.stream_seed(1, 1, 2, 10)
    assert reshard.valid_world_sizes(8, 64) == [1, 2, 4, 8]
    assert reshard.valid_world_sizes(12, 32) == [1, 2, 4]
    assert checkpoint.source_ranks(2, 4, 3) == [1] and checkpoint.source_ranks(4, 1, 0) == [0, 1, 2, 3]
    assert checkpoint.source_ranks(2, 3, 1) == [0, 1]


def test_an_env_state_not_stored_per_env_is_refused():
    olds = _rank_states(4, 2, 5, 8)
    for s in olds.values():
        s["env"] = {"leaves": {}, "key": torch.zeros(2), "impl": "jax"}
    with pytest.raises(reshard.ReshardError, match="cannot be resharded"):
        reshard.rank_state(olds, _target(4, 2, 1, 0))


def _checkpoint_replays(path: Path) -> list[dict]:
    world = json.loads((path / "manifest.json").read_text())["world_size"]
    return [load_h5(path / rank_file(r), FORMAT_VERSION)["replay"] for r in range(world)]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_resume_at_another_world_size_continues_every_env_ring(tmp_path):
    run = tmp_path / "run"
    stages = [(2, 40), (1, 80), (4, 120)]
    before = None
    for i, (world, steps) in enumerate(stages):
        args = TINY + ["--nproc", str(world), "--total-env-steps", str(steps), "--run-dir", str(run)]
        result = run_cli(args + (["--resume"] if i else []))
        assert result.returncode == 0, result.stderr
        path = checkpoint.latest(run)
        after = global_envs(_checkpoint_replays(path))
        if before is not None:
            old_world = stages[i - 1][0]
            assert f"hpcrl: resharded {old_world} → {world} ranks: {4 // world} envs per rank, " \
                   f"batch {32 // world} per rank" in result.stdout
            # every env's ring continues its own sequence (64 slots, 10 env steps a stage: nothing is
            # overwritten): what the resharded checkpoint held starts it, and nothing else was added
            for old_seq, new_seq in zip(before, after):
                assert new_seq[:len(old_seq)] == old_seq and len(new_seq) == len(old_seq) + 10
        before = after
    assert len(before) == 4


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_reshard_of_a_real_checkpoint_is_exact_in_process(tmp_path):
    """The multiset of stored transitions, and the learner, across a 2 -> 1 -> 4 re-deal of real rank files."""
    from hpcrl.comm import init_distributed, shutdown
    from hpcrl.sac.config import SACConfig, preset
    from hpcrl.sac.layout import plan
    from hpcrl.sac.state import restore, run_identity
    from hpcrl.sac.train import _build

    run = tmp_path / "run"
    result = run_cli(TINY + ["--nproc", "2", "--total-env-steps", "40", "--run-dir", str(run)])
    assert result.returncode == 0, result.stderr
    path = checkpoint.latest(run)
    olds = {r: load_h5(path / rank_file(r), FORMAT_VERSION) for r in range(2)}
    multiset = Counter(t for seq in global_envs([olds[r]["replay"] for r in range(2)]) for t in seq)
    one = reshard.rank_state(olds, _target(4, 2, 1, 0))
    four = [reshard.rank_state({0: one}, _target(4, 1, 4, k)) for k in range(4)]
    assert Counter(t for seq in global_envs([one["replay"]]) for t in seq) == multiset
    assert Counter(t for seq in global_envs([f["replay"] for f in four]) for t in seq) == multiset

    cfg = json.loads((run / "config.json").read_text())
    cfg = SACConfig(**{k: v for k, v in cfg.items() if k in SACConfig.__dataclass_fields__})
    cfg.resume, cfg.device = True, "cpu"
    ctx = init_distributed(timeout_s=60, device="cpu")
    try:
        parts, _ = _build(cfg, ctx, plan(cfg, 1))
        found = checkpoint.restore(run, 0, 1, torch.device("cpu"), identity=run_identity(cfg), reshard=True)
        assert found.world_size == 2 and sorted(found.rank_states) == [0, 1]
        restore(parts, found, torch.device("cpu"), 0)
        saved, loaded = found.learner["agent"], parts.agent.learner_state()
        flat = lambda tree, p="": ([(p, tree)] if not isinstance(tree, dict) else  # noqa: E731
                                   [x for k in sorted(tree) for x in flat(tree[k], f"{p}/{k}")])
        assert len(flat(saved)) == len(flat(loaded)) > 10
        for (ka, a), (kb, b) in zip(flat(saved), flat(loaded)):
            assert ka == kb and (torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b), ka
        assert Counter(t for seq in global_envs([parts.replay.state_dict()]) for t in seq) == multiset
    finally:
        shutdown()


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_world_size_that_does_not_divide_the_envs_exits_2_with_one_line(tmp_path):
    run = tmp_path / "run"
    assert run_cli(TINY + ["--nproc", "2", "--total-env-steps", "20", "--run-dir", str(run)]).returncode == 0
    bad = run_cli(TINY + ["--nproc", "3", "--total-env-steps", "40", "--run-dir", str(run), "--resume"])
    assert bad.returncode == 2, bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1 and "Traceback" not in bad.stderr


@pytest.mark.extended
@pytest.mark.timeout(900)
def test_pendulum_resharded_midway_reaches_the_return_band(tmp_path):
    run = tmp_path / "p"
    first = run_cli(["--preset", "pendulum", "--nproc", "2", "--total-env-steps", "4000", "--run-dir", str(run),
                     "--checkpoint-every", "0"], timeout=600)
    assert first.returncode == 0, first.stderr
    second = run_cli(["--preset", "pendulum", "--nproc", "1", "--run-dir", str(run), "--checkpoint-every", "0",
                      "--resume"], timeout=600)
    assert second.returncode == 0, second.stderr
    assert "resharded 2 → 1 ranks" in second.stdout
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["eval_return"] > -300, rows[-1]  # the uninterrupted run's band (test_sac_train)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_critic_obs_and_shared_state_reshard_two_to_one(tmp_path):
    import dataclasses

    from hpcrl.comm import spawn
    from hpcrl.sac import preset

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import sac_workers

    toy = dict(env="toy_privileged", num_envs=4, batch_size=32, actor_hidden=32, critic_hidden=32, num_atoms=21,
               learning_starts=4, random_steps=4, num_updates=2, log_every=10, eval_episodes=0, checkpoint_every=0)
    half = preset("pendulum", **toy, total_env_steps=120, run_dir=str(tmp_path / "run"))
    spawn(sac_workers.train_rank, 2, args=(half,), timeout_s=200)
    level = float(load_h5(checkpoint.latest(tmp_path / "run") / rank_file(0), FORMAT_VERSION)["env"]["level"])
    rest = dataclasses.replace(half, total_env_steps=240, resume=True)
    (one,) = spawn(sac_workers.train_rank, 1, args=(rest,), timeout_s=200)
    assert one["row"]["env_steps"] == 240 and one["level"] >= level
    replay = load_h5(checkpoint.latest(tmp_path / "run") / rank_file(0), FORMAT_VERSION)["replay"]
    assert replay["critic_obs_dim"] == 3 and int(replay["ptr"]) == 60


@pytest.mark.extended  # the fast tier's 2 -> 1 -> 4 run covers the reshard; this adds a stop mid-window
@pytest.mark.timeout(400)
def test_a_sigusr2_stop_mid_window_resumes_at_another_world_size(tmp_path):
    import signal
    import time

    run = tmp_path / "run"
    args = TINY + ["--log-every", "100000", "--total-env-steps", "1600", "--run-dir", str(run)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    proc = subprocess.Popen([sys.executable, "-m", "hpcrl.sac", *args, "--nproc", "2"], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None and not (run / "config.json").exists():
        time.sleep(0.05)
    time.sleep(1.0)
    os.killpg(proc.pid, signal.SIGUSR2)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err
    stopped = load_h5(checkpoint.latest(run) / rank_file(0), FORMAT_VERSION)
    assert "window" in stopped, "the stop landed on a row; the window path is not exercised"
    resumed = run_cli(args + ["--nproc", "1", "--resume"])
    assert resumed.returncode == 0, resumed.stderr
    assert "hpcrl: resharded 2 → 1 ranks: 4 envs per rank, batch 32 per rank" in resumed.stdout
    (row,) = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert row["env_steps"] == 1600 and row["updates"] == (400 - 4) * 2


def _save_old_style(run_dir: Path, world: int) -> None:
    """A checkpoint of ``world`` ranks whose identity records the world size (before resharding existed)."""
    import threading

    barrier = threading.Barrier(world)

    def rank(r):
        checkpoint.save(run_dir, 7, r, world, {"step": torch.tensor(7)} if r == 0 else None,
                        {"r": torch.full((4,), float(r))}, lambda name: barrier.wait(), keep=3,
                        identity={"world_size": world, "seed": 0})

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def test_restore_reads_the_overlapping_old_rank_files_and_keeps_the_strict_check_otherwise(tmp_path):
    cpu, ident = torch.device("cpu"), {"seed": 0}
    _save_old_style(tmp_path, 2)
    one = checkpoint.restore(tmp_path, 0, 1, cpu, identity=ident, reshard=True)
    assert one.world_size == 2 and one.rank_state == {}
    assert {r: float(s["r"][0]) for r, s in one.rank_states.items()} == {0: 0.0, 1: 1.0}
    three = checkpoint.restore(tmp_path, 3, 4, cpu, identity=ident, reshard=True)
    assert sorted(three.rank_states) == [1]
    same = checkpoint.restore(tmp_path, 1, 2, cpu, identity=ident, reshard=True)
    assert same.rank_states is None and float(same.rank_state["r"][0]) == 1.0
    with pytest.raises(checkpoint.CheckpointError, match="written by 2 ranks"):
        checkpoint.restore(tmp_path, 0, 1, cpu, identity={"world_size": 1, "seed": 0})  # PPO-style: strict
    with pytest.raises(checkpoint.CheckpointError, match="seed"):
        checkpoint.restore(tmp_path, 0, 1, cpu, identity={"seed": 1}, reshard=True)
