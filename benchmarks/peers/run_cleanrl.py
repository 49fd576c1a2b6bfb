#!/usr/bin/env python
"""Run an unmodified SAC script of the CleanRL family and evaluate it on the way: CleanRL's
``sac_continuous_action.py`` or LeanRL's compiled fork of it (``sac_continuous_action_torchcompile.py``).

    .venv-peers/bin/python benchmarks/peers/run_cleanrl.py [--peer cleanrl|leanrl] --src DIR --out CURVE.json
        --eval-every N --eval-episodes E [--threads T] -- --env-id HalfCheetah-v4 --total-timesteps N --no-cuda --seed K

Runs in the peer venv (gymnasium 0.29.1, numpy<2), not the main one: it imports nothing of hpcrl. ``DIR`` is
the peer's source as benchmarks/peers/sources.py located and checked it (the caller's job).
The script is run with ``runpy.run_path`` as ``__main__`` with its own command line (the flags after
``--``). Its logger is hooked, not the script (CleanRL: the TensorBoard writer's ``add_scalar`` and ``close``;
LeanRL: ``wandb.log``, W&B disabled, and the vector env's ``close``): when the script logs at a
``global_step`` that crosses an eval point (every ``--eval-every`` env steps), the hook takes the
script's ``actor`` from the calling frame's globals and evaluates it; the end of the run gives the last eval.
The evaluation is the benchmark's protocol for every system: the deterministic
policy (tanh(mean) scaled to the action box, the script's own third output of ``get_action``, computed
without its random draw so training's random streams are untouched) on ``E`` fresh envs, one episode
each. The training clock starts at the script's env reset before its loop and stops while an eval runs;
``clock_start_unix`` (the epoch time of that reset) lets the caller add the time from its launch.

``--pace K --pace-from S`` is the timing mode benchmarks/sac/sac_ladder.py interleaves with its rungs: from env
step ``S`` on, the script's ``envs.step`` waits for a line on stdin before every ``K`` loop iterations and, after
them, prints ``[pace] {"steps": K, "wall_s": ..., "cpu_s": ..., "env_s": ...}`` (wall and process CPU seconds of
those iterations, and the wall of their env steps alone); end of stdin ends the process.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: its peers' pins (standard library)
from benchmarks.peers.sources import PEERS  # noqa: E402
EVAL_SEED = 10_000  # eval envs' seeds: EVAL_SEED + seed + i, away from the training env's seed


@dataclass
class Clock:
    """Wall seconds since the script's first env reset, less the time spent evaluating."""

    start: float | None = None
    start_unix: float | None = None
    paused: float = 0.0

    def begin(self) -> None:
        if self.start is None:
            self.start, self.start_unix = time.perf_counter(), time.time()

    def seconds(self) -> float:
        return time.perf_counter() - (self.start or time.perf_counter()) - self.paused


@dataclass
class Curve:
    eval_every: int
    episodes: int
    env_id: str
    seed: int
    clock: Clock = field(default_factory=Clock)
    points: list[dict] = field(default_factory=list)

    def next_point(self) -> int:
        return (self.points[-1]["env_steps"] if self.points else 0) + self.eval_every


def evaluate(actor, env_id: str, episodes: int, seed: int) -> list[float]:
    """One episode on each of ``episodes`` fresh envs, stepped together, deterministic actions."""
    import gymnasium as gym
    import numpy as np
    import torch

    envs = [gym.make(env_id) for _ in range(episodes)]
    obs = [env.reset(seed=EVAL_SEED + seed + i)[0] for i, env in enumerate(envs)]
    returns, live = [0.0] * episodes, list(range(episodes))
    device = next(actor.parameters()).device
    with torch.no_grad():
        while live:
            x = torch.as_tensor(np.stack([obs[i] for i in live]), dtype=torch.float32, device=device)
            mean, _ = actor(x)
            act = (torch.tanh(mean) * actor.action_scale + actor.action_bias).cpu().numpy()
            still = []
            for i, a in zip(live, act):
                obs[i], r, term, trunc, _ = envs[i].step(a)
                returns[i] += float(r)
                if not (term or trunc):
                    still.append(i)
            live = still
    for env in envs:
        env.close()
    return returns


