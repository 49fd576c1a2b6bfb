"""The ``hf`` workload's trainer side: token-level PPO (KL-shaped rewards, GAE with the current
critic, clipped losses) or GRPO (group-normalised scores, a KL loss term), with ``--ref-on trainers``
the reference log-probs of each received batch first (:meth:`HFLearner.reference_logp`), through
:func:`hpcrl.ppo.update.ppo_update` (:mod:`hpcrl.ppo.workloads.hf`); after every ``--eval-every``-th
update, the held-out evaluation (:func:`~.hf_eval.evaluate`) joins the update's stats."""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from hpcrl.core.config_check import ConfigError

from ..losses import (approx_kl, group_advantages, masked_mean, per_token_kl_penalty, sequence_rewards_with_kl,
                      token_gae)
from ..update import Coefs, GradStep, Outputs, Plan, Samples, ppo_update, read_stats
from ..workload import AdamLearner, PPOConfig
from .hf_env import EnvEpisodes
from .hf_eval import evaluate
from .hf_generate import position_ids, token_logp

if TYPE_CHECKING:
    from .hf_factory import HFActorCritic
    from .hf_options import HFOptions
    from .hf_task import HFTask

__all__ = ["HFLearner", "check_learner_options", "group_advantages"]


def check_learner_options(algo: str, cfg: PPOConfig, micro_batch_size: int | None, flag: str = "--hf.") -> None:
    """What the hf learner refuses (one ConfigError line): a group baseline without groups, a
    micro-batch size that is not a positive integer (any size works: the last piece may be shorter)."""
    if cfg.advantage != "grpo" and algo != "grpo":
        raise ConfigError(f"--ppo.advantage {cfg.advantage}: a group baseline needs {flag}algo grpo (samples per "
                          f"prompt); drop it, or pass {flag}algo grpo")
    if micro_batch_size is not None and (not isinstance(micro_batch_size, int) or isinstance(micro_batch_size, bool)
                                         or not 1 <= micro_batch_size <= 1 << 20):
        raise ConfigError(f"{flag}micro-batch-size {micro_batch_size}: must be an integer >= 1 (sequences per forward "
                          f"/ backward pass); e.g. {flag}micro-batch-size 4, or leave it unset (the whole minibatch)")


