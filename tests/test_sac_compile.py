"""``--compile``: the captured FastSAC update equals the eager one to float rounding (inductor fuses and
reorders elementwise float arithmetic), on 1 rank and on 2 ranks, and compiles once.

Tolerance after 100 updates: the critic, its target and log-alpha within rtol 1e-4 / atol 1e-5; the
actor within rtol 1e-3 / atol 1e-4 (its zero-initialised heads make relative errors large on small
weights; measured 3e-5 at most). After the first two updates (one actor step) everything is within
rtol 1e-5 / atol 1e-6, so a wrong formula cannot hide in the looser tolerance.
"""

import sys
from pathlib import Path

import pytest
import torch

from hpcrl.comm import spawn
from hpcrl.core.config_check import ConfigError

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sac_compile_workers as workers  # noqa: E402

# The first compile on this loaded 2-core machine takes ~40-80 s; inductor's on-disk cache makes later runs fast.
pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

LOOSE = {"actor": (1e-3, 1e-4), "critic": (1e-4, 1e-5), "critic_target": (1e-4, 1e-5)}


def assert_states_close(got: dict, want: dict, tol: dict[str, tuple[float, float]], what: str) -> None:
    for group, (rtol, atol) in tol.items():
        for name, value in want[group].items():
            torch.testing.assert_close(got[group][name], value, rtol=rtol, atol=atol,
                                       msg=lambda m: f"{what}: {group}.{name}: {m}")
    torch.testing.assert_close(got["log_alpha"], want["log_alpha"], rtol=1e-5, atol=1e-6)
    assert got["counters"] == want["counters"]


@pytest.fixture(scope="module")
def eager():
    return workers.run(False)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """This module's --compile-cache: the first compiled run stores its graphs, later ones load them."""
    return str(tmp_path_factory.mktemp("compile_cache"))


@pytest.fixture(scope="module")
def compiled(cache):
    # one thread, as in the ranks that load its graphs (inductor compiles for the thread count: part of the
    # key); module fixtures run before conftest's per-test thread setting
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return workers.run(True, cache=cache)
    finally:
        torch.set_num_threads(prev)


# One eager and one compiled run serve every check below: a compile costs tens of seconds here.
def test_first_updates_match_eager_tightly(eager, compiled):
    tight = {g: (1e-5, 1e-6) for g in LOOSE}
    assert_states_close(compiled["early"], eager["early"], tight, "2 updates")


def test_compiled_matches_eager_over_100_updates(eager, compiled):
    assert_states_close(compiled, eager, LOOSE, "100 updates")
    for key, want in eager["outs"][-1].items():
        torch.testing.assert_close(compiled["outs"][-1][key], want, rtol=1e-3, atol=1e-4, msg=lambda m: f"{key}: {m}")
    # the optimizer state (moments, steps) follows too: a resume from a compiled run continues it
    for i, st in eager["critic_opt"]["state"].items():
        for key, value in st.items():
            torch.testing.assert_close(compiled["critic_opt"]["state"][i][key], value, rtol=1e-3, atol=1e-6)


def test_no_recompiles_after_warm_up(compiled):
    assert compiled["compile_s"] > 0
    # the two variants (with and without the actor step) compiled once, stored, and nothing compiled after
    assert compiled["graphs"] == {"loaded": 0, "compiled": 2, "unstored": None}
    after_warm_up, at_the_end = compiled["dynamo"]  # Dynamo's frames and graphs after 5 updates, after 100
    assert at_the_end == after_warm_up
    assert compiled["unguarded"] == workers.UPDATES  # stored graphs keep no guards


def test_a_later_process_loads_the_stored_update(compiled, cache):
    """What --compile-cache is for: a second run on this machine loads both graphs instead of compiling
    them, faster, and they compute bit for bit what the first run's did."""
    again = spawn(workers.compiled_rank, 1, args=(workers.UPDATES, cache), timeout_s=300)[0]
    assert again["graphs"] == {"loaded": 2, "compiled": 0, "unstored": None}
    assert again["compile_s"] < compiled["compile_s"]
    for group in ("actor", "critic", "critic_target"):
        for name, value in compiled[group].items():
            assert torch.equal(again[group][name], value), f"{group}.{name}"
    assert torch.equal(again["log_alpha"], compiled["log_alpha"])


@pytest.mark.extended
def test_a_batch_of_other_shapes_after_warm_up_is_guarded_again(compiled, cache):
    """Running without guards is only safe for the shapes the graphs were compiled for: a smaller batch after
    warm-up runs Dynamo's fully guarded path (a compile), and equals the eager update on it; so does
    Dynamo's path with guards skipped after warm-up (--compile-cache none)."""
    eager = workers.run(False, 8, half_from=5)
    stored, dynamo = workers.run(True, 8, half_from=5, cache=cache), workers.run(True, 8, half_from=5)
    assert stored["unguarded"] == 5  # updates 1-5, full size, by the stored graphs
    assert stored["graphs"]["compiled"] == 0  # the module's stored graphs, loaded
    assert dynamo["unguarded"] == 3  # updates 3, 4, 5: the warm, full-size ones
    for got in (stored, dynamo):
        assert_states_close(got, eager, {g: (1e-5, 1e-6) for g in LOOSE}, "8 updates, half batch from 6")
    for group in ("actor", "critic", "critic_target"):  # the same kernels either way
        for name, value in dynamo[group].items():
            assert torch.equal(stored[group][name], value), f"{group}.{name}"


def test_compile_refuses_what_it_cannot_capture():
    import dataclasses

    for bad in (dict(flat_params=False), dict(amp="fp16")):
        cfg = dataclasses.replace(workers.compiled_config(True), **bad)
        with pytest.raises(ConfigError, match="--compile"):
            workers.FastSAC(cfg, workers.OBS, workers.ACT, -torch.ones(workers.ACT), torch.ones(workers.ACT),
                            torch.device("cpu"), plane=workers.Plane.local("device"))


@pytest.mark.extended
def test_two_ranks_compiled_equal_one_rank_compiled(compiled, cache):
    """W=2 compiled vs W=1 compiled on the concatenated batches (tests/test_sac_dp.py does it for eager)."""
    results = spawn(workers.compiled_rank, 2, args=(workers.UPDATES, cache), timeout_s=580)
    for rank, res in enumerate(results):
        assert_states_close(res, compiled, LOOSE, f"rank {rank}")
    for group in ("actor", "critic", "critic_target"):  # same reduced gradients, same compiled step
        for name in compiled[group]:
            assert torch.equal(results[0][group][name], results[1][group][name]), f"{group}.{name} diverged"
