"""The ``hf`` workload's trainer side: token-level PPO (KL-shaped rewards, GAE with the current
critic, clipped losses) or GRPO (group-normalised scores, a KL loss term), through
:func:`hpcrl.ppo.update.ppo_update` (:mod:`hpcrl.ppo.workloads.hf`); after every ``--eval-every``-th
update, the held-out evaluation (:func:`~.hf_eval.evaluate`) joins the update's stats."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ..losses import approx_kl, masked_mean, sequence_rewards_with_kl, token_gae
from ..update import Coefs, GradStep, Outputs, Plan, Samples, ppo_update, read_stats
from ..workload import AdamLearner, PPOConfig
from .hf_eval import evaluate
from .hf_generate import token_logp

if TYPE_CHECKING:
    from .hf import HFActorCritic, HFWorkload

__all__ = ["HFLearner", "group_advantages"]


def group_advantages(score: Tensor, group_size: int, eps: float = 1e-6) -> Tensor:
    """GRPO: ``(score - mean) / (std + eps)`` within consecutive groups of ``group_size`` ([B] -> [B]);
    a group whose scores are all equal gets 0 (no signal, no NaN)."""
    g = score.float().view(-1, group_size)
    return ((g - g.mean(1, keepdim=True)) / (g.std(1, unbiased=False, keepdim=True) + eps)).view(-1)


class HFLearner(AdamLearner):
    """Trainer side: token-level PPO (KL-shaped rewards, GAE, clipped losses) or GRPO; Adam."""

    def __init__(self, wl: HFWorkload, model: HFActorCritic, cfg: PPOConfig, grad_average: Any) -> None:
        super().__init__(model, cfg, grad_average)
        self.wl = wl

    @torch.no_grad()
    def _samples(self, b: dict[str, Tensor]) -> tuple[Samples, Tensor]:
        """The update's samples (advantages; returns and old values with a critic; the reference
        log-probs for GRPO's KL term; proximal log-probs with ``cfg.truncated_is``) and token rewards."""
        cfg, model, wl = self.cfg, self.model, self.wl
        tokens, attn, mask = b["tokens"], b["attention_mask"], b["action_mask"]
        blogp, ref_logp, score = b["behaviour_logp"].float(), b["ref_logp"].float(), b["score"].float()
        prox = None
        if cfg.truncated_is is not None:
            prox = token_logp(model.action_logits(tokens, attn), tokens[:, wl.max_prompt_tokens:], wl.temperature)
        if wl.algo == "grpo":
            adv = group_advantages(score, wl.group_size)[:, None] * mask
            rewards = sequence_rewards_with_kl(score, blogp, ref_logp, mask, 0.0, wl.kl_estimator)
            return Samples(blogp, adv, proximal_logp=prox, ref_logp=ref_logp, mask=mask), rewards
        old_values = model.values(tokens, attn).float()
        rewards = sequence_rewards_with_kl(score, blogp, ref_logp, mask, cfg.kl_coef, wl.kl_estimator)
        adv, returns = token_gae(rewards, old_values, mask, cfg.gamma, cfg.gae_lambda, cfg.normalize_advantages)
        return Samples(blogp, adv, old_values, returns, prox, mask=mask), rewards

    def update(self, batches: list[dict[str, Tensor]], generator: torch.Generator) -> dict[str, float]:
        cfg, model, wl = self.cfg, self.model, self.wl
        b = {k: torch.cat([x[k] for x in batches]).to(model.compute_device) for k in batches[0]}
        tps = b.pop("maker_tokens_per_s")
        tokens, attn = b["tokens"], b["attention_mask"]
        response = tokens[:, wl.max_prompt_tokens:]
        model.train()  # dropout is off (build_model); train mode is what gradient checkpointing acts in
        t_start = time.perf_counter()
        samples, rewards = self._samples(b)
        critic = samples.old_values is not None

        def forward(idx: Tensor) -> Outputs:
            logits = model.action_logits(tokens[idx], attn[idx]).float() / wl.temperature
            logp_all = torch.log_softmax(logits, -1)
            logp = logp_all.gather(-1, response[idx].unsqueeze(-1)).squeeze(-1)
            values = model.values(tokens[idx], attn[idx]).float() if critic else None
            return Outputs(logp, -(logp_all.exp() * logp_all).sum(-1), values)

        n = tokens.shape[0]
        minibatches = min(cfg.minibatches, n // wl.group_size if wl.algo == "grpo" else n) or 1
        step = GradStep(self.optimizer, self.params, self.grad_average, cfg.max_grad_norm)
        stats = ppo_update(forward, samples, Coefs.of(cfg), Plan(cfg.epochs, minibatches), step, generator,
                           stats_dtype=torch.float64, logp_gap=True)
        self.updates += 1
        stats.update(_sequence_stats(samples, b["ref_logp"].float(), b["score"].float(), rewards),
                     maker_tokens_per_s=tps.mean(), tokens=attn.sum())
        out = read_stats(stats)  # the one host read: also waits for the update's device work
        tokens_done = out.pop("tokens")
        out.update(sequences=float(n),
                   trainer_tokens_per_s=tokens_done * cfg.epochs / max(time.perf_counter() - t_start, 1e-9))
        if wl.eval_every and self.updates % wl.eval_every == 0:  # every trainer: the same numbers
            out.update(evaluate(wl, model, self.updates))
        return out


@torch.no_grad()
def _sequence_stats(s: Samples, ref_logp: Tensor, score: Tensor, rewards: Tensor) -> dict[str, Tensor]:
    """Per-update stats of the batch (device tensors): score and its spread, KL to the reference per
    sequence (k1, k3), shaped reward, response length, EOS fraction, and with a critic its mean value
    and explained variance of the returns."""
    mask, blogp = s.mask, s.behaviour_logp
    lengths = mask.sum(-1)
    out = {"score": score.mean(), "score_std": score.std(unbiased=False),
           "kl_to_ref": ((blogp - ref_logp) * mask).sum(-1).mean(),
           "kl_to_ref_k3": (approx_kl(blogp, ref_logp) * mask).sum(-1).mean(),
           "reward": (rewards * mask).sum(-1).mean(), "response_len": lengths.mean(),
           "eos_frac": (lengths < mask.shape[1]).float().mean()}
    if s.old_values is not None:
        var_ret = s.returns[mask > 0].var()
        explained = 1 - (s.returns - s.old_values)[mask > 0].var() / var_ret
        out.update(value_mean=masked_mean(s.old_values, mask),
                   explained_variance=torch.where(var_ret > 0, explained, torch.zeros_like(explained)))
    return out
