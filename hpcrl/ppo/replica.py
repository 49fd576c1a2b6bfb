"""One trainer's model and what updates it (:class:`Replica`): the strategy (ddp / fsdp), the
workload's learner, the tensors published to the makers and the minibatch generator."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hpcrl.comm import Plane

from .config import DetachedConfig
from .strategy import Strategy
from .workload import PPOConfig, Workload

__all__ = ["Replica"]


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
            where = torch.device("meta" if getattr(workload, "builds_on_meta", False) else "cpu")
        model = workload.build_model(cfg.seed, where)
        strategy = Strategy(cfg.strategy, model, workload, plane, device, keep=index == 0, offload=cfg.offload,
                            dtype=cfg.trainer_dtype)
        tensors = workload.publish_tensors(model)
        learner = workload.make_learner(model, ppo, strategy.grad_average)
        return cls(model, strategy, learner, tensors, torch.Generator().manual_seed(cfg.seed + 2 + 1000 * index))

    def full_state(self) -> tuple[Any, Any]:
        """The model's and the learner's full state (gathered under fsdp: every trainer calls it)."""
        return self.strategy.full_state(self.model.state_dict()), self.strategy.full_state(self.learner.state_dict())

    def snapshot(self, bucket_numel: int) -> torch.Tensor | None:
        """A fresh flat copy of the published tensors (every trainer calls it: fsdp gathers the shards)."""
        return self.strategy.snapshot(self.tensors, bucket_numel)
