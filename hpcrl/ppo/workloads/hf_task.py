"""The ``hf`` workload's task (:class:`HFTask`): the tokenizer, the prompt records (``--prompts``, and
``--eval-prompts`` held out) with their texts and tokens, the sampling parameters, and the reward that
scores a response (``--reward-fn`` over the decoded text, or ``--reward-model`` over the tokens).
Constructing it reads the tokenizer and the records and probes the reward function once, so a bad
input fails before any rank starts; the makers' collector and the trainers' evaluation read it."""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import Tensor, nn

from hpcrl.config_check import ConfigError

from . import hf_models as M
from .hf_generate import SamplingParams
from .hf_options import HFOptions
from .hf_prompts import load_records

__all__ = ["HFTask"]


class HFTask:
    """Prompts and reward of one ``hf`` run. ``records`` / ``prompt_texts`` / ``prompt_ids``: the training
    records, what a prompts-reward receives for each (a chat record's templated text) and its tokens (at
    most ``--max-prompt-tokens``); ``eval_*`` the same for ``--eval-prompts`` (empty without)."""

    def __init__(self, options: HFOptions) -> None:
        o = self.options = options
        self.tokenizer = M.load_tokenizer(o.model)
        self.eos_id, self.pad_id = int(self.tokenizer.eos_token_id), int(self.tokenizer.pad_token_id)
        self.records = load_records(o.prompts, o.prompt_key)
        self.prompt_texts, self.prompt_ids = self._encode(self.records, "prompts", o.prompts)
        self.eval_records: list[dict[str, Any]] = []
        self.eval_texts: list[str] = []
        self.eval_ids: list[list[int]] = []
        if o.eval_prompts is not None:
            self.eval_records = load_records(o.eval_prompts, o.prompt_key, o.flag("eval_prompts"))
            self.eval_texts, self.eval_ids = self._encode(self.eval_records, "eval_prompts", o.eval_prompts)
        self.reward_callable = M.import_reward_fn(o.reward_fn) if o.reward_fn else None
        self.reward_takes = "prompts"
        if self.reward_callable is not None:  # a probe before any rank starts: raises / wrong length, named
            self.reward_takes = M.reward_takes(self.reward_callable, o.reward_fn)
            probe = self.reward_inputs([0, 1][:len(self.records)], self.records, self.prompt_texts)
            M.call_reward_fn(self.reward_callable, o.reward_fn, probe, self.prompt_texts[:2], batch="probe")
        self.sampling = SamplingParams(o.max_new_tokens, o.temperature, o.top_p, o.top_k)
        self.reward_models: dict[str, nn.Module] = {}
        """``--reward-model`` by device, loaded at its first use."""

    def _encode(self, records: list[dict[str, Any]], flag: str, path: str) -> tuple[list[str], list[list[int]]]:
        """``(texts, token ids)`` of the records of ``--prompts`` or ``--eval-prompts`` (``flag``, read from
        ``path``): the texts are what a prompts-reward receives (a chat record's: its templated text)."""
        o = self.options
        texts, out, long = [], [], []
        for i, record in enumerate(records):
            where = f"--{flag.replace('_', '-')} {path}: record {i}"
            text, templated = M.format_record(self.tokenizer, record, o.prompt_key, o.chat_template, where)
            ids = list(self.tokenizer(text, add_special_tokens=not templated)["input_ids"])
            if not ids:
                raise ConfigError(f"{where} tokenizes to nothing; drop empty prompts")
            if len(ids) > o.max_prompt_tokens:
                long.append((i, len(ids)))
                ids = ids[-o.max_prompt_tokens:]
            texts.append(record[o.prompt_key] if isinstance(record.get(o.prompt_key), str) else text)
            out.append(ids)
        if long:
            i, n = max(long, key=lambda x: x[1])
            what = (f"{len(long)} prompt(s) longer than --max-prompt-tokens {o.max_prompt_tokens} (longest: record "
                    f"{i}, {n} tokens)")
            if not o.truncate_prompts:
                raise ConfigError(f"--{flag.replace('_', '-')} {path}: {what}; raise --max-prompt-tokens to {n} or "
                                  "pass --truncate-prompts to keep their last tokens")
            print(f"hpcrl.ppo hf: warning: {what}: truncated to their last {o.max_prompt_tokens} tokens",
                  file=sys.stderr, flush=True)
        return texts, out

    def reward_inputs(self, idx: list[int], records: list[dict[str, Any]], texts: list[str]) -> list[Any]:
        """What ``--reward-fn`` receives for the prompts ``idx``: copies of the records (every field), or
        the prompt texts, by its first parameter (:func:`~.hf_models.reward_takes`)."""
        if self.reward_takes == "records":
            return [dict(records[i]) for i in idx]
        return [texts[i] for i in idx]

    def reward_model(self, device: torch.device) -> nn.Module:
        """``--reward-model`` on ``device``, loaded at its first use there."""
        key = str(device)
        if key not in self.reward_models:
            self.reward_models[key] = M.load_reward_model(self.options.reward_model, self.pad_id).to(device)
        return self.reward_models[key]

    def score(self, inputs: list[Any], tokens: Tensor, attn: Tensor, response: Tensor, amask: Tensor,
              batch: int | str) -> Tensor:
        """``[B]`` scores of the responses (``inputs``: what ``--reward-fn`` receives for them): the one
        place a reward is computed (makers, for experience; trainers, for evaluation)."""
        if self.reward_callable is None:
            rm = self.reward_model(tokens.device)
            return rm(input_ids=tokens, attention_mask=attn.long()).logits[:, 0].float()
        texts = [self.tokenizer.decode(r[m > 0].tolist(), skip_special_tokens=True)
                 for r, m in zip(response.cpu(), amask.cpu())]
        try:
            scores = M.call_reward_fn(self.reward_callable, self.options.reward_fn, inputs, texts, batch=batch)
        except ConfigError as err:
            raise self.options.renamed(err) from None
        return torch.tensor(scores, dtype=torch.float32, device=tokens.device)
