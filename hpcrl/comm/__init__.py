"""Rank bootstrap (torchrun / Slurm / MPI / single), devices, the host and device planes, gradient
averaging, packed reductions, timeouts.

Typical trainer::

    ctx = hpcrl.comm.init_distributed(timeout_s=cfg.timeout_s, device=cfg.device)
    critic_average = hpcrl.comm.GradAverager([*critic.parameters(), log_alpha], cfg.grad_average, plane=ctx.device_plane)
    ...
    if stop.agreed(ctx.host_plane): ...
    hpcrl.comm.shutdown()

Every collective names its plane (see :mod:`hpcrl.comm.planes`). Local ranks without a launcher:
``hpcrl.comm.spawn(main, nproc)``.
"""

from .barrier import BarrierTimeoutError, barrier, host_of, hosts
from .bootstrap import current, init_distributed, shutdown
from .context import DistContext, DistSetupError, Source
from .devices import check_local_gpus, cuda_count, rank_device
from .env import LaunchInfo, detect_launch
from .planes import IDLE_TIMEOUT, Plane, abort, new_plane, new_planes, strict_planes
from .grad_average import GradAverager, Mode
from .local import SpawnConfigError, SpawnError, spawn
from .nodelist import expand_nodelist, first_host
from .stop import EXIT_STOPPED, StopRequest
from .reduce import RankDivergenceError, all_reduce_sum_, broadcast_, check_replicas_equal, reduce_metrics
from .secret import UntrustedKeyError, UntrustedPeerError

__all__ = [
    "BarrierTimeoutError",
    "UntrustedKeyError",
    "UntrustedPeerError",
    "IDLE_TIMEOUT",
    "abort",
    "Plane",
    "check_local_gpus",
    "cuda_count",
    "new_plane",
    "new_planes",
    "rank_device",
    "strict_planes",
    "DistContext",
    "DistSetupError",
    "EXIT_STOPPED",
    "StopRequest",
    "GradAverager",
    "LaunchInfo",
    "Mode",
    "RankDivergenceError",
    "Source",
    "SpawnConfigError",
    "SpawnError",
    "all_reduce_sum_",
    "barrier",
    "host_of",
    "hosts",
    "broadcast_",
    "check_replicas_equal",
    "current",
    "detect_launch",
    "expand_nodelist",
    "first_host",
    "init_distributed",
    "reduce_metrics",
    "shutdown",
    "spawn",
]
