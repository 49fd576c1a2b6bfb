"""FastSAC's training loop on one rank, in named steps: collect -> store -> update -> log (and
evaluate, keep the best) -> checkpoint -> stop?, then the end of the run.

Envs and replay are rank-local. Once per vector step, in one all-reduce on the device plane: the
normaliser statistics (actor and, when the env has privileged critic observations, critic) of the
observations about to be acted on, packed with the env's shared state the previous step left (it is
first read by this step's env.step; a checkpoint reduces it on its own first). The stop agreement runs
every vector step on the host plane (one gloo all-reduce of a CPU flag, no device wait; none in one
process), so a signal is acted on within one vector step plus the checkpoint.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from hpcrl.run import checkpoint
from hpcrl.comm import check_replicas_equal, reduce_metrics, shutdown

from . import nonfinite
from .agent import UpdateNoise, mirror_batch
from .evaluate import evaluate_and_keep_best, snapshot
from .events import RowLogged, UpdatesDone
from .nonfinite import NonFiniteEnvData
from .state import LoopState, Run, Window, save


def run_loop(run: Run, state: LoopState) -> dict[str, float]:
    """The vector steps left, then the end of the run; returns the final row (``preempted`` after a stop)."""
    agent, cfg = run.parts.agent, run.cfg
    if state.sampler is not None:  # resumed: continue the replay stream where the checkpoint left it
        run.sampler.load_state_dict(state.sampler)
    state.window.start = time.time()
    shared = SharedPending()
    for it in range(agent.counters.vector_steps, run.layout.vector_steps):
        step = collect(run, state, it, shared)
        store(run, state, step, shared)
        if it >= cfg.learning_starts:
            update(run, state)
        agent.counters.vector_steps = it + 1
        state.window.iters += 1
        last = it + 1 == run.layout.vector_steps
        log(run, state, last)
        due = bool(cfg.checkpoint_every) and (it + 1) % cfg.checkpoint_every == 0
        if due and not last:
            save_reduced(run, state, shared)
        if stop_agreed(run, step.fault, last) and not last:
            return preempt(run, state, shared, saved=due)
    return finish(run, state, shared)


@dataclass
class SharedPending:
    """The env's shared state at the end of a vector step, packed (:func:`reduce_shared_state`) and not
    yet reduced over the ranks: the next step's one collective, or a checkpoint's, reduces it."""

    template: dict[str, torch.Tensor] | None = None
    packed: torch.Tensor | None = None

    def take(self) -> tuple[dict[str, torch.Tensor] | None, torch.Tensor | None]:
        out, self.template, self.packed = (self.template, self.packed), None, None
        return out


@dataclass(frozen=True)
class Collected:
    """One vector step's transition, as it goes to the replay."""

    action: torch.Tensor
    result: Any  # the env's step result; sanitized when it held non-finite data
    next_obs: torch.Tensor  # the observation to act on next
    fault: bool  # non-finite data under --nonfinite error, in a multi-rank run: stop at this step's agreement


def collect(run: Run, state: LoopState, it: int, shared: SharedPending) -> Collected:
    """Normaliser update (with the shared state), action (uniform during ``random_steps``), ``env.step``,
    non-finite check."""
    cfg, ctx, p = run.cfg, run.ctx, run.parts
    reduce_step(run, state, shared)
    if it < cfg.random_steps:
        low, high = p.env.action_low, p.env.action_high
        action = low + (high - low) * torch.rand(state.obs.shape[0], p.env.action_dim, generator=p.generator,
                                                 device=ctx.device)
    else:
        action = p.agent.actor.act(p.normalizer(state.obs), p.generator)
    result = p.env.step(action)
    bad = nonfinite.count_bad(result, p.has_critic_obs)
    if not bad:
        return Collected(action, result, result.obs, False)
    fault = cfg.nonfinite == "error"
    if fault:
        message = nonfinite.message(cfg, ctx.rank, it + 1, result, bad)
        if not ctx.is_distributed:
            raise NonFiniteEnvData(message)
        # The other ranks are about to enter this step's collectives: post the message, finish the
        # step on sanitized data, and stop together at the step's agreement.
        nonfinite.post(ctx, message)
    result, next_obs = nonfinite.sanitize(result, state.obs, state.critic_obs)
    state.window.dropped += 0 if fault else bad
    return Collected(action, result, next_obs, fault)


def store(run: Run, state: LoopState, step: Collected, shared: SharedPending) -> None:
    """Replay add, episode stats, next observations, and the env's shared state packed for the next
    step's reduction."""
    p, result, critic = run.parts, step.result, run.parts.has_critic_obs
    p.replay.add(state.obs, step.action, result.reward * run.cfg.reward_scale, result.next_obs, result.terminated,
                 result.truncated, critic_obs=result.critic_obs if critic else None,
                 next_critic_obs=result.next_critic_obs if critic else None)
    p.stats.update(result)
    state.obs = step.next_obs
    if critic:
        state.critic_obs = result.critic_obs
    local = p.env.shared_state()
    if local:  # episode-weighted mean over ranks, with the next step's normaliser statistics
        shared.template, shared.packed = local, _pack_shared(local, result.done.sum())


