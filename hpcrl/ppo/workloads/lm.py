"""Token-level LM PPO (the seed's ColossalChat ``coati/ray`` task, made small and measurable).

The four models of RLHF PPO, all built locally (no downloads):

* **actor** -- a tiny causal transformer LM (own pre-LN blocks, ``torch.nn`` only), *pretrained
  in-process* by :meth:`LMWorkload.build_model` on a synthetic corpus (below), so the initial policy
  is a sensible LM rather than noise;
* **critic** -- a separate transformer of the same shape, initialised from the pretrained trunk,
  with a zero-initialised scalar value head (separate trunks, as in ColossalChat: the value loss
  never moves the policy);
* **reward model** -- :class:`TargetTokenReward`, a rule scorer with a known optimum applied to the
  whole response, i.e. the reward arrives at the end of the sequence;
* **initial model** -- a frozen copy of the pretrained actor, held by the *collector* (maker side,
  cached per process, never part of the published model or of a trainer checkpoint).

Corpus (pretraining): "noisy counting" sequences ``x[t+1] = x[t] + d (mod V)`` with a per-sequence
step ``d`` in ``steps`` and, with probability ``noise``, a uniformly random token instead. To
continue a prompt the LM must infer ``d`` from the context (attention, not a bigram table).

Reward: ``score = fraction of generated tokens equal to target_token`` (``[0, 1]``, at the last
token). The optimum is known: 1.0, reached only by the response ``target target ... target``. The
pretrained LM scores about ``1 / vocab`` (every token is equally likely to be the target in the
corpus), and repeating one token is off-corpus (the initial model gives a repeat probability of
about ``noise / vocab``), so the KL term genuinely resists the reward. The all-target response
costs ~28 nats of KL(pi || initial) with the defaults (6 generated tokens), so with ``kl_coef``
below ~1/28 the reward optimum is also the KL-regularised optimum (score -> ~1, KL -> ~25 nats and
no further), while e.g. ``kl_coef = 0.3`` holds the policy within ~2 nats of the initial model.

Division of labour (docs/coati.md#experience, docs/coati.md#defects-of-coatiray-that-hpcrl-addresses): makers generate (temperature 1), score,
and ship ``tokens``, masks, ``behaviour_logp`` (log pi_maker of the sampled tokens, recomputed by one
full-sequence forward after sampling), ``ref_logp`` (frozen initial model) and ``score``. The
trainer computes per-token rewards ``-kl_coef * KL_t(behaviour || ref)`` + score at the last token,
values with its *current* critic, GAE (``gamma``, ``gae_lambda``: :meth:`LMWorkload.default_config`
sets ``gamma = 1``), whitened advantages, the clipped policy loss against ``behaviour_logp`` (or the
decoupled/truncated-IS form when ``cfg.truncated_is`` is set, per token or per sequence: ``cfg.is_level`` /
``cfg.is_mode``) and the clipped value loss.

LoRA (``lora_rank > 0``): every linear layer of the blocks (qkv, attention out, MLP in/out) of both
actor and critic becomes :class:`LoRALinear`, with the base weight frozen. Trainable: the adapters
and the critic's value head. Published (:meth:`LMWorkload.publish_tensors`): the actor's adapters only,
in a fixed order whose canonical names and shapes are checked against the config (fail loudly, no
``strict=False``). Maker side, :meth:`LMWorkload.after_publish` *merges*: each layer's effective weight
is rebuilt as ``W0 + s * B @ A`` from its pristine base ``W0`` (which is never written), so
inference runs on plain merged matrices and nothing accumulates over publishes. The trainer computes the
very same expression inside its forward (differentiably), so a maker's logits equal the trainer's
bit for bit.

Without LoRA the published tensors are all actor parameters (the critic never leaves the trainers;
makers never evaluate it) and :meth:`after_publish` is a no-op.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from hpcrl.core.config_check import ConfigError

from ..losses import approx_kl, masked_mean, sequence_rewards_with_kl, token_gae
from ..update import Coefs, GradStep, Outputs, Plan, Samples, ppo_update, read_stats
from ..workload import AdamLearner, Collector, PPOConfig, Workload
from .lm_corpus import CountingCorpus, TargetTokenReward, pretrain
from .lm_models import CausalTransformer, LMActorCritic, LoRALinear, token_logp

__all__ = [
    "CausalTransformer",
    "CountingCorpus",
    "LMActorCritic",
    "LMCollector",
    "LMLearner",
    "LMWorkload",
    "LoRALinear",
    "TargetTokenReward",
]


# --------------------------------------------------------------------------------------- workload


class LMWorkload(Workload):
    """Token-level LM PPO; see the module docstring. ``batch_size`` sequences per collect."""

    name = "lm"

    def __init__(self, vocab: int = 16, prompt_len: int = 6, gen_len: int = 6, d_model: int = 32,
                 n_layers: int = 2, n_heads: int = 2, batch_size: int = 32, lora_rank: int = 0,
                 lora_alpha: float | None = None, pretrain_steps: int = 200, pretrain_batch: int = 32,
                 pretrain_lr: float = 3e-3, task: str = "target_token", target_token: int = 0,
                 noise: float = 0.1, steps: tuple[int, ...] = (1, 2, 3), kl_estimator: str = "k1",
                 seq_len: int | None = None) -> None:
        if seq_len is not None and seq_len != prompt_len + gen_len:
            raise ValueError(f"seq_len={seq_len} must equal prompt_len + gen_len = {prompt_len + gen_len}")
        if prompt_len < 1 or gen_len < 1:
            raise ValueError(f"prompt_len={prompt_len} and gen_len={gen_len} must be >= 1")
        if task != "target_token":
            raise ValueError(f"unknown LM task {task!r} (known: 'target_token')")
        if not 0 <= target_token < vocab:
            raise ValueError(f"target_token={target_token} is outside the vocabulary [0, {vocab})")
        if kl_estimator not in ("k1", "k3"):
            raise ValueError(f"kl_estimator must be 'k1' or 'k3', not {kl_estimator!r}")
        self.vocab, self.prompt_len, self.gen_len = vocab, prompt_len, gen_len
        self.seq_len = prompt_len + gen_len
        self.d_model, self.n_layers, self.n_heads = d_model, n_layers, n_heads
        self.batch_size, self.lora_rank, self.lora_alpha = batch_size, lora_rank, lora_alpha
        self.pretrain_steps, self.pretrain_batch, self.pretrain_lr = pretrain_steps, pretrain_batch, pretrain_lr
        self.task, self.target_token, self.kl_estimator = task, target_token, kl_estimator
        self.corpus = CountingCorpus(vocab, noise, tuple(steps))
        self.reward_model = TargetTokenReward(target_token)
        self._arch = (vocab, self.seq_len, d_model, n_layers, n_heads)
        self._recipe = (noise, tuple(steps), pretrain_steps, pretrain_batch, pretrain_lr)
        self._refs: dict[tuple, CausalTransformer] = {}
        self._expected: list[tuple[str, tuple[int, ...]]] | None = None
        self.pretrain_loss = float("nan")

    def default_config(self) -> PPOConfig:
        """PPO hyper-parameters this workload was tuned with: gamma = 1 (the episode is the response),
        kl_coef = 0.02 (below 1 / KL(all-target response) ~ 1 / 28 nats, so the reward optimum is also
        the KL-regularised one), a higher learning rate for LoRA adapters."""
        return PPOConfig(epochs=4, minibatches=4, lr=3e-3 if self.lora_rank else 5e-4, gamma=1.0, gae_lambda=0.95,
                         clip_coef=0.2, value_clip_coef=0.2, ent_coef=0.0, vf_coef=0.5, max_grad_norm=1.0,
                         kl_coef=0.02)

    # -- models ----------------------------------------------------------------------------------
    def _new_lm(self, out_dim: int, rank: int) -> CausalTransformer:
        return CausalTransformer(self.vocab, self.seq_len, self.d_model, self.n_layers, self.n_heads, out_dim,
                                 rank, self.lora_alpha)

    def pretrained_state(self, seed: int) -> dict[str, Tensor]:
        """The pretrained LM's state dict (CPU), computed once per process per seed."""
        state, self.pretrain_loss = pretrain((self._arch, self._recipe, seed), self, seed)
        return state

    def build_model(self, seed: int, device: torch.device | str = "cpu") -> LMActorCritic:
        base = self.pretrained_state(seed)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + 1)
            actor = self._new_lm(self.vocab, self.lora_rank)
            critic = self._new_lm(1, self.lora_rank)
        _load_base(actor, base, with_head=True)
        _load_base(critic, base, with_head=False)
        nn.init.zeros_(critic.head.weight)
        nn.init.zeros_(critic.head.bias)
        if self.lora_rank:
            for net in (actor, critic):
                for name, p in net.named_parameters():
                    p.requires_grad_(".lora_" in name)
            critic.head.requires_grad_(True)
        return LMActorCritic(actor, critic, self.prompt_len, seed).to(device)

    def reference_model(self, seed: int, device: torch.device | str = "cpu") -> CausalTransformer:
        """The frozen initial model (the pretrained LM, no adapters), cached per (seed, device)."""
        key = (seed, str(device))
        if key not in self._refs:
            ref = self._new_lm(self.vocab, rank=0)
            ref.load_state_dict(self.pretrained_state(seed))
            self._refs[key] = ref.to(device).eval().requires_grad_(False)
        return self._refs[key]

    # -- weight publishing -----------------------------------------------------------------------------
    def _replicas_equal(self, name: str) -> bool:
        return ".lora_" in name if self.lora_rank else True

    def expected_publish_names(self) -> list[tuple[str, tuple[int, ...]]]:
        """Canonical (name, shape) list a publish carries, from the config alone (meta tensors)."""
        if self._expected is None:
            with torch.device("meta"):
                actor = self._new_lm(self.vocab, self.lora_rank)
            self._expected = [(f"actor.{n}", tuple(p.shape)) for n, p in actor.named_parameters() if self._replicas_equal(n)]
        return self._expected

    def publish_names(self, model: LMActorCritic) -> list[str]:
        return [name for name, _ in self._publish_items(model)]

    def _publish_items(self, model: LMActorCritic) -> list[tuple[str, Tensor]]:
        items = [(f"actor.{n}", p) for n, p in model.actor.named_parameters() if self._replicas_equal(n)]
        got = [(n, tuple(p.shape)) for n, p in items]
        want = self.expected_publish_names()
        if got != want:
            missing = sorted(set(want) - set(got))
            unexpected = sorted(set(got) - set(want))
            raise ValueError(f"LM publish tensors do not match the config (lora_rank={self.lora_rank}): "
                             f"missing {missing[:6]}, unexpected {unexpected[:6]}"
                             + ("" if missing or unexpected else ", order differs"))
        if self.lora_rank:
            trainable = [f"actor.{n}" for n, p in model.actor.named_parameters() if p.requires_grad]
            if trainable != [n for n, _ in items]:
                raise ValueError(f"LoRA mode: trainable actor parameters {trainable[:6]} are not exactly the adapters")
        return items

    def publish_tensors(self, model: LMActorCritic) -> list[Tensor]:
        """Actor parameters a publish carries (all of them, or only the LoRA adapters), fixed order."""
        return [p.data for _, p in self._publish_items(model)]

    def after_publish(self, model: LMActorCritic) -> None:
        """Maker side: LoRA -> rebuild every effective weight as ``W0 + s * B @ A`` from the pristine
        base (no accumulation); full-parameter publish -> nothing to do."""
        if self.lora_rank:
            for layer in model.actor.lora_layers():
                layer.merge_()

    # -- roles -----------------------------------------------------------------------------------
    def make_collector(self, rank_seed: int, device: torch.device | str = "cpu") -> "LMCollector":
        return LMCollector(self, rank_seed, torch.device(device))

    def make_learner(self, model: LMActorCritic, cfg: PPOConfig, grad_average: Any) -> "LMLearner":
        return LMLearner(self, model, cfg, grad_average)


