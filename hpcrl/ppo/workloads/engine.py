"""The contract between a maker and the inference engine it generates with (``transformers``' ``generate``
today, :class:`~.hf_engine.HFEngine`; vLLM or SGLang behind the same calls).

An :class:`Engine` generates a batch of token sequences with per-token behaviour log-probs under given
:class:`SamplingParams` and a seed (:meth:`Engine.generate`), loads a published version's named tensors in
place (:meth:`Engine.load_weights`) and says what it supports (:meth:`Engine.capabilities`). The maker owns
versions and swaps (it calls ``load_weights`` between batches, never during one); the engine owns its
memory and scheduling. What comes back is ragged (:class:`Generation`: values + offsets), as long as what
was generated: padding is the caller's choice (:meth:`Generation.padded`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = ["Engine", "EngineCapabilities", "Generation", "SamplingParams"]


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    """1 = off."""
    top_k: int = 0
    """0 = off."""
    sample: bool = True
    """False: greedy (the argmax token; temperature / top-p / top-k unused)."""


@dataclass(frozen=True)
class EngineCapabilities:
    """What an engine can run, checked before a run starts where it can be known then."""

    name: str
    dtypes: tuple[str, ...]
    """Maker precisions it generates in (``--maker-dtype`` values)."""
    head_sizes: tuple[int, ...] | None = None
    """Attention head sizes its kernels support; None: any."""
    lora: str = "merged"
    """How it serves LoRA adapters: ``merged`` (onto a pristine base at each version), ``adapter`` (served as
    adapters), ``none``."""
    devices: tuple[str, ...] = ("cpu", "cuda")


@dataclass(frozen=True)
class Generation:
    """A batch's responses, ragged: sequence ``i`` is ``tokens[offsets[i]:offsets[i + 1]]`` (up to and
    including its EOS, or ``max_new_tokens`` long), ``logp`` its tokens' behaviour log-probs (the tempered
    policy's, :func:`~.hf_generate.token_logp`), ``finish[i]`` ``"stop"`` (ended at EOS) or ``"length"``."""

    tokens: Tensor
    """``[N]`` int64, every sequence's response tokens one after another."""
    logp: Tensor
    """``[N]`` float32."""
    offsets: Tensor
    """``[B + 1]`` int64 (CPU), ``offsets[0] = 0``, ``offsets[B] = N``."""
    finish: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return self.offsets.numel() - 1

    @property
    def lengths(self) -> Tensor:
        return self.offsets[1:] - self.offsets[:-1]

    def response(self, i: int) -> list[int]:
        return self.tokens[int(self.offsets[i]):int(self.offsets[i + 1])].tolist()

    @classmethod
    def from_padded(cls, response: Tensor, mask: Tensor, logp: Tensor, eos_id: int) -> Generation:
        """Rows of ``response [B, G]`` / ``logp [B, G]`` cut where ``mask`` (1 on a row's real tokens, a
        prefix) ends."""
        lengths = mask.sum(1).long().cpu()
        keep = mask.bool()
        offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
        offsets[1:] = lengths.cumsum(0)
        tokens = response[keep]
        last = [int(tokens[int(offsets[i + 1]) - 1]) if lengths[i] else -1 for i in range(len(lengths))]
        return cls(tokens, logp[keep], offsets, ["stop" if t == eos_id else "length" for t in last])

    def padded(self, width: int, pad_id: int) -> tuple[Tensor, Tensor, Tensor]:
        """``(response [B, width], mask [B, width], logp [B, width])``: each row's tokens from column 0, then
        ``pad_id`` (mask and log-prob 0 there)."""
        n = len(self)
        device = self.tokens.device
        cols = torch.arange(width, device=device)
        keep = cols[None, :] < self.lengths.to(device)[:, None]
        response = torch.full((n, width), pad_id, dtype=self.tokens.dtype, device=device)
        logp = torch.zeros(n, width, dtype=self.logp.dtype, device=self.logp.device)
        response[keep] = self.tokens
        logp[keep.to(logp.device)] = self.logp
        return response, keep.float(), logp


class Engine(ABC):
    """One maker's inference engine (see the module's docstring)."""

    version: int = -1
    """The version :meth:`load_weights` last adopted (-1: the weights it was built with)."""

    @abstractmethod
    def generate(self, prompts: list[list[int]], params: SamplingParams, seed: int) -> Generation:
        """Responses to ``prompts`` (token ids, no padding), row for row, sampled under ``params`` from
        ``seed`` alone (the same seed and weights give the same tokens) without drawing from the caller's
        random streams; with their behaviour log-probs."""

    @abstractmethod
    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        """Adopt a published version's tensors (by the trainer's parameter names) in place, between
        batches; tensors the engine already shares with the caller are not copied."""

    @abstractmethod
    def capabilities(self) -> EngineCapabilities: ...

    def close(self) -> None:
        """Free what the engine holds (memory, worker processes). Default: nothing to free."""
