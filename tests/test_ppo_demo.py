"""``python -m hpcrl.ppo.demo DIR``: builds a tiny Llama, tokenizer, prompts and a verifiable reward
locally, prints the training command; that command, run as printed (fewer steps), learns."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from hpcrl.ppo import demo  # noqa: E402
from hpcrl.ppo.demo_task import CATEGORIES, reward, task_prompts, task_record  # noqa: E402

STEPS = 100
"""Shortened from the printed 400 (measured on 2 vCPU: reward 0.09 over the first 5 updates, ~0.5 over
updates 90-100, 0.84 over the last 20 of 400)."""


def _env() -> dict[str, str]:
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("SLURM_", "SBATCH_", "SRUN_")) and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return {**clean, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "COLUMNS": "200"}


def test_reward_counts_new_words_of_the_prompts_category():
    cat_dog = task_record("list: cat dog", 0)
    assert cat_dog == {"prompt": "list: cat dog", "answer": ["bird", "fish", "horse", "cow"], "id": 0}
    assert reward([cat_dog] * 5, ["horse cow fish", "cat dog cow", "cow cow cow", "red blue one", ""]) == \
        pytest.approx([1.0, 1 / 3, 1 / 3, 0.0, 0.0])
    # only the first three words count
    assert reward([task_record("list: red blue", 1)], ["green yellow black cat white"]) == [1.0]
    prompts = task_prompts(60)
    assert {p.split()[1] for p in prompts} <= {w for ws in CATEGORIES.values() for w in ws}
    assert len(set(prompts)) > 30


@pytest.mark.slow
def test_demo_builds_and_its_printed_command_learns(hf_demo, tmp_path, capsys):
    out = hf_demo.out  # built once per session (conftest), then read only
    t0 = time.perf_counter()
    assert (out / "model" / "config.json").is_file() and (out / "model" / "tokenizer.json").is_file()
    assert len((out / "prompts.jsonl").read_text().splitlines()) == 256
    held_out = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    assert len(held_out) == demo.EVAL_RECORDS and all(r["answer"] for r in held_out)
    cmd = shlex.split(hf_demo.stdout.strip().splitlines()[-1])
    assert cmd[1:3] == ["-m", "hpcrl.ppo"] and cmd[cmd.index("--total-steps") + 1] == "400", cmd
    assert cmd[cmd.index("--hf.eval-prompts") + 1] == str(out / "eval.jsonl") and "--hf.eval-every" in cmd, cmd
    cmd[cmd.index("--total-steps") + 1] = str(STEPS)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "runs" / "hf" / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward"] for r in rows if "score" in r][:STEPS]  # one row per update (+ the final row)
    first, last = sum(rewards[:5]) / 5, sum(rewards[-10:]) / 10
    assert len(rewards) == STEPS and first < 0.2 and last > 0.4 and last > first + 0.25, \
        ([round(r, 2) for r in rewards], time.perf_counter() - t0)
    evals = {r["updates"]: r for r in rows if "eval_reward" in r}  # at updates 50 and 100
    assert sorted(evals) == [demo.EVAL_EVERY, STEPS], sorted(evals)
    assert all(r["eval_records"] == demo.EVAL_RECORDS and 0 <= r["eval_pass_rate"] <= 1 for r in evals.values())
    before, after = demo.show(str(out / "model")), demo.show(str(tmp_path / "runs" / "hf" / "hf" / "actor"))
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 14 and " -> " in lines[0] and lines[-1].startswith("mean score"), lines
    assert after > before, lines  # the trained actor's greedy answers, not the initial model's


def test_demo_refuses_a_dir_that_holds_one(tmp_path, capsys):
    (tmp_path / "prompts.jsonl").write_text("{}\n")
    assert demo.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "prompts.jsonl already exists" in err[0], err
    assert (tmp_path / "prompts.jsonl").read_text() == "{}\n"  # untouched


def test_demo_for_vllm_builds_heads_vllm_runs_and_prints_the_engine_flag(tmp_path, capsys):
    from transformers import AutoConfig

    from hpcrl.ppo.workloads.vllm_engine import CPU_HEAD_SIZES, head_dim

    assert demo.main([str(tmp_path / "d"), "--engine", "vllm", "--pretrain-steps", "0"]) == 0
    out = capsys.readouterr().out
    config = AutoConfig.from_pretrained(tmp_path / "d" / "model")
    assert head_dim(config) == 32 and head_dim(config) in CPU_HEAD_SIZES and config.hidden_size == 64
    command = shlex.split(out.strip().splitlines()[-1])
    assert command[command.index("--hf.engine") + 1] == "vllm", command
    assert "--hf.engine" not in demo.command(tmp_path / "d")  # the default engine's command stays as it was
