"""ReplayShard: fused gather vs reference vs a brute-force loop over the raw episode log."""

import os

import h5py
import numpy as np
import pytest
import torch

import hpcrl.ops as ops
from hpcrl.ops import reference
from hpcrl.core.h5io import save_h5
from hpcrl.replay import ReplayShard, Sampler, load_shard, save_shard


class Recorder:
    """Feeds a shard from a fake auto-resetting env and keeps the raw log of every transition."""

    def __init__(self, num_envs, obs_dim, action_dim, p_term, p_trunc, seed, device="cpu"):
        self.g = torch.Generator().manual_seed(seed)
        self.E, self.D, self.A = num_envs, obs_dim, action_dim
        self.p_term, self.p_trunc = p_term, p_trunc
        self.device = device
        self.obs = torch.randn(num_envs, obs_dim, generator=self.g)
        self.log = []  # per step: dict of [E, ...] tensors

    def step(self, shard):
        E, g = self.E, self.g
        action = torch.rand(E, self.A, generator=g) * 2 - 1
        reward = torch.randn(E, generator=g)
        next_obs = torch.randn(E, self.D, generator=g)
        term = torch.rand(E, generator=g) < self.p_term
        trunc = torch.rand(E, generator=g) < self.p_trunc
        self.log.append(dict(obs=self.obs, action=action, reward=reward, next_obs=next_obs, term=term,
                             trunc=trunc & ~term))
        d = self.device
        shard.add(self.obs.to(d), action.to(d), reward.to(d), next_obs.to(d), term.to(d), trunc.to(d))
        reset = torch.randn(E, self.D, generator=g)
        self.obs = torch.where((term | trunc)[:, None], reset, next_obs)

    def brute_force(self, env, t, n_step, gamma):
        """n-step target of the transition at logical time t of env, from the raw log."""
        ret, disc, k, last = 0.0, 1.0, 0, t
        for j in range(n_step):
            if t + j >= len(self.log):
                break  # the write head: that step does not exist yet
            row = self.log[t + j]
            ret += disc * float(row["reward"][env])
            disc *= gamma
            k, last = j + 1, t + j
            if row["term"][env] or row["trunc"][env]:
                break
        if self.log[last]["term"][env]:
            disc = 0.0
        return ret, disc, k, self.log[last]["next_obs"][env]


def fill(num_envs=3, capacity=7, steps=25, n_step=3, gamma=0.9, p_term=0.15, p_trunc=0.15, seed=0, device="cpu"):
    shard = ReplayShard(num_envs, capacity, obs_dim=4, action_dim=2, n_step=n_step, gamma=gamma, device=device)
    rec = Recorder(num_envs, 4, 2, p_term, p_trunc, seed, device)
    for _ in range(steps):
        rec.step(shard)
    return shard, rec


def all_pairs(shard):
    filled = min(shard.ptr, shard.capacity)
    env = torch.arange(shard.num_envs).repeat(filled)
    slot = torch.arange(filled).repeat_interleave(shard.num_envs)
    return env, slot


