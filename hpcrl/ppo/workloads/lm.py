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
decoupled/truncated-IS form when ``cfg.truncated_is`` is set) and the clipped value loss.

LoRA (``lora_rank > 0``): every linear layer of the blocks (qkv, attention out, MLP in/out) of both
actor and critic becomes :class:`LoRALinear`, with the base weight frozen. Trainable: the adapters
and the critic's value head. Published (:meth:`LMWorkload.sync_tensors`): the actor's adapters only,
in a fixed order whose canonical names and shapes are checked against the config (fail loudly, no
``strict=False``). Maker side, :meth:`LMWorkload.after_sync` *merges*: each layer's effective weight
is rebuilt as ``W0 + s * B @ A`` from its pristine base ``W0`` (which is never written), so
inference runs on plain merged matrices and nothing accumulates over syncs. The trainer computes the
very same expression inside its forward (differentiably), so a maker's logits equal the trainer's
bit for bit.

Without LoRA the published tensors are all actor parameters (the critic never leaves the trainers;
makers never evaluate it) and :meth:`after_sync` is a no-op.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..losses import approx_kl, gae, masked_mean, policy_loss, sequence_rewards_with_kl, value_loss, whiten
from ..workload import AdamLearner, PPOConfig

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


# ------------------------------------------------------------------------------------------ model


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


