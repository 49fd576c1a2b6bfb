"""The four RLHF models of the ``hf`` workload through ``transformers`` (docs/coati.md: actor, critic,
reward model, initial model), plus the tokenizer.

* actor / frozen reference: ``AutoModelForCausalLM.from_pretrained(path)``;
* critic: :class:`ValueModel`, a zero-initialised scalar head on the causal-LM *backbone*
  (``AutoModel.from_pretrained``: the trunk without the LM head) of the actor or of ``--critic``;
* reward: ``AutoModelForSequenceClassification`` with exactly one label, or a function named
  ``package.module:fn``: ``fn(records, responses)`` gets the dataset's records (dicts with every
  field), ``fn(prompts, responses)`` the prompt strings (:func:`reward_takes` reads the first
  parameter's name); either returns ``list[float]``;
* tokenizer from the model directory; pad = EOS when it has no pad token; left padding.

Every check here reads configs only (cheap), so the workload constructor runs them in the launching
process before any rank starts; errors are :class:`ConfigError` lines naming the flag and the fix.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
from pathlib import Path
from typing import Any, Callable, Literal

import torch
from torch import Tensor, nn

from hpcrl.core.config_check import ConfigError

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def _transformers():
    try:
        import transformers
    except ImportError:
        raise ConfigError("--workload hf needs the transformers package: pip install transformers "
                          "tokenizers safetensors (or the hpcrl[hf] extra)") from None
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    return transformers


def check_model_path(flag: str, path: str) -> None:
    """A local path must be a directory with a ``config.json``; anything else is a hub id (resolved
    offline if ``HF_HUB_OFFLINE`` is set, which the loaders then report)."""
    p = Path(path).expanduser()
    looks_local = p.exists() or path.startswith((".", "/", "~")) or path.count("/") > 1
    if looks_local:
        if not p.is_dir():
            raise ConfigError(f"{flag} {path}: no such model directory; pass a directory written by save_pretrained "
                              "(with config.json) or a hub id such as gpt2")
        if not (p / "config.json").is_file():
            raise ConfigError(f"{flag} {path}: the directory has no config.json; pass the directory save_pretrained "
                              "wrote (the one holding config.json and the weights)")
        missing = missing_weights(p)
        if missing:
            raise ConfigError(f"{flag} {path}: {missing}; pass the directory save_pretrained wrote (config.json "
                              "with its weights) or save the model there again")


WEIGHTS = ("model.safetensors", "pytorch_model.bin")
"""The weights files ``from_pretrained`` loads, each also sharded as ``NAME.index.json`` + its shards."""


def missing_weights(directory: Path) -> str | None:
    """What a model directory lacks to load its weights (one phrase), None if a weights file or a
    sharded index with every shard is there: read before any rank starts, so none fails on it later."""
    for name in WEIGHTS:
        if (directory / name).is_file():
            return None
    for name in WEIGHTS:
        index = directory / f"{name}.index.json"
        if index.is_file():
            try:
                shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
                return f"its shard index {index.name} is unreadable ({type(err).__name__}: {err})"
            lost = [shard for shard in shards if not (directory / shard).is_file()]
            if not lost:
                return None
            return f"{len(lost)} of the {len(shards)} shards {index.name} names are missing (first: {lost[0]})"
    return f"no weights file: neither {' nor '.join(WEIGHTS)} (nor a sharded *.index.json) is there"


def load_config(flag: str, path: str):
    check_model_path(flag, path)
    tf = _transformers()
    try:
        return tf.AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"{flag} {path}: cannot load a transformers config ({first}); pass a local model "
                          "directory or a hub id that is cached") from None


def context_length(config: Any) -> int | None:
    """The model's positional limit (``max_position_embeddings`` / ``n_positions``), None if unknown."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(text, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def load_tokenizer(path: str):
    """The model directory's tokenizer, left-padded, pad = EOS when it has none."""
    tf = _transformers()
    try:
        tok = tf.AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise ConfigError(f"--model {path}: cannot load its tokenizer ({str(err).splitlines()[0]}); save the "
                          "tokenizer next to the model (tokenizer.save_pretrained(DIR))") from None
    if tok.eos_token_id is None:
        raise ConfigError(f"--model {path}: the tokenizer has no EOS token; set tokenizer.eos_token and save it again "
                          "(generation needs a stop token)")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def format_prompt(tok: Any, text: str, use_chat_template: bool) -> str:
    """The text the actor sees: the chat template's user turn + generation prompt when the tokenizer
    has a template (and it is enabled), else the prompt as is."""
    if use_chat_template and getattr(tok, "chat_template", None):
        return tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    return text


