"""Scoring and held-out evaluation of the ``hf`` workload.

:func:`score_responses` is the one place a reward is computed (makers, for experience; trainers, for
evaluation): the reward model over the tokens, or ``--reward-fn`` over the decoded responses with the
records (or prompt strings) they answer. :func:`evaluate` runs on every trainer after each
``--eval-every``-th update, on the trainers' current actor: the same version everywhere, so every
trainer computes the same numbers (greedy decoding; the sampled answers are seeded by the update
number) and, under fsdp, makes the same sequence of forward passes. It draws from no training random
stream, so a run with evaluation trains exactly as one without.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from hpcrl.config_check import ConfigError

from . import hf_models as M
from .hf_generate import generate_by_length, left_pad

if TYPE_CHECKING:
    from .hf import HFActorCritic, HFWorkload

__all__ = ["evaluate", "pass_rate", "score_responses"]


def score_responses(wl: HFWorkload, inputs: list[Any], tokens: Tensor, attn: Tensor, response: Tensor,
                    amask: Tensor, batch: int | str) -> Tensor:
    """``[B]`` scores of the responses (``inputs``: what ``--reward-fn`` receives for them)."""
    if wl.reward_callable is None:
        rm = wl.reward_net(tokens.device)
        return rm(input_ids=tokens, attention_mask=attn.long()).logits[:, 0].float()
    texts = [wl.tokenizer.decode(r[m > 0].tolist(), skip_special_tokens=True)
             for r, m in zip(response.cpu(), amask.cpu())]
    try:
        scores = M.call_reward_fn(wl.reward_callable, wl.reward_fn, inputs, texts, batch=batch)
    except ConfigError as err:
        raise wl.renamed(err) from None
    return torch.tensor(scores, dtype=torch.float32, device=tokens.device)


def pass_rate(scores: list[list[float]], threshold: float) -> float:
    """Share of records with any answer scoring ``>= threshold`` (``scores[i]``: record ``i``'s answers)."""
    return sum(max(s) >= threshold for s in scores) / len(scores)


@torch.no_grad()
def evaluate(wl: HFWorkload, model: HFActorCritic, updates: int) -> dict[str, float]:
    """The eval stats of the actor after ``updates`` updates: ``eval_reward`` (mean greedy score),
    ``eval_pass_rate`` (:func:`pass_rate` over the greedy + ``--eval-samples`` sampled answers),
    ``eval_records``, and with samples ``eval_sample_reward`` (their mean score)."""
    device, actor = model.compute_device, model.actor
    training = actor.training
    actor.eval()
    per_record: list[list[float]] = []
    greedy = dataclasses.replace(wl.sampling, sample=False)
    for start in range(0, len(wl.eval_ids), wl.batch_size):
        idx = list(range(start, min(start + wl.batch_size, len(wl.eval_ids))))
        prompt, pmask = (t.to(device) for t in left_pad([wl.eval_ids[i] for i in idx], wl.max_prompt_tokens,
                                                        wl.pad_id))
        inputs = wl.reward_inputs(idx, wl.eval_records, wl.eval_texts)
        answers = []
        for k in range(1 + wl.eval_samples):
            seed = (updates * 1_000_003 + start * 1024 + k) % 2**62
            response, amask = generate_by_length(actor, prompt, pmask.long(), wl.sampling if k else greedy,
                                                 wl.eos_id, wl.pad_id, seed, wl.generate_buckets)
            response, amask = response.to(device), amask.to(device)
            tokens, attn = torch.cat([prompt, response], 1), torch.cat([pmask, amask], 1)
            answers.append(score_responses(wl, inputs, tokens, attn, response, amask, f"eval {updates}").tolist())
        per_record += [list(s) for s in zip(*answers)]
    actor.train(training)
    out = {"eval_reward": sum(s[0] for s in per_record) / len(per_record),
           "eval_pass_rate": pass_rate(per_record, wl.eval_pass_threshold), "eval_records": float(len(per_record))}
    if wl.eval_samples:
        out["eval_sample_reward"] = sum(sum(s[1:]) for s in per_record) / (len(per_record) * wl.eval_samples)
    return out
