"""Resharding a FastSAC checkpoint to another world size: the pure re-deal (envs, replay rings, streams)
and real runs resumed at W' != W (2 -> 1 -> 2 -> 4 ranks under --nproc, 1 -> 2 torchrun-style) keeping every
stored transition, every env's trajectory and the learner; bad requests exit 2 with one line."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from hpcrl.run import checkpoint
from hpcrl.run.checkpoint_manifest import MANIFEST, file_entry, rank_file
from hpcrl.run.checkpoint_write import FORMAT_VERSION
from hpcrl.core.h5io import load_h5, save_h5
from hpcrl.replay import ReplayShard
from hpcrl.sac import reshard
from torchrun_style import clean_env, finish, torchrun_style

TINY = ["--preset", "pendulum", "--num-envs", "4", "--batch-size", "32", "--actor-hidden", "32",
        "--critic-hidden", "32", "--num-atoms", "21", "--learning-starts", "4", "--random-steps", "4",
        "--num-updates", "2", "--log-every", "5", "--eval-episodes", "0", "--checkpoint-every", "0",
        "--keep-checkpoints", "10", "--buffer-size", "64"]


def run_cli(args, timeout=180):
    return subprocess.run([sys.executable, "-m", "hpcrl.sac", *args], capture_output=True, text=True,
                          timeout=timeout, env=clean_env())


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> Path:
    """A real 2-rank run (TINY, 40 env steps: its checkpoint at env step 10); a test that changes it copies it."""
    run = tmp_path_factory.mktemp("two_ranks") / "run"
    result = run_cli(TINY + ["--nproc", "2", "--total-env-steps", "40", "--run-dir", str(run)])
    assert result.returncode == 0, result.stderr
    return run


def _copy(run: Path, tmp_path: Path) -> Path:
    shutil.copytree(run, tmp_path / "run")
    return tmp_path / "run"


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
def test_resume_at_another_world_size_continues_every_env_ring(two_ranks, tmp_path):
    """Each resume at half or twice the previous world size (2 -> 1 -> 2 -> 4 ranks), resharding; the first
    stage is the module's 2-rank run (40 env steps)."""
    run = _copy(two_ranks, tmp_path)
    stages = [(2, 40), (1, 80), (2, 120), (4, 160)]
    before = global_envs(_checkpoint_replays(checkpoint.latest(run)))
    for i, (world, steps) in enumerate(stages[1:], 1):
        result = run_cli(TINY + ["--nproc", str(world), "--total-env-steps", str(steps), "--run-dir", str(run),
                                 "--resume"])
        assert result.returncode == 0, result.stderr
        after = global_envs(_checkpoint_replays(checkpoint.latest(run)))
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
def test_a_torchrun_style_launch_reshards_one_rank_to_two(tmp_path):
    """A 1-rank checkpoint resumed by 2 ranks started as torchrun starts them (RANK, WORLD_SIZE, MASTER_*;
    one ``python -m hpcrl.sac`` each): rank 0 says what it did in one line, both finish, every env's ring
    continues."""
    run = tmp_path / "run"
    first = run_cli(TINY + ["--total-env-steps", "40", "--run-dir", str(run)])
    assert first.returncode == 0, first.stderr
    before = global_envs(_checkpoint_replays(checkpoint.latest(run)))
    ranks = finish(torchrun_style("hpcrl.sac", TINY + ["--total-env-steps", "80", "--run-dir", str(run), "--resume"],
                                  2), timeout=240)
    for rank, (rc, _, err) in enumerate(ranks):
        assert rc == 0, (rank, err[-3000:])
    out = ranks[0][1]
    assert "hpcrl.sac: 2 rank(s) via torchrun" in out, out
    said = [line for line in out.splitlines() if "resharded" in line]
    assert said == ["hpcrl: resharded 1 → 2 ranks: 2 envs per rank, batch 16 per rank"], out
    assert "resharded" not in ranks[1][1]  # rank 0 alone says it
    path = checkpoint.latest(run)
    assert checkpoint.read_manifest(path)["world_size"] == 2 and path.name == "step_000000000020"
    after = global_envs(_checkpoint_replays(path))
    assert len(after) == len(before) == 4
    for old_seq, new_seq in zip(before, after):
        assert new_seq[:len(old_seq)] == old_seq and len(new_seq) == len(old_seq) + 10


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_reshard_of_a_real_checkpoint_is_exact_in_process(two_ranks):
    """The multiset of stored transitions, and the learner, across a 2 -> 1 -> 4 re-deal of real rank files."""
    from hpcrl.comm import init_distributed, shutdown
    from hpcrl.sac.config import SACConfig
    from hpcrl.sac.layout import plan
    from hpcrl.sac.state import restore, run_identity
    from hpcrl.sac.run import _build

    run = two_ranks  # read only
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
def test_a_world_size_that_does_not_divide_the_envs_exits_2_with_one_line(two_ranks, tmp_path):
    run = _copy(two_ranks, tmp_path)
    bad = run_cli(TINY + ["--nproc", "3", "--total-env-steps", "80", "--run-dir", str(run), "--resume"])
    assert bad.returncode == 2, bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1 and "Traceback" not in bad.stderr, bad.stderr
    # it names the valid world sizes: the divisors of gcd(num_envs=4, batch_size=32)
    assert reshard.valid_world_sizes(4, 32) == [1, 2, 4]
    assert "with 3 ranks" in bad.stderr and "split over 1, 2, 4 ranks only" in bad.stderr, bad.stderr
    assert [p.name for p in checkpoint.committed(run)] == ["step_000000000010"]  # nothing written