def _token_logp(logits: Tensor, tokens: Tensor) -> Tensor:
    return torch.log_softmax(logits.float(), -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


# -------------------------------------------------------------------------------- corpus / reward


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


# ----------------------------------------------------------------------------------- pretraining

_PRETRAINED: dict[tuple, tuple[dict[str, Tensor], float]] = {}
"""Per-process cache: (architecture, corpus, pretraining recipe, seed) -> (state_dict, final loss)."""


def _pretrain(key: tuple, wl: "LMWorkload", seed: int) -> tuple[dict[str, Tensor], float]:
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


# --------------------------------------------------------------------------------------- workload


class LMWorkload:
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
        state, self.pretrain_loss = _pretrain((self._arch, self._recipe, seed), self, seed)
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

    # -- weight sync -----------------------------------------------------------------------------
    def _is_synced(self, name: str) -> bool:
        return ".lora_" in name if self.lora_rank else True

    def expected_sync_names(self) -> list[tuple[str, tuple[int, ...]]]:
        """Canonical (name, shape) list a publish carries, from the config alone (meta tensors)."""
        if self._expected is None:
            with torch.device("meta"):
                actor = self._new_lm(self.vocab, self.lora_rank)
            self._expected = [(f"actor.{n}", tuple(p.shape)) for n, p in actor.named_parameters() if self._is_synced(n)]
        return self._expected

    def sync_names(self, model: LMActorCritic) -> list[str]:
        return [name for name, _ in self._sync_items(model)]

    def _sync_items(self, model: LMActorCritic) -> list[tuple[str, Tensor]]:
        items = [(f"actor.{n}", p) for n, p in model.actor.named_parameters() if self._is_synced(n)]
        got = [(n, tuple(p.shape)) for n, p in items]
        want = self.expected_sync_names()
        if got != want:
            missing = sorted(set(want) - set(got))
            unexpected = sorted(set(got) - set(want))
            raise ValueError(f"LM sync tensors do not match the config (lora_rank={self.lora_rank}): "
                             f"missing {missing[:6]}, unexpected {unexpected[:6]}"
                             + ("" if missing or unexpected else ", order differs"))
        if self.lora_rank:
            trainable = [f"actor.{n}" for n, p in model.actor.named_parameters() if p.requires_grad]
            if trainable != [n for n, _ in items]:
                raise ValueError(f"LoRA mode: trainable actor parameters {trainable[:6]} are not exactly the adapters")
        return items

    def sync_tensors(self, model: LMActorCritic) -> list[Tensor]:
        """Actor parameters a publish carries (all of them, or only the LoRA adapters), fixed order."""
        return [p.data for _, p in self._sync_items(model)]

    def after_sync(self, model: LMActorCritic) -> None:
        """Maker side: LoRA -> rebuild every effective weight as ``W0 + s * B @ A`` from the pristine
        base (no accumulation); full-parameter sync -> nothing to do."""
        if self.lora_rank:
            for layer in model.actor.lora_layers():
                layer.merge_()

    # -- roles -----------------------------------------------------------------------------------
    def make_collector(self, rank_seed: int, device: torch.device | str = "cpu") -> "LMCollector":
        return LMCollector(self, rank_seed, torch.device(device))

    def make_learner(self, model: LMActorCritic, cfg: PPOConfig, grad_sync: Any) -> "LMLearner":
        return LMLearner(self, model, cfg, grad_sync)


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


class LMCollector:
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
        logp = _token_logp(model.action_logits(tokens), actions)
        ref_logp = _token_logp(ref(tokens[:, :-1])[:, wl.prompt_len - 1 :], actions)
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

    def __init__(self, wl: LMWorkload, model: LMActorCritic, cfg: PPOConfig, grad_sync: Any) -> None:
        super().__init__(model, cfg, grad_sync)
        self.wl = wl

    def update(self, batches: list[dict[str, Tensor]], generator: torch.Generator) -> dict[str, float]:
        cfg, model = self.cfg, self.model
        device = next(model.parameters()).device
        b = {k: torch.cat([x[k] for x in batches]).to(device) for k in batches[0]}
        for layer in model.actor.lora_layers() + model.critic.lora_layers():
            layer.unmerge_()  # a trainer never runs on a cached merge
        tokens, mask = b["tokens"], b["action_mask"]
        blogp, ref_logp, score = b["behaviour_logp"].float(), b["ref_logp"].float(), b["score"].float()
        n, g = blogp.shape
        with torch.no_grad():
            old_values = model.values(tokens).float()
            rewards = sequence_rewards_with_kl(score, blogp, ref_logp, mask, cfg.kl_coef, self.wl.kl_estimator)
            last = F.one_hot(torch.clamp(mask.sum(-1).long() - 1, min=0), g).to(rewards.dtype)
            next_values = torch.cat([old_values[:, 1:], torch.zeros_like(old_values[:, :1])], 1)
            # time-major for losses.gae; the sequence terminates at its last action token
            adv, returns = gae(rewards.T, old_values.T, next_values.T, last.T, last.T, cfg.gamma, cfg.gae_lambda)
            adv, returns = adv.T * mask, returns.T
            if cfg.normalize_advantages:
                adv = whiten(adv, mask=mask)
            prox_logp = None
            if cfg.truncated_is is not None:
                prox_logp = _token_logp(model.action_logits(tokens), tokens[:, self.wl.prompt_len :])
        actions = tokens[:, self.wl.prompt_len :]
        sums: dict[str, float] = {}
        steps = 0
        for _ in range(cfg.epochs):
            perm = torch.randperm(n, generator=generator).to(device)
            for idx in perm.chunk(cfg.minibatches):
                m = mask[idx]
                logits = model.action_logits(tokens[idx]).float()
                logp_all = torch.log_softmax(logits, -1)
                logp = logp_all.gather(-1, actions[idx].unsqueeze(-1)).squeeze(-1)
                pg_loss, pg_stats = policy_loss(logp, blogp[idx], adv[idx], cfg.clip_coef, cfg.truncated_is,
                                                None if prox_logp is None else prox_logp[idx], mask=m)
                entropy = -(logp_all.exp() * logp_all).sum(-1)
                values = model.values(tokens[idx]).float()
                v_loss = value_loss(values, old_values[idx], returns[idx], cfg.value_clip_coef, mask=m)
                ent = masked_mean(entropy, m)
                loss = pg_loss + cfg.vf_coef * v_loss - cfg.ent_coef * ent
                self._zero_grad()
                loss.backward()
                self.grad_sync.all_reduce()
                grad_norm = nn.utils.clip_grad_norm_(self.params, cfg.max_grad_norm)
                self.opt.step()
                with torch.no_grad():
                    anchor = blogp[idx] if prox_logp is None else prox_logp[idx]
                    row = {"policy_loss": pg_loss, "value_loss": v_loss, "entropy": ent,
                           "approx_kl": masked_mean(approx_kl(anchor, logp), m), "grad_norm": grad_norm, **pg_stats}
                for k, v in row.items():
                    sums[k] = sums.get(k, 0.0) + float(v.detach())
                steps += 1
        self.updates += 1
        out = {k: v / max(1, steps) for k, v in sums.items()}
        with torch.no_grad():
            var_ret = returns[mask > 0].var()
            out.update(
                score=float(score.mean()),
                kl_to_ref=float(((blogp - ref_logp) * mask).sum(-1).mean()),
                kl_to_ref_k3=float((approx_kl(blogp, ref_logp) * mask).sum(-1).mean()),
                reward=float((rewards * mask).sum(-1).mean()),
                value_mean=float(masked_mean(old_values, mask)),
                explained_variance=float(1 - (returns - old_values)[mask > 0].var() / var_ret) if var_ret > 0 else 0.0,
                sequences=float(n),
            )
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.opt.state_dict(), "updates": self.updates}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.opt.load_state_dict(state["optimizer"])
        self.updates = int(state["updates"])

