"""A tiny deterministic workload that exercises detached PPO's plumbing, not learning.

Every batch carries the checksum of the maker's weights and the version it believes it has, so the
trainer side can verify that makers run exactly the published weights of that version.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from hpcrl.ppo.channels import checksum

import json
import os
from dataclasses import asdict

VERSIONS: set[float] = set()  # trainer side: checksums of every version this trainer has held


class ToyWorkload:
    name = "toy"

    def __init__(self, rollout_s: float = 0.0, train_s: float = 0.0, samples: int = 8, trainable_only: bool = False):
        self.rollout_s, self.train_s, self.samples, self.trainable_only = rollout_s, train_s, samples, trainable_only

    def build_model(self, seed: int, device: torch.device) -> nn.Module:
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
        if self.trainable_only:
            model[0].requires_grad_(False)  # a frozen "base"; only the head is published
        return model

    def publish_tensors(self, model: nn.Module) -> list[torch.Tensor]:
        return [p.data for p in model.parameters() if p.requires_grad or not self.trainable_only]

    def after_publish(self, model: nn.Module) -> None:
        pass

    def make_collector(self, rank_seed: int, device: torch.device) -> "ToyCollector":
        return ToyCollector(self, rank_seed)

    def make_learner(self, model, cfg, grad_average) -> "ToyLearner":
        return ToyLearner(self, model, grad_average)


def model_checksum(model: nn.Module) -> float:
    return checksum(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))


class ToyCollector:
    def __init__(self, w: ToyWorkload, seed: int) -> None:
        self.w, self.seed = w, seed

    def collect(self, model, generator):
        if self.w.rollout_s:
            time.sleep(self.w.rollout_s)
        obs = torch.randn(self.w.samples, 4, generator=generator)
        with torch.no_grad():
            logits = model(obs)
        return ({"obs": obs, "behaviour_logp": torch.log_softmax(logits, -1)[:, 0],
                 "weights_checksum": torch.tensor([model_checksum(model)], dtype=torch.float64)},
                {"env_steps": float(self.w.samples), "episode_return_sum": 1.0, "episodes": 1.0})

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


class ToyLearner:
    def __init__(self, w: ToyWorkload, model: nn.Module, grad_average) -> None:
        self.w, self.model, self.averager = w, model, grad_average
        self.opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        self.mismatches = 0

    def update(self, batches, generator):
        VERSIONS.add(model_checksum(self.model))  # the current version (also right after a resume)
        for b in batches:  # each batch says which weights produced it: they must be a version we held
            if float(b["weights_checksum"]) not in VERSIONS:
                self.mismatches += 1
        if self.w.train_s:
            time.sleep(self.w.train_s)
        obs = torch.cat([b["obs"] for b in batches])
        self.opt.zero_grad()
        self.model(obs).square().mean().backward()
        self.averager.all_reduce()
        self.opt.step()
        VERSIONS.add(model_checksum(self.model))
        return {"loss": 0.0, "checksum_mismatches": float(self.mismatches)}

    def state_dict(self):
        return {"opt": self.opt.state_dict()}

    def load_state_dict(self, state):
        self.opt.load_state_dict(state["opt"])


class EventLog:
    """A picklable events callback: one JSON line per event, one file per rank process."""

    def __init__(self, directory: str) -> None:
        self.directory = directory

    def __call__(self, event) -> None:
        with open(os.path.join(self.directory, f"events-{os.getpid()}.jsonl"), "a") as f:
            f.write(json.dumps({"kind": type(event).__name__, **asdict(event)}, default=str) + "\n")
