"""Maker-side generation for the ``hf`` workload, and the pure functions of its masks.

Layout of one experience batch (fixed shapes for a given config, so it travels as one buffer):
``tokens [B, P + G]`` = the prompt *left*-padded to ``P = max_prompt_tokens`` followed by the response
right-padded to ``G = max_new_tokens``. ``attention_mask`` is 1 on real prompt tokens and on the
response up to and including its first EOS; ``action_mask [B, G]`` is that response part. Action
``t`` (the token at ``P + t``) is scored by the logits at ``P + t - 1``. Positions count real
tokens only (:func:`position_ids`), as ``generate`` does with left padding.

:func:`generate` is ``transformers``' batched ``generate`` (KV cache, temperature / top-p / top-k,
EOS stop), :func:`generate_by_length` the same over sub-batches of like prompt length;
:func:`generate_recompute` is the cache-less loop (one full forward per new token) kept as the
benchmark's baseline (``benchmarks/hf_generate.py``).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .engine import SamplingParams

__all__ = ["SamplingParams", "filter_logits", "generate", "generate_by_length", "generate_recompute", "left_pad",
           "position_ids", "response_mask", "token_logp"]


def left_pad(rows: list[list[int]], length: int, pad_id: int) -> tuple[Tensor, Tensor]:
    """``(ids [B, length], mask [B, length])``: each row right-aligned (left padding)."""
    ids = torch.full((len(rows), length), pad_id, dtype=torch.int64)
    mask = torch.zeros(len(rows), length, dtype=torch.float32)
    for i, row in enumerate(rows):
        if row:
            ids[i, length - len(row):] = torch.tensor(row, dtype=torch.int64)
            mask[i, length - len(row):] = 1.0
    return ids, mask


def position_ids(attention_mask: Tensor) -> Tensor:
    """0, 1, ... over the real tokens of each row (left padding: pads get 0)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp_min(0)


def response_mask(response: Tensor, eos_id: int, generated: int | None = None) -> Tensor:
    """``[B, G]`` float mask: 1 up to and including the first ``eos_id`` of each row, 0 after it (and
    beyond ``generated`` columns, when the batch stopped early and was padded)."""
    is_eos = (response == eos_id).long()
    before = is_eos.cumsum(-1) - is_eos  # EOS tokens strictly before t
    mask = (before == 0).float()
    if generated is not None and generated < response.shape[1]:
        mask[:, generated:] = 0.0
    return mask


