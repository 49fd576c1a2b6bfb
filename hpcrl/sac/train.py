"""FastSAC data-parallel training loop: one ``train()`` per rank.

Data path: env.step -> ReplayShard.add -> ReplayShard.sample -> FastSAC.update (losses ->
GradSync all-reduce -> optimizer step). Envs and replay are rank-local; parameters are broadcast
from rank 0 at start and after a resume; normaliser statistics (actor and, when the env has
privileged critic observations, critic) and the env's shared state are reduced once per env step
on the device plane. The stop agreement runs every env step on the host plane (one gloo all-reduce
of a CPU flag, no device sync), so a signal is acted on within one env step plus the checkpoint; a
checkpoint taken mid metrics window carries the window, so a resumed run logs the same rows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from hpcrl import checkpoint, rundir
from hpcrl.comm import (DistContext, StopRequest, all_reduce_sum_, barrier, broadcast_, check_parameters_in_sync,
                        hosts, init_distributed, reduce_metrics, shutdown)
from hpcrl.envs import EpisodeStats, first_episode_returns, make_env
from hpcrl.metrics import RunLogger
from hpcrl.replay import ReplayShard

from .agent import FastSAC, UpdateNoise, mirror_batch
from .config import ConfigError, SACConfig
from .normalizer import ObsNormalizer



# Keys of RUN_DIR/config.json that the run resolved (not SACConfig fields): --config skips them, so a
# run's own config.json reruns as written.
RESOLVED_KEYS = frozenset({"world_size", "envs_per_rank", "batch_per_rank", "iterations", "launcher", "hosts"})


class NonFiniteEnvData(RuntimeError):
    """The env returned a NaN/inf reward or observation (``--nonfinite error``); the message (one line)
    names the env, the rank, the vector step, the quantity and the fix. Not a configuration error."""


class RunDirConfigError(ConfigError, rundir.RunDirError):
    """The run directory refused the run (in use by another run, a checkpoint of another run, nothing to
    resume, no usable checkpoint): a ConfigError for the CLI (exit 2), a RunDirError for launchers."""


@contextlib.contextmanager
def _run_dir_errors() -> Iterator[None]:
    try:
        yield
    except rundir.RunDirError as err:
        if isinstance(err, ConfigError):
            raise
        raise RunDirConfigError(str(err)) from None


# SACConfig fields a resume may change: how long it runs, where and how fast, how often it logs,
# checkpoints and checks. Every other field, with the world size, is the run's identity: a
# checkpoint resumes only into the run that wrote it (the first differing field is named).
RESUMABLE_FIELDS = frozenset({"total_env_steps", "run_dir", "resume", "resume_missing", "device", "nproc", "threads",
                              "timeout_s", "grad_sync", "bf16", "amp", "compile", "log_every", "checkpoint_every",
                              "keep_checkpoints", "check_sync_every", "eval_episodes", "eval_every", "preset",
                              "config", "seeds", "nonfinite", "wandb_project", "wandb_mode"})


def run_identity(cfg: SACConfig, world_size: int) -> dict[str, Any]:
    fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name not in RESUMABLE_FIELDS}
    return {"world_size": world_size, "seed": fields.pop("seed"), **fields}


@dataclass(frozen=True)
class Layout:
    """Global sizes split over the ranks."""

    world_size: int
    envs_per_rank: int
    batch_per_rank: int
    iterations: int  # vector-env steps; each collects num_envs transitions globally


def _nearest_multiples(value: int, world: int) -> str:
    low = (value // world) * world
    return ", ".join(str(v) for v in sorted({max(low, world), low + world}))


def plan(cfg: SACConfig, world_size: int) -> Layout:
    cfg.check()  # every field's range first (one line naming the flag)
    """Validate the global sizes against the world size (DESIGN.md, FastSAC contract 2)."""
    for name in ("num_envs", "batch_size", "total_env_steps", "num_updates", "policy_frequency", "buffer_size",
                 "n_step", "log_every"):
        if getattr(cfg, name) < 1:
            raise ConfigError(f"{name}={getattr(cfg, name)} must be >= 1")
    if cfg.num_envs % world_size:
        raise ConfigError(f"num_envs={cfg.num_envs} not divisible by world_size={world_size}; "
                          f"use e.g. --num-envs {_nearest_multiples(cfg.num_envs, world_size)}")
    if cfg.batch_size < world_size:
        raise ConfigError(f"batch_size={cfg.batch_size} < world_size={world_size}: every rank needs at least "
                          f"one sample per update; use --batch-size {world_size} or more")
    if cfg.batch_size % world_size:
        raise ConfigError(f"batch_size={cfg.batch_size} not divisible by world_size={world_size}; "
                          f"use e.g. --batch-size {_nearest_multiples(cfg.batch_size, world_size)}")
    if cfg.checkpoint_every and cfg.checkpoint_every % cfg.log_every:
        raise ConfigError(f"checkpoint_every={cfg.checkpoint_every} must be a multiple of log_every={cfg.log_every} "
                          "(a checkpoint lands on a metrics row so a resume repeats no partial window)")
    if cfg.n_step > cfg.buffer_size:
        raise ConfigError(f"n_step={cfg.n_step} exceeds buffer_size={cfg.buffer_size}")
    return Layout(world_size, cfg.num_envs // world_size, cfg.batch_size // world_size,
                  math.ceil(cfg.total_env_steps / cfg.num_envs))


def train(cfg: SACConfig) -> dict[str, float]:
    """Run (or resume) one rank of a FastSAC job; returns the final metrics row (all ranks)."""
    stop = StopRequest.install()  # first: a USR2 during start-up must stop cleanly too, not kill the rank
    cfg.check()  # before anything starts: a bad --threads or --device would fail less clearly below
    torch.set_num_threads(cfg.threads)
    ctx = init_distributed(timeout_s=cfg.timeout_s, device=cfg.device)
    layout = plan(cfg, ctx.world_size)
    with _run_dir_errors():  # before any rank touches the run dir; refused: exit 2 on every rank
        lock = rundir.claim(cfg.run_dir, ctx)  # rank 0 holds it for the life of the run
    try:
        return _train(cfg, stop, ctx, layout)
    finally:
        lock.release()


def _train(cfg: SACConfig, stop: StopRequest, ctx: DistContext, layout: Layout) -> dict[str, float]:
    device = ctx.device
    rank, world = ctx.rank, ctx.world_size
    # Planes (hpcrl.comm.planes): gradients, parameters, normaliser statistics and checksums on the
    # device plane; metrics rows and the stop agreement on the host plane.
    data, control = ctx.device_plane, ctx.host_plane

    def sync_barrier(name: str) -> None:
        barrier(ctx, name)

    def reduce_sum(t: torch.Tensor) -> None:
        all_reduce_sum_([t], data)

    # Model init identical on every rank (then broadcast anyway); env and sampling streams per rank.
    torch.manual_seed(cfg.seed)
    env_seed = cfg.seed + rank * layout.envs_per_rank
    try:
        # gymnasium seeds sub-env i with seed + i: space the ranks so their streams never overlap.
        env = make_env(cfg.env, layout.envs_per_rank, device=device, seed=env_seed)
    except ValueError as err:  # unknown env name or bad size: a config problem, not a crash
        raise ConfigError(str(err)) from None
    if env.num_actions is not None:
        raise ConfigError(f"env {cfg.env!r} has discrete actions; FastSAC needs a continuous action space")
    if cfg.symmetry and not env.has_symmetry:
        raise ConfigError(f"--symmetry: env {cfg.env!r} has no mirror maps (mirror_obs/mirror_action"
                          f"{'/mirror_critic_obs' if env.critic_obs_dim else ''}); drop --symmetry")
    cdim = env.critic_obs_dim
    agent = FastSAC(cfg, env.obs_dim, env.action_dim, env.action_low, env.action_high, device, plane=data,
                    critic_obs_dim=cdim)
    normalizer = ObsNormalizer(env.obs_dim, enabled=cfg.obs_normalization).to(device)
    # The critic's own normaliser over the privileged observations (None: the critic reads the actor's).
    critic_normalizer = ObsNormalizer(cdim, enabled=cfg.obs_normalization).to(device) if cdim else None
    if cfg.compile:
        agent.actor.compile()
        agent.critic.compile()
        agent.critic_target.compile()
    replay = ReplayShard(layout.envs_per_rank, cfg.buffer_size, env.obs_dim, env.action_dim, cfg.n_step,
                         cfg.gamma, device, critic_obs_dim=cdim or 0)
    generator = torch.Generator(device).manual_seed(cfg.seed * 1_000_003 + rank)
    stats = EpisodeStats(layout.envs_per_rank, device)
    obs = env.reset(seed=env_seed)
    critic_obs = env.observe_critic() if cdim else None
    low, high = env.action_low, env.action_high

    run_dir = Path(cfg.run_dir)
    resumed = _resume(cfg, ctx) if cfg.resume else None
    resume_from = resumed.path if resumed is not None else None
    if resumed is not None:
        learner, mine = resumed.learner, resumed.rank_state
        agent.load_learner_state(learner["agent"])
        normalizer.load_state_dict(learner["normalizer"])
        if critic_normalizer is not None:
            critic_normalizer.load_state_dict(learner["critic_normalizer"])
        replay.load_state_dict(mine["replay"])
        env.load_state_dict(mine["env"])
        if mine.get("shared_state"):
            env.load_shared_state({k: v.to(device) for k, v in mine["shared_state"].items()})
        stats.load_state_dict(mine["episode_stats"])
        generator.set_state(mine["generator"])
        obs = mine["obs"].to(device)
        if cdim:
            critic_obs = mine["critic_obs"].to(device)
    elif rank == 0 and (removed := checkpoint.clear(run_dir)):  # a fresh start: the run dir is this run's now
        print(f"hpcrl.sac: fresh start in {run_dir}: removed {len(removed)} checkpoint(s) of the run that used it "
              f"before (newest {removed[0].name}); pass --resume to continue a run instead", flush=True)
    norm_buffers = [normalizer.count, normalizer.mean, normalizer.m2]
    if critic_normalizer is not None:
        norm_buffers += [critic_normalizer.count, critic_normalizer.mean, critic_normalizer.m2]
    broadcast_([t.data for t in agent.broadcast_tensors()] + norm_buffers, data)

    if rank == 0:
        resolved = {**dataclasses.asdict(cfg), "world_size": world, "envs_per_rank": layout.envs_per_rank,
                    "batch_per_rank": layout.batch_per_rank, "iterations": layout.iterations,
                    "launcher": ctx.source, "hosts": hosts(ctx)}
        rundir.write_text(run_dir / "config.json", json.dumps(resolved, indent=2))
        print(f"hpcrl.sac: {world} rank(s) via {ctx.source}, device {device}; global num_envs={cfg.num_envs} "
              f"({layout.envs_per_rank}/rank), global batch={cfg.batch_size} ({layout.batch_per_rank}/rank), "
              f"{layout.iterations} env steps x {cfg.num_envs} envs = {layout.iterations * cfg.num_envs} "
              f"transitions" + (f"; resuming from {resume_from}" if resume_from else ""), flush=True)
    start_iter = agent.counters.iteration
    best = float(resumed.learner.get("best_eval_return", -math.inf)) if resumed is not None and rank == 0 \
        else -math.inf  # rank 0's: only it writes best/
    if start_iter >= layout.iterations:  # a finished run resumed as is
        if rank == 0:
            print(f"hpcrl.sac: {run_dir} already finished ({start_iter * cfg.num_envs} of "
                  f"{layout.iterations * cfg.num_envs} transitions); nothing left to do (raise --total-env-steps "
                  "to train longer)", flush=True)
        shutdown()
        return {}
    logger = RunLogger(run_dir, rank == 0, layout.iterations * cfg.num_envs,
                       resume_env_steps=start_iter * cfg.num_envs if resume_from else 0,
                       wandb_project=cfg.wandb_project or None, wandb_mode=cfg.wandb_mode,
                       wandb_config=dataclasses.asdict(cfg))
    eval_envs = max(1, cfg.eval_episodes)

    def snapshot(kind: str, eval_return: float | None) -> Path:
        from .policy import Policy, save_policy  # rank 0 only, at evals and the end

        path = rundir.make_dir(run_dir / kind) / "policy.pt"
        meta = {"env": cfg.env, "env_steps": agent.counters.iteration * cfg.num_envs, "eval_return": eval_return,
                "seed": cfg.seed, "kind": kind}
        save_policy(path, Policy.from_agent(agent, normalizer), meta)
        return path

    def keep_if_best(eval_return: float) -> None:
        nonlocal best
        if rank == 0 and math.isfinite(eval_return) and eval_return > best:
            best = eval_return
            snapshot("best", eval_return)

    window: dict[str, list[torch.Tensor]] = {}
    window_start = time.time()
    window_iters = 0
    dropped = 0  # transitions with non-finite data replaced in this window (--nonfinite skip)
    if resumed is not None and "window" in mine:  # a checkpoint taken mid-window (a stop): continue it
        window = {k: list(v.to(device).unbind(0)) for k, v in mine["window"].items()}
        window_iters, dropped = int(mine["window_iters"]), int(mine["dropped"])

    def save() -> None:
        extra = {"critic_obs": critic_obs, "shared_state": env.shared_state(),
                 "window": {k: torch.stack(v) for k, v in window.items() if v},
                 "window_iters": window_iters, "dropped": dropped}
        _save(cfg, ctx, agent, normalizer, replay, env, stats, generator, obs, sync_barrier, best,
              critic_normalizer=critic_normalizer, extra=extra)

    row: dict[str, float] = {}
    for it in range(start_iter, layout.iterations):
        normalizer.update(obs, reduce_sum if ctx.is_distributed else None)
        if critic_normalizer is not None:
            critic_normalizer.update(critic_obs, reduce_sum if ctx.is_distributed else None)
        if it < cfg.random_steps:
            action = low + (high - low) * torch.rand(obs.shape[0], env.action_dim, generator=generator,
                                                     device=device)
        else:
            action = agent.actor.act(normalizer(obs), generator)
        result = env.step(action)
        # One reduction and one host read per step: a NaN/inf anywhere in reward, next_obs or obs makes
        # its env's sum non-finite (so does a float overflow, which is unusable data too). The read
        # lands just before replay.add's own host sync (the finished-episode count), which then
        # finds the queue drained.
        total = result.reward + result.next_obs.sum(-1) + result.obs.sum(-1)
        if cdim:
            total = total + result.critic_obs.sum(-1) + result.next_critic_obs.sum(-1)
        bad = int((~torch.isfinite(total)).sum())
        fault = bad and cfg.nonfinite == "error"
        if fault:
            message = _nonfinite_message(cfg, rank, it + 1, result, bad)
            if not ctx.is_distributed:
                raise NonFiniteEnvData(message)
            # The other ranks are about to enter this step's collectives: post the message, finish the
            # step on sanitized data, and stop together at the step's agreement below.
            ctx.store.set(_NONFINITE_KEY.format(rank=rank), message)
        if bad:
            result, next_obs_for_policy = _sanitize(result, obs, critic_obs)
            dropped += 0 if fault else bad
        else:
            next_obs_for_policy = result.obs
        replay.add(obs, action, result.reward * cfg.reward_scale, result.next_obs, result.terminated,
                   result.truncated, critic_obs=result.critic_obs if cdim else None,
                   next_critic_obs=result.next_critic_obs if cdim else None)
        stats.update(result)
        obs = next_obs_for_policy
        if cdim:
            critic_obs = result.critic_obs
        shared = env.shared_state()
        if shared:  # episode-weighted mean over ranks, on the device plane, every env step
            env.load_shared_state(reduce_shared_state(shared, result.done.sum(),
                                                      reduce_sum if ctx.is_distributed else None))

        if it >= cfg.learning_starts:
            for _ in range(cfg.num_updates):
                batch = replay.sample(layout.batch_per_rank, generator)
                if cfg.symmetry:  # [sampled; mirrored]: 2 x batch_per_rank rows (raw obs are mirrored)
                    batch = mirror_batch(batch, env.mirror_obs, env.mirror_action,
                                         env.mirror_critic_obs if cdim else None)
                batch = batch._replace(obs=normalizer(batch.obs), next_obs=normalizer(batch.next_obs))
                if critic_normalizer is not None:
                    batch = batch._replace(critic_obs=critic_normalizer(batch.critic_obs),
                                           next_critic_obs=critic_normalizer(batch.next_critic_obs))
                noise = UpdateNoise.draw(batch.obs.shape[0], env.action_dim, generator, device)
                for key, value in agent.update(batch, noise).items():
                    window.setdefault(key, []).append(value)
                if cfg.check_sync_every and agent.counters.critic_steps % cfg.check_sync_every == 0:
                    check_parameters_in_sync(
                        [(f"actor.{n}", p) for n, p in agent.actor.named_parameters()]
                        + [(f"critic.{n}", p) for n, p in agent.critic.named_parameters()]
                        + [("log_alpha", agent.log_alpha)], data)
        agent.counters.iteration = it + 1
        window_iters += 1

        last = it + 1 == layout.iterations
        if (it + 1) % cfg.log_every == 0 or last:
            row = _log_row(agent, stats, window, window_iters, time.time() - window_start, cfg, ctx,
                           dropped if cfg.nonfinite == "skip" else None)
            logger.log(row)
            window, window_iters, window_start, dropped = {}, 0, time.time(), 0
            if cfg.eval_every and (it + 1) % cfg.eval_every == 0 and not last:
                eval_return = evaluate(cfg, agent, normalizer, device, ctx, episodes=eval_envs)["eval_return"]
                logger.log(_eval_row(agent, cfg, eval_return))
                keep_if_best(eval_return)
        if cfg.checkpoint_every and (it + 1) % cfg.checkpoint_every == 0 and not last:
            save()
        # Every env step: one gloo all-reduce of a CPU flag on the host plane (no device sync); its cost
        # per step is in the README (measured at 2 ranks). A stop mid-window checkpoints the window too.
        stopping = stop.agreed(control, fault=bool(fault)) if ctx.is_distributed or not last else False
        if stop.faults:  # every rank raises the same message (the lowest faulty rank's)
            raise NonFiniteEnvData(_posted_nonfinite(ctx))
        if not last and stopping:
            if not (cfg.checkpoint_every and (it + 1) % cfg.checkpoint_every == 0):
                save()
            if rank == 0:
                print(f"hpcrl.sac: stop requested ({stop.reason}); checkpoint at env step "
                      f"{agent.counters.iteration * cfg.num_envs} written, resume with --resume", flush=True)
            logger.close()
            shutdown()
            return {**row, "preempted": 1.0}

    final_eval = None
    if cfg.eval_episodes or cfg.eval_every:  # the last eval (of --eval-every too) runs at the end
        final_eval = evaluate(cfg, agent, normalizer, device, ctx, episodes=eval_envs)["eval_return"]
        row.update(eval_return=final_eval)
        logger.log(_eval_row(agent, cfg, final_eval))
        keep_if_best(final_eval)
    save()  # always: the end of the run is resumable (a longer --total-env-steps) and exportable
    if rank == 0:
        final = snapshot("final", final_eval)
        logger.finish({"eval_return": final_eval, "best_eval_return": best if math.isfinite(best) else None},
                      {"checkpoint": checkpoint.latest(run_dir, report=False), "policy": final})
    logger.close()
    shutdown()  # rank 0 usually hosts the rendezvous store: it leaves only after every peer is done
    return row


def _eval_row(agent: FastSAC, cfg: SACConfig, eval_return: float) -> dict[str, float]:
    """An eval row: its own line in metrics.jsonl (``eval_return`` at this ``env_steps``; transitions)."""
    return {"env_steps": agent.counters.iteration * cfg.num_envs, "updates": agent.counters.critic_steps,
            "eval_return": round(eval_return, 6)}


_NONFINITE_KEY = "sac/nonfinite/{rank}"


def _posted_nonfinite(ctx: DistContext) -> str:
    """The message the lowest rank that found non-finite env data posted before the agreement."""
    for r in range(ctx.world_size):
        key = _NONFINITE_KEY.format(rank=r)
        if ctx.store.check([key]):
            return ctx.store.get(key).decode(errors="replace")[:2000]
    return "another rank found non-finite env data (its message did not reach the store)"


def _nonfinite_message(cfg: SACConfig, rank: int, step: int, result: Any, bad: int) -> str:
    # The error path only: find what was non-finite (host syncs do not matter any more).
    parts = []
    for name, t in (("reward", result.reward), ("next observation", result.next_obs), ("observation", result.obs)):
        finite = torch.isfinite(t) if t.dim() == 1 else torch.isfinite(t).all(-1)
        if not bool(finite.all()):
            idx = int((~finite).nonzero()[0, 0])
            value = t[idx] if t.dim() == 1 else t[idx][~torch.isfinite(t[idx])][0]
            parts.append(f"{name} ({float(value)} in env {idx} of the rank)")
    what = ", ".join(parts) or "sum of reward and observations (overflow)"
    return (f"env {cfg.env!r} returned a non-finite {what} on rank {rank} at vector step {step} "
            f"({bad} env(s) affected); fix the env, or pass --nonfinite skip to replace such transitions and count "
            "them (nonfinite_dropped)")


def _sanitize(result: Any, obs: torch.Tensor, critic_obs: torch.Tensor | None = None) -> tuple[Any, torch.Tensor]:
    """--nonfinite skip: the affected envs' transition becomes "nothing happened" (reward 0, the next
    observation is the one it acted on), so no NaN reaches the replay, the normaliser or the episode
    stats; returns (result, the observation to act on next). Critic observations alike."""
    reward_ok = torch.isfinite(result.reward)
    next_ok = torch.isfinite(result.next_obs).all(-1, keepdim=True)
    obs_ok = torch.isfinite(result.obs).all(-1, keepdim=True)
    reward = torch.where(reward_ok & next_ok.squeeze(-1), result.reward, torch.zeros_like(result.reward))
    fixed = dataclasses.replace(result, reward=reward, next_obs=torch.where(next_ok, result.next_obs, obs),
                                obs=torch.where(obs_ok, result.obs, obs))
    if critic_obs is not None:
        c_next_ok = torch.isfinite(result.next_critic_obs).all(-1, keepdim=True)
        c_ok = torch.isfinite(result.critic_obs).all(-1, keepdim=True)
        fixed = dataclasses.replace(
            fixed, reward=torch.where(c_next_ok.squeeze(-1), fixed.reward, torch.zeros_like(fixed.reward)),
            next_critic_obs=torch.where(c_next_ok, result.next_critic_obs, critic_obs),
            critic_obs=torch.where(c_ok, result.critic_obs, critic_obs))
    return fixed, fixed.obs


def reduce_shared_state(state: dict[str, torch.Tensor], episodes: torch.Tensor,
                        all_reduce_sum: Any = None) -> dict[str, torch.Tensor]:
    """The episode-weighted mean of every rank's env shared state: sum_r w_r v_r / sum_r w_r with w_r the
    episodes rank r finished this step, or the plain mean over ranks when no rank finished one. One
    collective (``all_reduce_sum``, the device plane; None = one process), no host sync."""
    keys = sorted(state)
    flat = torch.cat([state[k].detach().reshape(-1).to(torch.float64) for k in keys])
    w = episodes.detach().to(torch.float64).reshape(1)
    packed = torch.cat([flat * w, flat, w, torch.ones_like(w)])
    if all_reduce_sum is not None:
        all_reduce_sum(packed)
    n = flat.numel()
    wsum, ranks = packed[2 * n], packed[2 * n + 1]
    mean = torch.where(wsum > 0, packed[:n] / wsum.clamp(min=1e-300), packed[n:2 * n] / ranks)
    out, i = {}, 0
    for k in keys:
        v = state[k]
        out[k] = mean[i:i + v.numel()].reshape(v.shape).to(v.dtype)
        i += v.numel()
    return out


def _log_row(agent: FastSAC, stats: EpisodeStats, window: dict[str, list[torch.Tensor]], iters: int,
             seconds: float, cfg: SACConfig, ctx: DistContext, dropped: int | None = None) -> dict[str, float]:
    episodes = stats.pop()
    count = episodes.count
    metrics = {key: torch.stack(values).float().mean() for key, values in window.items() if values}
    for key in ("critic_loss", "actor_loss", "alpha_loss", "entropy"):
        metrics.setdefault(key, torch.tensor(float("nan")))
    metrics["episode_return"] = episodes.return_sum / count.clamp(min=1)  # raw env rewards
    metrics["episode_length"] = episodes.length_sum / count.clamp(min=1)
    metrics["alpha"] = agent.alpha
    weights = {"episode_return": count, "episode_length": count}
    if dropped is not None:  # --nonfinite skip: transitions replaced in this window, summed over ranks
        metrics["nonfinite_dropped"] = float(dropped)
    out = reduce_metrics(metrics, ctx.host_plane, weights=weights,
                         sums=("nonfinite_dropped",) if dropped is not None else ())
    if "nonfinite_dropped" in out:
        out["nonfinite_dropped"] = int(out["nonfinite_dropped"])
    env_steps = agent.counters.iteration * cfg.num_envs
    return {"env_steps": env_steps, "updates": agent.counters.critic_steps,
            "actor_updates": agent.counters.actor_steps, **{k: round(v, 6) for k, v in sorted(out.items())},
            "sps": round(iters * cfg.num_envs / max(seconds, 1e-9), 1)}


def _resume(cfg: SACConfig, ctx: DistContext) -> checkpoint.Restored | None:
    """The newest checkpoint every rank can load (collective); None only with ``--resume-missing fresh``."""
    with _run_dir_errors():
        found = checkpoint.restore(cfg.run_dir, ctx.rank, ctx.world_size, ctx.device,
                                   identity=run_identity(cfg, ctx.world_size), agree=checkpoint.store_agree(ctx))
        if found is None:
            checkpoint.fresh_or_refuse(cfg.run_dir, cfg.resume_missing, ctx.rank == 0, "hpcrl.sac")
        return found


def _save(cfg, ctx, agent, normalizer, replay, env, stats, generator, obs, sync_barrier, best=-math.inf, *,
          critic_normalizer=None, extra=None) -> None:
    # best_eval_return: what a resumed run's best/ must beat (rank 0's learner state; -inf = no eval yet)
    learner = ({"agent": agent.learner_state(), "normalizer": normalizer.state_dict(), "best_eval_return": best}
               if ctx.rank == 0 else None)
    if learner is not None and critic_normalizer is not None:
        learner["critic_normalizer"] = critic_normalizer.state_dict()
    rank_state = {"replay": replay.state_dict(), "env": env.state_dict(), "episode_stats": stats.state_dict(),
                  "generator": generator.get_state(), "obs": obs,
                  **{k: v for k, v in (extra or {}).items() if v is not None}}
    checkpoint.save(cfg.run_dir, agent.counters.iteration, ctx.rank, ctx.world_size, learner, rank_state,
                    sync_barrier, keep=cfg.keep_checkpoints, identity=run_identity(cfg, ctx.world_size))


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
