"""The ``hf`` workload's task (:class:`HFTask`): the tokenizer, the prompt records (``--prompts``, and
``--eval-prompts`` held out) with their texts and tokens, the sampling parameters, and the reward that
scores a response (``--reward-fn`` over the decoded text, or ``--reward-model`` over the tokens).
Constructing it reads the tokenizer and the records and probes the reward function once, so a bad
input fails before any rank starts; the makers' collector and the trainers' evaluation read it."""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
from torch import Tensor, nn

from hpcrl.run import rundir
from hpcrl.comm import detect_launch
from hpcrl.core.config_check import ConfigError

from . import hf_models as M
from .hf_generate import SamplingParams
from .hf_options import HFOptions
from .hf_prompts import load_records, tail_tokens

__all__ = ["HFTask", "warn_once"]

UNKNOWN_CONTEXT_FACTOR = 64
"""Without a context in the model's config, how far past ``--max-prompt-tokens`` a long prompt is counted
(to suggest the value that holds it)."""
_WARNED: set[str] = set()


def warn_once(line: str) -> None:
    """Print ``line`` on stderr once per run: in the process that checks the inputs before spawning the
    ranks (not again in them: they inherit its launch), or in rank 0 under srun / torchrun, where every
    rank checks for itself; and once in that process however often the task is built."""
    if line in _WARNED or os.environ.get(rundir.LAUNCHED_PID_ENV):
        return
    try:
        first = detect_launch().rank == 0
    except Exception:  # a partial launcher environment is reported where the run starts; warn here
        first = True
    if first:
        _WARNED.add(line)
        print(line, file=sys.stderr, flush=True)


class HFTask:
    """Prompts and reward of one ``hf`` run. ``records`` / ``prompt_texts`` / ``prompt_ids``: the training
    records, what a prompts-reward receives for each (a chat record's templated text) and its tokens (at
    most ``--max-prompt-tokens``); ``eval_*`` the same for ``--eval-prompts`` (empty without)."""

    def __init__(self, options: HFOptions) -> None:
        o = self.options = options
        self.tokenizer = M.load_tokenizer(o.model)
        self.eos_id, self.pad_id = int(self.tokenizer.eos_token_id), int(self.tokenizer.pad_token_id)
        self.context = M.context_length(M.load_config(o.flag("model"), o.model))
        """The model's context in tokens (None if its config does not say)."""
        self.longest_allowed = (self.context - o.episode_tokens if self.context is not None
                                else UNKNOWN_CONTEXT_FACTOR * o.max_prompt_tokens)
        """The highest ``--max-prompt-tokens`` that can work with this model (``--max-new-tokens`` included)."""
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
        ``path``): the texts are what a prompts-reward receives (a chat record's: its templated text). A
        prompt is tokenized from its end, only as far as a verdict needs (:func:`~.hf_prompts.tail_tokens`):
        its last ``--max-prompt-tokens`` with ``--truncate-prompts``, else up to the longest the model allows."""
        o = self.options
        keep = o.max_prompt_tokens if o.truncate_prompts else self.longest_allowed
        texts, out, long = [], [], []
        for i, record in enumerate(records):
            where = f"--{flag.replace('_', '-')} {path}: record {i}"
            text, templated = M.format_record(self.tokenizer, record, o.prompt_key, o.chat_template, where)
            tokenize = lambda t: list(self.tokenizer(t, add_special_tokens=not templated)["input_ids"])  # noqa: E731
            ids, whole = tail_tokens(tokenize, text, keep)
            if not ids:
                raise ConfigError(f"{where} tokenizes to nothing; drop empty prompts")
            if len(ids) > o.max_prompt_tokens:
                long.append((not whole, len(ids), i))
                ids = ids[-o.max_prompt_tokens:]
            texts.append(record[o.prompt_key] if isinstance(record.get(o.prompt_key), str) else text)
            out.append(ids)
        if long:
            self._long_prompts(long, f"--{flag.replace('_', '-')} {path}")
        return texts, out

    def _long_prompts(self, long: list[tuple[bool, int, int]], where: str) -> None:
        """Warn (once per run) of the prompts cut to ``--max-prompt-tokens``, or refuse them with a fix
        that can work: a higher ``--max-prompt-tokens`` only where the model's context holds it."""
        o = self.options
        cut, n, i = max(long)  # cut: only the prompt's tail was tokenized, it has n tokens or more
        size = f"{'at least ' if cut else ''}{n} tokens"
        what = (f"{len(long)} prompt(s) longer than --max-prompt-tokens {o.max_prompt_tokens} (longest: record {i}, "
                f"{size})")
        if o.truncate_prompts:
            line = f"{where}: {what}: truncated to their last {o.max_prompt_tokens} tokens"
            warn_once(f"hpcrl.ppo hf: warning: {o.renamed(ConfigError(line))}")  # flags spelt as the user did
            return
        fixes = [f"pass --truncate-prompts to keep their last {o.max_prompt_tokens} tokens"]
        if not cut and n <= self.longest_allowed:
            fixes.insert(0, f"raise --max-prompt-tokens to {n}")
        elif self.context is not None:
            fixes.append(f"use a model with a longer context (--model's is {self.context} tokens, "
                         f"--max-new-tokens {o.max_new_tokens} included)")
        else:
            fixes.append("shorten the record")
        raise ConfigError(f"{where}: {what}; {', or '.join(fixes)}")

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

    def score_answer(self, record: dict[str, Any], prompt: str, response: str) -> float:
        """``--reward-fn`` of one episode's answer (given the record, or the prompt text)."""
        inputs = [dict(record)] if self.reward_takes == "records" else [prompt]
        try:
            return M.call_reward_fn(self.reward_callable, self.options.reward_fn, inputs, [response], batch="answer")[0]
        except ConfigError as err:
            raise self.options.renamed(err) from None
