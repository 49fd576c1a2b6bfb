"""Collectives per FastSAC env step, per plane, on 2 ranks: at most one on each outside the update,
the log and the checkpoint (normaliser statistics, critic normaliser and the env's shared state
packed on the device plane; the stop agreement with its non-finite flag on the host plane).

Counted by tests/sac_counters.py (torch.distributed's collectives wrapped, keyed by the Run's planes)
on the toy env with privileged critic observations and a shared state: every per-step reduction on.
"""

import sys
from pathlib import Path

import pytest

from hpcrl.comm import spawn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sac_counters  # noqa: E402

from hpcrl.sac import preset  # noqa: E402

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

STEPS = 60
TOY = dict(env="toy_privileged", num_envs=4, batch_size=32, actor_hidden=32, critic_hidden=32, num_atoms=21,
           learning_starts=4, random_steps=4, num_updates=2, log_every=10, eval_episodes=0, checkpoint_every=20,
           check_replicas_every=1, max_grad_norm=1.0, total_env_steps=4 * STEPS)
ENV_STEP = ("collect", "store", "stop_agreed")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    cfg = preset("pendulum", **TOY, run_dir=str(tmp_path_factory.mktemp("collectives")))
    return spawn(sac_counters.train_counted, 2, args=(cfg, True, True), timeout_s=200)


def test_at_most_one_collective_per_plane_per_env_step(ranks):
    for rank, out in enumerate(ranks):
        assert out["calls"]["collect"] == STEPS
        per_plane: dict[str, int] = {}
        for (step, plane), n in out["collectives"].items():
            if step in ENV_STEP:
                per_plane[plane] = per_plane.get(plane, 0) + n
        assert set(per_plane) == {"device", "host"}, (rank, out["collectives"])
        assert per_plane == {"device": STEPS, "host": STEPS}, (rank, out["collectives"])


def test_checkpoints_and_rows_add_their_own(ranks):
    for out in ranks:
        c = out["collectives"]
        # A checkpoint first reduces the pending shared state (device); its barriers go through the store.
        assert c[("save_reduced", "device")] == out["calls"]["save_reduced"] == STEPS // TOY["checkpoint_every"]
        assert c[("log", "host")] == STEPS // TOY["log_every"]  # one reduced metrics row each
        steps = {step for step, _ in c}
        assert steps <= {"outside", *ENV_STEP, "update", "log", "save_reduced", "save", "finish"}, c


def test_two_rank_env_steps_read_the_host_at_most_the_documented_counts(ranks):
    for out in ranks:
        reads, steps = out["reads"], out["calls"]["collect"]
        assert reads["collect"] <= steps and reads["store"] <= steps  # non-finite check, replay.add
        assert reads["stop_agreed"] <= 2 * steps  # the agreement's two CPU flags (StopRequest.agreed)
        # Inside updates only the replica check reads (its checksums, once per check: every update here).
        assert {op for (step, op) in out["read_ops"] if step == "update"} <= {"tolist"}
        assert reads.get("update", 0) <= out["row"]["updates"]
