"""Sizes checked before anything starts: a FastSAC config whose ranks cannot fit in this node's memory
exits 2 with one line naming the flag and a value that fits (hpcrl.sac.sizes), and an hf model directory
without loadable weights exits 2 naming what is missing, both before any rank starts."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcrl.core.config_check import ConfigError
from hpcrl.replay import ReplayShard
from hpcrl.sac.config import preset
from hpcrl.sac.sizes import (EnvDims, Memory, RankBytes, check_fits, check_sac, largest_fitting, local_ranks,
                         probe_dims, rank_bytes, replay_bytes, show_bytes)

TESTS = Path(__file__).resolve().parent
PENDULUM = EnvDims(3, 1)


TORCHRUN_RANK = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                     MASTER_PORT="29511")  # a rank as torchrun starts it: refused before its rendezvous


def _sac(args: list[str], cwd: Path, launcher: dict[str, str]) -> tuple[subprocess.CompletedProcess, float]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
           and not k.startswith("SLURM_")}
    env.update(launcher)
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "hpcrl.sac", "--preset", "pendulum", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)
    return proc, time.monotonic() - start


@pytest.mark.parametrize("args, name, launcher", [
    (["--buffer-size", "1000000000000"], "--buffer-size", {}),
    (["--num-envs", "100000000"], "--num-envs", {}),
    (["--batch-size", "1000000000000"], "--batch-size", {}),
    (["--nproc", "2", "--buffer-size", "1000000000000"], "--buffer-size", {}),
    (["--buffer-size", "1000000000000"], "--buffer-size", TORCHRUN_RANK),
])
def test_sizes_too_large_for_the_node_exit_2_before_any_rank(tmp_path, args, name, launcher):
    run = tmp_path / "run"
    proc, elapsed = _sac([*args, "--run-dir", str(run)], tmp_path, launcher)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and lines[0].startswith(f"hpcrl.sac: error: {name} "), proc.stderr
    ranks = "2 ranks" if "--nproc" in args or launcher else "1 rank"
    assert f"available for {ranks}: use {name} <= " in lines[0], lines[0]
    assert elapsed < 20, elapsed
    assert not (run / "checkpoints").exists() and not (run / "config.json").exists()  # no rank started


def test_the_suggested_value_fits_and_the_raised_flag_is_blamed():
    memory = Memory(20 * 10**9, "host memory", 2)
    default = preset("pendulum")
    for name, value in (("buffer_size", 10**12), ("num_envs", 10**8), ("batch_size", 10**12)):
        cfg = dataclasses.replace(default, nproc=2, **{name: value})
        with pytest.raises(ConfigError) as err:
            check_fits(cfg, 2, PENDULUM, memory, default)
        msg = str(err.value)
        flag = "--" + name.replace("_", "-")
        assert msg.startswith(f"{flag} {value} needs ") and "\n" not in msg, msg
        fit = int(msg.rsplit("<= ", 1)[1])
        assert fit % (1 if name == "buffer_size" else 2) == 0
        check_fits(dataclasses.replace(cfg, **{name: fit}), 2, PENDULUM, memory, default)  # fits: no raise
        assert rank_bytes(dataclasses.replace(cfg, **{name: 2 * fit}), 2, PENDULUM).total > 10 * 10**9


@pytest.mark.parametrize("name, dims", [("holosoma", PENDULUM), ("pendulum", PENDULUM),
                                        ("halfcheetah", EnvDims(17, 6)), ("playground", EnvDims(5, 1))])
def test_the_presets_pass_the_check(name, dims):
    cfg = preset(name)
    need = check_fits(cfg, 1, dims, Memory(4 * 10**9, "host memory", 1), cfg)
    assert isinstance(need, RankBytes) and need.total < 4 * 10**9


def test_a_small_config_passes_on_this_machine():
    cfg = preset("pendulum")
    assert probe_dims("pendulum") == PENDULUM
    need = check_sac(cfg, 1, 1, cfg, local_rank=0)
    assert need is None or need.total < 10**9  # None: this machine's memory cannot be read


@pytest.mark.parametrize("critic_obs_dim", [0, 7])
def test_the_replay_estimate_matches_the_shard_allocation(critic_obs_dim):
    envs, capacity, obs_dim, action_dim = 6, 50, 11, 3
    shard = ReplayShard(envs, capacity, obs_dim, action_dim, critic_obs_dim=critic_obs_dim)
    real = sum(t.nbytes for t in (shard.obs, shard.action, shard.reward, shard.flags, shard.final_ref,
                                  shard.final_pool, shard.head_next_obs))
    estimate = replay_bytes(envs, capacity, EnvDims(obs_dim, action_dim, critic_obs_dim))
    assert real / 2 <= estimate <= 2 * real, (estimate, real)
    assert estimate == shard.nbytes()  # the layout as built, before the final-observation pool grows


def test_pure_helpers():
    assert largest_fitting(lambda v: v <= 12345, 1, 10**9, 1) == 12000
    assert largest_fitting(lambda v: v <= 130, 4, 1000, 4) == 120  # two digits, a multiple of 4
    assert largest_fitting(lambda v: v <= 3, 4, 1000, 4) is None
    assert show_bytes(61.4e12) == "61.4 TB" and show_bytes(999) == "999 B"
    assert local_ranks({"LOCAL_WORLD_SIZE": "4"}) == 4
    assert local_ranks({"SLURM_STEP_TASKS_PER_NODE": "8(x2)"}) == 8
    assert local_ranks({}) == 1


def test_hf_model_without_weights_exits_2_naming_the_file(tmp_path):
    pytest.importorskip("transformers")
    import hf_fixtures as F

    model = F.build_causal_lm(tmp_path / "llama")
    prompts = F.write_prompts(tmp_path / "prompts.jsonl")
    weights = model / "model.safetensors"
    assert weights.is_file()
    weights.unlink()
    run = tmp_path / "run"
    proc = F.run_ppo(["--workload", "hf", "--hf.model", str(model), "--hf.reward-fn", "hf_fixtures:target_fraction",
                      "--hf.prompts", str(prompts), "--makers", "1", "--trainers", "1", "--run-dir", str(run)],
                     tmp_path, 240)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr
    assert lines[-1].startswith("hpcrl.ppo: error: ") and f"--hf.model {model}: no weights file" in lines[-1], \
        proc.stderr
    assert "model.safetensors" in lines[-1]
    assert not (run / "checkpoints").exists()


def test_hf_sharded_index_with_a_missing_shard_is_named(tmp_path):
    from hpcrl.ppo.workloads.hf_models import check_model_path, missing_weights

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors.index.json").write_text(
        '{"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}')
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match="1 of the 2 shards .* missing .first: model-00002-of-00002"):
        check_model_path("--hf.model", str(tmp_path))
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(b"")
    assert missing_weights(tmp_path) is None


def test_hf_model_without_its_tokenizer_is_refused_up_front(tmp_path):
    pytest.importorskip("transformers")
    import hf_fixtures as F
    from hpcrl.ppo.workloads.hf import HFWorkload

    model = F.build_causal_lm(tmp_path / "llama")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model / name).unlink()
    with pytest.raises(ConfigError, match=f"--model {model}: cannot load its tokenizer") as err:
        HFWorkload(model=str(model), reward_fn="hf_fixtures:target_fraction",
                   prompts=str(F.write_prompts(tmp_path / "prompts.jsonl")), max_prompt_tokens=8, max_new_tokens=8)
    assert "\n" not in str(err.value)
