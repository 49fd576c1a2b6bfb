"""Tiny local Hugging Face artefacts (nothing downloads) and the demo's verifiable task.

* :func:`build_tokenizer`: a ``tokenizers`` tokenizer (WordLevel or BPE) trained on a word corpus,
  wrapped as a ``transformers`` fast tokenizer with ``<eos>`` / ``<unk>`` and no pad token (the ``hf``
  workload falls back to EOS);
* :func:`tiny_config` / :func:`build_causal_lm`: a 2-layer, hidden-64 Llama or GPT-2 causal LM;
* the *list* task of ``python -m hpcrl.ppo.demo``: a record ``{"prompt": "list: cat dog", "answer":
  [the category's other words]}`` names two words of one category, and :func:`reward` (a records
  reward: it reads each record's ``answer``) scores how many distinct words of the answer the
  response's first three words are (0, 1/3, 2/3 or 1); :func:`pretrain` teaches a model the format (three words,
  then ``<eos>``) with words drawn from every category, so a policy starts near 0.1 and RL must learn
  the categories.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

CATEGORIES: dict[str, tuple[str, ...]] = {
    "colour": ("red", "blue", "green", "yellow", "black", "white"),
    "animal": ("cat", "dog", "bird", "fish", "horse", "cow"),
    "number": ("one", "two", "three", "four", "five", "six"),
    "sky": ("sun", "moon", "star", "cloud", "rain", "snow"),
    "food": ("bread", "milk", "rice", "apple", "egg", "cheese"),
    "body": ("hand", "foot", "head", "eye", "ear", "nose"),
}
CATEGORY_OF = {w: c for c, ws in CATEGORIES.items() for w in ws}
WORDS = tuple(CATEGORY_OF)
ASK = "list:"
ANSWER_WORDS = 3
PROMPT_TOKENS = 3  # "list:" + two words (one token each)


# ---------------------------------------------------------------------------- tokenizer and models


def build_tokenizer(out: Path, corpus: list[str], kind: str = "wordlevel", chat_template: str | None = None):
    """Train a tokenizer on ``corpus`` and save it (``save_pretrained``) to ``out``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<eos>"]
    if kind == "wordlevel":
        tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
        trainer = trainers.WordLevelTrainer(special_tokens=specials)
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    elif kind == "bpe":
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        trainer = trainers.BpeTrainer(special_tokens=specials, vocab_size=80)
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
    else:
        raise ValueError(kind)
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>")
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(out)
    return fast


def tiny_config(arch: str, vocab: int, eos: int, max_positions: int = 64, head_dim: int | None = None, **extra: Any):
    """A 2-layer, hidden-64 config (``llama`` or ``gpt2``) over ``vocab`` tokens; 4 attention heads of
    ``hidden / 4 = 16`` features, or of ``head_dim`` (Llama only: vLLM's CPU attention runs 32 and up)."""
    from transformers import GPT2Config, LlamaConfig

    if arch == "llama":
        return LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                           eos_token_id=eos, bos_token_id=eos, tie_word_embeddings=False,
                           **({} if head_dim is None else {"head_dim": head_dim}), **extra)
    if head_dim is not None:
        raise ValueError(f"head_dim is a Llama option, not {arch}'s")
    if arch == "gpt2":
        return GPT2Config(vocab_size=vocab, n_embd=64, n_layer=2, n_head=4, n_positions=max_positions,
                          eos_token_id=eos, bos_token_id=eos, **extra)
    raise ValueError(arch)


def build_causal_lm(out: Path, corpus: list[str], arch: str = "llama", kind: str = "wordlevel", seed: int = 0,
                    max_positions: int = 64, chat_template: str | None = None, pretrain_steps: int = 0,
                    head_dim: int | None = None):
    """A random (or briefly :func:`pretrain`-ed on ``corpus``) tiny causal LM and its tokenizer, saved
    in ``out``; returns ``(model, tokenizer)``."""
    import torch
    from transformers import AutoModelForCausalLM

    tok = build_tokenizer(out, corpus, kind, chat_template)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, len(tok), tok.eos_token_id, max_positions, head_dim))
    if pretrain_steps:
        pretrain(model, tok, corpus, pretrain_steps, seed)
    model.save_pretrained(out)
    return model, tok


def pretrain(model: Any, tok: Any, corpus: list[str], steps: int, seed: int = 0, batch: int = 64,
             lr: float = 3e-3) -> float:
    """Next-token training on ``corpus`` lines (each followed by ``<eos>``); returns the last loss."""
    import torch

    rows = [tok(line)["input_ids"] + [tok.eos_token_id] for line in corpus]
    width = max(map(len, rows))
    ids = torch.tensor([r + [tok.eos_token_id] * (width - len(r)) for r in rows])
    labels = torch.tensor([r + [-100] * (width - len(r)) for r in rows])
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(steps):
        pick = torch.randint(len(rows), (batch,), generator=gen)
        loss = model(input_ids=ids[pick], labels=labels[pick]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    return float(loss.detach())


# ---------------------------------------------------------------------------- the list task


def prompt_words(prompt: str) -> list[str]:
    return [w for w in prompt.split() if w != ASK]


def task_prompts(n: int, seed: int = 0) -> list[str]:
    """``n`` prompts ``list: A B`` (two distinct words of one category, categories in turn)."""
    rng = random.Random(seed)
    names = sorted(CATEGORIES)
    return [f"{ASK} " + " ".join(rng.sample(CATEGORIES[names[i % len(names)]], 2)) for i in range(n)]


def format_corpus(n: int, seed: int = 1) -> list[str]:
    """Prompt + answer lines whose answers are three words of *any* category: the format, not the task."""
    rng = random.Random(seed)
    return [f"{p} " + " ".join(rng.choice(WORDS) for _ in range(ANSWER_WORDS)) for p in task_prompts(n, seed)]


def task_record(prompt: str, i: int) -> dict[str, Any]:
    """The dataset record of ``prompt``: its ``answer`` lists the words that score (the category's
    words not in the prompt)."""
    given = prompt_words(prompt)
    return {"prompt": prompt, "answer": [w for w in CATEGORIES[CATEGORY_OF[given[0]]] if w not in given], "id": i}


def reward(records: list[dict[str, Any]], responses: list[str]) -> list[float]:
    """The ``--hf.reward-fn`` of the demo (a records reward): distinct words of each record's
    ``answer`` among the response's first :data:`ANSWER_WORDS` words, over :data:`ANSWER_WORDS`."""
    return [len(set(r.split()[:ANSWER_WORDS]) & set(rec["answer"])) / ANSWER_WORDS
            for rec, r in zip(records, responses)]


def write_records(path: Path, prompts: list[str]) -> Path:
    """``prompts`` as jsonl records (:func:`task_record`)."""
    with open(path, "w") as f:
        for i, p in enumerate(prompts):
            f.write(json.dumps(task_record(p, i)) + "\n")
    return path


def greedy_answers(model_dir: str | Path, prompts: list[str]) -> list[str]:
    """The model's greedy answers (:data:`ANSWER_WORDS` + 1 new tokens) to ``prompts``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tok.padding_side = "left"  # a batch of prompts ends where the answers begin
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    batch = tok(prompts, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=ANSWER_WORDS + 1, do_sample=False, pad_token_id=tok.pad_token_id)
    return tok.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
