"""Same-host sums through shared memory (hpcrl.comm.shm): the same numbers as gloo on every rank and in
every dtype, across many slot rounds, no file left behind, and a missing peer named (real processes)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hpcrl.comm import spawn
from hpcrl.comm.shm import tree_sum_

sys.path.insert(0, str(Path(__file__).resolve().parent))
from comm_workers import shm as workers  # noqa: E402

pytestmark = pytest.mark.timeout(180)


def test_tree_sum_adds_pairs_then_pairs_of_pairs():
    rows = [workers.rank_data(r, torch.float32, 1000) for r in range(5)]
    out = torch.empty(1000)
    tree_sum_(rows, out)
    assert torch.equal(out, ((rows[0] + rows[1]) + (rows[2] + rows[3])) + rows[4])
    same = [torch.full((4,), 0.1)] * 4  # W equal values, W a power of two: exactly W times the value
    tree_sum_(same, out[:4])
    assert torch.equal(out[:4], torch.full((4,), 0.1) * 4)


@pytest.mark.parametrize("world, reference_wait", [(2, False), (3, False), (2, True)])
def test_sums_equal_the_tree_sum_on_every_rank_and_gloo_where_order_is_free(world, reference_wait):
    ranks = spawn(workers.sums, world, args=(4096, reference_wait), timeout_s=150)
    for res in ranks:
        assert "gloo + shared memory" in res["context"], res["context"]
        assert "shared memory" in res["planes"][0] and "shared memory" in res["planes"][1], res["planes"]
        assert res["rounds"] > 2 * 40_000 * 8 // 4096, "a 40k-element sum should span many 4 KiB slot rounds"
        assert res["leftover"] == [], f"segment files left in /dev/shm: {res['leftover']}"
    for (dtype, n), got in ranks[0]["sums"].items():
        parts = [workers.rank_data(r, getattr(torch, dtype.split(".")[1]), n) for r in range(world)]
        want = torch.empty_like(parts[0])
        tree_sum_(parts, want)
        for rank, res in enumerate(ranks):
            assert torch.equal(res["sums"][(dtype, n)], want), f"rank {rank}, {dtype} x {n}"
        if world == 2 or dtype == "torch.int64":  # a + b is a + b in any order: gloo must agree bit for bit
            assert torch.equal(ranks[0]["gloo"][(dtype, n)], want), f"gloo, {dtype} x {n}"


def test_shared_memory_false_keeps_gloo():
    for line in spawn(workers.switched_off, 2, timeout_s=60)[0]:
        assert "gloo" in line and "shared memory" not in line, line


def test_a_peer_that_exits_is_named_at_once():
    res = spawn(workers.dead_peer, 2, timeout_s=60, expendable=(1,))[0]
    assert res["rank"] == 1 and "rank 1 (pid" in res["error"] and "exited" in res["error"], res
    assert res["s"] < 5, f"named after {res['s']:.1f} s"


def test_a_late_peer_is_named_after_the_timeout():
    res = spawn(workers.late_peer, 2, timeout_s=60)[0]
    assert res["rank"] == 1 and "did not reach sum 1 on the host plane" in res["error"], res
    assert 2 <= res["s"] < 7, f"named after {res['s']:.1f} s"


def test_how_ranks_sum_is_not_part_of_a_runs_identity():
    """A checkpoint written with or without shared memory (or overlap) resumes either way: same numbers."""
    from hpcrl.sac import preset
    from hpcrl.sac.state import run_identity

    base = run_identity(preset("pendulum"))
    for flags in ({"shared_memory": False}, {"overlap_grad_average": True}):
        assert run_identity(preset("pendulum", **flags)) == base, flags
    assert "shared_memory" not in base


def test_a_subgroup_gets_its_own_segment_and_only_its_members_take_part():
    ranks = spawn(workers.subgroup, 3, timeout_s=120)
    assert all("shared memory" not in p for p in ranks[0]["planes"]), ranks[0]["planes"]
    want = workers.rank_data(1, torch.float32, 1000) + workers.rank_data(2, torch.float32, 1000)
    for res in ranks[1:]:
        assert all("shared memory" in p and "ranks [1, 2]" in p for p in res["planes"]), res["planes"]
        assert torch.equal(res["x"][10:], want[10:]) and torch.equal(res["x"][:10], 2 * want[:10])
    world = torch.empty(10)
    tree_sum_([workers.rank_data(r, torch.float32, 10) for r in range(3)], world)
    assert all(torch.equal(res["world"], world) for res in ranks)


def test_detached_ppo_trainers_sum_through_shared_memory():
    trainers, _, maker = spawn(workers.ppo_trainer_planes, 3, timeout_s=120)
    assert all("shared memory" in p and "ranks [0, 1]" in p for p in trainers), trainers
    assert all("shared memory" not in p for p in maker), maker  # not a member: its trainer planes are inactive


def test_a_member_gone_before_the_sums_began_is_still_watched():
    """A peer that exited between mapping the segment and the first sum is named as exited at once (it once
    looked unwatchable, and its wait ran to the timeout); one in another pid namespace is not watched."""
    from hpcrl.comm.shm import _peer, _pid_namespace
    from hpcrl.core import process_state

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    own = _pid_namespace()
    pid, start = _peer(gone.pid, own, own)
    assert pid == gone.pid and not process_state.pid_alive(pid, start)
    me = _peer(os.getpid(), own, own)
    assert me[0] == os.getpid() and process_state.pid_alive(*me)
    assert _peer(os.getpid(), "pid:[1]", own) == (0, "")
