"""``python -m hpcrl.sac.play RUN_DIR [--which best|final|latest] [--episodes N] [--seed S] [--video out.mp4]``

Evaluates a trained FastSAC policy (deterministic action) on fresh envs and prints every episode's
return and their mean ± std (population std over the episodes). ``RUN_DIR`` may also be a policy
snapshot file or a checkpoint directory (:func:`hpcrl.sac.policy.resolve`).

``--video FILE.mp4`` also records one episode (seed ``--seed``) of a gymnasium env made with
``render_mode="rgb_array"`` and writes it with mediapy (ffmpeg from imageio-ffmpeg; ``pip install
'hpcrl[video]'``). hpcrl's own torch envs (``pendulum``, ``cartpole*``) have no renderer: pass
``--env gym:Pendulum-v1`` (needs pygame) or record a ``gym:`` MuJoCo env. Without a display,
MuJoCo is pointed at EGL (``MUJOCO_GL=egl``) unless ``MUJOCO_GL`` is already set.

Exit codes: 0 done, 2 bad input (no such run dir, no snapshot, an env that cannot render, ...), one line.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import torch
import tyro

from hpcrl.run.cli import cli
from hpcrl.core.config_check import MAX_SEED, Check, ConfigError
from hpcrl.core.conventions import EXIT_BAD_CONFIG
from hpcrl.envs import GYM_PREFIX, first_episode_returns, make_env

from .policy import Policy, load

__all__ = ["PlayConfig", "evaluate_policy", "main", "record_video"]


@dataclass
class PlayConfig:
    """Evaluate a trained FastSAC policy; optionally record a video."""

    run_dir: Annotated[str, tyro.conf.Positional] = "runs/fastsac"
    """Run directory (or a policy.pt snapshot, or a checkpoints/step_N directory); default: FastSAC's
    default --run-dir."""
    which: Literal["best", "final", "latest"] = "best"
    """Which policy of the run: best eval return (RUN_DIR/best), end of training (RUN_DIR/final), or the
    newest training checkpoint (latest)."""
    episodes: int = 10
    """Episodes to evaluate (>= 1), run as that many parallel envs."""
    seed: int = 0
    """Seed of the evaluation envs (env i gets seed + i), in [0, 2**31 - 1]."""
    env: str = ""
    """Env to play in; empty = the env the policy was trained on (its snapshot's meta)."""
    max_steps: int = 1000
    """Step limit per episode for envs without their own time limit (>= 1)."""
    video: str = ""
    """Write one episode as an MP4 here (a gym:<Id> env that renders rgb_array; needs 'hpcrl[video]')."""
    fps: int = 30
    """Frames per second of the video (>= 1)."""
    device: str = "cpu"
    """Device of policy and envs ("cpu", "cuda", "cuda:K")."""

    def check(self) -> None:
        c = Check(self)
        c.text("run_dir")
        c.integer("episodes", 1, hint="parallel evaluation episodes")
        c.integer("seed", 0, MAX_SEED)
        c.integer("max_steps", 1, hint="steps per episode")
        c.integer("fps", 1, hint="video frames per second")
        if self.video and not self.video.lower().endswith(".mp4"):
            c.fail("video", "a path ending in .mp4", f"e.g. --video {Path(self.video).stem or 'play'}.mp4")


@torch.no_grad()
def evaluate_policy(policy: Policy, env_name: str, episodes: int, seed: int, device: str = "cpu",
                    max_steps: int = 1000) -> list[float]:
    """Return of the first episode of each of ``episodes`` fresh envs (env i seeded ``seed + i``); an
    episode still running after the step limit counts with the return it has so far."""
    env = make_env(env_name, episodes, device=device, seed=seed)
    _check_dims(policy, env, env_name)
    returns = first_episode_returns(env, env.reset(seed=seed), lambda obs: policy(obs.float()), max_steps)
    close = getattr(env, "close", None)
    if close is not None:
        close()
    return [float(r) for r in returns.cpu()]


def _check_dims(policy: Policy, env, env_name: str) -> None:
    if env.num_actions is not None:
        raise ConfigError(f"--env {env_name}: discrete actions; a FastSAC policy needs a continuous action space")
    if (env.obs_dim, env.action_dim) != (policy.obs_dim, policy.action_dim):
        raise ConfigError(f"--env {env_name}: obs_dim {env.obs_dim}, action_dim {env.action_dim}, but the policy "
                          f"takes obs_dim {policy.obs_dim} and gives action_dim {policy.action_dim}; pass the env "
                          "it was trained on (or leave --env empty)")


def _video_writer():
    try:
        import imageio_ffmpeg
        import mediapy
    except ImportError:
        raise ConfigError("--video needs mediapy and imageio-ffmpeg: pip install 'hpcrl[video]'") from None
    # mediapy shells out to ffmpeg; imageio-ffmpeg ships a static binary, so no system ffmpeg is needed.
    mediapy.set_ffmpeg(imageio_ffmpeg.get_ffmpeg_exe())
    return mediapy


def _check_renderable(env_name: str) -> None:
    if not env_name.startswith(GYM_PREFIX):
        raise ConfigError(f"--video: env {env_name!r} cannot render (hpcrl's own torch envs have no renderer); "
                          f"pass --env gym:<Id> of a gymnasium env with rgb_array rendering, e.g. gym:Pendulum-v1")


@torch.no_grad()
def record_video(policy: Policy, env_name: str, path: str | os.PathLike, seed: int = 0, fps: int = 30,
                 max_steps: int = 1000, device: str = "cpu") -> tuple[int, float]:
    """Record one deterministic episode of gymnasium env ``env_name`` (``gym:<Id>``) into ``path`` (MP4);
    returns (frames, episode return). :class:`ConfigError` when the env cannot render."""
    _check_renderable(env_name)
    mediapy = _video_writer()
    if not os.environ.get("DISPLAY"):
        os.environ.setdefault("MUJOCO_GL", "egl")  # headless nodes: MuJoCo's default GLFW needs an X display
    import gymnasium as gym

    gym_id = env_name[len(GYM_PREFIX):]
    try:
        env = gym.make(gym_id, render_mode="rgb_array")
        obs, _ = env.reset(seed=seed)
        first = env.render()
    except Exception as err:  # noqa: BLE001  (missing pygame, no OpenGL, no such env: all mean "cannot render")
        message = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"--video: env {env_name!r} cannot render rgb_array frames here ({type(err).__name__}: "
                          f"{message}); try MUJOCO_GL=egl or osmesa for MuJoCo envs, pygame for classic control, "
                          "or play without --video") from None
    if first is None or getattr(first, "ndim", 0) != 3:
        raise ConfigError(f"--video: env {env_name!r} rendered no rgb_array frame; play without --video")
    frames, total = [first], 0.0
    limit = (env.spec.max_episode_steps if env.spec is not None else None) or max_steps
    for _ in range(limit):
        x = torch.as_tensor(obs, dtype=torch.float32, device=device).reshape(1, -1)
        if x.shape[1] != policy.obs_dim:
            raise ConfigError(f"--video: env {env_name!r} has obs_dim {x.shape[1]}, the policy takes {policy.obs_dim}")
        action = policy(x)[0].cpu().numpy().astype(env.action_space.dtype)
        obs, reward, terminated, truncated, _ = env.step(action)
        total += float(reward)
        frames.append(env.render())
        if terminated or truncated:
            break
    env.close()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    mediapy.write_video(str(path), frames, fps=fps)
    return len(frames), total


