"""The ``lm`` workload's data: the noisy-counting corpus, the target-token reward model, and the
in-process next-token pretraining of the initial LM on that corpus (cached per process)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

if TYPE_CHECKING:
    from .lm import LMWorkload

__all__ = ["CountingCorpus", "TargetTokenReward", "masked_mean_rows", "pretrain"]


class CountingCorpus:
    """Noisy counting sequences: ``x[0] ~ U(V)``, ``d ~ U(steps)`` per sequence,
    ``x[t+1] = (x[t] + d) % V`` with probability ``1 - noise``, else ``~ U(V)``."""

    def __init__(self, vocab: int, noise: float, steps: tuple[int, ...]) -> None:
        self.vocab, self.noise, self.steps = vocab, noise, torch.tensor(steps, dtype=torch.int64)

    def sample(self, n: int, length: int, generator: torch.Generator) -> Tensor:
        v = self.vocab
        x = torch.empty(n, length, dtype=torch.int64)
        x[:, 0] = torch.randint(v, (n,), generator=generator)
        d = self.steps[torch.randint(len(self.steps), (n,), generator=generator)]
        for t in range(1, length):
            noisy = torch.rand(n, generator=generator) < self.noise
            rand = torch.randint(v, (n,), generator=generator)
            x[:, t] = torch.where(noisy, rand, (x[:, t - 1] + d) % v)
        return x


class TargetTokenReward(nn.Module):
    """Reward model: the fraction of response tokens (within ``mask``) equal to ``target``.
    Range ``[0, 1]``; the optimum 1.0 is the all-``target`` response."""

    def __init__(self, target: int) -> None:
        super().__init__()
        self.target = target

    def forward(self, response: Tensor, mask: Tensor) -> Tensor:
        return masked_mean_rows((response == self.target).float(), mask)


def masked_mean_rows(x: Tensor, mask: Tensor) -> Tensor:
    m = mask.to(x.dtype)
    return (x * m).sum(-1) / m.sum(-1).clamp_min(1.0)


_PRETRAINED: dict[tuple, tuple[dict[str, Tensor], float]] = {}
"""Per-process cache: (architecture, corpus, pretraining recipe, seed) -> (state_dict, final loss)."""


def pretrain(key: tuple, wl: "LMWorkload", seed: int) -> tuple[dict[str, Tensor], float]:
    """Next-token pretraining on the corpus; always on CPU and one thread (bit-identical on every
    rank whatever its device or thread count), deterministic given ``seed``."""
    if key in _PRETRAINED:
        return _PRETRAINED[key]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            lm = wl._new_lm(wl.vocab, rank=0)
        gen = torch.Generator().manual_seed(seed + 7919)
        opt = torch.optim.Adam(lm.parameters(), lr=wl.pretrain_lr)
        steps = wl.pretrain_steps
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * i / max(1, steps))))
        loss = torch.tensor(float("nan"))
        for _ in range(steps):
            x = wl.corpus.sample(wl.pretrain_batch, wl.seq_len, gen)
            logits = lm(x[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, wl.vocab), x[:, 1:].reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
        state = {k: v.detach().clone() for k, v in lm.state_dict().items()}
    finally:
        torch.set_num_threads(threads)
    _PRETRAINED[key] = (state, float(loss.detach()))
    return _PRETRAINED[key]
