"""Tiny real Hugging Face artefacts for the ``hf`` workload's tests, built locally (no network).

* a tokenizer trained with ``tokenizers`` (WordLevel or BPE, whitespace pre-tokenizer) on a small
  word corpus, wrapped as a ``transformers`` fast tokenizer with ``<eos>`` / ``<unk>`` (and no pad
  token: the workload must fall back to EOS);
* random-init causal LMs (Llama, GPT-2: 2 layers, hidden 64) and a one-label
  ``AutoModelForSequenceClassification`` reward model, saved with ``save_pretrained`` so the code
  under test loads them back by path;
* prompts as jsonl;
* verifiable reward functions (``pkg.mod:fn``) the makers import by name.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from hpcrl.ppo import demo_task as T  # the tiny tokenizer / model builders (shared with python -m hpcrl.ppo.demo)

WORDS = ["yes", "no", "red", "blue", "green", "cat", "dog", "bird", "one", "two", "three", "four", "five",
         "six", "sun", "moon", "star", "tree", "sea", "sky", "big", "small", "up", "down"]
TARGET = "yes"


def corpus(n: int = 400, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 10))) for _ in range(n)]


def build_tokenizer(out: Path, kind: str = "wordlevel", chat_template: str | None = None):
    """A tokenizer trained on :func:`corpus`, saved (``save_pretrained``) to ``out``."""
    return T.build_tokenizer(out, corpus(), kind, chat_template)


def build_causal_lm(out: Path, arch: str = "llama", kind: str = "wordlevel", seed: int = 0,
                    max_positions: int = 64, chat_template: str | None = None) -> Path:
    """A random 2-layer, hidden-64 causal LM and its tokenizer in ``out`` (``save_pretrained``)."""
    T.build_causal_lm(out, corpus(), arch, kind, seed, max_positions, chat_template)
    return out


def build_reward_model(out: Path, labels: int = 1, seed: int = 1) -> Path:
    import torch
    from transformers import AutoModelForSequenceClassification

    tok = build_tokenizer(out)
    eos = tok.eos_token_id
    config = T.tiny_config("llama", len(tok), eos, num_labels=labels, pad_token_id=eos)
    torch.manual_seed(seed)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(out)
    return out


def write_prompts(path: Path, n: int = 64, seed: int = 3, key: str = "prompt", words: int = 3) -> Path:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({key: " ".join(rng.choice(WORDS[2:]) for _ in range(words)), "id": i}) + "\n")
    return path


# ---------------------------------------------------------------------------- verifiable rewards


def target_fraction(prompts: list[str], responses: list[str]) -> list[float]:
    """Fraction of the response's words equal to :data:`TARGET` (0 for an empty response)."""
    out = []
    for r in responses:
        words = r.split()
        out.append(sum(w == TARGET for w in words) / len(words) if words else 0.0)
    return out


def broken_raises(prompts: list[str], responses: list[str]) -> list[float]:
    raise RuntimeError("the grader is down")


def broken_length(prompts: list[str], responses: list[str]) -> list[float]:
    return [0.0] * (len(responses) - 1)


_CALLS = {"n": 0}


def fails_on_third_call(prompts: list[str], responses: list[str]) -> list[float]:
    """Passes the construction probe and the first batch, then raises (a grader that breaks mid-run)."""
    _CALLS["n"] += 1
    if _CALLS["n"] >= 3:
        raise ValueError("grader lost its answer key")
    return target_fraction(prompts, responses)


def logged_target_fraction(prompts: list[str], responses: list[str]) -> list[float]:
    """:func:`target_fraction`, appending each batch's prompts (one json line) to the file named by
    ``HF_TEST_PROMPT_LOG``: which prompts the makers were given, and in which order."""
    import os

    path = os.environ.get("HF_TEST_PROMPT_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"pid": os.getpid(), "prompts": prompts}) + "\n")
    return target_fraction(prompts, responses)


def run_ppo(args: list[str], cwd: Path, timeout: float, env: dict[str, str] | None = None):
    """``python -m hpcrl.ppo ARGS`` as a user runs it (outside any launcher: no Slurm or torchrun variables,
    one torch thread per rank, this directory on PYTHONPATH for the reward functions, no network)."""
    import os
    import subprocess
    import sys

    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("SLURM_", "SBATCH_", "SRUN_")) and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    here = str(Path(__file__).resolve().parent)
    clean.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([here, clean.get("PYTHONPATH", "")]),
                 HF_HUB_OFFLINE="1", COLUMNS="200", **(env or {}))
    return subprocess.run([sys.executable, "-m", "hpcrl.ppo", *args], capture_output=True, text=True,
                          timeout=timeout, env=clean, cwd=cwd)
