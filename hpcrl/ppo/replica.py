"""One trainer's model and what updates it (:class:`Replica`): the strategy (ddp / fsdp), the
workload's learner, the tensors published to the makers and the minibatch generator."""

from __future__ import annotations

import resource
import sys
from dataclasses import dataclass
from typing import Any

import torch

from hpcrl.comm import Plane

from .config import DetachedConfig
from .strategy import Strategy
from .workload import PPOConfig, Workload

__all__ = ["Replica", "built_line", "peak_rss_mib"]


def peak_rss_mib() -> float:
    """This process's peak resident set so far (``VmHWM``; ``ru_maxrss`` where /proc is missing), MiB."""
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def built_line(index: int, strategy: str, where: torch.device, model: torch.nn.Module) -> str:
    """The line each trainer logs once its model is built: how it was loaded, the share of the
    parameters it holds, its dtype(s) and the process's peak RSS so far."""
    here = total = 0
    dtypes = set()
    for p in model.parameters():
        total += p.numel()
        here += p.to_local().numel() if hasattr(p, "to_local") else p.numel()
        dtypes.add(str(p.dtype).removeprefix("torch."))
    how = "sharded load" if where.type == "meta" else "full build"
    return (f"hpcrl.ppo trainer {index}: model built ({strategy}, {how}, {'/'.join(sorted(dtypes))}): "
            f"{here / 1e6:.2f}M of {total / 1e6:.2f}M parameters here, peak RSS {peak_rss_mib():.0f} MiB")


@dataclass
class Replica:
    """One trainer's model and what updates it: the strategy (ddp / fsdp), the workload's learner, the
    tensors published to the makers and the minibatch generator."""

    model: torch.nn.Module
    strategy: Strategy
    learner: Any
    tensors: list[torch.Tensor]  # sharded under fsdp: Strategy.snapshot gathers them
    generator: torch.Generator

    @classmethod
    def build(cls, cfg: DetachedConfig, workload: Workload, ppo: PPOConfig, plane: Plane, device: torch.device,
              index: int) -> "Replica":
        # fsdp: built on the meta device where the workload can (its shards filled after fully_shard:
        # no trainer ever holds the whole model), else in host memory (fully_shard moves one unit at a
        # time to the device, so no trainer holds the whole model there)
        where = device
        if cfg.strategy == "fsdp":
            where = torch.device("meta" if workload.capabilities().builds_on_meta else "cpu")
        model = workload.build_model(cfg.seed, where)
        strategy = Strategy(cfg.strategy, model, workload, plane, device, keep=index == 0, offload=cfg.offload,
                            dtype=cfg.trainer_dtype)
        print(built_line(index, cfg.strategy, where, model), file=sys.stderr, flush=True)
        tensors = workload.publish_tensors(model)
        learner = workload.make_learner(model, ppo, strategy.grad_average)
        return cls(model, strategy, learner, tensors, torch.Generator().manual_seed(cfg.seed + 2 + 1000 * index))

    def full_state(self) -> tuple[Any, Any]:
        """The model's and the learner's full state (gathered under fsdp: every trainer calls it)."""
        return self.strategy.full_state(self.model.state_dict()), self.strategy.full_state(self.learner.state_dict())

    def snapshot(self, bucket_numel: int) -> torch.Tensor | None:
        """A fresh flat copy of the published tensors (every trainer calls it: fsdp gathers the shards)."""
        return self.strategy.snapshot(self.tensors, bucket_numel)
