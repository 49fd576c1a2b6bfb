#!/usr/bin/env python
"""Run CleanRL's unmodified ``sac_continuous_action.py`` and evaluate it on the way.

    .venv-peers/bin/python benchmarks/peers/run_cleanrl.py --cleanrl-src DIR --out CURVE.json --eval-every N
        --eval-episodes E [--threads T] -- --env-id HalfCheetah-v4 --total-timesteps N --no-cuda --seed K

Runs in the peer venv (gymnasium 0.29.1, numpy<2), not the main one: it imports nothing of hpcrl. ``DIR`` is
CleanRL's source as benchmarks/peers/cleanrl_source.py located and checked it (the caller's job).
The script is run with ``runpy.run_path`` as ``__main__`` with its own command line (the flags after
``--``). Its TensorBoard writer is hooked, not the script: when the script logs a scalar at a
``global_step`` that crosses an eval point (every ``--eval-every`` env steps), the hook takes the
script's ``actor`` from the calling frame's globals and evaluates it; ``writer.close()`` at the end
gives the last eval. The evaluation is the benchmark's protocol for every system: the deterministic
policy (tanh(mean) scaled to the action box, the script's own third output of ``get_action``, computed
without its random draw so training's random streams are untouched) on ``E`` fresh envs, one episode
each. The wall clock starts at the script's env reset before its loop and stops while an eval runs.
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

SCRIPT = "cleanrl/sac_continuous_action.py"  # in the source folder
EVAL_SEED = 10_000  # eval envs' seeds: EVAL_SEED + seed + i, away from the training env's seed


@dataclass
class Clock:
    """Wall seconds since the script's first env reset, less the time spent evaluating."""

    start: float | None = None
    paused: float = 0.0

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


def install_hooks(curve: Curve) -> None:
    """Wrap the vector env's reset (clock start) and SummaryWriter's add_scalar (eval points) and close
    (last eval)."""
    import gymnasium as gym
    from torch.utils.tensorboard import SummaryWriter

    reset, add_scalar, close = gym.vector.SyncVectorEnv.reset, SummaryWriter.add_scalar, SummaryWriter.close

    def hooked_reset(self, *args, **kwargs):
        # the script's reset right before its loop, after building envs and networks (where its own
        # start_time is taken, and where hpcrl's clock starts too); the eval envs are not vector envs
        if curve.clock.start is None:
            curve.clock.start = time.perf_counter()
        return reset(self, *args, **kwargs)

    def hooked_add_scalar(self, tag, scalar_value, global_step=None, *args, **kwargs):
        out = add_scalar(self, tag, scalar_value, global_step, *args, **kwargs)
        # global_step is 0-based: at the log of step k, k + 1 env steps have been taken
        if global_step is not None and int(global_step) + 1 >= curve.next_point():
            actor = sys._getframe(1).f_globals.get("actor")
            if actor is not None:
                steps = int(global_step) + 1  # the last point crossed (a log may skip one)
                eval_at(curve, actor, steps, steps // curve.eval_every * curve.eval_every)
        return out

    def hooked_close(self):
        g = sys._getframe(1).f_globals
        total = int(g["args"].total_timesteps) if "args" in g else None
        done = curve.points[-1]["env_steps_actual"] if curve.points else 0
        if g.get("actor") is not None and total and done < total:
            eval_at(curve, g["actor"], total, total)
        close(self)

    gym.vector.SyncVectorEnv.reset = hooked_reset
    SummaryWriter.add_scalar, SummaryWriter.close = hooked_add_scalar, hooked_close


def versions() -> dict[str, str]:
    import platform

    import gymnasium
    import mujoco
    import numpy
    import torch

    return {"python": platform.python_version(), "torch": torch.__version__, "gymnasium": gymnasium.__version__,
            "mujoco": mujoco.__version__, "numpy": numpy.__version__}


def script_flag(argv: list[str], name: str, default: str) -> str:
    return argv[argv.index(name) + 1] if name in argv[:-1] else default


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cleanrl-src", required=True, help="CleanRL's source folder (checked by the caller)")
    p.add_argument("--out", required=True, help="the curve's JSON")
    p.add_argument("--eval-every", type=int, required=True, help="env steps between evals")
    p.add_argument("--eval-episodes", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (set before the script runs)")
    p.add_argument("--workdir", default=".", help="the script's cwd (its runs/ TensorBoard folder goes there)")
    args, rest = p.parse_known_args()
    script_argv = rest[1:] if rest[:1] == ["--"] else rest
    import torch

    torch.set_num_threads(args.threads)
    curve = Curve(args.eval_every, args.eval_episodes, script_flag(script_argv, "--env-id", "Hopper-v4"),
                  int(script_flag(script_argv, "--seed", "1")))
    install_hooks(curve)
    out = Path(args.out).resolve()
    src = Path(args.cleanrl_src).resolve()
    script = src / SCRIPT
    sys.path.insert(0, str(src))  # the script's `from cleanrl_utils.buffers import ...`
    sys.argv = [str(script), *script_argv]
    os.makedirs(args.workdir, exist_ok=True)
    os.chdir(args.workdir)
    runpy.run_path(str(script), run_name="__main__")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"env_id": curve.env_id, "seed": curve.seed, "script_argv": script_argv,
                               "threads": args.threads, "eval_every": args.eval_every,
                               "eval_episodes": args.eval_episodes, "versions": versions(),
                               "points": curve.points}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