def _load_base(net: CausalTransformer, base: dict[str, Tensor], with_head: bool) -> None:
    """Copy the pretrained (rank-0) weights into ``net``; adapters and (optionally) the head keep
    their init. Every base key must land (strict by construction)."""
    own = dict(net.state_dict())
    for k, v in base.items():
        if k.startswith("head.") and not with_head:
            continue
        if k not in own or own[k].shape != v.shape:
            raise ValueError(f"pretrained key {k!r} {tuple(v.shape)} has no match in the model")
        own[k] = v
    net.load_state_dict(own, strict=True)


# -------------------------------------------------------------------------------------- collector


class LMCollector(Collector):
    """Maker side: prompts from a seeded stream, sampling, scoring, reference log-probs."""

    def __init__(self, wl: LMWorkload, rank_seed: int, device: torch.device) -> None:
        self.wl, self.device = wl, device
        self.prompt_gen = torch.Generator().manual_seed(rank_seed)
        self.batches = 0

    def next_prompts(self) -> Tensor:
        return self.wl.corpus.sample(self.wl.batch_size, self.wl.prompt_len, self.prompt_gen)

    @torch.no_grad()
    def collect(self, model: LMActorCritic, generator: torch.Generator) -> tuple[dict[str, Tensor], dict[str, float]]:
        wl = self.wl
        actor = model.actor
        device = next(actor.parameters()).device
        ref = wl.reference_model(model.init_seed, device)
        tokens = self.next_prompts().to(device)
        for _ in range(wl.gen_len):
            probs = torch.softmax(actor(tokens)[:, -1].float(), -1)
            nxt = torch.multinomial(probs.to(generator.device), 1, generator=generator).to(device)
            tokens = torch.cat([tokens, nxt], 1)
        actions = tokens[:, wl.prompt_len :]
        # One full-sequence forward (as the trainer does) rather than the incremental logits, so the
        # first PPO ratio at lag 0 is 1 up to batch-shape rounding.
        logp = token_logp(model.action_logits(tokens), actions)
        ref_logp = token_logp(ref(tokens[:, :-1])[:, wl.prompt_len - 1 :], actions)
        mask = torch.ones_like(logp)
        score = wl.reward_model(actions, mask)
        self.batches += 1
        batch = {
            "tokens": tokens,
            "attention_mask": torch.ones(tokens.shape, dtype=torch.float32, device=device),
            "action_mask": mask,
            "behaviour_logp": logp,
            "ref_logp": ref_logp,
            "score": score,
        }
        n = float(tokens.shape[0])
        score_sum = float(score.sum())
        stats = {
            "reward_sum": score_sum,
            "sequences": n,
            "episode_return_sum": score_sum,
            "episodes": n,
            "env_steps": float(mask.sum()),
            "kl_to_ref_sum": float((logp - ref_logp).sum()),
        }
        return batch, stats

    def state_dict(self) -> dict[str, Any]:
        return {"prompt_gen": self.prompt_gen.get_state(), "batches": self.batches}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.prompt_gen.set_state(state["prompt_gen"])
        self.batches = int(state["batches"])