def play(cfg: PlayConfig) -> dict[str, float]:
    cfg.check()
    policy, meta, where = load(cfg.run_dir, cfg.which, cfg.device)
    env_name = cfg.env or meta.get("env") or ""
    if not env_name:
        raise ConfigError(f"{where}: the snapshot names no env; pass --env NAME")
    info = ", ".join(f"{k}={meta[k]:.4g}" if isinstance(meta[k], float) else f"{k}={meta[k]}" for k in ("env_steps", "eval_return", "seed") if meta.get(k) is not None)
    if cfg.video:  # before the evaluation: a video that cannot be made fails in a second, not after it
        _check_renderable(env_name)
        _video_writer()
    print(f"hpcrl.sac.play: {where} ({info}) on {env_name}, {cfg.episodes} episode(s), seed {cfg.seed}", flush=True)
    try:
        returns = evaluate_policy(policy, env_name, cfg.episodes, cfg.seed, cfg.device, cfg.max_steps)
    except ValueError as err:  # unknown env name, bad size: input, not a crash
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(f"--env {env_name}: {err}") from None
    for i, r in enumerate(returns):
        print(f"episode {i}: return {r:.2f}")
    mean = sum(returns) / len(returns)
    std = math.sqrt(sum((r - mean) ** 2 for r in returns) / len(returns))
    print(f"return {mean:.2f} ± {std:.2f} over {len(returns)} episode(s)", flush=True)
    out = {"mean": mean, "std": std}
    if cfg.video:
        frames, total = record_video(policy, env_name, cfg.video, cfg.seed, cfg.fps, cfg.max_steps, cfg.device)
        print(f"video: {cfg.video} ({frames} frames, episode return {total:.2f})", flush=True)
        out["video_frames"] = frames
    return out


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = cli(PlayConfig, sys.argv[1:] if argv is None else argv, "python -m hpcrl.sac.play")
        play(cfg)
    except ConfigError as err:
        print(f"hpcrl.sac.play: error: {err}", file=sys.stderr)
        return EXIT_BAD_CONFIG
    return 0


if __name__ == "__main__":
    sys.exit(main())
