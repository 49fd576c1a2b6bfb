"""hpcrl.plot: a PNG from real run dirs (two seeds of one config), grouping, row rules, the band."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from hpcrl import plot

pytest.importorskip("matplotlib")

# 250 vector steps x 4 envs: Pendulum episodes (200 steps) finish, so rows carry episode returns.
TINY = ["--preset", "pendulum", "--num-envs", "4", "--total-env-steps", "1000", "--learning-starts", "20",
        "--random-steps", "0", "--batch-size", "64", "--actor-hidden", "32", "--critic-hidden", "32",
        "--num-atoms", "11", "--num-updates", "1", "--log-every", "10", "--checkpoint-every", "0",
        "--eval-episodes", "2"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def seeds(tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("plot")
    dirs = []
    for seed in (0, 1):
        run_dir = root / f"seed{seed}"
        proc = subprocess.run([sys.executable, "-m", "hpcrl.sac", *TINY, "--seed", str(seed), "--run-dir",
                               str(run_dir)], capture_output=True, text=True, timeout=180,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert proc.returncode == 0, proc.stderr[-2000:]
        dirs.append(run_dir)
    return dirs


def test_plot_cli_writes_a_png_of_two_seeds(seeds, tmp_path):
    out = tmp_path / "runs.png"
    proc = subprocess.run([sys.executable, "-m", "hpcrl.plot", *map(str, seeds), "--out", str(out)],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "MPLBACKEND": ""})
    assert proc.returncode == 0, proc.stderr
    data = out.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 20_000
    assert "(2 runs, seeds 0,1)" in proc.stdout  # one group: same config but for the seed
    for run_dir in seeds:  # and each run really had finished episodes to draw
        assert len(plot.load_run(run_dir).series["episode_return"][0]) >= 1


def test_runs_group_by_config_without_seed_or_by_labels(seeds, tmp_path):
    other = tmp_path / "lr"
    shutil.copytree(seeds[0], other)
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "critic_lr": 0.01, "run_dir": str(other)}))
    runs = [plot.load_run(d) for d in (*seeds, other)]
    groups = plot.group_runs(runs)
    assert [len(g) for g in groups.values()] == [2, 1]
    assert list(groups)[0].startswith("critic_lr=0.001") and list(groups)[1] == "critic_lr=0.01"
    by_label = plot.group_runs(runs, ["a", "b", "a"])
    assert {k: [r.path for r in v] for k, v in by_label.items()} == {"a": [seeds[0], other], "b": [seeds[1]]}
    with pytest.raises(plot.ConfigError, match="--labels: 1 label"):
        plot.group_runs(runs, ["a"])
    out = tmp_path / "three.png"
    assert plot.main([*map(str, (*seeds, other)), "--out", str(out), "--band", "minmax"]) == 0
    assert out.read_bytes()[:8] == PNG_MAGIC


def test_rows_without_a_return_are_skipped_and_eval_rows_are_eval_only(tmp_path):
    rows = [
        {"env_steps": 10, "episode_return": float("nan"), "critic_loss": 1.0, "alpha": 0.1},
        {"env_steps": 20, "episode_return": None, "critic_loss": 0.5},
        {"env_steps": 30, "critic_loss": 0.25},
        {"env_steps": 40, "episode_return": -100.0, "critic_loss": 0.2, "alpha": 0.05},
        {"env_steps": 40, "episode_return": -100.0, "eval_return": -50.0},  # eval point only
        {"env_steps": 50, "eval_return": None},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"env_steps": 6')
    run = plot.load_run(tmp_path)
    assert run.config is None
    assert run.series["episode_return"][0].tolist() == [40.0]
    assert run.series["eval_return"][0].tolist() == [40.0] and run.series["eval_return"][1].tolist() == [-50.0]
    assert run.series["critic_loss"][0].tolist() == [10.0, 20.0, 30.0, 40.0]
    assert run.series["alpha"][1].tolist() == [0.1, 0.05]


def test_mean_band_on_a_shared_grid():
    a = (np.array([0.0, 10.0, 20.0]), np.array([0.0, 10.0, 20.0]))
    b = (np.array([5.0, 15.0, 25.0]), np.array([2.0, 2.0, 2.0]))
    grid, mean, low, high = plot.mean_band([a, b])
    assert grid.tolist() == [5.0, 10.0, 15.0, 20.0]  # the union of steps inside the common range
    assert np.allclose(mean, [3.5, 6.0, 8.5, 11.0])
    assert np.allclose(high - mean, np.abs(np.array([5.0, 10.0, 15.0, 20.0]) - 2.0) / 2)  # population std of 2
    _, _, lo, hi = plot.mean_band([a, b], "minmax")
    assert np.allclose(lo, [2, 2, 2, 2]) and np.allclose(hi, [5, 10, 15, 20])
    assert plot.mean_band([a, (np.array([30.0, 40.0]), np.array([1.0, 1.0]))]) is None  # no common range


def test_bad_input_is_one_line_exit_2(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "nan").mkdir()
    (tmp_path / "nan" / "metrics.jsonl").write_text('{"env_steps": 10, "episode_return": NaN}\n')
    for args, message in (([str(tmp_path / "absent")], "no such run dir"),
                          ([str(tmp_path / "empty")], "no metrics.jsonl"),
                          ([str(tmp_path / "nan")], "nothing to plot"),
                          ([str(tmp_path / "nan"), "--out", "x.pdf"], "--out x.pdf")):
        assert plot.main([*args, "--out", str(tmp_path / "o.png")] if "--out" not in args else args) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "o.png").exists()