class HFLearner(AdamLearner):
    """Trainer side: token-level PPO (KL-shaped rewards, GAE, clipped losses) or GRPO; Adam. The task is
    read only by the held-out evaluation (:func:`~.hf_eval.evaluate`)."""

    def __init__(self, options: HFOptions, task: HFTask, model: HFActorCritic, cfg: PPOConfig,
                 grad_average: Any) -> None:
        check_learner_options(options.algo, cfg, options.micro_batch_size, options.FLAG_PREFIX)
        super().__init__(model, cfg, grad_average)
        self.options, self.task = options, task
        self.packing_checked = False
        self.eval_env: EnvEpisodes | None = None
        if options.ref_on == "trainers":
            print(f"hpcrl.ppo hf trainer: ref_logp on the trainers, reference: {_reference_held(model)}",
                  file=sys.stderr, flush=True)

    @torch.no_grad()
    def reference_logp(self, tokens: Tensor, attn: Tensor, mask: Tensor, rows: int) -> Tensor:
        """``[B, G]`` ref_logp under ``--ref-on trainers``: the frozen reference's log-probs of the response
        tokens, tempered as the makers temper theirs, masked as theirs, in forwards of ``rows`` sequences
        (one received batch: the makers' shapes; fewer with ``--micro-batch-size``). The reference is the
        model's own (sharded under fsdp: every trainer makes the same forwards, each received batch
        having the same shape) or, with LoRA, the actor with its adapters disabled."""
        o = self.options
        step = min(rows, o.micro_batch_size or rows)
        if o.micro_batch_tokens is not None:  # padded forwards: the budget in whole rows
            step = min(step, max(1, o.micro_batch_tokens // tokens.shape[1]))
        response = tokens[:, o.max_prompt_tokens:]
        out = []
        for i in range(0, tokens.shape[0], step):
            t, a = tokens[i:i + step], attn[i:i + step]
            out.append(token_logp(self._reference_logits(t, a), response[i:i + step], o.temperature))
        return torch.cat(out) * mask

    def _reference_logits(self, tokens: Tensor, attn: Tensor) -> Tensor:
        model = self.model
        if model.reference is not None:
            return model.action_logits(tokens, attn, model.reference)
        # LoRA: the base model is the reference. peft freezes the adapters while they are off and makes
        # them trainable again after (FSDP2 re-reads requires_grad at every gather: tested under fsdp)
        with model.actor.disable_adapter():
            return model.action_logits(tokens, attn)

    @torch.no_grad()
    def _samples(self, b: dict[str, Tensor]) -> tuple[Samples, Tensor]:
        """The update's samples (advantages; returns and old values with a critic; the reference
        log-probs for GRPO's KL term; proximal log-probs with ``cfg.truncated_is``, for the rollout correction at
        ``cfg.is_level`` / ``cfg.is_mode``: rows are sequences) and token rewards."""
        cfg, model, o = self.cfg, self.model, self.options
        tokens, attn, mask = b["tokens"], b["attention_mask"], b["action_mask"]
        blogp, ref_logp, score = b["behaviour_logp"].float(), b["ref_logp"].float(), b["score"].float()
        prox = None
        if cfg.truncated_is is not None:
            prox = token_logp(model.action_logits(tokens, attn), tokens[:, o.max_prompt_tokens:], o.temperature)
        if o.algo == "grpo":
            adv = group_advantages(score, o.group_size, cfg.advantage)[:, None] * mask
            rewards = sequence_rewards_with_kl(score, blogp, ref_logp, mask, 0.0, o.kl_estimator)
            return Samples(blogp, adv, proximal_logp=prox, ref_logp=ref_logp, mask=mask), rewards
        old_values = model.values(tokens, attn).float()
        if "turn_reward" in b:  # episodes: each turn's reward where the turn ended, the KL penalty on every token
            rewards = per_token_kl_penalty(blogp, ref_logp, mask, self.kl_coef, o.kl_estimator) + b["turn_reward"]
        else:
            rewards = sequence_rewards_with_kl(score, blogp, ref_logp, mask, self.kl_coef, o.kl_estimator)
        adv, returns = token_gae(rewards, old_values, mask, cfg.gamma, cfg.gae_lambda, cfg.normalize_advantages)
        return Samples(blogp, adv, old_values, returns, prox, mask=mask), rewards

    def update(self, batches: list[dict[str, Tensor]], generator: torch.Generator) -> dict[str, float]:
        cfg, model, o = self.cfg, self.model, self.options
        b = {k: torch.cat([x[k] for x in batches]).to(model.compute_device) for k in batches[0]}
        tps = b.pop("maker_tokens_per_s")
        info = b.pop("episode_info", None)
        tokens, attn = b["tokens"], b["attention_mask"]
        response = tokens[:, o.max_prompt_tokens:]
        t_start = time.perf_counter()
        if o.ref_on == "trainers":  # before train mode: the reference forward is an eval one
            model.eval()
            b["ref_logp"] = self.reference_logp(tokens, attn, b["action_mask"], batches[0]["tokens"].shape[0])
        model.train()  # dropout is off (build_model); train mode is what gradient checkpointing acts in
        lr = self.start_update()
        samples, rewards = self._samples(b)
        critic = samples.old_values is not None

        trim = self._trim(attn, b["action_mask"])

        def forward(idx: Tensor) -> Outputs:
            if trim is not None:
                return trim.forward(model, tokens, attn, response, idx, o.temperature, critic)
            logits = model.action_logits(tokens[idx], attn[idx]).float() / o.temperature
            logp_all = torch.log_softmax(logits, -1)
            logp = logp_all.gather(-1, response[idx].unsqueeze(-1)).squeeze(-1)
            values = model.values(tokens[idx], attn[idx]).float() if critic else None
            return Outputs(logp, -(logp_all.exp() * logp_all).sum(-1), values)

        n = tokens.shape[0]
        minibatches = min(cfg.minibatches, n // o.group_size if o.algo == "grpo" else n) or 1
        step = GradStep(self.optimizer, self.params, self.grad_average, cfg.max_grad_norm)
        coefs = dataclasses.replace(Coefs.of(cfg), kl=self.kl_coef)
        width = tokens.shape[1]
        cost = (lambda rows: len(rows) * width) if trim is None else trim.cost  # noqa: E731  (padded: all of it)
        stats = ppo_update(forward, samples, coefs, Plan(cfg.epochs, minibatches), step, generator,
                           stats_dtype=torch.float64, logp_gap=True, micro_batch_size=o.micro_batch_size,
                           loss_norm=cfg.loss_norm, piece_key=None if trim is None else trim.key,
                           micro_batch_tokens=o.micro_batch_tokens, piece_cost=cost)
        stats.update(_sequence_stats(samples, b["ref_logp"].float(), b["score"].float(), rewards),
                     maker_tokens_per_s=tps.mean(), tokens=attn.sum())
        if info is not None:
            stats.update(episode_stats(info, b["action_mask"]))
        if cfg.kl_target is not None:
            stats["kl_measure"] = self.kl_measure(stats["kl_to_ref"])
        out = read_stats(stats)  # the one host read: also waits for the update's device work
        tokens_done = out.pop("tokens")
        if trim is not None:
            out.update(trim.stats())
        measured = out.pop("kl_measure", out["kl_to_ref"])
        out.update(lr=lr, kl_coef=self.finish_update(measured, n * self.trainers()))
        out.update(sequences=float(n),
                   trainer_tokens_per_s=tokens_done * cfg.epochs / max(time.perf_counter() - t_start, 1e-9))
        if o.eval_every and self.updates % o.eval_every == 0:  # every trainer: the same numbers
            out.update(self._evaluate())
        return out

    def _trim(self, attn: Tensor, action_mask: Tensor) -> _Trim | None:
        """The padding-free forward ``--ppo.pack-sequences`` / ``--ppo.trim-padding`` ask for, or None."""
        cfg, p = self.cfg, self.options.max_prompt_tokens
        if cfg.pack_sequences:
            if not self.packing_checked:
                check_packing(self.model)
                self.packing_checked = True
            return _Pack(attn, action_mask, p)
        return _Trim(attn, action_mask, p) if cfg.trim_padding else None

    def _evaluate(self) -> dict[str, float]:
        if self.options.multi_turn and self.eval_env is None:  # its own tool workers, on this trainer
            self.eval_env = EnvEpisodes(self.options, self.task)
        return evaluate(self.options, self.task, self.model, self.updates, self.eval_env)


class _Trim:
    """``cfg.trim_padding``: the training forward over only the columns some sequence of the piece
    uses. Prompts are left-padded to ``P`` and responses right-padded to ``G``: a piece whose longest
    prompt is ``P - lead`` tokens and longest response ``g`` runs on columns ``lead .. P + g``; its
    outputs are padded back to ``G`` with zeros (weight 0: outside every mask). Exact: dropped keys
    are masked out of attention, position ids count real tokens only, and the causal model's outputs
    at kept positions never see the dropped tail. ``padding_frac`` / ``trimmed_padding_frac``: the
    share of computed token positions that are padding, without and with the trim."""

    def __init__(self, attn: Tensor, action_mask: Tensor, prompt_len: int) -> None:
        self.P, self.G = prompt_len, action_mask.shape[1]
        # the tokens after the prompt are a prefix of the response columns (the action mask has gaps in episodes)
        after = attn[:, prompt_len:]
        lengths = torch.stack([attn[:, :prompt_len].sum(-1), after.sum(-1)]).long().cpu()  # one host read
        self.lead = (prompt_len - lengths[0]).tolist()
        self.resp = lengths[1].tolist()
        self.real = float(lengths.sum())
        # micro-batches of like lengths (response first, then prompt): their forwards trim the most
        self.key = (after.sum(-1).long() * (prompt_len + 1) + attn[:, :prompt_len].sum(-1).long())
        self.full = 0
        self.kept = 0

    def _span(self, rows: list[int]) -> tuple[int, int]:
        """(first kept column, response columns kept) of a forward over ``rows``."""
        return min(self.lead[i] for i in rows), max(1, max(self.resp[i] for i in rows))

    def cost(self, rows: list[int]) -> int:
        """Token positions a forward over ``rows`` computes (``--micro-batch-tokens`` counts these)."""
        lead, g = self._span(rows)
        return len(rows) * (self.P - lead + g)

    def forward(self, model: Any, tokens: Tensor, attn: Tensor, response: Tensor, idx: Tensor, temperature: float,
                critic: bool) -> Outputs:
        rows = idx.tolist()  # on a GPU: a sync per forward (the piece's shape is a host number)
        lead, g = self._span(rows)
        p = self.P - lead
        self.full += len(rows) * (self.P + self.G)
        self.kept += len(rows) * (p + g)
        t, a = tokens[idx, lead:self.P + g], attn[idx, lead:self.P + g]
        pos = position_ids(a)
        # HFActorCritic.action_logits / values with the piece's own prompt length p
        out = model.actor(input_ids=t, attention_mask=a.long(), position_ids=pos, use_cache=False,
                          logits_to_keep=g + 1)
        logp_all = torch.log_softmax(out.logits[:, :-1].float() / temperature, -1)
        logp = logp_all.gather(-1, response[idx, :g].unsqueeze(-1)).squeeze(-1)
        entropy = -(logp_all.exp() * logp_all).sum(-1)
        values = model.critic(t, a.long(), pos)[:, p - 1:-1].float() if critic else None
        pad = lambda x: None if x is None else torch.nn.functional.pad(x, (0, self.G - g))  # noqa: E731
        return Outputs(pad(logp), pad(entropy), pad(values))

    name = "trimmed"

    def stats(self) -> dict[str, float]:
        """Padding shares of this update's training forwards (``real`` tokens counted once per forward)."""
        if not self.full:
            return {}
        epochs = self.full / (len(self.lead) * (self.P + self.G))  # forwards per sample
        real = self.real * epochs
        return {"padding_frac": 1.0 - real / self.full, f"{self.name}_padding_frac": 1.0 - real / self.kept}


class _Pack(_Trim):
    """``cfg.pack_sequences``: the training forward over the piece's real tokens only. Each sequence's
    prompt (without its left padding) and response (up to its last real token) are laid end to end in
    rows as wide as the longest sequence of the piece, longest first into the first row with room; the
    position ids restart at 0 for each, which transformers turns into a block-diagonal causal mask when
    no attention mask is given (:func:`check_packing`). A row's unused tail is one more "sequence" of its
    own, never read. Outputs are gathered back into the padded ``[rows, G]`` layout, zeros beyond each
    response. ``packed_padding_frac``: the share of computed positions in those tails."""

    name = "packed"

    def _bins(self, rows: list[int]) -> tuple[list[list[int]], int, dict[int, int]]:
        """(the packed rows' members, their width, each sequence's length): first fit, longest first, into
        rows as wide as the longest sequence."""
        length = {i: self.P - self.lead[i] + self.resp[i] for i in rows}
        width = max(length.values())
        bins: list[list[int]] = []
        used: list[int] = []
        for i in sorted(rows, key=lambda i: -length[i]):
            b = next((b for b, u in enumerate(used) if u + length[i] <= width), len(used))
            if b == len(used):
                bins.append([])
                used.append(0)
            bins[b].append(i)
            used[b] += length[i]
        return bins, width, length

    def cost(self, rows: list[int]) -> int:
        bins, width, _ = self._bins(rows)
        return len(bins) * width

    def forward(self, model: Any, tokens: Tensor, attn: Tensor, response: Tensor, idx: Tensor, temperature: float,
                critic: bool) -> Outputs:
        rows = idx.tolist()
        bins, width, length = self._bins(rows)
        src = torch.zeros(len(bins), width, dtype=torch.long)  # flat index into tokens of each packed slot
        pos = torch.zeros(len(bins), width, dtype=torch.long)
        out_row = torch.zeros(len(rows), self.G, dtype=torch.long)  # where each output is read: packed row,
        out_col = torch.zeros(len(rows), self.G, dtype=torch.long)  # column
        out_mask = torch.zeros(len(rows), self.G, dtype=torch.bool)
        slot = {i: k for k, i in enumerate(rows)}
        row_width = self.P + self.G
        for b, members in enumerate(bins):
            off = 0
            for i in members:
                n, p, g = length[i], self.P - self.lead[i], self.resp[i]
                src[b, off:off + n] = i * row_width + torch.arange(self.lead[i], self.P + g)
                pos[b, off:off + n] = torch.arange(n)
                # the logits at the position before each response token score it
                out_row[slot[i], :g] = b
                out_col[slot[i], :g] = off + p - 1 + torch.arange(g)
                out_mask[slot[i], :g] = True
                off += n
            pos[b, off:] = torch.arange(width - off)  # the tail: a block of its own
        self.full += len(rows) * row_width
        self.kept += len(bins) * width
        # logits only at the columns some output is read from (the vocabulary projection is the big one)
        cols = torch.unique(out_col[out_mask])
        col_at = torch.zeros(width, dtype=torch.long)
        col_at[cols] = torch.arange(len(cols))
        device = tokens.device
        at_logit = (out_row * len(cols) + col_at[out_col]).reshape(-1).to(device)
        at_value = (out_row * width + out_col).reshape(-1).to(device)
        src, pos, cols, out_mask = (x.to(device) for x in (src, pos, cols, out_mask))
        t = tokens.reshape(-1)[src]
        out = model.actor(input_ids=t, attention_mask=None, position_ids=pos, use_cache=False, logits_to_keep=cols)
        logits = out.logits.reshape(-1, out.logits.shape[-1])[at_logit]
        logp_all = torch.log_softmax(logits.float() / temperature, -1).view(len(rows), self.G, -1)
        logp = logp_all.gather(-1, response[idx].unsqueeze(-1)).squeeze(-1) * out_mask
        entropy = -(logp_all.exp() * logp_all).sum(-1) * out_mask
        values = None
        if critic:
            values = model.critic(t, None, pos).float().reshape(-1)[at_value].view(len(rows), self.G) * out_mask
        return Outputs(logp, entropy, values)


def check_packing(model: Any) -> None:
    """The actor separates packed sequences (transformers' packed-sequence masks: position ids that
    restart, no attention mask), else a ConfigError: packing would let sequences attend to each other.
    Two short sequences, alone and packed into one row: the second's logits must not change."""
    tokens = torch.tensor([[3, 4, 5, 6], [7, 8, 9, 10]], device=model.compute_device)
    ar = torch.arange(4, device=tokens.device)
    alone_pos, packed_pos = ar[None], torch.cat([ar, ar])[None]
    with torch.no_grad():
        nets = [lambda t, pos: model.actor(input_ids=t, attention_mask=None, position_ids=pos, use_cache=False).logits]
        if model.critic is not None:
            nets.append(lambda t, pos: model.critic(t, None, pos))
        pairs = [(net(tokens[1:], alone_pos)[0].float(), net(tokens.reshape(1, -1), packed_pos)[0, 4:].float())
                 for net in nets]
    # loose enough for bf16 rounding across shapes; attending to another sequence moves outputs far more
    apart = all(torch.allclose(a, b, rtol=1e-2, atol=1e-2 * float(a.abs().max())) for a, b in pairs)
    if not apart:
        raise ConfigError("--ppo.pack-sequences: this model's attention does not keep packed sequences apart "
                          "(recent transformers build block-diagonal masks from restarting position ids, for models "
                          "on their shared masking code); drop the flag, or use --ppo.trim-padding True")


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


@torch.no_grad()
def episode_stats(info: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """Per-update stats of multi-turn episodes (``info``: ``episode_info`` rows, :data:`~.rollout.EPISODE_INFO`):
    turns and tool calls per episode, the share of episodes that called a tool, of calls that failed (an
    error or a timeout), of episodes truncated and of episodes the maker ended (their step failed), and the share of the tokens after the prompts that are observations."""
    turns, calls, tool_errors, truncated, errors, obs = info.float().unbind(-1)
    policy = mask.sum()
    return {"turns": turns.mean(), "tool_calls": calls.mean(), "tool_call_rate": (calls > 0).float().mean(),
            "tool_error_frac": tool_errors.sum() / torch.clamp(calls.sum(), min=1.0), "truncated_frac": truncated.mean(),
            "episode_error_frac": errors.mean(),
            "observation_token_frac": obs.sum() / torch.clamp(obs.sum() + policy, min=1.0)}


def _reference_held(model: HFActorCritic) -> str:
    """What a trainer's reference is, and the share of its parameters this trainer holds."""
    ref = model.reference
    if ref is None:
        return "the actor's base with the LoRA adapters disabled (no second model)"
    here = total = 0
    for p in ref.parameters():
        total += p.numel()
        here += p.to_local().numel() if hasattr(p, "to_local") else p.numel()
    how = "sharded" if here < total else "a full copy"
    return f"{how}, {here / 1e6:.2f}M of {total / 1e6:.2f}M parameters here"
