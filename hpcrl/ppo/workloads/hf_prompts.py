"""Prompt datasets of the ``hf`` workload: jsonl (one JSON object per line), parquet (needs pyarrow)
or a saved ``datasets`` directory (needs datasets), read as *records*: dicts with any fields (an
``answer``, ``tests``, ``meta`` for the reward function) holding either a string prompt under
``--prompt-key`` or a chat ``messages`` list of ``{role, content}``; and :class:`PromptStream`,
the per-maker cursor over them (shuffled per epoch from the seed, its position a small state dict so
a resume continues with the next prompt)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import torch

from hpcrl.core.config_check import ConfigError


def load_records(path: str, key: str, flag: str = "--prompts") -> list[dict[str, Any]]:
    """Every record of the dataset at ``path``, checked: a string ``key`` field, or a chat ``messages``
    list (``flag`` names the option in messages)."""
    rows = _read_rows(path, flag)
    for i, row in enumerate(rows):
        if isinstance(row, dict) and (isinstance(row.get(key), str) or is_chat(row.get("messages"))):
            continue
        keys = sorted(row) if isinstance(row, dict) else type(row).__name__
        raise ConfigError(f"{flag} {path}: record {i} has no string field {key!r} nor a 'messages' list of "
                          f"{{role, content}} (fields: {keys}); pass --prompt-key NAME of the field holding the prompt")
    if not rows:
        raise ConfigError(f"{flag} {path}: no records in it; give at least one record")
    return rows


def load_prompts(path: str, key: str) -> list[str]:
    """The ``key`` field of every record (a dataset of plain prompts)."""
    return [r[key] for r in load_records(path, key)]


def is_chat(messages: Any) -> bool:
    """A chat-format prompt: a non-empty list of ``{"role": str, "content": str}``."""
    return (isinstance(messages, list) and bool(messages) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in messages))


def _read_rows(path: str, flag: str) -> list[Any]:
    p = Path(path).expanduser()
    if not p.exists():
        raise ConfigError(f"{flag} {path}: no such file or directory; pass a .jsonl file, a .parquet file or a "
                          "datasets directory (save_to_disk)")
    if p.is_dir():
        try:
            import datasets
        except ImportError:
            raise ConfigError(f"{flag} {path}: a directory is read as a saved datasets dataset, which needs the "
                              "datasets package (pip install datasets); or pass a .jsonl file") from None
        ds = datasets.load_from_disk(str(p))
        if isinstance(ds, datasets.DatasetDict):
            ds = ds["train"] if "train" in ds else next(iter(ds.values()))
        return list(ds)
    if p.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ConfigError(f"{flag} {path}: parquet needs pyarrow (pip install pyarrow); or pass a .jsonl "
                              "file") from None
        return pq.read_table(p).to_pylist()
    rows = []
    with open(p, "rb") as f:  # bytes: a line that is not UTF-8 is named, not a codec error of the file
        for i, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ConfigError(f"{flag} {path}: line {i} is not UTF-8 (byte 0x{raw[err.start]:02x} at byte "
                                  f"{err.start + 1} of the line); save the file as UTF-8 (JSON text is "
                                  "UTF-8)") from None
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except (json.JSONDecodeError, RecursionError) as err:
                why = err.msg if isinstance(err, json.JSONDecodeError) else "nested too deeply"
                raise ConfigError(f"{flag} {path}: line {i} is not JSON ({why}); one JSON object per "
                                  "line, e.g. {\"prompt\": \"...\"}") from None
    return rows


CHARS_PER_TOKEN = 16
"""A generous bound on the characters of one token: a prompt's tail of ``CHARS_PER_TOKEN`` times the
tokens kept is tokenized first, a longer one only when that tail has too few tokens."""
MARGIN = 16
"""Tokens tokenized beyond the ones kept, so that the cut through the text (perhaps mid-word) lies
before every token kept: those come out as tokenizing the whole text gives them."""


def tail_tokens(tokenize: Callable[[str], list[int]], text: str, keep: int) -> tuple[list[int], bool]:
    """``(ids, whole)``: the tokens of ``text`` when they are at most ``keep`` (``whole``, exact), else
    ``(more than keep tokens ending with its last keep, whole)``; ``whole`` False when only a tail of the
    text was tokenized (the count is then unknown, but more than ``keep``). The work is bounded by
    ``keep``, not by the text: a 10 MB prompt cut to 64 tokens tokenizes a few kB."""
    window = (keep + MARGIN) * CHARS_PER_TOKEN
    while window < len(text):
        ids = tokenize(text[-window:])
        if len(ids) > keep + MARGIN:
            return ids, False
        window *= 4  # tokens longer than the bound: a wider tail
    return tokenize(text), True


def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    """The prompt order of one epoch: a permutation of ``range(n)`` from ``(seed, epoch)`` alone."""
    g = torch.Generator().manual_seed((seed * 1_000_003 + epoch) % (2**63 - 1))
    return torch.randperm(n, generator=g).tolist()


class PromptStream:
    """Next prompts, epoch after epoch, each epoch its own shuffle; ``state_dict`` = (epoch, position)."""

    def __init__(self, n: int, seed: int) -> None:
        self.n, self.seed = n, seed
        self.epoch, self.pos = 0, 0
        self._order = epoch_order(n, seed, 0)

    def take(self, k: int) -> list[int]:
        out = []
        while len(out) < k:
            if self.pos == self.n:
                self.epoch, self.pos = self.epoch + 1, 0
                self._order = epoch_order(self.n, self.seed, self.epoch)
            out.append(self._order[self.pos])
            self.pos += 1
        return out

    def seek(self, position: int, seed: int) -> None:
        """Continue at ``position`` of the endless order (epoch ``position // n``) shuffled from ``seed``."""
        epoch, pos = divmod(int(position), self.n)
        if (epoch, seed) != (self.epoch, self.seed):
            self._order = epoch_order(self.n, seed, epoch)
        self.seed, self.epoch, self.pos = seed, epoch, pos

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "pos": self.pos, "n": self.n, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["n"] != self.n:
            raise ValueError(f"prompt stream state is for {state['n']} prompts, the dataset has {self.n}")
        self.seed, self.epoch, self.pos = int(state["seed"]), int(state["epoch"]), int(state["pos"])
        self._order = epoch_order(self.n, self.seed, self.epoch)
