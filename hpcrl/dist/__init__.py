"""Rank bootstrap (torchrun / Slurm / MPI / single), gradient sync, packed reductions, timeouts.

Typical trainer::

    ctx = hpcrl.dist.init_distributed(timeout_s=cfg.dist_timeout_s)
    critic_sync = hpcrl.dist.GradSync([*critic.parameters(), log_alpha], mode=cfg.grad_sync)
    ...
    hpcrl.dist.shutdown()

Local ranks without a launcher: ``hpcrl.dist.spawn(main, nproc)``.
"""

from .barrier import BarrierTimeoutError, barrier, hosts
from .bootstrap import current, init_distributed, shutdown
from .context import DistContext, DistSetupError, Source
from .env import LaunchInfo, detect_launch, slurm_port
from .grad_sync import GradSync, Mode
from .local import SpawnError, spawn
from .nodelist import expand_nodelist, first_host
from .stop import EXIT_STOPPED, StopRequest
from .reduce import RankDivergenceError, all_reduce_sum_, broadcast_, check_parameters_in_sync, reduce_metrics

__all__ = [
    "BarrierTimeoutError",
    "DistContext",
    "DistSetupError",
    "EXIT_STOPPED",
    "StopRequest",
    "GradSync",
    "LaunchInfo",
    "Mode",
    "RankDivergenceError",
    "Source",
    "SpawnError",
    "all_reduce_sum_",
    "barrier",
    "hosts",
    "broadcast_",
    "check_parameters_in_sync",
    "current",
    "detect_launch",
    "expand_nodelist",
    "first_host",
    "init_distributed",
    "reduce_metrics",
    "shutdown",
    "slurm_port",
    "spawn",
]