def format_record(tok: Any, record: dict[str, Any], key: str, use_chat_template: bool, where: str) -> tuple[str, bool]:
    """``(text the actor sees, whether a chat template made it)`` of one dataset record: its ``key``
    prompt (:func:`format_prompt`), or its chat ``messages`` through the tokenizer's chat template
    (required for them; ``where`` names the record in the error)."""
    if isinstance(record.get(key), str):
        text = format_prompt(tok, record[key], use_chat_template)
        return text, bool(use_chat_template and getattr(tok, "chat_template", None))
    if not getattr(tok, "chat_template", None):
        raise ConfigError(f"{where} is chat-format ('messages') but the tokenizer of --model has no chat template; "
                          "set tokenizer.chat_template and save it, or give plain prompt records")
    return tok.apply_chat_template(record["messages"], tokenize=False, add_generation_prompt=True), True


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def resolve_dtype(choice: str, config: Any, flag: str, path: str) -> torch.dtype:
    """The parameter dtype ``--hf.dtype`` names: ``fp32`` / ``bf16``, or ``auto``: the dtype config.json
    says the weights are stored in (``dtype``, formerly ``torch_dtype``; fp32 when it says none). Stored
    fp16 (or anything else) is refused: trainers train in fp32 or bf16."""
    if choice in DTYPES:
        return DTYPES[choice]
    if choice != "auto":
        raise ConfigError(f"{flag} {choice}: must be one of auto, fp32, bf16; e.g. {flag} auto (the stored dtype)")
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    stored = getattr(text, "dtype", None) or getattr(text, "torch_dtype", None)
    if isinstance(stored, str):
        stored = getattr(torch, stored, stored)
    if stored is None:
        return torch.float32
    if stored in (torch.float32, torch.bfloat16):
        return stored
    raise ConfigError(f"{flag} auto: {path} stores its weights as {stored} (config.json), which the trainers do "
                      f"not train in; pass {flag} bf16 or {flag} fp32")


def load_causal_lm(path: str, dtype: torch.dtype = torch.float32) -> nn.Module:
    tf = _transformers()
    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model.config.use_cache = True
    return model


def empty_causal_lm(path: str, dtype: torch.dtype) -> nn.Module:
    """The causal LM of ``path`` with its parameters on ``meta`` (:func:`.hf_shards.params_on_meta`:
    no weights read, none allocated; tied weights tied, non-persistent buffers computed)."""
    from .hf_shards import params_on_meta

    tf = _transformers()
    config = tf.AutoConfig.from_pretrained(path)
    with params_on_meta():
        model = tf.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.config.use_cache = True
    return model


class ValueModel(nn.Module):
    """Critic: ``AutoModel`` backbone (the causal LM's trunk) + a zero-initialised linear value head.
    ``forward(input_ids, attention_mask, position_ids) -> [B, T]`` values."""

    def __init__(self, backbone: nn.Module, hidden: int, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.backbone = backbone
        self.value_head = nn.Linear(hidden, 1, dtype=dtype)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor) -> Tensor:
        h = self.backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          use_cache=False).last_hidden_state
        return self.value_head(h.to(self.value_head.weight.dtype)).float().squeeze(-1)  # bf16 under FSDP mixed precision


def load_value_model(path: str, dtype: torch.dtype = torch.float32, empty: bool = False) -> ValueModel:
    """The critic on the trunk of ``path`` in ``dtype`` (its head too: FSDP shards a unit of one dtype);
    ``empty``: parameters on ``meta`` (:func:`empty_causal_lm`)."""
    from .hf_shards import params_on_meta

    tf = _transformers()
    if empty:
        with params_on_meta():
            backbone = tf.AutoModel.from_config(tf.AutoConfig.from_pretrained(path), dtype=dtype)
    else:
        backbone = tf.AutoModel.from_pretrained(path, dtype=dtype)
    text = backbone.config.get_text_config() if hasattr(backbone.config, "get_text_config") else backbone.config
    hidden = getattr(text, "hidden_size", None) or getattr(text, "n_embd")
    if not empty:
        return ValueModel(backbone, hidden, dtype)
    with params_on_meta():
        return ValueModel(backbone, hidden, dtype)