@pytest.mark.parametrize("backend", ["extension", "reference"])
@pytest.mark.parametrize("steps", [1, 2, 6, 7, 8, 25, 70])  # partly full, exactly full, wrapped often
@pytest.mark.parametrize("n_step", [1, 3, 5])
def test_gather_matches_brute_force(steps, n_step, backend, monkeypatch):
    if backend == "reference":
        monkeypatch.setattr(ops, "_C", None)
        monkeypatch.setattr(ops, "_warned", True)
    gamma = 0.9
    shard, rec = fill(steps=steps, n_step=n_step, gamma=gamma, seed=steps * 10 + n_step)
    env, slot = all_pairs(shard)
    batch = shard.gather(env, slot)
    for b in range(len(env)):
        e, s = int(env[b]), int(slot[b])
        t = s + shard.capacity * ((shard.ptr - 1 - s) // shard.capacity)  # logical time of the slot
        ret, disc, k, next_obs = rec.brute_force(e, t, n_step, gamma)
        assert int(batch.n[b]) == k
        assert float(batch.reward[b]) == pytest.approx(ret, rel=1e-5, abs=1e-5)
        assert float(batch.discount[b]) == pytest.approx(disc, rel=1e-6)
        assert torch.equal(batch.next_obs[b], next_obs)
        assert torch.equal(batch.obs[b], rec.log[t]["obs"][e])
        assert torch.equal(batch.action[b], rec.log[t]["action"][e])


def test_window_stops_at_write_head_and_never_wraps():
    # Rewards are the logical time: a window that read across the ring seam would pick up old times.
    shard = ReplayShard(1, 4, 1, 1, n_step=3, gamma=1.0)
    for t in range(10):
        z = torch.zeros(1, 1)
        shard.add(z, z, torch.tensor([float(t)]), z, torch.tensor([False]), torch.tensor([False]))
    # ptr=10: slots hold times 8, 9, 6, 7 (slot 1 = time 9 is the newest).
    batch = shard.gather(torch.zeros(4, dtype=torch.long), torch.arange(4))
    assert batch.n.tolist() == [2, 1, 3, 3]
    assert batch.reward.tolist() == [8 + 9, 9, 6 + 7 + 8, 7 + 8 + 9]


def test_truncation_bootstraps_from_final_obs_without_next_episode_reward():
    shard = ReplayShard(1, 8, 1, 1, n_step=3, gamma=0.5)
    f = torch.tensor([False])
    t = torch.tensor([True])
    z = torch.zeros(1, 1)
    shard.add(torch.tensor([[0.0]]), z, torch.tensor([1.0]), torch.tensor([[1.0]]), f, f)
    shard.add(torch.tensor([[1.0]]), z, torch.tensor([2.0]), torch.tensor([[42.0]]), f, t)  # time limit
    shard.add(torch.tensor([[-5.0]]), z, torch.tensor([100.0]), torch.tensor([[-4.0]]), f, f)  # next episode
    shard.add(torch.tensor([[-4.0]]), z, torch.tensor([100.0]), torch.tensor([[-3.0]]), t, f)  # terminates
    b = shard.gather(torch.zeros(4, dtype=torch.long), torch.arange(4))
    assert b.reward.tolist() == [1 + 0.5 * 2, 2, 100 + 0.5 * 100, 100]
    assert b.n.tolist() == [2, 1, 2, 1]
    assert b.next_obs[:, 0].tolist() == [42.0, 42.0, -3.0, -3.0]
    assert b.discount.tolist() == [0.25, 0.5, 0.0, 0.0]


def test_termination_wins_over_truncation():
    shard = ReplayShard(1, 4, 1, 1, n_step=2, gamma=0.9)
    z, t = torch.zeros(1, 1), torch.tensor([True])
    shard.add(z, z, torch.tensor([1.0]), z, t, t)
    assert int(shard.flags[0, 0]) == 1
    assert float(shard.gather([0], [0]).discount[0]) == 0.0


@pytest.mark.parametrize("n_step", [1, 3])
def test_kernel_matches_reference_exactly(n_step):
    shard, _ = fill(num_envs=5, capacity=11, steps=40, n_step=n_step, gamma=0.97, seed=5)
    g = torch.Generator().manual_seed(0)
    env = torch.randint(5, (300,), generator=g)
    slot = torch.randint(11, (300,), generator=g)
    mine = shard.gather(env, slot)
    ref = reference.replay_gather(shard.obs, shard.action, shard.reward, shard.flags, shard.final_ref,
                                  shard.final_pool, shard.head_next_obs, env, slot, shard.ptr, n_step, 0.97)
    for a, b in zip(mine, ref):
        assert torch.equal(a, b)


def test_batch_of_one_and_empty_batch():
    shard, rec = fill(steps=9)
    one = shard.gather(torch.tensor([2]), torch.tensor([4]))
    assert one.obs.shape == (1, 4) and one.n.shape == (1,)
    empty = shard.gather(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long))
    assert empty.obs.shape == (0, 4) and empty.reward.shape == (0,)
    assert shard.sample(1).obs.shape == (1, 4)