def reduce_step(run: Run, state: LoopState, shared: SharedPending) -> None:
    """One collective on the device plane (none when there is nothing to reduce): the normalisers'
    statistics of the observations about to be acted on and the pending shared state, packed."""
    p = run.parts
    norms = [(n, x) for n, x in ((p.normalizer, state.obs), (p.critic_normalizer, state.critic_obs))
             if n is not None and n.enabled]
    template, pending = shared.take()
    chunks = [n.batch_stats(x) for n, x in norms] + ([pending] if pending is not None else [])
    if not chunks:
        return
    packed = torch.cat(chunks)
    if run.reduce_sum is not None:
        run.reduce_sum(packed)
    reduced = packed.split([c.numel() for c in chunks])
    for (n, _), stats in zip(norms, reduced):
        n.merge(stats)
    if template is not None:
        p.env.load_shared_state(_unpack_shared(template, reduced[-1]))


def save_reduced(run: Run, state: LoopState, shared: SharedPending) -> None:
    """Collective: a checkpoint, with the pending shared state reduced first (its own collective), so a
    checkpoint holds what a vector step acts on."""
    template, pending = shared.take()
    if template is not None:
        if run.reduce_sum is not None:
            run.reduce_sum(pending)
        run.parts.env.load_shared_state(_unpack_shared(template, pending))
    save(run, state)


def update(run: Run, state: LoopState) -> None:
    """``num_updates`` learner updates (gradients averaged over the ranks), with the replica check when due."""
    cfg, agent = run.cfg, run.parts.agent
    t0 = time.perf_counter()
    for _ in range(cfg.num_updates):
        batch, noise = _sample(run)
        for key, value in agent.update(batch, noise).items():
            state.window.metrics.setdefault(key, []).append(value)
        if cfg.check_replicas_every and agent.counters.critic_steps % cfg.check_replicas_every == 0:
            check_replicas_equal([(f"actor.{n}", p) for n, p in agent.actor.named_parameters()]
                                     + [(f"critic.{n}", p) for n, p in agent.critic.named_parameters()]
                                     + [("log_alpha", agent.log_alpha)], run.ctx.device_plane)
    run.events(UpdatesDone(time.time(), run.ctx.rank, agent.counters.vector_steps + 1, cfg.num_updates,
                           time.perf_counter() - t0))


def _sample(run: Run) -> tuple[Any, UpdateNoise]:
    """A normalised replay batch (with its mirror under --symmetry) and the update's noise.

    The sampled tensors are the sampler's buffers, overwritten by the next call: the mirror's cat and
    the normalisers copy them, and the update reads the rest (action, reward, discount) once, before
    the next draw, so nothing keeps them across updates."""
    cfg, p, env = run.cfg, run.parts, run.parts.env
    batch = run.sampler.sample()
    if cfg.symmetry:  # [sampled; mirrored]: 2 x batch_per_rank rows (raw obs are mirrored)
        batch = mirror_batch(batch, env.mirror_obs, env.mirror_action,
                             env.mirror_critic_obs if p.has_critic_obs else None)
    batch = batch._replace(obs=p.normalizer(batch.obs), next_obs=p.normalizer(batch.next_obs))
    if p.critic_normalizer is not None:
        batch = batch._replace(critic_obs=p.critic_normalizer(batch.critic_obs),
                               next_critic_obs=p.critic_normalizer(batch.next_critic_obs))
    return batch, UpdateNoise.draw(batch.obs.shape[0], env.action_dim, p.generator, run.ctx.device)


def log(run: Run, state: LoopState, last: bool) -> None:
    """Every ``log_every`` vector steps and at the last: the metrics row; every ``eval_every``: an eval."""
    cfg, steps = run.cfg, run.parts.agent.counters.vector_steps
    if steps % cfg.log_every and not last:
        return
    state.row = log_row(run, state.window)
    run.logger.log(state.row)
    run.events(RowLogged(time.time(), run.ctx.rank, dict(state.row)))
    state.window = Window()
    if cfg.eval_every and steps % cfg.eval_every == 0 and not last:  # the last eval runs at the end
        evaluate_and_keep_best(run, state)


def stop_agreed(run: Run, fault: bool, last: bool) -> bool:
    """Every vector step: one gloo all-reduce of a CPU flag on the host plane (no device wait); its cost
    per step is in the README (measured at 2 ranks). Raises when a rank found non-finite env data.
    One process has nothing to agree on (a fault raised in collect): the signal flag alone."""
    if not run.ctx.is_distributed:
        return bool(run.stop.reason)
    stopping = run.stop.agreed(run.ctx.host_plane, fault=fault)
    if run.stop.faults:  # every rank raises the same message (the lowest faulty rank's)
        raise NonFiniteEnvData(nonfinite.posted(run.ctx))
    return stopping


