"""No host read inside a FastSAC update; the env step's few, counted and bounded.

A host read (``.item()``, ``float(t)``, ``bool(t)``, ``.tolist()``, ``.numpy()``, a device-to-host copy)
waits for the device on a GPU. Counted per loop step by tests/sac_counters.py during a short 1-rank
run: updates read nothing (outside the opt-in replica check, tests/test_sac_collectives.py); an env
step reads at most the numbers below.
"""

import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sac_counters  # noqa: E402

from hpcrl.sac import preset  # noqa: E402

# Host reads per env step, by loop step: collect: the non-finite check's count (nonfinite.count_bad);
# store: ReplayShard.add's finished-episode count (it places their final observations). One process
# has no stop agreement; on W ranks it reads its two CPU flags (no device wait).
PER_ENV_STEP = {"collect": 1, "store": 1, "stop_agreed": 0}

TINY = dict(num_envs=4, batch_size=32, actor_hidden=32, critic_hidden=32, num_atoms=11, learning_starts=8,
            random_steps=8, num_updates=2, log_every=20, checkpoint_every=0, eval_episodes=0, eval_every=0,
            check_replicas_every=0, total_env_steps=4 * 60)


@pytest.fixture(scope="module")
def counted():
    with tempfile.TemporaryDirectory() as run_dir:
        return sac_counters.train_counted(preset("pendulum", **TINY, run_dir=run_dir))


def test_updates_read_nothing_from_the_device(counted):
    assert counted["calls"]["update"] == 60 - 8
    assert counted["row"]["updates"] == 2 * (60 - 8)
    assert counted["reads"].get("update", 0) == 0, {k: v for k, v in counted["read_ops"].items() if k[0] == "update"}


def test_env_steps_read_at_most_the_documented_counts(counted):
    steps = counted["calls"]["collect"]
    assert steps == 60
    for step, k in PER_ENV_STEP.items():
        assert counted["reads"].get(step, 0) <= k * steps, (step, counted["read_ops"])
    assert counted["reads"]["store"] >= steps  # the counter sees .item()-style reads at all


def test_log_rows_read_only_when_they_log(counted):
    rows = 60 // TINY["log_every"]
    assert counted["calls"]["log"] == 60  # called every env step, returns at once between rows
    assert counted["reads"].get("log", 0) <= rows  # one reduced metrics row: one .tolist()


def test_symmetry_batches_are_copies_of_the_sampler_buffers(monkeypatch, tmp_path):
    """--symmetry: [sampled; mirrored] rows, concatenated into new tensors, so the next draw (into the
    same buffers) changes nothing the update still holds; its updates read nothing either."""
    from hpcrl.sac import loop

    seen = []  # (rows, batch_per_rank, shares a sampler buffer, second half mirrored): read after the run
    real = loop._sample

    def sample(run):
        batch, noise = real(run)
        buffers = {t.untyped_storage().data_ptr() for t in run.sampler.buffers}
        seen.append((batch.obs.shape[0], run.layout.batch_per_rank,
                     any(t.untyped_storage().data_ptr() in buffers for t in batch if t is not None),
                     (batch.action[run.layout.batch_per_rank:] == -batch.action[:run.layout.batch_per_rank]).all()))
        return batch, noise

    monkeypatch.setattr(loop, "_sample", sample)
    cfg = preset("pendulum", **{**TINY, "total_env_steps": 4 * 20}, env="cartpole_swingup", symmetry=True,
                 run_dir=str(tmp_path))
    out = sac_counters.train_counted(cfg)
    assert out["reads"].get("update", 0) == 0
    assert len(seen) == 2 * (20 - 8)
    assert all(rows == 2 * per and not shared and bool(mirrored) for rows, per, shared, mirrored in seen), seen[:3]