def test_sample_is_uniform_over_written_pairs_and_reproducible():
    shard, _ = fill(num_envs=3, capacity=5, steps=4)  # not full: slot 4 must never be drawn
    g = torch.Generator().manual_seed(1)
    draws = 24_000
    b = shard.sample(draws, generator=g)
    # Identify each row by its stored obs (random floats are unique).
    keys = shard.obs[:4].reshape(12, 4)
    match = (b.obs[:, None, :] == keys[None]).all(-1)
    assert bool(match.any(1).all()), "sampled a row that was never written"
    counts = match.sum(0).float()
    assert counts.min() > 0.85 * draws / 12 and counts.max() < 1.15 * draws / 12
    again = shard.sample(draws, generator=torch.Generator().manual_seed(1))
    assert torch.equal(again.obs, b.obs)


def test_storage_is_once_per_obs_plus_finished_episodes():
    shard, rec = fill(num_envs=8, capacity=64, steps=300, p_term=0.01, p_trunc=0.01)
    ended_live = sum(int((r["term"] | r["trunc"]).sum()) for r in rec.log[-64:])
    assert shard._pool_live == ended_live
    assert shard.final_pool.shape[0] < 64 * 8 // 4  # far below a dense next_obs copy
    assert len(shard) == 8 * 64


def test_state_dict_and_hdf5_round_trip(tmp_path):
    shard, rec = fill(steps=30)
    path = tmp_path / "shard.h5"
    save_shard(shard, path)
    copy = ReplayShard(3, 7, 4, 2, n_step=3, gamma=0.9)
    load_shard(copy, path)
    assert copy.ptr == shard.ptr and len(copy) == len(shard)
    for _ in range(12):  # keep writing to both: pool bookkeeping must have survived too
        obs, act = torch.randn(3, 4), torch.rand(3, 2)
        rew, nxt = torch.randn(3), torch.randn(3, 4)
        term, trunc = torch.rand(3) < 0.3, torch.rand(3) < 0.3
        shard.add(obs, act, rew, nxt, term, trunc)
        copy.add(obs, act, rew, nxt, term, trunc)
    a = shard.sample(64, generator=torch.Generator().manual_seed(3))
    b = copy.sample(64, generator=torch.Generator().manual_seed(3))
    for x, y in zip(a, b):
        assert (x is None and y is None) or torch.equal(x, y)
    wrong = ReplayShard(3, 8, 4, 2, n_step=3, gamma=0.9)
    with pytest.raises(ValueError, match="capacity=7"):
        load_shard(wrong, path)


@pytest.mark.parametrize("steps", [0, 1, 5, 7, 30])  # empty, partly full, exactly full, wrapped
def test_a_saved_shard_holds_only_what_is_filled_and_loads_back_identical(tmp_path, steps):
    big = 1000  # a checkpoint taken early in a run must not write the empty rest of the ring
    shard = ReplayShard(3, big, obs_dim=4, action_dim=2, n_step=3, gamma=0.9)
    rec = Recorder(3, 4, 2, 0.15, 0.15, seed=1)
    for _ in range(steps):
        rec.step(shard)
    state = shard.state_dict()
    assert state["obs"].shape[0] == state["flags"].shape[0] == min(steps, big)
    path = tmp_path / "shard.h5"
    save_shard(shard, path)
    copy = ReplayShard(3, big, obs_dim=4, action_dim=2, n_step=3, gamma=0.9)
    load_shard(copy, path)
    for name in ("obs", "action", "reward", "flags", "final_ref", "final_pool", "head_next_obs"):
        assert torch.equal(getattr(copy, name), getattr(shard, name)), name
    full = tmp_path / "full.h5"  # what a checkpoint of the whole capacity weighed (and still loads)
    save_h5(full, {**state, **{n: getattr(shard, n) for n in ReplayShard._RING}}, 1)
    if steps < 30:
        assert path.stat().st_size * 5 < full.stat().st_size
    older = ReplayShard(3, big, obs_dim=4, action_dim=2, n_step=3, gamma=0.9)
    load_shard(older, full)
    assert all(torch.equal(getattr(older, n), getattr(shard, n)) for n in ReplayShard._RING)
    state["obs"] = state["obs"][:-1] if steps else torch.zeros(2, 3, 4)
    with pytest.raises(ValueError, match="saved obs has shape"):
        copy.load_state_dict(state)