def eval_at(curve: Curve, actor, env_steps: int, point: int) -> None:
    """Evaluate now (``env_steps`` taken), clock paused, and record it as eval point ``point``."""
    wall = curve.clock.seconds()
    t0 = time.perf_counter()
    returns = evaluate(actor, curve.env_id, curve.episodes, curve.seed)
    eval_s = time.perf_counter() - t0
    curve.clock.paused += eval_s
    curve.points.append({"env_steps": point, "env_steps_actual": env_steps, "wall_s": round(wall, 3),
                         "eval_return": round(sum(returns) / len(returns), 3),
                         "episode_returns": [round(r, 3) for r in returns], "eval_s": round(eval_s, 3)})
    print(f"[run_cleanrl] eval at {env_steps} env steps: {curve.points[-1]['eval_return']:.1f} "
          f"({wall:.1f} s training wall)", flush=True)


def crossed(curve: Curve, global_step, frame_globals: dict) -> None:
    """A log at ``global_step`` (0-based: ``global_step + 1`` env steps taken): evaluate if it crossed a point."""
    if global_step is not None and int(global_step) + 1 >= curve.next_point():
        actor = frame_globals.get("actor")
        if actor is not None:
            steps = int(global_step) + 1  # the last point crossed (a log may skip one)
            eval_at(curve, actor, steps, steps // curve.eval_every * curve.eval_every)


def at_end(curve: Curve, frame_globals: dict) -> None:
    """The script is closing its logger or envs: the last eval, at the budget, if not taken yet."""
    total = int(frame_globals["args"].total_timesteps) if "args" in frame_globals else None
    done = curve.points[-1]["env_steps_actual"] if curve.points else 0
    if frame_globals.get("actor") is not None and total and done < total:
        eval_at(curve, frame_globals["actor"], total, total)


@dataclass
class Pace:
    """The timing mode (module doc): segments of ``every`` loop iterations from env step ``start`` on, each
    begun by a line on stdin and reported on stdout."""

    every: int
    start: int
    calls: int = 0
    segment: tuple[float, float] | None = None  # (wall, process CPU) at the segment's start
    env_s: float = 0.0

    def before_step(self) -> None:
        """Called as the script steps its envs: the loop's iteration ``calls`` begins."""
        done = self.calls - self.start
        self.calls += 1
        if done < 0 or done % self.every:
            return
        if self.segment is not None:
            wall, cpu = time.perf_counter() - self.segment[0], time.process_time() - self.segment[1]
            print("[pace] " + json.dumps({"steps": self.every, "wall_s": wall, "cpu_s": cpu, "env_s": self.env_s}),
                  flush=True)
        if not sys.stdin.readline():  # the caller is done: leave without the rest of the run
            sys.stdout.flush()
            os._exit(0)
        self.segment, self.env_s = (time.perf_counter(), time.process_time()), 0.0


def install_pace(pace: Pace) -> None:
    import gymnasium as gym

    step = gym.vector.SyncVectorEnv.step

    def paced_step(self, *args, **kwargs):
        pace.before_step()
        t0 = time.perf_counter()
        out = step(self, *args, **kwargs)
        pace.env_s += time.perf_counter() - t0
        return out

    gym.vector.SyncVectorEnv.step = paced_step


def install_hooks(curve: Curve, peer: str) -> None:
    """Wrap the vector env's reset (clock start) and the peer's logger (eval points, last eval)."""
    import gymnasium as gym

    reset = gym.vector.SyncVectorEnv.reset

    def hooked_reset(self, *args, **kwargs):
        # the script's reset right before its loop, after building envs and networks (where its own
        # start_time is taken, and where hpcrl's clock starts too); the eval envs are not vector envs
        curve.clock.begin()
        return reset(self, *args, **kwargs)

    gym.vector.SyncVectorEnv.reset = hooked_reset
    if peer == "leanrl":
        os.environ["WANDB_MODE"] = "disabled"  # its wandb.init and wandb.log stay calls, nothing is sent or written
        import wandb

        init, close = wandb.init, gym.vector.SyncVectorEnv.close

        def hooked_init(*args, **kwargs):
            run = init(*args, **kwargs)
            log = wandb.log  # init sets the module's log to its run's: wrap that one

            def hooked_log(data, step=None, *args, **kwargs):
                out = log(data, step, *args, **kwargs)
                crossed(curve, step, sys._getframe(1).f_globals)
                return out

            wandb.log = hooked_log
            return run

        def hooked_close(self, *args, **kwargs):
            at_end(curve, sys._getframe(1).f_globals)
            return close(self, *args, **kwargs)

        wandb.init, gym.vector.SyncVectorEnv.close = hooked_init, hooked_close
        return
    from torch.utils.tensorboard import SummaryWriter

    add_scalar, close = SummaryWriter.add_scalar, SummaryWriter.close

    def hooked_add_scalar(self, tag, scalar_value, global_step=None, *args, **kwargs):
        out = add_scalar(self, tag, scalar_value, global_step, *args, **kwargs)
        crossed(curve, global_step, sys._getframe(1).f_globals)
        return out

    def hooked_writer_close(self):
        at_end(curve, sys._getframe(1).f_globals)
        close(self)

    SummaryWriter.add_scalar, SummaryWriter.close = hooked_add_scalar, hooked_writer_close


def versions(peer: str) -> dict[str, str]:
    import platform
    from importlib.metadata import version

    names = ["torch", "gymnasium", "mujoco", "numpy"] + (["tensordict", "torchrl"] if peer == "leanrl" else [])
    return {"python": platform.python_version(), **{name: version(name) for name in names}}


def script_flag(argv: list[str], name: str, default: str) -> str:
    return argv[argv.index(name) + 1] if name in argv[:-1] else default


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--peer", choices=sorted(PEERS), default="cleanrl")
    p.add_argument("--src", required=True, help="the peer's source folder (checked by the caller)")
    p.add_argument("--out", required=True, help="the curve's JSON")
    p.add_argument("--eval-every", type=int, required=True, help="env steps between evals")
    p.add_argument("--eval-episodes", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (set before the script runs)")
    p.add_argument("--workdir", default=".", help="the script's cwd (CleanRL's runs/ TensorBoard folder goes there)")
    p.add_argument("--pace", type=int, default=0, help="timing mode: segments of this many loop iterations, each "
                   "started by a line on stdin and reported on stdout (module doc)")
    p.add_argument("--pace-from", type=int, default=0, help="with --pace: the env step the first segment starts at")
    args, rest = p.parse_known_args()
    script_argv = rest[1:] if rest[:1] == ["--"] else rest
    import torch

    torch.set_num_threads(args.threads)
    # the scripts' own defaults where the caller gives no --env-id / --seed
    curve = Curve(args.eval_every, args.eval_episodes,
                  script_flag(script_argv, "--env-id", "Hopper-v4" if args.peer == "cleanrl" else "HalfCheetah-v4"),
                  int(script_flag(script_argv, "--seed", "1")))
    install_hooks(curve, args.peer)
    if args.pace > 0:
        install_pace(Pace(args.pace, args.pace_from))
    out = Path(args.out).resolve()
    src = Path(args.src).resolve()
    script = src / PEERS[args.peer].script
    sys.path.insert(0, str(src))  # CleanRL's `from cleanrl_utils.buffers import ...`
    sys.argv = [str(script), *script_argv]
    os.makedirs(args.workdir, exist_ok=True)
    os.chdir(args.workdir)
    runpy.run_path(str(script), run_name="__main__")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"peer": args.peer, "env_id": curve.env_id, "seed": curve.seed,
                               "script_argv": script_argv, "threads": args.threads, "eval_every": args.eval_every,
                               "eval_episodes": args.eval_episodes, "versions": versions(args.peer),
                               "clock_start_unix": curve.clock.start_unix, "points": curve.points}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
