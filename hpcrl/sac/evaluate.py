"""Evaluation of the deterministic policy, its metrics rows, and the best / final policy snapshots."""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch

from hpcrl.run import rundir
from hpcrl.comm import DistContext, reduce_metrics
from hpcrl.envs import first_episode_returns, make_env

from .agent import FastSAC
from .config import SACConfig
from .events import EvalDone
from .normalizer import ObsNormalizer
from .state import LoopState, Run


@torch.no_grad()
def evaluate(cfg: SACConfig, agent: FastSAC, normalizer: ObsNormalizer, device: torch.device,
             ctx: DistContext, episodes: int | None = None) -> dict[str, float]:
    """Deterministic policy on fresh envs (seed offset so they differ from training; the same envs at every
    eval, so evals compare), one episode per env, ``episodes`` (default ``cfg.eval_episodes``) envs per
    rank; mean return over ranks. Collective. Touches no training state or random stream."""
    episodes = episodes or cfg.eval_episodes
    env = make_env(cfg.env, episodes, device=device, seed=10_000 + cfg.seed + ctx.rank)
    act = lambda obs: agent.actor.act(normalizer(obs), deterministic=True)  # noqa: E731
    returns = first_episode_returns(env, env.reset(), act)
    return {"eval_return": reduce_metrics({"r": returns.mean()}, ctx.host_plane)["r"]}


def eval_row(agent: FastSAC, cfg: SACConfig, eval_return: float) -> dict[str, float]:
    """An eval row: its own line in metrics.jsonl (``eval_return`` at this ``env_steps``; transitions)."""
    return {"env_steps": agent.counters.vector_steps * cfg.num_envs, "updates": agent.counters.critic_steps,
            "eval_return": round(eval_return, 6)}


def snapshot(run: Run, kind: str, eval_return: float | None) -> Path:
    """``RUN_DIR/<kind>/policy.pt`` (``best`` or ``final``): the policy alone, for play and export. Rank 0."""
    from .policy import Policy, save_policy  # rank 0 only, at evals and the end

    cfg, agent = run.cfg, run.parts.agent
    path = rundir.make_dir(Path(cfg.run_dir) / kind) / "policy.pt"
    meta = {"env": cfg.env, "env_steps": agent.counters.vector_steps * cfg.num_envs, "eval_return": eval_return,
            "seed": cfg.seed, "kind": kind}
    save_policy(path, Policy.from_agent(agent, run.parts.normalizer), meta)
    return path


def evaluate_and_keep_best(run: Run, state: LoopState) -> float:
    """Collective: evaluate, log the eval row, and (rank 0) snapshot the policy when it beats the best."""
    cfg, ctx, agent = run.cfg, run.ctx, run.parts.agent
    t0 = time.perf_counter()
    eval_return = evaluate(cfg, agent, run.parts.normalizer, ctx.device, ctx,
                           episodes=max(1, cfg.eval_episodes))["eval_return"]
    run.logger.log(eval_row(agent, cfg, eval_return))
    run.events(EvalDone(time.time(), ctx.rank, agent.counters.vector_steps * cfg.num_envs, eval_return,
                        time.perf_counter() - t0))
    if ctx.rank == 0 and math.isfinite(eval_return) and eval_return > state.best:
        state.best = eval_return
        snapshot(run, "best", eval_return)
    return eval_return