def test_interrupted_save_keeps_previous_file(tmp_path, monkeypatch):
    shard, _ = fill(steps=10)
    path = tmp_path / "shard.h5"
    save_shard(shard, path)
    before = path.read_bytes()
    real = h5py.File.create_dataset

    def crash_midway(self, name, *a, **k):
        if name == "flags":
            raise OSError("disk full (simulated)")
        return real(self, name, *a, **k)

    monkeypatch.setattr(h5py.File, "create_dataset", crash_midway)
    shard.add(*[torch.zeros(3, 4), torch.zeros(3, 2), torch.zeros(3), torch.zeros(3, 4)],
              torch.zeros(3, dtype=torch.bool), torch.zeros(3, dtype=torch.bool))
    with pytest.raises(OSError, match="simulated"):
        save_shard(shard, path)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["shard.h5"]


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda s: s.add(torch.zeros(2, 4), torch.zeros(3, 2), torch.zeros(3), torch.zeros(3, 4),
                         torch.zeros(3), torch.zeros(3)), ValueError, r"obs has shape \(2, 4\), expected \(3, 4\)"),
        (lambda s: s.sample(4), RuntimeError, "empty"),
        (lambda s: s.gather([0], [0]), RuntimeError, "empty"),
    ],
)
def test_clear_errors(call, error, message):
    with pytest.raises(error, match=message):
        call(ReplayShard(3, 7, 4, 2))


def test_bad_construction_and_indices():
    with pytest.raises(ValueError, match="n_step=9 exceeds capacity=8"):
        ReplayShard(1, 8, 1, 1, n_step=9)
    with pytest.raises(ValueError, match="num_envs=0"):
        ReplayShard(0, 8, 1, 1)
    shard, _ = fill(steps=3)
    with pytest.raises(IndexError, match=r"slot_idx must be in \[0, 3\)"):
        shard.gather([0], [5])
    with pytest.raises(IndexError, match="env_idx"):
        shard.gather([3], [0])


@pytest.mark.cuda
@pytest.mark.parametrize("n_step", [1, 3])
def test_cuda_gather_matches_cpu(n_step):
    assert ops.with_cuda(), "hpcrl._C was built without CUDA"
    cpu, _ = fill(num_envs=16, capacity=33, steps=100, n_step=n_step, gamma=0.97, seed=9)
    gpu, _ = fill(num_envs=16, capacity=33, steps=100, n_step=n_step, gamma=0.97, seed=9, device="cuda")
    env, slot = all_pairs(cpu)
    a = cpu.gather(env, slot)
    b = gpu.gather(env.cuda(), slot.cuda())
    for x, y in zip(a, b):
        assert torch.allclose(x.cpu(), y.cpu(), rtol=1e-6, atol=1e-6)  # nvcc may fuse multiply-adds


# -- sampling inside the kernel (hpcrl.replay.Sampler, csrc/common/replay_sample.h) ---------------

