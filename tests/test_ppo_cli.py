"""``python -m hpcrl.ppo``'s front door: typed options in --help, command lines that parse into the
config the workload is built from, one-line errors, and the README's target-return command as written."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hpcrl.core.conventions import EXIT_BAD_CONFIG
from hpcrl.ppo.config import DetachedConfig, parse_args
from hpcrl.ppo.run import build_workload
from hpcrl.ppo.workloads.options import LMOptions, PPOOptions, VectorEnvOptions

TESTS = Path(__file__).resolve().parent


def _cli(args: list[str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "SBATCH_", "SRUN_")) and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")]),
               COLUMNS="200")
    return subprocess.run([sys.executable, "-m", "hpcrl.ppo", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=cwd)


def _first_words(doc: str, n: int = 4) -> str:
    return " ".join(doc.split()[:n])


def test_help_lists_every_typed_option_with_its_description(tmp_path):
    proc = _cli(["--help"], tmp_path, timeout=60)
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())  # help wraps lines: compare word sequences
    assert "--workload-args" not in text and "--ppo-args" not in text
    assert "--plugin-args" not in text  # filled from the flags a plugin workload takes, not a flag itself
    for group, kind in (("env", VectorEnvOptions), ("lm", LMOptions), ("ppo", PPOOptions)):
        docs = _field_docs(kind)
        for f in dataclasses.fields(kind):
            name = f"--{group}.{f.name.replace('_', '-')}"
            assert name in text, name
            assert _first_words(docs[f.name]) in text, (name, docs[f.name])
    for flag, words in (("--target-return", "Stop early once"), ("--lag", "Staleness bound"),
                        ("--resume", "Continue the run")):
        assert flag in text and words in text, flag


def _field_docs(kind: type) -> dict[str, str]:
    """Each field's docstring, read from the source (what tyro shows)."""
    import inspect

    src = inspect.getsource(kind)
    return {m.group(1): m.group(2) for m in re.finditer(r"^    (\w+): [^\n]+\n    \"\"\"(.+?)\"\"\"", src, re.S | re.M)}


def test_plugin_help_shows_the_plugins_own_options(tmp_path):
    proc = _cli(["--workload", "ppo_toy:ToyWorkload", "--help"], tmp_path, timeout=60)
    assert proc.returncode == 0, proc.stderr
    for flag in ("--rollout-s", "--train-s", "--samples", "--trainable-only", "--makers", "--env.num-envs"):
        assert flag in proc.stdout, flag


def test_command_lines_round_trip_into_the_built_workload():
    cfg = parse_args(["--workload", "lm", "--lm.lora-rank", "4", "--lm.steps", "1", "2", "--lm.kl-estimator", "k3",
                      "--ppo.truncated-is", "2", "--ppo.value-clip-coef", "inf", "--ppo.lr", "1e-3", "--makers", "2"])
    want = DetachedConfig(workload="lm", makers=2, lm=LMOptions(lora_rank=4, steps=(1, 2), kl_estimator="k3"),
                          ppo=PPOOptions(truncated_is=2.0, value_clip_coef=math.inf, lr=1e-3))
    assert cfg == want
    cfg.check()
    workload, ppo = build_workload(cfg)
    assert (workload.lora_rank, workload.kl_estimator, workload._recipe[1]) == (4, "k3", (1, 2))
    assert (ppo.truncated_is, ppo.value_clip_coef, ppo.lr) == (2.0, None, 1e-3)  # inf = off
    assert ppo.gamma == 1.0 and ppo.kl_coef == 0.02  # unset: the LM workload's own

    cfg = parse_args(["--workload", "swingup", "--env.num-envs", "4", "--ppo.anneal-updates", "7"])
    workload, ppo = build_workload(cfg)
    assert (workload.num_envs, workload.rollout_len) == (4, 64)  # rollout_len unset: swing-up's 64
    assert ppo.extra["anneal_updates"] == 7 and ppo.epochs == 5

    workload, ppo = build_workload(parse_args(["--workload", "cartpole"]))
    assert (workload.num_envs, workload.rollout_len) == (8, 32) and ppo.epochs == 20  # cartpole's SB3-zoo settings


def test_plugin_flags_are_parsed_against_its_constructor(monkeypatch):
    monkeypatch.syspath_prepend(str(TESTS))
    cfg = parse_args(["--workload", "ppo_toy:ToyWorkload", "--makers", "2", "--rollout-s", "0.05", "--trainable-only",
                      "--samples", "16"])
    assert cfg.makers == 2 and cfg.plugin_args == ("--rollout-s", "0.05", "--trainable-only", "--samples", "16")
    cfg.check()
    workload, _ = build_workload(cfg)
    plugin = workload.inner  # the plugin itself, adapted onto the Workload contract
    assert (plugin.rollout_s, plugin.trainable_only, plugin.samples) == (0.05, True, 16)
    # the config a spawned rank or a resume sees carries the same flags
    assert dataclasses.replace(cfg) == cfg and json.loads(json.dumps(dataclasses.asdict(cfg)))["plugin_args"] == \
        list(cfg.plugin_args)


@pytest.mark.parametrize("args, part", [
    (["--ppo.gamma", "2"], "--ppo.gamma 2: must be in [0, 1]"),
    (["--ppo.epochs", "many"], "Error parsing --ppo.epochs"),
    (["--workload", "lm", "--lm.kl-estimator", "k9"], "--lm.kl-estimator"),
    (["--env.hidden", "64", "--env.num-envs"], "--env.num-envs"),
])
def test_bad_values_exit_2_with_one_line(tmp_path, args, part):
    proc = _cli([*args, "--run-dir", str(tmp_path / "run")], tmp_path, timeout=60)
    assert proc.returncode == EXIT_BAD_CONFIG, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith("hpcrl.ppo: error: ") and part in lines[0], lines[0]
    assert not (tmp_path / "run").exists()


README_PPO = ["--workload", "cartpole", "--makers", "2", "--trainers", "1", "--lag", "1", "--target-return", "475",
              "--total-steps", "400"]
"""The README's detached-PPO command (its --run-dir aside): seeds 0-3 reach 475 after 109-139 updates."""


def test_readme_target_return_command_reaches_it_and_says_so(tmp_path):
    proc = _cli([*README_PPO, "--run-dir", str(tmp_path / "run")], tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    stop = re.search(r"stopped early at updates=(\d+)/400 after \S+: episode_return_recent ([\d.]+) >= "
                     r"--target-return 475", out)
    assert stop, out[-3000:]
    assert int(stop.group(1)) < 400 and float(stop.group(2)) >= 475
    assert re.search(r"done in \S+: episode_return_recent=[\d.]+, updates=\d+", out), out[-2000:]
    assert (tmp_path / "run" / "checkpoints" / f"step_{int(stop.group(1)):012d}").is_dir()


def test_a_budget_that_ends_first_says_the_target_was_not_reached(tmp_path):
    proc = _cli(["--workload", "cartpole", "--makers", "1", "--trainers", "1", "--target-return", "475",
                 "--total-steps", "3", "--run-dir", str(tmp_path / "run")], tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert "stopped early" not in out
    assert re.search(r"target_return=475 not reached in 3 updates \(best episode_return_recent \S+; raise "
                     r"--total-steps\)", out), out[-2000:]