def _strip(run: Path, key: str) -> None:
    """Remove ``key`` from every rank file of the newest checkpoint (as a version that did not write it), the
    manifest updated: the checkpoint verifies, it only lacks the piece."""
    path = checkpoint.latest(run)
    manifest = checkpoint.read_manifest(path)
    for r in range(manifest["world_size"]):
        state = load_h5(path / rank_file(r), FORMAT_VERSION)
        del state[key]
        save_h5(path / rank_file(r), state, FORMAT_VERSION)
        manifest["files"][rank_file(r)] = file_entry(path / rank_file(r))
    (path / MANIFEST).write_text(json.dumps(manifest))
    checkpoint.verify(path)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_checkpoint_too_old_to_reshard_exits_2_with_one_line(two_ranks, tmp_path):
    run = _copy(two_ranks, tmp_path)
    _strip(run, "episode_stats")  # what reshard.rank_state needs of every rank file it reads
    bad = run_cli(TINY + ["--nproc", "1", "--total-env-steps", "80", "--run-dir", str(run), "--resume"])
    assert bad.returncode == 2, bad.stderr
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in bad.stderr, bad.stderr
    assert "hold no 'episode_stats'" in lines[0] and "resume with the 2 rank(s) that wrote it" in lines[0], lines[0]
    assert "resharded" not in bad.stdout and [p.name for p in checkpoint.committed(run)] == ["step_000000000010"]


def test_rank_files_lacking_a_piece_inside_are_refused_with_what_to_do():
    """Not only the top-level pieces: one inside them (a replay column, the episode sums) too, on any old rank."""
    for drop in (("replay", "final_pool"), ("episode_stats", "running_length")):
        olds = _rank_states(4, 2, 5, 8)
        del olds[1][drop[0]][drop[1]]
        with pytest.raises(reshard.ReshardError, match=f"hold no '{drop[1]}'.*resume with the 2 rank"):
            reshard.rank_state(olds, _target(4, 2, 1, 0))
    olds = _rank_states(4, 2, 5, 8)
    del olds[1]["obs"]  # the second rank read, not only the first
    with pytest.raises(reshard.ReshardError, match="hold no 'obs'"):
        reshard.rank_state(olds, _target(4, 2, 1, 0))


def _step_all(envs: list, actions: torch.Tensor) -> dict[str, torch.Tensor]:
    """Step each rank's env with its envs' slice of ``actions`` (global env order); the results concatenated."""
    out, lo = [], 0
    for env in envs:
        out.append(env.step(actions[lo:lo + env.num_envs]))
        lo += env.num_envs
    return {k: torch.cat([getattr(r, k) for r in out]) for k in ("obs", "next_obs", "reward", "terminated", "truncated")}


