"""What a FastSAC rank will allocate, checked against this node's memory before any rank starts.

:func:`rank_bytes` estimates a rank's memory from the resolved config and the env's dimensions (pure
arithmetic); :func:`check_fits` refuses a config that cannot fit with one :class:`ConfigError` line
naming the flag that grew the estimate most, the bytes, the memory available and a value that fits.
:func:`check_sac` is the CLI's entry: env dimensions from a one-env probe, memory from
/proc/meminfo, the cgroup limit, or the GPU.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from hpcrl.core.config_check import ConfigError, flag

F32, I64 = 4, 8
REPLAY_SLOT_FIXED = 2 * F32 + I64  # one 8-byte step (reward f32, flags in its second word), final_ref i64 per (slot, env)
SIZE_FLAGS = ("buffer_size", "num_envs", "batch_size")
RUNTIME_BYTES = 400 * 10**6
"""A rank's footprint before it allocates anything of its own (355 MB resident measured on CPU)."""
TERM_FLAG = {"replay": "buffer_size", "envs": "num_envs", "batch": "batch_size", "model": "critic_hidden"}


@dataclass(frozen=True)
class EnvDims:
    obs_dim: int
    action_dim: int
    critic_obs_dim: int = 0  # privileged critic observations; 0 = none
    exact: bool = True  # False: a floor (the env was not probed), so an estimate is a lower bound


@dataclass(frozen=True)
class RankBytes:
    """One rank's estimated allocations, in bytes."""

    replay: int
    envs: int
    batch: int
    model: int
    runtime: int = 0  # the interpreter, torch and the CUDA context: what no flag changes

    @property
    def total(self) -> int:
        return self.replay + self.envs + self.batch + self.model + self.runtime

    def largest(self) -> str:
        return max(("replay", "envs", "batch", "model"), key=lambda name: getattr(self, name))


@dataclass(frozen=True)
class Memory:
    """Memory one node offers the run: ``available`` bytes of ``kind`` for ``ranks`` ranks."""

    available: int
    kind: str  # "host memory" or "cuda:K memory"
    ranks: int


def replay_bytes(envs: int, capacity: int, dims: EnvDims) -> int:
    """:class:`hpcrl.replay.ReplayShard` as built: obs (actor + critic columns), action, reward, flags and
    final_ref per (slot, env); final_pool (initially one row per env) and head_next_obs per env."""
    row = dims.obs_dim + dims.critic_obs_dim
    per_slot = F32 * (row + dims.action_dim) + REPLAY_SLOT_FIXED
    return capacity * envs * per_slot + 2 * envs * F32 * row


def env_bytes(envs: int, dims: EnvDims) -> int:
    """The env's state and the loop's per-env tensors, roughly: obs, next obs, normalised and critic copies,
    actions, rewards, done flags and episode statistics (about six observation-sized rows per env)."""
    row = dims.obs_dim + dims.critic_obs_dim
    return envs * F32 * (6 * row + 3 * dims.action_dim + 16)