def preempt(run: Run, state: LoopState, shared: SharedPending, saved: bool) -> dict[str, float]:
    """A stop before the end: checkpoint (the window too) unless this step just did, and leave."""
    if not saved:
        save_reduced(run, state, shared)
    if run.ctx.rank == 0:
        print(f"hpcrl.sac: stop requested ({run.stop.reason}); checkpoint at env step "
              f"{run.parts.agent.counters.vector_steps * run.cfg.num_envs} written, resume with --resume", flush=True)
    run.logger.close()
    shutdown()
    return {**state.row, "preempted": 1.0}


def finish(run: Run, state: LoopState, shared: SharedPending) -> dict[str, float]:
    """The end of the run: the last eval, a checkpoint (resumable with a longer budget, exportable) and
    the final policy snapshot."""
    cfg = run.cfg
    final_eval = None
    if cfg.eval_episodes or cfg.eval_every:  # the last eval (of --eval-every too) runs at the end
        final_eval = evaluate_and_keep_best(run, state)
        state.row.update(eval_return=final_eval)
    save_reduced(run, state, shared)
    if run.ctx.rank == 0:
        final = snapshot(run, "final", final_eval)
        best = state.best if math.isfinite(state.best) else None
        run.logger.finish({"eval_return": final_eval, "best_eval_return": best},
                          {"checkpoint": checkpoint.latest(Path(cfg.run_dir), report=False), "policy": final})
    run.logger.close()
    shutdown()  # rank 0 usually hosts the rendezvous store: it leaves only after every peer is done
    return state.row


def log_row(run: Run, window: Window) -> dict[str, float]:
    """The window's metrics row, reduced over the ranks on the host plane (one collective)."""
    cfg, agent = run.cfg, run.parts.agent
    seconds = time.time() - window.start
    dropped = window.dropped if cfg.nonfinite == "skip" else None
    episodes = run.parts.stats.pop()
    count = episodes.count
    metrics = {key: torch.stack(values).float().mean() for key, values in window.metrics.items() if values}
    for key in ("critic_loss", "actor_loss", "alpha_loss", "entropy"):
        metrics.setdefault(key, torch.tensor(float("nan")))
    metrics["episode_return"] = episodes.return_sum / count.clamp(min=1)  # raw env rewards
    metrics["episode_length"] = episodes.length_sum / count.clamp(min=1)
    metrics["alpha"] = agent.alpha
    weights = {"episode_return": count, "episode_length": count}
    if dropped is not None:  # --nonfinite skip: transitions replaced in this window, summed over ranks
        metrics["nonfinite_dropped"] = float(dropped)
    out = reduce_metrics(metrics, run.ctx.host_plane, weights=weights,
                         sums=("nonfinite_dropped",) if dropped is not None else ())
    if "nonfinite_dropped" in out:
        out["nonfinite_dropped"] = int(out["nonfinite_dropped"])
    return {"env_steps": agent.counters.vector_steps * cfg.num_envs, "updates": agent.counters.critic_steps,
            "actor_updates": agent.counters.actor_steps, **{k: round(v, 6) for k, v in sorted(out.items())},
            "sps": round(window.iters * cfg.num_envs / max(seconds, 1e-9), 1)}


def reduce_shared_state(state: dict[str, torch.Tensor], episodes: torch.Tensor,
                        all_reduce_sum: Callable[[torch.Tensor], None] | None = None) -> dict[str, torch.Tensor]:
    """The episode-weighted mean of every rank's env shared state: sum_r w_r v_r / sum_r w_r with w_r the
    episodes rank r finished this step, or the plain mean over ranks when no rank finished one. One
    collective (``all_reduce_sum``, the device plane; None = one process), no host read."""
    packed = _pack_shared(state, episodes)
    if all_reduce_sum is not None:
        all_reduce_sum(packed)
    return _unpack_shared(state, packed)


def _pack_shared(state: dict[str, torch.Tensor], episodes: torch.Tensor) -> torch.Tensor:
    """[w v, v, w, 1] in float64 (v: the state flattened, keys sorted): summed over ranks, the
    weighted and plain sums with their weights."""
    flat = torch.cat([state[k].detach().reshape(-1).to(torch.float64) for k in sorted(state)])
    w = episodes.detach().to(torch.float64).reshape(1)
    return torch.cat([flat * w, flat, w, torch.ones_like(w)])


def _unpack_shared(state: dict[str, torch.Tensor], packed: torch.Tensor) -> dict[str, torch.Tensor]:
    """The episode-weighted mean (plain mean when no rank finished an episode), in ``state``'s shapes."""
    keys = sorted(state)
    n = (packed.numel() - 2) // 2
    wsum, ranks = packed[2 * n], packed[2 * n + 1]
    mean = torch.where(wsum > 0, packed[:n] / wsum.clamp(min=1e-300), packed[n:2 * n] / ranks)
    out, i = {}, 0
    for k in keys:
        v = state[k]
        out[k] = mean[i:i + v.numel()].reshape(v.shape).to(v.dtype)
        i += v.numel()
    return out