def _loaded(name: str, env_states: list[dict]) -> list:
    from hpcrl.envs import make_env

    envs = []
    for state in env_states:
        n = len(state["envs"]) if "envs" in state else state["state"].shape[0]
        env = make_env(name, n, seed=12345)  # the seed is overwritten by the state
        env.reset()  # as a resuming rank builds it (hpcrl.sac.run._build), then restores
        env.load_state_dict(state)
        envs.append(env)
    return envs


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_every_env_trajectory_is_the_same_after_a_reshard_given_the_same_actions(two_ranks):
    """The envs of the 2 ranks that wrote a real checkpoint and the same envs re-dealt to 1 and to 4 ranks,
    stepped with identical actions: identical observations, rewards and dones for every env, up to and
    including the step its episode ends (pendulum: truncated after 200 steps; the next reset state of a
    pure-torch env is a fresh draw of the re-derived generator, docs/elastic.md)."""
    path = checkpoint.latest(two_ranks)
    olds = {r: load_h5(path / rank_file(r), FORMAT_VERSION) for r in range(2)}
    news = {w: [reshard.rank_state({r: olds[r] for r in checkpoint.source_ranks(2, w, k)}, _target(4, 2, w, k))
                for k in range(w)] for w in (1, 4)}
    before = _loaded("pendulum", [olds[r]["env"] for r in range(2)])
    after = {w: _loaded("pendulum", [n["env"] for n in news[w]]) for w in news}
    first = torch.cat([olds[r]["obs"] for r in range(2)])
    assert torch.equal(torch.cat([e.observe() for e in before]), first)
    for w in news:
        assert torch.equal(torch.cat([n["obs"] for n in news[w]]), first)
        assert torch.equal(torch.cat([e.observe() for e in after[w]]), first)
    gen = torch.Generator().manual_seed(7)
    left = 200 - int(olds[0]["env"]["elapsed"][0])  # env steps until every episode in progress is truncated
    assert left == 190  # 40 env steps over 4 envs
    for t in range(left):
        actions = torch.rand(4, 1, generator=gen) * 4 - 2
        want = _step_all(before, actions)
        for w in news:
            got = _step_all(after[w], actions)
            for key in ("next_obs", "reward", "terminated", "truncated"):
                assert torch.equal(got[key], want[key]), (w, t, key)
            if t < left - 1:
                assert torch.equal(got["obs"], want["obs"]), (w, t)
    assert bool(want["truncated"].all()) and not bool(want["terminated"].any())


def test_a_gymnasium_env_trajectory_is_the_same_across_a_reshard_including_resets(tmp_path):
    """A gymnasium env keeps each sub-env's own RNG: through episode ends (CartPole, random actions: many
    resets) every env of 2 -> 1 and 2 -> 4 re-dealt states steps as the old ranks' do, rank files written and
    read back as a checkpoint does."""
    pytest.importorskip("gymnasium")
    from hpcrl.envs import make_env

    name, states = "gym:CartPole-v1", []
    for r in range(2):
        env = make_env(name, 2, seed=100 * r)
        env.reset()
        for _ in range(7):
            env.step(torch.randint(0, 2, (2,)))
        save_h5(tmp_path / rank_file(r), {"env": env.state_dict()}, FORMAT_VERSION)
        states.append(load_h5(tmp_path / rank_file(r), FORMAT_VERSION)["env"])
    before = _loaded(name, states)
    gen_state = lambda s: torch.Generator().manual_seed(s).get_state()  # noqa: E731 (unused by gym envs)
    after = {w: _loaded(name, [reshard.merge_env([(states[p.rank], p) for p in reshard.pieces(4, 2, w, k)], 0,
                                                 gen_state) for k in range(w)]) for w in (1, 4)}
    gen, ends = torch.Generator().manual_seed(3), 0
    for t in range(150):
        actions = torch.randint(0, 2, (4,), generator=gen)
        want = _step_all(before, actions)
        for w in after:
            got = _step_all(after[w], actions)
            for key in want:
                assert torch.equal(got[key], want[key]), (w, t, key)
        ends += int((want["terminated"] | want["truncated"]).sum())
    assert ends >= 10, ends  # episodes of ~20 steps: the resets after a reshard are exact too


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
    proc = subprocess.Popen([sys.executable, "-m", "hpcrl.sac", *args, "--nproc", "2"], env=clean_env(), text=True,
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
