"""Overlapped gradient averaging (GradAverager(overlap=True), --overlap-grad-average): bucket all-reduces
start during backward and the result is bitwise the non-overlapped one, on 2 CPU ranks."""

import sys
from pathlib import Path

import pytest
import torch

from hpcrl.comm import spawn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sac_workers  # noqa: E402

# 2 spawned ranks and 4 FastSAC runs: ~2 min on this loaded machine, so the extended tier.
pytestmark = [pytest.mark.timeout(300), pytest.mark.slow, pytest.mark.extended]


@pytest.fixture(scope="module")
def results():
    return spawn(sac_workers.overlap_rank, 2, timeout_s=170)


def test_buckets_start_during_backward_and_sum_bitwise(results):
    for rank, res in enumerate(results):
        assert res["pieces"] > 2, "the bare model should be cut into several buckets"
        # every bucket but the first layer's can start before backward ends (its hook fires last)
        assert res["started_in_backward"] >= res["pieces"] - 1, (rank, res["started_in_backward"], res["pieces"])
        assert torch.equal(res["bare"][True], res["bare"][False]), f"rank {rank}: overlapped sums differ"
    assert torch.equal(results[0]["bare"][True], results[1]["bare"][True])


@pytest.mark.parametrize("mode", ["flat", "view"])
def test_fastsac_overlapped_equals_plain_on_two_ranks(results, mode):
    for rank, res in enumerate(results):
        plain, over = res[f"{mode}_False"], res[f"{mode}_True"]
        for group in ("actor", "critic", "critic_target"):
            for name, value in plain[group].items():
                assert torch.equal(over[group][name], value), f"rank {rank} {mode}: {group}.{name}"
        for name, g in plain["grads"].items():
            assert torch.equal(over["grads"][name], g), f"rank {rank} {mode}: gradient of {name}"
        assert torch.equal(over["log_alpha"], plain["log_alpha"])