# ---------------------------------------------------------------------------------------- learner


class LMLearner(AdamLearner):
    """Trainer side: KL-shaped token rewards, GAE with the current critic, clipped PPO, Adam."""

    def __init__(self, wl: LMWorkload, model: LMActorCritic, cfg: PPOConfig, grad_average: Any) -> None:
        if cfg.advantage != "grpo":
            raise ConfigError(f"--ppo.advantage {cfg.advantage}: a group baseline needs groups of samples per prompt "
                              "(--workload hf --hf.algo grpo); --workload lm uses GAE with its critic; drop it")
        super().__init__(model, cfg, grad_average)
        self.wl = wl

    def update(self, batches: list[dict[str, Tensor]], generator: torch.Generator) -> dict[str, float]:
        cfg, model = self.cfg, self.model
        device = next(model.parameters()).device
        b = {k: torch.cat([x[k] for x in batches]).to(device) for k in batches[0]}
        for layer in model.actor.lora_layers() + model.critic.lora_layers():
            layer.unmerge_()  # a trainer never runs on a cached merge
        tokens = b["tokens"]
        actions = tokens[:, self.wl.prompt_len :]
        lr = self.start_update()
        samples, rewards = self._samples(b)

        def forward(idx: Tensor) -> Outputs:
            logp_all = torch.log_softmax(model.action_logits(tokens[idx]).float(), -1)
            logp = logp_all.gather(-1, actions[idx].unsqueeze(-1)).squeeze(-1)
            entropy = -(logp_all.exp() * logp_all).sum(-1)
            return Outputs(logp, entropy, model.values(tokens[idx]).float())

        step = GradStep(self.optimizer, self.params, self.grad_average, cfg.max_grad_norm)
        stats = ppo_update(forward, samples, Coefs.of(cfg), Plan(cfg.epochs, cfg.minibatches), step, generator,
                           stats_dtype=torch.float64, loss_norm=cfg.loss_norm)
        stats.update(_sequence_stats(samples, b["ref_logp"].float(), b["score"].float(), rewards))
        if cfg.kl_target is not None:
            stats["kl_measure"] = self.kl_measure(stats["kl_to_ref"])
        out = read_stats(stats)
        n = tokens.shape[0]
        kl_coef = self.finish_update(out.pop("kl_measure", out["kl_to_ref"]), n * self.trainers())
        return {**out, "sequences": float(n), "lr": lr, "kl_coef": kl_coef}

    @torch.no_grad()
    def _samples(self, b: dict[str, Tensor]) -> tuple[Samples, Tensor]:
        """Token rewards, the current critic's values, GAE (the sequence terminates at its last action
        token), whitened advantages and (with ``cfg.truncated_is``) the proximal log-probs, rows = sequences (the
        sequence-level rollout corrections' weights are per row)."""
        cfg, model = self.cfg, self.model
        tokens, mask = b["tokens"], b["action_mask"]
        blogp, ref_logp, score = b["behaviour_logp"].float(), b["ref_logp"].float(), b["score"].float()
        old_values = model.values(tokens).float()
        rewards = sequence_rewards_with_kl(score, blogp, ref_logp, mask, self.kl_coef, self.wl.kl_estimator)
        adv, returns = token_gae(rewards, old_values, mask, cfg.gamma, cfg.gae_lambda, cfg.normalize_advantages)
        prox_logp = None
        if cfg.truncated_is is not None:
            prox_logp = token_logp(model.action_logits(tokens), tokens[:, self.wl.prompt_len :])
        return Samples(blogp, adv, old_values, returns, prox_logp, mask=mask), rewards


@torch.no_grad()
def _sequence_stats(s: Samples, ref_logp: Tensor, score: Tensor, rewards: Tensor) -> dict[str, Tensor]:
    """Per-update stats of the batch (device tensors): score, KL to the reference per sequence (k1 and
    k3), shaped reward, the critic's mean value and its explained variance of the returns."""
    mask, blogp = s.mask, s.behaviour_logp
    var_ret = s.returns[mask > 0].var()
    explained = 1 - (s.returns - s.old_values)[mask > 0].var() / var_ret
    return {"score": score.mean(), "kl_to_ref": ((blogp - ref_logp) * mask).sum(-1).mean(),
            "kl_to_ref_k3": (approx_kl(blogp, ref_logp) * mask).sum(-1).mean(),
            "reward": (rewards * mask).sum(-1).mean(), "value_mean": masked_mean(s.old_values, mask),
            "explained_variance": torch.where(var_ret > 0, explained, torch.zeros_like(explained))}
