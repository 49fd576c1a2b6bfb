"""FastSAC data parallelism: W=2 ranks must equal one rank fed both ranks' batches."""

import sys
from pathlib import Path

import pytest
import torch

from hpcrl.comm import spawn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sac_workers  # noqa: E402

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]


MODES = ["flat", "view", "ddp"]


@pytest.fixture(scope="module")
def single():
    return sac_workers.run_updates("flat")


@pytest.fixture(scope="module")
def two_ranks():
    return spawn(sac_workers.dp_rank, 2, args=(MODES,), timeout_s=100)  # one job runs every mode


@pytest.mark.parametrize("mode", MODES)
def test_two_ranks_equal_one_rank_on_concatenated_batches(mode, single, two_ranks):
    results = [by_mode[mode] for by_mode in two_ranks]
    for rank, res in enumerate(results):
        for name, g in single["grads"].items():
            torch.testing.assert_close(res["grads"][name], g, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"rank {rank} {mode}: gradient of {name}: {m}")
        for group in ("actor", "critic", "critic_target", "normalizer"):
            for name, value in single[group].items():
                torch.testing.assert_close(res[group][name], value, rtol=1e-5, atol=1e-5,
                                           msg=lambda m: f"rank {rank} {mode}: {group}.{name}: {m}")
        torch.testing.assert_close(res["log_alpha"], single["log_alpha"], rtol=1e-6, atol=1e-7)
        assert res["counters"] == single["counters"]
    # and the ranks agree with each other exactly: same reduced gradients, same optimizer arithmetic
    for group in ("actor", "critic"):
        for name in single[group]:
            assert torch.equal(results[0][group][name], results[1][group][name]), f"{group}.{name} diverged"


def test_single_rank_actually_learns_something(single):
    # Guard against a vacuous comparison: the updates moved the parameters.
    torch.manual_seed(0)
    fresh = sac_workers.FastSAC(
        sac_workers.small_config("flat"), sac_workers.OBS, sac_workers.ACT, -torch.ones(2), torch.ones(2),
        torch.device("cpu"), plane=sac_workers.Plane.local("device"))
    moved = [not torch.equal(v, fresh.critic.state_dict()[k]) for k, v in single["critic"].items()]
    assert sum(moved) > len(moved) // 2
    assert single["counters"] == (0, sac_workers.UPDATES, sac_workers.UPDATES // 2)
