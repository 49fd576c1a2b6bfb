"""hpcrl/sac/graph_store.py: compiled graphs stored per machine under a key of what they depend on.

The store on a tiny function (a compile costs seconds, not the update's tens), and the key of the
captured FastSAC update built for real agents (no compile: keys only)."""

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

from hpcrl.sac.update import Data
from hpcrl.sac.graph_store import GraphStore, graph_key

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sac_compile_workers as workers  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def scaled_sum(x, y):
    return (x * 3 + y).sum(dim=0)


ARGS = (torch.arange(12.0).view(4, 3), torch.ones(4, 3))


def test_a_stored_graph_loads_in_a_new_store_and_computes_the_same(tmp_path):
    first = GraphStore(tmp_path)
    graph = first.graph("scaled_sum", scaled_sum, ARGS, "k" * 64)
    assert (first.compiled, first.loaded, first.unstored) == (1, 0, None)
    assert torch.equal(graph(*ARGS), scaled_sum(*ARGS))
    assert [p.name for p in tmp_path.iterdir()] == ["scaled_sum-" + "k" * 40 + ".bin"]  # no temporary left
    again = GraphStore(tmp_path)
    other = (torch.randn(4, 3), torch.randn(4, 3))  # same shapes, other values: computed, not replayed
    assert torch.equal(again.graph("scaled_sum", scaled_sum, ARGS, "k" * 64)(*other), scaled_sum(*other))
    assert (again.compiled, again.loaded) == (0, 1)


def test_an_unreadable_stored_graph_is_compiled_again_and_replaced(tmp_path):
    path = tmp_path / ("scaled_sum-" + "k" * 40 + ".bin")
    path.write_bytes(b"half a file")
    store = GraphStore(tmp_path)
    with pytest.warns(UserWarning, match="unreadable.*compiling it again"):
        graph = store.graph("scaled_sum", scaled_sum, ARGS, "k" * 64)
    assert torch.equal(graph(*ARGS), scaled_sum(*ARGS)) and store.compiled == 1
    assert GraphStore(tmp_path).graph("scaled_sum", scaled_sum, ARGS, "k" * 64)(*ARGS).shape == (3,)


def test_a_graph_that_cannot_be_stored_still_runs_and_says_why(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    store = GraphStore(blocker / "cache")  # a directory under a file: mkdir fails
    graph = store.graph("scaled_sum", scaled_sum, ARGS, "k" * 64)
    assert torch.equal(graph(*ARGS), scaled_sum(*ARGS))
    assert store.compiled == 1 and store.unstored and "cache" in store.unstored


def _key(**changes) -> str:
    """The key of the one-rank update graph (with the actor step) of the test config with ``changes``."""
    cfg = dataclasses.replace(workers.compiled_config(True, "none"), **changes)
    torch.manual_seed(0)
    agent = workers.FastSAC(cfg, workers.OBS, workers.ACT, -torch.ones(workers.ACT), torch.ones(workers.ACT),
                            torch.device("cpu"), plane=workers.Plane.local("device"))
    cu = agent.compiled
    args = (cu.fn, cu.state(), Data.of(*workers.global_data(0)), True)  # run_update(...)'s arguments
    return graph_key("whole-1", args, cfg, cu.modules(), cu.fn.constants())


def test_the_key_follows_what_the_graph_depends_on_and_nothing_else():
    base = _key()
    # run-level settings: every seed, run dir and run length of a preset shares its graphs
    assert _key(seed=7, run_dir="elsewhere", total_env_steps=123, eval_every=5, alpha_init=0.5) == base
    # constants baked into the graph, the networks' sizes and the thread count inductor compiles for
    for change in (dict(tau=0.06), dict(critic_lr=2e-3), dict(critic_hidden=48), dict(num_atoms=13),
                   dict(max_grad_norm=1.0), dict(cdq=True), dict(log_std_max=1.0)):
        assert _key(**change) != base, change
    prev = torch.get_num_threads()
    torch.set_num_threads(prev + 1)
    try:
        assert _key() != base
    finally:
        torch.set_num_threads(prev)


def test_where_compiled_graphs_are_stored_is_not_part_of_a_runs_identity():
    """A checkpoint resumes with another --compile-cache (or none), and older checkpoints, written before
    the field existed, still resume: it is how the update is computed, not what."""
    from hpcrl.sac import preset
    from hpcrl.sac.state import run_identity

    base = run_identity(preset("pendulum", compile=True))
    for cache in ("none", "/elsewhere"):
        assert run_identity(preset("pendulum", compile=True, compile_cache=cache)) == base, cache
    assert "compile_cache" not in base