def _trunk_activations(hidden: int) -> int:
    """Floats one row keeps through a Linear-LayerNorm-SiLU trunk (H, H/2, H/4): three tensors per layer."""
    return 3 * (hidden + hidden // 2 + hidden // 4)


def batch_bytes(cfg: Any, rows: int, dims: EnvDims) -> int:
    """One update's tensors for ``rows`` sampled rows, roughly: sample indices, the gathered batch, the
    critics' ``[num_q, B, *]`` activations and ``[num_q, B, num_atoms]`` logits (softmax, projection,
    loss), and the actor's."""
    q_in = dims.obs_dim + dims.critic_obs_dim + dims.action_dim
    gathered = 4 * (dims.obs_dim + dims.critic_obs_dim) + 2 * dims.action_dim + 4  # obs, next obs, normalised
    per_head = q_in + _trunk_activations(cfg.critic_hidden) + 4 * cfg.num_atoms
    # x1.5: the online forward's saved activations, plus the transient target forward and gradients
    # (measured on CPU: 14 kB per row at the pendulum preset's sizes, this estimate 17 kB)
    critic = 3 * cfg.num_q * per_head // 2
    actor = 3 * (dims.obs_dim + _trunk_activations(cfg.actor_hidden) + 4 * dims.action_dim) // 2
    return rows * (3 * I64 + F32 * (gathered + critic + actor))


def _mlp_params(in_dim: int, hidden: int, out_dim: int, heads: int = 1) -> int:
    widths = (in_dim, hidden, hidden // 2, hidden // 4)
    trunk = sum(a * b + b + 2 * b for a, b in zip(widths, widths[1:]))  # Linear + LayerNorm
    return trunk + heads * (widths[-1] * out_dim + out_dim)


def model_bytes(cfg: Any, dims: EnvDims) -> int:
    """Actor and critic with gradients, the flat averaging buffer and two AdamW moments (x5), the target
    critic (x1)."""
    actor = _mlp_params(dims.obs_dim, cfg.actor_hidden, dims.action_dim, heads=2)
    q_in = (dims.critic_obs_dim or dims.obs_dim) + dims.action_dim
    critic = cfg.num_q * _mlp_params(q_in, cfg.critic_hidden, cfg.num_atoms)
    return F32 * (5 * actor + 6 * critic)


def rank_bytes(cfg: Any, world_size: int, dims: EnvDims) -> RankBytes:
    """A rank's estimated allocations for a config whose sizes :func:`hpcrl.sac.layout.plan` accepted."""
    envs = cfg.num_envs // world_size
    rows = (cfg.batch_size // world_size) * (2 if cfg.symmetry else 1)
    return RankBytes(replay_bytes(envs, cfg.buffer_size, dims), env_bytes(envs, dims),
                     batch_bytes(cfg, rows, dims), model_bytes(cfg, dims), RUNTIME_BYTES)


def show_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB", "PB"):
        if n < 1000 or unit == "PB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def _round_down(value: int, step: int) -> int:
    """``value`` down to two significant digits, then to a multiple of ``step``."""
    digits = max(0, len(str(value)) - 2)
    value = value // 10**digits * 10**digits
    return value // step * step


def largest_fitting(fits: Callable[[int], bool], lo: int, hi: int, step: int) -> int | None:
    """The largest multiple of ``step`` in [lo, hi] (lo a multiple) where ``fits`` holds (monotone:
    true up to some value), None if not even ``lo`` fits; rounded down to two significant digits when
    that still is at least ``lo``."""
    if not fits(lo):
        return None
    good, bad = lo // step, hi // step + 1  # fits(good * step), not known beyond
    while bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if fits(mid * step) else (good, mid)
    best = good * step
    rounded = _round_down(best, step)
    return rounded if rounded >= lo else best


def _blame(cfg: Any, default: Any, estimate: Callable[[Any], RankBytes]) -> str:
    """The size flag whose value above ``default``'s grows the estimate most; else the largest term's."""
    total = estimate(cfg).total
    saved = {}
    for name in SIZE_FLAGS:
        if getattr(cfg, name) > getattr(default, name):
            saved[name] = total - estimate(dataclasses.replace(cfg, **{name: getattr(default, name)})).total
    if saved and max(saved.values()) > 0:
        return max(saved, key=saved.__getitem__)
    return TERM_FLAG[estimate(cfg).largest()]


def check_fits(cfg: Any, world_size: int, dims: EnvDims, memory: Memory, default: Any) -> RankBytes:
    """Refuse (ConfigError, one line) a config whose rank estimate exceeds the memory each local rank
    gets; ``default`` (the preset's config) says which size was raised. Returns the estimate."""
    def estimate(c: Any) -> RankBytes:
        return rank_bytes(c, world_size, dims)

    need = estimate(cfg)
    per_rank = memory.available // max(1, memory.ranks)
    if need.total <= per_rank:
        return need
    name = _blame(cfg, default, estimate)
    value = getattr(cfg, name)
    step = world_size if name in ("num_envs", "batch_size") else 1
    lo = {"buffer_size": max(1, cfg.n_step), "num_envs": world_size, "batch_size": world_size}.get(name, 4)
    best = largest_fitting(lambda v: estimate(dataclasses.replace(cfg, **{name: v})).total <= per_rank,
                           lo, value, step)
    largest = need.largest()
    at_least = "" if dims.exact else "at least "
    fix = (f"use {flag(name)} <= {best}" if best is not None else
           f"even {flag(name)} {lo} does not fit; lower {', '.join(flag(n) for n in SIZE_FLAGS if n != name)} too")
    ranks = f"{memory.ranks} rank{'s' if memory.ranks != 1 else ''}"
    raise ConfigError(f"{flag(name)} {value} needs {at_least}{show_bytes(need.total)} per rank ({largest} "
                      f"{show_bytes(getattr(need, largest))}); this node has {show_bytes(memory.available)} of "
                      f"{memory.kind} available for {ranks}: {fix}")


# ------------------------------------------------------------------------------ this node's memory


def _meminfo_available(text: str) -> int | None:
    match = re.search(r"^MemAvailable:\s+(\d+)\s*kB", text, re.MULTILINE)
    return int(match.group(1)) * 1024 if match else None


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None


def _cgroup_room() -> int | None:
    """The cgroup's limit less its usage (v2, else v1); None without a limit."""
    for limit_path, usage_path in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        limit, usage = _read(limit_path), _read(usage_path)
        if limit is None or not limit.strip().isdigit():
            continue  # "max" (v2) or absent: no limit here
        if int(limit) >= 2**60:  # v1 writes "no limit" as a huge number
            return None
        return max(0, int(limit) - int(usage.strip() if usage and usage.strip().isdigit() else 0))
    return None


def host_available() -> int | None:
    """Host bytes this process may still allocate: MemAvailable, capped by the cgroup's room."""
    meminfo = _read("/proc/meminfo")
    found = [n for n in (_meminfo_available(meminfo or ""), _cgroup_room()) if n is not None]
    return min(found) if found else None


def local_ranks(env: dict[str, str] | None = None) -> int:
    """Ranks of this run on this node: LOCAL_WORLD_SIZE (torchrun, --nproc ranks), Slurm's tasks per
    node ("4(x2)" -> 4), else 1."""
    env = os.environ if env is None else env
    for var in ("LOCAL_WORLD_SIZE", "SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        match = re.match(r"\d+", env.get(var, ""))
        if match and int(match.group()) >= 1:
            return int(match.group())
    return 1


def _cuda_free(index: int, here: bool) -> int | None:
    """Free bytes of GPU ``index``: read in this process (a rank, which uses that GPU anyway), else in a
    child (a parent that spawns ranks must not hold a CUDA context of its own while they run)."""
    if here:
        import torch

        return int(torch.cuda.mem_get_info(index)[0])
    code = f"import torch; print(torch.cuda.mem_get_info({index})[0])"
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return int(out.stdout) if out.returncode == 0 and out.stdout.strip().isdigit() else None


def _cuda_memory(device: str, ranks: int, local_rank: int | None) -> Memory | None:
    """Free memory of the GPU this rank (``local_rank``; None: the spawner, for its first rank) runs on,
    and how many of the node's ``ranks`` share it; None off CUDA."""
    import torch

    if device == "cpu" or not torch.cuda.is_available():
        return None  # "auto" without a GPU runs on the CPU; "cuda" without one is refused by the ranks
    count = torch.cuda.device_count()
    if ":" in device:
        index, sharing = int(device.split(":")[1]), ranks
    else:  # ranks get cuda:(local rank mod GPUs), as hpcrl.comm.devices.rank_device gives them
        index, sharing = (local_rank or 0) % count, math.ceil(ranks / count)
    if index >= count:
        return None  # refused with a clearer line by check_local_gpus / the ranks
    free = _cuda_free(index, here=local_rank is not None)
    return None if free is None else Memory(free, f"cuda:{index} memory", sharing)


def node_memory(device: str, ranks: int, local_rank: int | None = 0) -> Memory | None:
    """What this node offers ``ranks`` ranks on ``device``: the GPU's free memory on CUDA, else the
    host's available memory; None when it cannot be read. ``local_rank``: this process's rank on the
    node, None if it spawns the ranks."""
    cuda = _cuda_memory(device, ranks, local_rank)
    if cuda is not None:
        return cuda
    host = host_available()
    return None if host is None else Memory(host, "host memory", ranks)


def probe_dims(env_name: str) -> EnvDims:
    """The env's dimensions from one CPU env, for the built-in and gymnasium envs (fast); other kinds
    (Playground, torchvec, user classes) may compile or start simulators, so they get a floor of one
    dimension each. An unknown name is a ConfigError, as in the ranks."""
    from hpcrl import envs

    if env_name not in envs.env_names() and not env_name.startswith(envs.GYM_PREFIX):
        return EnvDims(1, 1, 0, exact=False)
    try:
        env = envs.make_env(env_name, 1, device="cpu", seed=0)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    except ImportError:  # the ranks report the missing package with its install line
        return EnvDims(1, 1, 0, exact=False)
    try:
        return EnvDims(env.obs_dim, env.action_dim or 1, env.critic_obs_dim or 0)
    finally:
        env.close()


def check_sac(cfg: Any, world_size: int, ranks: int, default: Any, local_rank: int | None) -> RankBytes | None:
    """Refuse a FastSAC config whose ranks cannot fit on this node (ConfigError, one line); ``ranks``
    ranks of a ``world_size`` run share it, ``default`` is the preset's config (what a size was raised
    from), ``local_rank`` this process's rank on the node (None: it spawns the ranks). Call after
    ``plan`` accepted the sizes. None when the memory cannot be read."""
    memory = node_memory(cfg.device, ranks, local_rank)
    if memory is None:
        return None
    return check_fits(cfg, world_size, probe_dims(cfg.env), memory, default)
