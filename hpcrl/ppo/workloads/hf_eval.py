"""Held-out evaluation of the ``hf`` workload.

:func:`evaluate` runs on every trainer after each ``--eval-every``-th update, on the trainers' current
actor: the same version everywhere, so every trainer computes the same numbers (greedy decoding; the
sampled answers are seeded by the update number) and, under fsdp, makes the same sequence of forward
passes; the answers are scored by the task's reward (:meth:`HFTask.score <.hf_task.HFTask.score>`). It
draws from no training random stream, so a run with evaluation trains exactly as one without.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from .engine import Generation, SamplingParams
from .hf_generate import generate_by_length, left_pad
from .rollout import run_turns

if TYPE_CHECKING:
    from torch import nn

    from .hf_env import EnvEpisodes
    from .hf_factory import HFActorCritic
    from .hf_options import HFOptions
    from .hf_task import HFTask

__all__ = ["evaluate", "pass_rate"]


def pass_rate(scores: list[list[float]], threshold: float) -> float:
    """Share of records with any answer scoring ``>= threshold`` (``scores[i]``: record ``i``'s answers)."""
    return sum(max(s) >= threshold for s in scores) / len(scores)


@torch.no_grad()
def evaluate(options: HFOptions, task: HFTask, model: HFActorCritic, updates: int,
             env: EnvEpisodes | None = None) -> dict[str, float]:
    """The eval stats of the actor after ``updates`` updates: ``eval_reward`` (mean greedy score),
    ``eval_pass_rate`` (:func:`pass_rate` over the greedy + ``--eval-samples`` sampled answers),
    ``eval_records``, and with samples ``eval_sample_reward`` (their mean score). With ``env`` (multi-turn),
    each answer is a whole episode played from the record, scored by its return."""
    o = options
    device, actor = model.compute_device, model.actor
    training = actor.training
    actor.eval()
    per_record: list[list[float]] = []
    greedy = dataclasses.replace(task.sampling, sample=False)
    for start in range(0, len(task.eval_ids), o.batch_size):
        idx = list(range(start, min(start + o.batch_size, len(task.eval_ids))))
        if env is not None:  # full episodes: each scored by its return
            per_record += _episode_answers(o, task, actor, env, idx, updates, start)
            continue
        prompt, pmask = (t.to(device) for t in left_pad([task.eval_ids[i] for i in idx], o.max_prompt_tokens,
                                                        task.pad_id))
        inputs = task.reward_inputs(idx, task.eval_records, task.eval_texts)
        answers = []
        for k in range(1 + o.eval_samples):
            seed = (updates * 1_000_003 + start * 1024 + k) % 2**62
            response, amask = generate_by_length(actor, prompt, pmask.long(), task.sampling if k else greedy,
                                                 task.eos_id, task.pad_id, seed, o.generate_buckets)
            response, amask = response.to(device), amask.to(device)
            tokens, attn = torch.cat([prompt, response], 1), torch.cat([pmask, amask], 1)
            answers.append(task.score(inputs, tokens, attn, response, amask, f"eval {updates}").tolist())
        per_record += [list(s) for s in zip(*answers)]
    actor.train(training)
    out = {"eval_reward": sum(s[0] for s in per_record) / len(per_record),
           "eval_pass_rate": pass_rate(per_record, o.eval_pass_threshold), "eval_records": float(len(per_record))}
    if o.eval_samples:
        out["eval_sample_reward"] = sum(sum(s[1:]) for s in per_record) / (len(per_record) * o.eval_samples)
    return out


def _episode_answers(o: HFOptions, task: HFTask, actor: nn.Module, env: EnvEpisodes, idx: list[int], updates: int,
                     start: int) -> list[list[float]]:
    """Records ``idx`` of the eval set played as episodes, greedily then ``--eval-samples`` times sampled:
    each episode's return, per record."""
    greedy = dataclasses.replace(task.sampling, sample=False)
    device = next(actor.parameters()).device

    def generate(prompts: list[list[int]], params: SamplingParams, seed: int) -> Generation:
        ids, mask = left_pad(prompts, max(o.max_prompt_tokens, max(map(len, prompts))), task.pad_id)
        response, amask = generate_by_length(actor, ids.to(device), mask.long().to(device), params, task.eos_id,
                                             task.pad_id, seed, o.generate_buckets)
        return Generation.from_padded(response.cpu(), amask.cpu(), torch.zeros(amask.shape), task.eos_id)

    answers = []
    for k in range(1 + o.eval_samples):
        traces = env.start([task.eval_records[i] for i in idx])
        # every step waited for (no turn-wait): trainers under fsdp must make the same forwards
        run_turns(traces, generate, env.step, env.observation_ids, task.sampling if k else greedy,
                  (updates * 1_000_003 + start * 1024 + k) % 2**62, o.max_turns, o.episode_tokens)
        answers.append([t.episode_return() for t in traces])
    return [list(s) for s in zip(*answers)]
