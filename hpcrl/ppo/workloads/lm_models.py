"""The ``lm`` workload's networks: a tiny causal transformer LM (own pre-LN blocks, ``torch.nn`` only)
with optional LoRA on every linear layer of its blocks, and the actor + critic pair the trainers train."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["Block", "CausalTransformer", "LMActorCritic", "LoRALinear", "token_logp"]


class LoRALinear(nn.Module):
    """``y = x W^T + b`` with, when ``rank > 0``, ``W = W0 + s * B @ A`` (``s = alpha / rank``).

    ``weight`` is the pristine base ``W0``: frozen, never written after construction/loading.
    ``A`` is Kaiming-uniform and ``B`` zero at init (the adapter starts as the identity update).
    :meth:`merge_` caches ``W0 + s * B @ A`` (computed from the base, not added to the previous
    cache) for gradient-free forwards; any forward with autograd enabled ignores the cache and
    recomputes the same expression, so merged and unmerged forwards give identical numbers.
    """

    def __init__(self, in_features: int, out_features: int, rank: int = 0, alpha: float | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features, self.rank = in_features, out_features, rank
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features))
        nn.init.normal_(self.weight, std=0.02)
        self.merged_weight: Tensor | None
        self.register_buffer("merged_weight", None, persistent=False)
        if rank > 0:
            self.scale = float(alpha if alpha is not None else rank) / rank
            self.lora_A = nn.Parameter(torch.empty(rank, in_features))
            self.lora_B = nn.Parameter(torch.zeros(out_features, rank))
            nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
            self.weight.requires_grad_(False)
            self.bias.requires_grad_(False)

    def effective_weight(self) -> Tensor:
        if self.rank == 0:
            return self.weight
        if self.merged_weight is not None and not torch.is_grad_enabled():
            return self.merged_weight
        return self.weight + self.scale * (self.lora_B @ self.lora_A)

    @torch.no_grad()
    def merge_(self) -> None:
        """Rebuild the cached effective weight from the pristine base (idempotent: never ``+=``)."""
        if self.rank > 0:
            self.merged_weight = self.weight + self.scale * (self.lora_B @ self.lora_A)

    def unmerge_(self) -> None:
        self.merged_weight = None

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.effective_weight(), self.bias)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, rank={self.rank}"


class Block(nn.Module):
    """Pre-LN transformer block with causal self-attention (``scaled_dot_product_attention``)."""

    def __init__(self, d_model: int, n_heads: int, rank: int, alpha: float | None) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}")
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = LoRALinear(d_model, 3 * d_model, rank, alpha)
        self.proj = LoRALinear(d_model, d_model, rank, alpha)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc1 = LoRALinear(d_model, 4 * d_model, rank, alpha)
        self.fc2 = LoRALinear(4 * d_model, d_model, rank, alpha)

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class CausalTransformer(nn.Module):
    """Token + learned position embeddings, ``n_layers`` blocks, final LayerNorm, a linear head
    (``out_dim = vocab`` for an LM, 1 for a value head). ``forward(tokens [B, T]) -> [B, T, out_dim]``."""

    def __init__(self, vocab: int, max_len: int, d_model: int, n_layers: int, n_heads: int, out_dim: int,
                 rank: int = 0, alpha: float | None = None) -> None:
        super().__init__()
        self.max_len = max_len
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos.weight, std=0.02)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, rank, alpha) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, out_dim)
        nn.init.normal_(self.head.weight, std=0.02)
        nn.init.zeros_(self.head.bias)

    def forward(self, tokens: Tensor) -> Tensor:
        t = tokens.shape[1]
        if t > self.max_len:
            raise ValueError(f"sequence of {t} tokens is longer than max_len={self.max_len}")
        x = self.tok(tokens) + self.pos(torch.arange(t, device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def lora_layers(self) -> list[LoRALinear]:
        return [m for m in self.modules() if isinstance(m, LoRALinear)]


class LMActorCritic(nn.Module):
    """Actor LM + separate critic; ``prompt_len`` positions of prompt, then ``gen_len`` actions.

    Action ``t`` (token at position ``prompt_len + t``) is scored by the logits, and valued by the
    critic, at position ``prompt_len + t - 1``.
    """

    def __init__(self, actor: CausalTransformer, critic: CausalTransformer, prompt_len: int, init_seed: int) -> None:
        super().__init__()
        self.actor, self.critic = actor, critic
        self.prompt_len = prompt_len
        self.init_seed = init_seed  # names the frozen initial model the collector compares against

    def action_logits(self, tokens: Tensor) -> Tensor:
        """``[B, G, V]`` logits of the ``G = L - prompt_len`` generated tokens."""
        return self.actor(tokens[:, :-1])[:, self.prompt_len - 1 :]

    def values(self, tokens: Tensor) -> Tensor:
        """``[B, G]`` critic values of the states before each generated token."""
        return self.critic(tokens[:, :-1])[:, self.prompt_len - 1 :, 0]


def token_logp(logits: Tensor, tokens: Tensor) -> Tensor:
    return torch.log_softmax(logits.float(), -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
