"""What the Slurm cluster offers (from ``sinfo``), and whether a request fits before it is queued.

sbatch would reject most misfits too, but some only after queueing, or with "Requested node
configuration is not available"; these messages name the partition, its nodes and their sizes.
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass

from .errors import LaunchError
from .request import JobRequest

# "gpu:4", "gpu:a100:4", "gpu:a100:4(S:0-1)", "gpu:2,shard:8"; "(null)" without GRES
_GPU_GRES = re.compile(r"(?:^|,)gpu(?::[^:,(]+)?:(\d+)")


@dataclass(frozen=True)
class Node:
    name: str
    cpus: int
    gpus: int


@dataclass(frozen=True)
class Partition:
    name: str
    default: bool
    nodes: tuple[Node, ...]

    def describe(self) -> str:
        sizes = ", ".join(f"{n.name}: {n.cpus} CPUs {n.gpus} GPUs" for n in self.nodes)
        return f"partition {self.name} ({len(self.nodes)} nodes: {sizes})"


def parse_sinfo(text: str) -> dict[str, Partition]:
    """``sinfo -h -N -o '%P|%N|%c|%G'``: one line per (partition, node); the default partition ends in '*'."""
    nodes: dict[str, list[Node]] = {}
    default = None
    for line in text.splitlines():
        if not line.strip():
            continue
        part, name, cpus, gres = line.split("|")
        if part.endswith("*"):
            part = default = part[:-1]
        match = _GPU_GRES.search(gres)
        nodes.setdefault(part, []).append(Node(name, int(cpus), int(match.group(1)) if match else 0))
    return {p: Partition(p, p == default, tuple(ns)) for p, ns in nodes.items()}


def query_partitions() -> dict[str, Partition]:
    try:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%P|%N|%c|%G"], capture_output=True, text=True,
                             timeout=30, check=True).stdout
    except subprocess.CalledProcessError as err:
        raise LaunchError(f"cannot read the cluster's partitions (sinfo failed): {err.stderr.strip()}") from None
    return parse_sinfo(out)


def check_fits(request: JobRequest, partitions: dict[str, Partition]) -> Partition:
    """The partition the request runs in; LaunchError when it cannot run there."""
    if request.partition is None:
        chosen = next((p for p in partitions.values() if p.default), None)
        if chosen is None:
            raise LaunchError(f"the cluster has no default partition; pass one of {sorted(partitions)}")
    elif request.partition not in partitions:
        raise LaunchError(f"unknown partition {request.partition!r}; this cluster has {sorted(partitions)}")
    else:
        chosen = partitions[request.partition]
    gpus = max(n.gpus for n in chosen.nodes)
    if request.gpus_per_node > gpus:
        raise LaunchError(f"gpus_per_node={request.gpus_per_node} but nodes of {chosen.describe()} have at most "
                          f"{gpus} GPUs")
    cpus = request.ntasks_per_node * request.cpus_per_task
    fitting = [n for n in chosen.nodes if n.gpus >= request.gpus_per_node and n.cpus >= cpus]
    if len(fitting) < request.nodes:
        raise LaunchError(f"{request.nodes} node(s) with {request.gpus_per_node} GPUs and {cpus} CPUs "
                          f"({request.ntasks_per_node} tasks x {request.cpus_per_task} CPUs) requested, but only "
                          f"{len(fitting)} of {chosen.describe()} have that")
    return chosen