def filter_logits(logits: Tensor, temperature: float, top_k: int, top_p: float) -> Tensor:
    """``[..., V]`` logits as sampled from: divided by the temperature, then top-k and top-p (nucleus)
    filtered to ``-inf`` (the most likely token always survives)."""
    logits = logits.float() / temperature
    if top_k and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, -1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, idx = logits.sort(-1, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs > top_p  # tokens entirely past the nucleus
        logits = logits.masked_fill(drop.scatter(-1, idx, drop), float("-inf"))
    return logits


def token_logp(logits: Tensor, tokens: Tensor, temperature: float = 1.0) -> Tensor:
    """log softmax(logits / T) of the taken tokens (the policy PPO optimises is the tempered one, on
    maker and trainer alike; top-k / top-p truncation is not part of it)."""
    return torch.log_softmax(logits.float() / temperature, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def _pad_response(out: Tensor, prompt_len: int, g: int, pad_id: int) -> tuple[Tensor, int]:
    response = out[:, prompt_len:]
    generated = response.shape[1]
    if generated < g:
        response = torch.cat([response, response.new_full((response.shape[0], g - generated), pad_id)], 1)
    return response, generated


@torch.no_grad()
def generate(model: nn.Module, input_ids: Tensor, attention_mask: Tensor, params: SamplingParams, eos_id: int,
             pad_id: int, seed: int) -> tuple[Tensor, Tensor]:
    """``(response [B, G], action_mask [B, G])`` sampled with ``model.generate`` (KV cache), seeded by
    ``seed`` without touching the caller's global RNG (or greedy: ``params.sample`` False), from the
    left-padded prompts less the columns that are padding in every row (the batch's own width). Never
    ``synced_gpus``: transformers turns it on for an FSDP module and then all-reduces over the *world*
    group, makers included; trainers evaluating together make the same forward passes anyway."""
    kw = (dict(do_sample=True, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k or None)
          if params.sample else dict(do_sample=False, temperature=None, top_p=None, top_k=None))
    # Columns that are padding in every row cost compute at every step (prefill and each step's attention)
    # and change nothing: positions count real tokens only. Generate from the longest prompt's width.
    width = max(1, int(attention_mask.sum(1).max()))
    input_ids, attention_mask = input_ids[:, -width:], attention_mask[:, -width:]
    devices = [input_ids.device] if input_ids.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=params.max_new_tokens,
                             min_new_tokens=0, eos_token_id=eos_id, pad_token_id=pad_id, use_cache=True,
                             synced_gpus=False, **kw)
    response, generated = _pad_response(out, input_ids.shape[1], params.max_new_tokens, pad_id)
    return response, response_mask(response, eos_id, generated)


@torch.no_grad()
def generate_by_length(model: nn.Module, input_ids: Tensor, attention_mask: Tensor, params: SamplingParams,
                       eos_id: int, pad_id: int, seed: int, buckets: int) -> tuple[Tensor, Tensor]:
    """:func:`generate` over ``buckets`` sub-batches of like prompt length: the rows ordered by prompt length
    (stably) and cut into ``buckets`` runs of equal count, each generated from its own longest prompt and
    seeded ``seed + k``; the results go back to the rows' places. Short prompts then stop paying for the long
    ones' padding in the prefill and in every step's attention. Which prompts form the batch, and its row
    order, do not change (a resumed run generates the same), only how it is computed. ``buckets`` 1: one call."""
    n = input_ids.shape[0]
    if buckets <= 1 or n < 2:
        return generate(model, input_ids, attention_mask, params, eos_id, pad_id, seed)
    order = attention_mask.sum(1).argsort(stable=True)
    response = input_ids.new_full((n, params.max_new_tokens), pad_id)
    mask = torch.zeros(n, params.max_new_tokens, device=input_ids.device)
    for k, rows in enumerate(order.tensor_split(min(buckets, n))):
        r, m = generate(model, input_ids[rows], attention_mask[rows], params, eos_id, pad_id, seed + k)
        response[rows], mask[rows] = r.to(response.device), m.to(mask.device)
    return response, mask


@torch.no_grad()
def generate_recompute(model: nn.Module, input_ids: Tensor, attention_mask: Tensor, params: SamplingParams,
                       eos_id: int, pad_id: int, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """The same sampling without a KV cache: one full forward over the whole sequence per new token
    (what the in-house ``lm`` workload does). Stops when every row has produced EOS."""
    tokens, attn = input_ids, attention_mask
    done = torch.zeros(tokens.shape[0], dtype=torch.bool, device=tokens.device)
    for _ in range(params.max_new_tokens):
        logits = model(input_ids=tokens, attention_mask=attn, position_ids=position_ids(attn), use_cache=False).logits
        probs = filter_logits(logits[:, -1], params.temperature, params.top_k, params.top_p).softmax(-1)
        nxt = torch.multinomial(probs.cpu(), 1, generator=generator).to(tokens.device).squeeze(-1)
        nxt = torch.where(done, torch.full_like(nxt, pad_id), nxt)
        tokens = torch.cat([tokens, nxt[:, None]], 1)
        attn = torch.cat([attn, (~done).to(attn.dtype)[:, None]], 1)
        done |= nxt == eos_id
        if bool(done.all()):
            break
    response, generated = _pad_response(tokens, input_ids.shape[1], params.max_new_tokens, pad_id)
    return response, response_mask(response, eos_id, generated)
