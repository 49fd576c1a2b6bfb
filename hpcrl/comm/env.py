"""Which launcher started this process, and what it says about rank, world and rendezvous.

Pure functions of the environment (plus mpi4py for MPI ranks), so precedence and error messages are
testable without a network. Precedence: torchrun variables -> Slurm task variables -> MPI -> single.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Mapping

from hpcrl.core.conventions import rendezvous_port

from .context import DistSetupError, Source
from .nodelist import first_host

__all__ = ["LaunchInfo", "detect_launch"]

# Variables an MPI launcher (mpirun/mpiexec/srun --mpi=...) gives its ranks. PMIX_RANK carries no size.
_MPI_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE")
_MPI_MARKER_VARS = _MPI_SIZE_VARS + ("PMIX_RANK",)


@dataclass(frozen=True)
class LaunchInfo:
    source: Source
    rank: int
    world_size: int
    local_rank: int
    hostname: str
    master_addr: str | None = None  # None for MPI (rank 0 broadcasts it) and single
    master_port: int | None = None
    store_hosted_elsewhere: bool = False  # torchrun's agent (or hpcrl.comm.spawn's parent) hosts the store
    restart: int = 0  # torchrun restart count: keeps store keys of an earlier attempt out of the way


def _int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise DistSetupError(f"{name}={env[name]!r} is not an integer") from None


def _check_ranks(source: str, rank: int, world: int, local_rank: int) -> None:
    if world < 1 or not 0 <= rank < world or local_rank < 0:
        raise DistSetupError(
            f"{source}: inconsistent rank {rank}, world size {world}, local rank {local_rank} "
            "(need world >= 1, 0 <= rank < world, local rank >= 0)"
        )


def _torchrun(env: Mapping[str, str], source: Source = "torchrun") -> LaunchInfo:
    world = _int(env, "WORLD_SIZE") if "WORLD_SIZE" in env else None
    # A single-process run needs no rendezvous, so only a multi-rank run needs the master variables.
    required = ["RANK", "WORLD_SIZE"] + (["LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"] if world != 1 else [])
    missing = [v for v in required if not env.get(v)]
    if missing:
        present = ", ".join(f"{v}={env[v]}" for v in ("RANK", "WORLD_SIZE") if v in env)
        raise DistSetupError(
            f"torchrun-style launch detected ({present}) but {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not set. Set all of RANK, WORLD_SIZE, LOCAL_RANK, "
            "MASTER_ADDR and MASTER_PORT (address and free port of the rank-0 host), or launch with "
            "torchrun, which sets them all; unset RANK and WORLD_SIZE to run a single process."
        )
    rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
    local_rank = _int(env, "LOCAL_RANK") if env.get("LOCAL_RANK") else 0
    _check_ranks("torchrun variables", rank, world, local_rank)
    return LaunchInfo(
        source=source,
        rank=rank,
        world_size=world,
        local_rank=local_rank,
        hostname=socket.gethostname(),
        master_addr=env.get("MASTER_ADDR"),
        master_port=_int(env, "MASTER_PORT") if env.get("MASTER_PORT") else None,
        store_hosted_elsewhere=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
        restart=_int(env, "TORCHELASTIC_RESTART_COUNT") if env.get("TORCHELASTIC_RESTART_COUNT") else 0,
    )


def _slurm(env: Mapping[str, str]) -> LaunchInfo:
    nodelist_var = next(
        (v for v in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST") if env.get(v)), None
    )
    missing = [] if env.get("SLURM_NTASKS") or env.get("SLURM_STEP_NUM_TASKS") else ["SLURM_NTASKS"]
    missing += [] if env.get("SLURM_LOCALID") else ["SLURM_LOCALID"]
    if nodelist_var is None and not env.get("MASTER_ADDR"):
        missing.append("SLURM_JOB_NODELIST")
    if not env.get("SLURM_JOB_ID") and not env.get("MASTER_PORT"):
        missing.append("SLURM_JOB_ID")
    if missing:
        raise DistSetupError(
            f"Slurm task detected (SLURM_PROCID={env['SLURM_PROCID']}) but {', '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not set. Start one task per rank with `srun` inside "
            "an allocation, which sets SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_JOB_NODELIST and "
            "SLURM_JOB_ID (MASTER_ADDR / MASTER_PORT override the node list / job id); unset SLURM_PROCID "
            "to run a single process."
        )
    # srun sets the step's task count; SLURM_NTASKS may still describe the whole allocation.
    world = _int(env, "SLURM_STEP_NUM_TASKS") if env.get("SLURM_STEP_NUM_TASKS") else _int(env, "SLURM_NTASKS")
    rank, local_rank = _int(env, "SLURM_PROCID"), _int(env, "SLURM_LOCALID")
    _check_ranks("Slurm variables", rank, world, local_rank)
    if not env.get("SLURM_STEP_ID") and world > 1:
        # The batch script itself has SLURM_PROCID=0 and the allocation's task count, but no step:
        # starting the trainer there directly would wait forever for ranks that srun never started.
        raise DistSetupError(
            f"SLURM_PROCID={rank} and SLURM_NTASKS={world} are set but SLURM_STEP_ID is not: this "
            "process runs in the batch script, not in a task started by srun. Launch it with "
            "`srun python ...` (one rank per task), or use --nproc N for local ranks, or unset "
            "SLURM_PROCID to run a single process."
        )
    # A heterogeneous step's node list is the union of its components; rank 0 lives in component 0.
    het0 = env.get("SLURM_JOB_NODELIST_HET_GROUP_0") if env.get("SLURM_HET_SIZE") else None
    master_addr = env.get("MASTER_ADDR") or first_host(het0 or env[nodelist_var])  # type: ignore[index]
    step = env.get("SLURM_STEP_ID", "")
    port = (_int(env, "MASTER_PORT") if env.get("MASTER_PORT")
            else rendezvous_port(_int(env, "SLURM_JOB_ID"), int(step) if step.isdigit() else 0))
    return LaunchInfo(
        source="slurm",
        rank=rank,
        world_size=world,
        local_rank=local_rank,
        hostname=env.get("SLURMD_NODENAME") or socket.gethostname(),
        master_addr=master_addr,
        master_port=port,
    )


def _mpi_env_size(env: Mapping[str, str]) -> int | None:
    for var in _MPI_SIZE_VARS:
        if env.get(var, "").isdigit():
            return int(env[var])
    return None


def _mpi(env: Mapping[str, str]) -> LaunchInfo:
    try:
        from mpi4py import MPI  # imported only here: MPI_Init is costly and noisy outside MPI jobs
    except ImportError as err:  # includes a wheel that cannot find libmpi
        raise DistSetupError(
            f"started by an MPI launcher ({', '.join(v for v in _MPI_MARKER_VARS if v in env)} set) but "
            f"mpi4py cannot be imported ({err}). Install it (pip install mpi4py) or launch with "
            "torchrun / srun instead."
        ) from err
    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    expected = _mpi_env_size(env)
    if expected is not None and expected != world:
        # A wrong PMI flavour gives every process a world of its own: N copies of rank 0.
        raise DistSetupError(
            f"the MPI launcher says {expected} ranks but MPI.COMM_WORLD has {world}: mpi4py's MPI "
            "does not match the launcher (under srun, try --mpi=pmix or --mpi=pmi2)"
        )
    local_rank = comm.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()
    _check_ranks("MPI", rank, world, local_rank)
    return LaunchInfo(
        source="mpi", rank=rank, world_size=world, local_rank=local_rank, hostname=socket.gethostname()
    )


def _single() -> LaunchInfo:
    return LaunchInfo(source="single", rank=0, world_size=1, local_rank=0, hostname=socket.gethostname())


def detect_launch(env: Mapping[str, str] | None = None, source: Source | None = None) -> LaunchInfo:
    """Read rank, world size, local rank and the rendezvous address from the launcher's variables.

    ``source`` forces one path ("single" ignores every launcher variable). Otherwise: ``RANK`` or
    ``WORLD_SIZE`` set -> torchrun (``local`` with ``HPCRL_LAUNCHER=local``: hpcrl's own local
    launchers); ``SLURM_PROCID`` set -> Slurm task; MPI launcher variables and
    mpi4py -> MPI; else a single process. An MPI launcher running inside a Slurm allocation
    (``mpirun`` in the batch script: no ``SLURM_STEP_ID``, or a task count that disagrees with
    Slurm's) wins over the Slurm variables it inherited. A partial environment raises
    :class:`DistSetupError` naming what is missing.
    """
    env = os.environ if env is None else env
    if source is None:
        mpi_size = _mpi_env_size(env)
        slurm_world = env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS")
        mpi_in_slurm = any(v in env for v in _MPI_MARKER_VARS) and (
            not env.get("SLURM_STEP_ID") or (mpi_size is not None and str(mpi_size) != slurm_world)
        )
        if "RANK" in env or "WORLD_SIZE" in env:
            # hpcrl.comm.spawn (--nproc) and submitit's local executor set the same variables as torchrun
            source = "local" if env.get("HPCRL_LAUNCHER") == "local" else "torchrun"
        elif "SLURM_PROCID" in env and not mpi_in_slurm:
            source = "slurm"
        elif any(v in env for v in _MPI_MARKER_VARS):
            source = "mpi"
        else:
            source = "single"
    if source in ("torchrun", "local"):
        return _torchrun(env, source)
    if source == "slurm":
        if "SLURM_PROCID" not in env:
            raise DistSetupError("source='slurm' but SLURM_PROCID is not set: start the task with srun")
        return _slurm(env)
    if source == "mpi":
        return _mpi(env)
    if source == "single":
        return _single()
    raise ValueError(f"unknown source {source!r}; expected torchrun, local, slurm, mpi or single")
