"""Rank functions for tests/test_sac_compile.py (importable by spawned processes)."""

from __future__ import annotations

import dataclasses

import torch
from sac_workers import ACT, OBS, global_data, rows, small_config

from hpcrl.comm import Plane, init_distributed
from hpcrl.replay import Batch
from hpcrl.sac import FastSAC, UpdateNoise

UPDATES = 100


def compiled_config(compile: bool, cache: str = "none"):
    return dataclasses.replace(small_config("flat"), compile=compile, compile_cache=cache)


def run(compile: bool, updates: int = UPDATES, rank: int = 0, world: int = 1, ctx=None,
        early: int = 2, warm: int = 5, half_from: int | None = None, cache: str = "none") -> dict:
    """``updates`` updates on this rank's rows of each global batch; the final state, the outputs of the
    last update, the state after ``early`` updates (``"early"``) and Dynamo's frame / graph counts after
    ``warm`` updates and at the end (``"dynamo"``: equal when nothing recompiled after warm-up).
    ``half_from``: from that update on, half of those rows (a batch of other shapes). ``cache``: --compile-cache
    ("none": Dynamo's path, compiled in this process; a directory: the graphs stored there, or loaded from it)."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    plane = ctx.device_plane if ctx is not None else Plane.local("device")
    agent = FastSAC(compiled_config(compile, cache), OBS, ACT, -torch.ones(ACT), torch.ones(ACT), torch.device("cpu"),
                    plane=plane)
    outs, early_state, dynamo = [], None, []
    count = lambda: (counters["frames"]["total"], counters["stats"]["unique_graphs"])  # noqa: E731
    for step in range(updates):
        batch, noise = global_data(step)
        part = (lambda t: rows(rows(t, rank, world), 0, 2)) if half_from is not None and step >= half_from else (
            lambda t: rows(t, rank, world))
        outs.append(agent.update(Batch(*[None if t is None else part(t) for t in batch]),
                                 UpdateNoise(*[part(t) for t in noise])))
        if step + 1 == early:
            early_state = state(agent, [])
        if step + 1 == warm:
            dynamo.append(count())
    dynamo.append(count())
    return {**state(agent, outs), "early": early_state, "dynamo": dynamo,
            "compile_s": agent.compiled.compile_s if compile else 0.0,
            "unguarded": agent.compiled.unguarded if compile else 0,
            "graphs": _graphs(agent.compiled.store) if compile else None}


def _graphs(store) -> dict | None:
    return None if store is None else {"loaded": store.loaded, "compiled": store.compiled, "unstored": store.unstored}


def state(agent: FastSAC, outs: list[dict]) -> dict:
    return {
        "actor": {k: v.clone() for k, v in agent.actor.state_dict().items()},
        "critic": {k: v.clone() for k, v in agent.critic.state_dict().items()},
        "critic_target": {k: v.clone() for k, v in agent.critic_target.state_dict().items()},
        "log_alpha": agent.log_alpha.detach().clone(),
        "critic_opt": agent.learner_state()["critic_opt"],
        "outs": outs,
        "counters": dataclasses.astuple(agent.counters),
    }


def compiled_rank(updates: int, cache: str = "none") -> dict:
    ctx = init_distributed(timeout_s=60)
    return run(True, updates, ctx.rank, ctx.world_size, ctx, cache=cache)