def test_philox_matches_the_published_answer_and_the_kernels_draw_the_reference_pairs():
    # Random123's known-answer vector for Philox4x32-10 (counter 0, key 0); the C++ header was also
    # checked against torch's at::Philox4_32 at 12 (seed, counter) points when it was written.
    words = reference.philox4x32_10(np.zeros(1, dtype=np.uint64), 0)[0]
    assert [int(w) for w in words] == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    shard, _ = fill(num_envs=5, capacity=40, steps=57)
    env, slot = torch.empty(3000, dtype=torch.int64), torch.empty(3000, dtype=torch.int64)
    for seed, offset in [(0, 0), (12345, 77), (2**64 - 1, 2**33 + 5)]:
        ops.replay_sample(shard.obs, shard.action, shard.reward, shard.flags, shard.final_ref, shard.final_pool,
                          shard.head_next_obs, shard.ptr, 3, 0.9, seed, offset, env, slot)
        want_env, want_slot = reference.sample_pairs(seed, offset, 3000, 5, 40, 57)
        assert torch.equal(env, want_env) and torch.equal(slot, want_slot)


@pytest.mark.parametrize("num_envs, capacity, steps", [(1, 1, 1), (1, 5, 3), (1, 7, 50), (2, 3, 3), (3, 64, 200),
                                                     (7, 9, 9), (16, 100, 333), (13, 1000, 1001)])
def test_the_kernels_draw_the_reference_pairs_for_any_ring(num_envs, capacity, steps):
    """The CPU kernel divides by multiplying (per-call magic numbers) and wraps slots by a compare: the
    same pairs as the reference's plain modulo and division, one env or many, ring full or not."""
    shard = ReplayShard(num_envs, capacity, obs_dim=1, action_dim=1, n_step=1, gamma=0.9)
    shard.ptr = steps  # the draw reads only the ring's shape and write count
    env, slot = torch.empty(20_000, dtype=torch.int64), torch.empty(20_000, dtype=torch.int64)
    for seed, offset in [(3, 0), (2**63 + 11, 2**40)]:
        ops.replay_sample(shard.obs, shard.action, shard.reward, shard.flags, shard.final_ref, shard.final_pool,
                          shard.head_next_obs, shard.ptr, 1, 0.9, seed, offset, env, slot)
        want_env, want_slot = reference.sample_pairs(seed, offset, 20_000, num_envs, capacity, steps)
        assert torch.equal(env, want_env) and torch.equal(slot, want_slot)


@pytest.mark.parametrize("batch", [1, 7, 13, 261, 1031])
def test_the_kernels_draw_the_reference_pairs_for_any_batch(batch):
    """Philox runs on 8 or 4 counters at once where the CPU has vector units and one at a time for the
    rest of a block: every batch size, and counters whose low word wraps inside a vector, draw the same
    pairs as the reference."""
    shard = ReplayShard(5, 40, obs_dim=1, action_dim=1, n_step=1, gamma=0.9)
    shard.ptr = 57
    env, slot = torch.empty(batch, dtype=torch.int64), torch.empty(batch, dtype=torch.int64)
    for seed, offset in [(9, 0), (2**40 + 3, 2**32 - 5)]:
        ops.replay_sample(shard.obs, shard.action, shard.reward, shard.flags, shard.final_ref, shard.final_pool,
                          shard.head_next_obs, shard.ptr, 1, 0.9, seed, offset, env, slot)
        want_env, want_slot = reference.sample_pairs(seed, offset, batch, 5, 40, 57)
        assert torch.equal(env, want_env) and torch.equal(slot, want_slot)


