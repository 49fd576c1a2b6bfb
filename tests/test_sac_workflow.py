"""The researcher's FastSAC workflow, end to end in real runs: evaluation rows during training, best/ and
final/ policy snapshots, the final checkpoint and a resume of a finished run, --config round trips,
non-finite env data (error and skip), W&B offline files, --seeds, --help."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hpcrl.envs
from hpcrl.run import checkpoint, progress
from hpcrl.envs import Pendulum
from hpcrl.sac.__main__ import main, parse
from hpcrl.sac.config import parse_seeds, preset, seed_runs
from hpcrl.sac.policy import load_policy
from hpcrl.core.conventions import EXIT_NONFINITE

TINY = ["--preset", "pendulum", "--num-envs", "4", "--batch-size", "32", "--actor-hidden", "32",
        "--critic-hidden", "32", "--num-atoms", "21", "--learning-starts", "4", "--random-steps", "4",
        "--num-updates", "1", "--log-every", "5", "--eval-episodes", "0"]


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_eval_rows_best_and_final_snapshots_final_checkpoint_and_resume(tmp_path, capsys):
    run = tmp_path / "run"
    args = TINY + ["--total-env-steps", "160", "--eval-every", "10", "--eval-episodes", "2",
                   "--checkpoint-every", "15", "--run-dir", str(run)]
    assert main(args) == 0
    written = rows(run)
    evals = [r for r in written if "eval_return" in r]
    # every 10 vector steps (40 transitions) but the last, then the final eval at the end
    assert [r["env_steps"] for r in evals] == [40, 80, 120, 160]
    assert all(isinstance(r["eval_return"], float) for r in evals)
    best_policy, best_meta = load_policy(run / "best" / "policy.pt")
    final_policy, final_meta = load_policy(run / "final" / "policy.pt")
    assert best_meta["eval_return"] == pytest.approx(max(r["eval_return"] for r in evals), abs=1e-5)
    assert best_meta["env"] == "pendulum" and best_meta["seed"] == 0
    assert final_meta["env_steps"] == 160 and final_meta["eval_return"] == pytest.approx(evals[-1]["eval_return"], abs=1e-5)
    action = final_policy(torch.zeros(3, 3))
    assert action.shape == (3, 1) and bool(torch.isfinite(action).all())
    # 40 vector steps, checkpoint_every 15 does not divide it: the final checkpoint is written anyway
    assert checkpoint.latest(run).name.endswith(f"{40:012d}")
    err = capsys.readouterr().err
    assert "hpcrl: done in " in err and "eval_return=" in err and f"metrics {progress.short_path(run / 'metrics.jsonl', os.getcwd())}" in err

    assert main(args + ["--resume"]) == 0  # finished: nothing to do, nothing changed
    assert "nothing left to do" in capsys.readouterr().out
    assert rows(run) == written

    best_before = best_meta["eval_return"]
    assert main([a if a != "160" else "240" for a in args] + ["--resume"]) == 0  # train longer
    more = [r for r in rows(run) if "eval_return" in r]
    assert [r["env_steps"] for r in more] == [40, 80, 120, 160, 200, 240]
    _, best_meta = load_policy(run / "best" / "policy.pt")
    # "best so far" survived the resume: best/ holds the best of all six evals, not of the resumed part
    assert best_meta["eval_return"] == pytest.approx(max(best_before, *(r["eval_return"] for r in more[4:])), abs=1e-5)
    learner, _ = checkpoint.load(checkpoint.latest(run), 0, 1, torch.device("cpu"))
    assert learner["best_eval_return"] == pytest.approx(best_meta["eval_return"])  # what a resume must beat


def test_config_json_round_trip_flags_override_and_unknown_keys(tmp_path, capsys):
    run = tmp_path / "run"
    args = TINY + ["--total-env-steps", "20", "--checkpoint-every", "0", "--run-dir", str(run)]
    assert main(args) == 0
    original = parse(args)
    written = run / "config.json"
    again = parse(["--config", str(written)])
    assert again == dataclasses.replace(original, config=str(written))  # the file reruns the same config
    assert parse(["--config", str(written), "--num-envs", "8"]).num_envs == 8  # flags win over the file
    # YAML, a preset named in the file, and preset < file < flags
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("preset: pendulum\nbatch_size: 64\nlog-every: 7\n")
    cfg = parse(["--config", str(yaml_file), "--log-every", "9"])
    assert (cfg.preset, cfg.batch_size, cfg.log_every, cfg.num_envs) == ("pendulum", 64, 9, preset("pendulum").num_envs)
    capsys.readouterr()
    data = json.loads(written.read_text())
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**data, "num_env": 3}))
    assert main(["--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown key 'num_env'" in err and "Traceback" not in err
    (tmp_path / "broken.yaml").write_text("a: [1,\n")
    assert main(["--config", str(tmp_path / "broken.yaml")]) == 2
    assert "not valid YAML" in capsys.readouterr().err


class NonFinitePendulum(Pendulum):
    """A real env: Pendulum whose env 1 returns a NaN reward (or env 0 a NaN observation) at its 7th step."""

    what = "reward"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = 0

    def step(self, action):
        result = super().step(action)
        self.calls += 1
        if self.calls == 7:
            if self.what == "reward":
                result.reward[1] = float("nan")
            else:
                result.obs[0, 2] = float("inf")
                result.next_obs[0, 2] = float("inf")
        return result


class NonFiniteObsPendulum(NonFinitePendulum):
    what = "observation"


@pytest.fixture
def nan_envs(monkeypatch):
    monkeypatch.setitem(hpcrl.envs._REGISTRY, "nan_reward", NonFinitePendulum)
    monkeypatch.setitem(hpcrl.envs._REGISTRY, "inf_obs", NonFiniteObsPendulum)


def test_nonfinite_reward_stops_with_one_line_naming_env_rank_and_step(tmp_path, capsys, nan_envs):
    code = main(TINY + ["--env", "nan_reward", "--total-env-steps", "40", "--run-dir", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert code == EXIT_NONFINITE == 65
    line = [ln for ln in err.splitlines() if "error" in ln]
    assert len(line) == 1 and "Traceback" not in err
    assert "env 'nan_reward'" in line[0] and "non-finite reward (nan in env 1" in line[0]
    assert "rank 0" in line[0] and "vector step 7" in line[0] and "--nonfinite skip" in line[0]


@pytest.mark.parametrize("env", ["nan_reward", "inf_obs"])
def test_nonfinite_skip_counts_and_keeps_the_run_finite(tmp_path, nan_envs, env):
    run = tmp_path / "r"
    assert main(TINY + ["--env", env, "--nonfinite", "skip", "--total-env-steps", "40", "--checkpoint-every", "0",
                        "--run-dir", str(run)]) == 0
    written = rows(run)
    assert sum(r["nonfinite_dropped"] for r in written) == 1
    assert [r["nonfinite_dropped"] for r in written] == [0, 1]  # vector step 7 is in the second window
    assert all(v is None or v == v for r in written for v in r.values() if isinstance(v, float))
    learner = checkpoint.latest(run)
    assert learner is not None


def test_wandb_offline_run_writes_its_files(tmp_path):
    pytest.importorskip("wandb")
    wandb_dir = tmp_path / "wandb_home"
    wandb_dir.mkdir()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "WANDB_"))},
           "WANDB_MODE": "offline", "WANDB_DIR": str(wandb_dir), "WANDB_SILENT": "true"}
    run = tmp_path / "r"
    done = subprocess.run([sys.executable, "-m", "hpcrl.sac", *TINY, "--total-env-steps", "40", "--checkpoint-every",
                           "0", "--wandb-project", "hpcrl-test", "--wandb-mode", "offline", "--run-dir", str(run)],
                          capture_output=True, text=True, timeout=180, env=env)
    assert done.returncode == 0, done.stderr
    runs = list((wandb_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, list(wandb_dir.rglob("*"))[:20]
    assert list(runs[0].glob("run-*.wandb")), list(runs[0].iterdir())
    run_id = (run / "wandb_id").read_text().strip()
    assert runs[0].name.endswith(run_id)


def test_seeds_helper_and_sibling_runs(tmp_path, capsys):
    assert parse_seeds("0, 1,2") == [0, 1, 2]
    for bad in ("", "1,x", "1,1", "-1", str(2**31)):
        with pytest.raises(ValueError):
            parse_seeds(bad)
    cfgs = seed_runs(preset("pendulum", seeds="3,5", run_dir=str(tmp_path)))
    assert [(c.seed, c.seeds, c.run_dir) for c in cfgs] == [(3, "", str(tmp_path / "seed_3")),
                                                            (5, "", str(tmp_path / "seed_5"))]
    assert seed_runs(preset("pendulum")) == [preset("pendulum")]
    assert main(TINY + ["--seeds", "1,x", "--run-dir", str(tmp_path)]) == 2
    assert "--seeds '1,x'" in capsys.readouterr().err
    assert main(TINY + ["--seeds", "0,1", "--total-env-steps", "8", "--log-every", "1", "--checkpoint-every", "0",
                        "--run-dir", str(tmp_path / "s")]) == 0
    for seed in (0, 1):
        assert json.loads((tmp_path / "s" / f"seed_{seed}" / "config.json").read_text())["seed"] == seed


def test_help_shows_preset_config_and_descriptions(capsys):
    with pytest.raises(SystemExit) as done:
        parse(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "--preset" in out and "--config" in out and "--eval-every" in out and "--nonfinite" in out
    assert not re.search(r"-- (run|data|updates|networks|bookkeeping) -", out)  # no section comments as help
    assert "(default: True)" not in out.replace("\n", " ").split("--obs-normalization")[1][:40]  # described
    assert "Vector steps" in out and "Transitions" in out


@pytest.mark.slow
def test_nonfinite_on_one_of_two_ranks_stops_both_with_its_message(tmp_path):
    # Rank 1's env turns NaN; rank 0 must not wait in a collective for it: both stop at that step's
    # agreement and the run exits 65 with rank 1's one line (not "rank N failed", not a timeout).
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "hpcrl.sac", *TINY, "--env", "nonfinite_env:NaNRewardOnSeed2",
                           "--nproc", "2", "--total-env-steps", "80", "--timeout-s", "60",
                           "--run-dir", str(tmp_path / "r")], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == EXIT_NONFINITE, done.stderr[-3000:]
    errors = [ln for ln in done.stderr.splitlines() if "error" in ln]
    assert len(errors) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "on rank 1 at vector step 7" in errors[0] and "non-finite reward" in errors[0], errors[0]