def check_reward_model(path: str) -> None:
    config = load_config("--reward-model", path)
    labels = getattr(config, "num_labels", None)
    if labels != 1:
        raise ConfigError(f"--reward-model {path}: has {labels} labels, a reward model scores with exactly one "
                          "(AutoModelForSequenceClassification with num_labels=1)")


def load_reward_model(path: str, pad_id: int) -> nn.Module:
    tf = _transformers()
    rm = tf.AutoModelForSequenceClassification.from_pretrained(path)
    rm.config.pad_token_id = pad_id  # pooled at the last non-pad token
    return rm.eval().requires_grad_(False)


RewardFn = Callable[[list[Any], list[str]], list[float]]


def import_reward_fn(spec: str) -> RewardFn:
    module, _, name = spec.partition(":")
    if not module or not name:
        raise ConfigError(f"--reward-fn {spec}: must be package.module:function; e.g. --reward-fn mypkg.rewards:score")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"--reward-fn {spec}: {err}; give an importable package.module:function (its module on "
                          "PYTHONPATH)") from None
    if not callable(fn):
        raise ConfigError(f"--reward-fn {spec}: {type(fn).__name__} is not callable; name a function "
                          "fn(records, responses) or fn(prompts, responses) -> list[float]")
    return fn


def reward_takes(fn: RewardFn, spec: str) -> Literal["records", "prompts"]:
    """What ``fn`` is called with, by its first parameter's name: ``records`` (the dataset's dicts) or
    ``prompts`` (strings)."""
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        params = []
    first = params[0] if params else None
    if first not in ("records", "prompts"):
        raise ConfigError(f"--reward-fn {spec}: its first parameter is {first!r}; name it records (gets the "
                          "dataset's dicts) or prompts (gets the prompt strings): fn(records, responses)")
    return first


def call_reward_fn(fn: RewardFn, spec: str, prompts: list[Any], responses: list[str],
                   batch: int | str) -> list[float]:
    """``fn(prompts, responses)`` (``prompts``: records or strings, :func:`reward_takes`) checked: it
    must return one finite number per response (int, float, bool, numpy or 0-d tensor; never a string,
    even one that reads as a number); anything else is a :class:`ConfigError` naming the function and
    the batch."""
    where = f"--reward-fn {spec} on batch {batch} ({len(responses)} responses)"
    try:
        out = fn(list(prompts), list(responses))
    except Exception as err:  # the user's function: report it, whatever it raised
        raise ConfigError(f"{where} raised {type(err).__name__}: {err}; it must return list[float] of "
                          "len(responses)") from None
    words = (str, bytes, bytearray)
    try:
        items = [out] if isinstance(out, words) else list(out)
    except TypeError:
        items = None
    text = next((v for v in items or () if isinstance(v, words)), None)
    if text is not None:  # float("0.5") would take it: a reward is a number, never text parsed as one
        got = f"the {type(text).__name__} {_preview(text)}" + ("" if text is out else f" in a {type(out).__name__}")
        raise ConfigError(f"{where} returned {got}, not numbers; it must return list[float] of len(responses) "
                          "(convert with float() inside the function)")
    try:
        values = [float(v) for v in items]
    except (TypeError, ValueError):
        raise ConfigError(f"{where} returned {type(out).__name__}, not a list of numbers; it must return "
                          "list[float] of len(responses)") from None
    if len(values) != len(responses):
        raise ConfigError(f"{where} returned {len(values)} scores for {len(responses)} responses; return one "
                          "float per response")
    bad = [v for v in values if v != v or v in (float("inf"), float("-inf"))]
    if bad:
        raise ConfigError(f"{where} returned non-finite scores ({bad[0]}); return finite floats")
    return values


def _preview(value: Any) -> str:
    shown = repr(value)
    return shown if len(shown) <= 40 else shown[:37] + "..."