@pytest.mark.parametrize("backend", ["extension", "reference"])
@pytest.mark.parametrize("steps", [4, 7, 25])  # not full (unwritten slots never drawn), full, wrapped
def test_sampler_draws_uniformly_gathers_exactly_and_resumes_its_stream(backend, steps, monkeypatch):
    if backend == "reference":
        monkeypatch.setattr(ops, "_C", None)
    shard, _ = fill(num_envs=3, capacity=7, steps=steps)
    sampler = Sampler(shard, 21_000, seed=5)
    b = sampler.sample()
    filled = min(steps, 7)
    written = {(e, (steps - filled + t) % 7) for e in range(3) for t in range(filled)}
    pairs = list(zip(sampler.env_idx.tolist(), sampler.slot_idx.tolist()))
    assert set(pairs) == written  # every written pair drawn, nothing else
    counts = torch.bincount(sampler.env_idx * 7 + sampler.slot_idx, minlength=21).float()
    expected = 21_000 / len(written)
    assert counts[counts > 0].min() > 0.85 * expected and counts.max() < 1.15 * expected
    direct = shard.gather(sampler.env_idx, sampler.slot_idx)  # the batch is the gather of its pairs
    for x, y in zip(b, direct):
        assert (x is None and y is None) or torch.equal(x, y)
    state = sampler.state_dict()
    assert state == {"seed": 5, "offset": 21_000}
    nxt = [t.clone() for t in sampler.sample() if t is not None]
    other = Sampler(shard, 21_000, seed=99)
    other.load_state_dict(state)
    assert all(torch.equal(x, y) for x, y in zip(nxt, (t for t in other.sample() if t is not None)))


def test_sampler_reuses_its_buffers_and_checks_what_it_is_given():
    shard, _ = fill(num_envs=3, capacity=7, steps=25)
    sampler = Sampler(shard, 64, seed=0)
    first = sampler.sample()
    ptrs = [t.data_ptr() for t in first if t is not None]
    second = sampler.sample()
    assert [t.data_ptr() for t in second if t is not None] == ptrs  # no allocation per call
    assert not torch.equal(sampler.env_idx * 7 + sampler.slot_idx, torch.zeros(64, dtype=torch.int64))
    with pytest.raises(ValueError, match="batch_size"):
        Sampler(shard, 0, seed=0)
    with pytest.raises(RuntimeError, match="empty"):
        Sampler(ReplayShard(2, 4, 4, 2), 8, seed=0).sample()
    bad = [torch.empty(63, 4), *sampler._out[1:]]
    with pytest.raises(RuntimeError, match="out obs has shape"):
        ops.replay_sample(shard.obs, shard.action, shard.reward, shard.flags, shard.final_ref, shard.final_pool,
                          shard.head_next_obs, shard.ptr, 3, 0.9, 0, 0, sampler.env_idx, sampler.slot_idx, out=bad)


@pytest.mark.parametrize("rows", [0, 1, 16])
def test_gather_prefetch_distance_changes_nothing_but_speed(rows):
    shard, _ = fill(num_envs=8, capacity=64, steps=300)
    env, slot = all_pairs(shard)
    a = ops.replay_gather(shard.obs, shard.action, shard.reward, shard.flags, shard.final_ref, shard.final_pool,
                          shard.head_next_obs, env, slot, shard.ptr, 3, 0.9, prefetch_rows=rows)
    b = reference.replay_gather(shard.obs, shard.action, shard.reward, shard.flags, shard.final_ref,
                                shard.final_pool, shard.head_next_obs, env, slot, shard.ptr, 3, 0.9)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.cuda
def test_cuda_sampler_draws_the_cpu_pairs():
    assert ops.with_cuda(), "hpcrl._C was built without CUDA"
    cpu, _ = fill(num_envs=16, capacity=33, steps=100, seed=9)
    gpu, _ = fill(num_envs=16, capacity=33, steps=100, seed=9, device="cuda")
    a, b = Sampler(cpu, 4096, seed=3), Sampler(gpu, 4096, seed=3)
    x, y = a.sample(), b.sample()
    assert torch.equal(a.env_idx, b.env_idx.cpu()) and torch.equal(a.slot_idx, b.slot_idx.cpu())
    for u, v in zip(x, y):
        assert (u is None and v is None) or torch.allclose(u, v.cpu(), rtol=1e-6, atol=1e-6)
