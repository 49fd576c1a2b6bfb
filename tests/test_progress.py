"""The progress display: pure formatting (width, no cut values, no nan, final and early-stop lines) and
RunLogger's output on a terminal-like and a file-like stream, and its strict-JSON metrics.jsonl."""

from __future__ import annotations

import io
import json
import math
import os

import pytest

from hpcrl.run import progress
from hpcrl.run.metrics import RunLogger, truncate_rows

ROW = {"env_steps": 4000, "updates": 3120, "actor_updates": 1560, "actor_loss": 43.2612, "alpha": 0.0998,
       "alpha_loss": 0.15672, "critic_loss": 6.0091, "entropy": 0.5907, "episode_length": float("nan"),
       "episode_return": float("nan"), "sps": 535.8}


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def fields(**kw):
    return progress.progress_fields(ROW, key="env_steps", total=8000, elapsed_s=62.0, rate=100.0,
                                    last_return=-198.31, return_age=2, **kw)


@pytest.mark.parametrize("width", [20, 40, 60, 80, 120, 200, 400])
def test_line_fits_the_width_and_cuts_no_value(width):
    all_fields = fields()
    line = progress.fit(all_fields, width)
    assert len(line) <= width
    assert line.startswith("[ 50.0%]")
    # every field on the line is whole: it is one of the fields, in order
    shown = [f for f in all_fields if f in line]
    assert " ".join(shown) == line or width < len(all_fields[0])
    if width >= 60:
        assert "return=-198.3 (2 rows ago)" in line and "env_steps=4000/8000" in line
    assert "nan" not in line


def test_no_width_keeps_every_field_and_missing_values_read_as_dash():
    line = progress.fit(fields(), None)
    assert "eta=40s" in line and "elapsed=1m02s" in line and "sps=535.8" in line
    # a value missing from the row (no episode ended in the window) is left out, not shown as "-"
    assert "episode_length" not in line and "nan" not in line.lower()
    assert "\r" not in line


def test_return_age_and_first_return():
    now = progress.progress_fields({"env_steps": 10, "episode_return": -5.0}, key="env_steps", total=10,
                                   elapsed_s=1, last_return=-5.0, return_age=0)
    assert "return=-5" in now and not any("ago" in f for f in now)
    one = progress.progress_fields({"env_steps": 5}, key="env_steps", total=10, elapsed_s=1, last_return=-5.0,
                                   return_age=1)
    assert "return=-5 (1 row ago)" in one
    none = progress.progress_fields({"env_steps": 5}, key="env_steps", total=10, elapsed_s=1)
    assert not any(f.startswith("return=") for f in none)


@pytest.mark.parametrize("seconds, text", [(0, "0s"), (45.4, "45s"), (62, "1m02s"), (3600 * 2 + 300, "2h05m"),
                                           (float("nan"), "?"), (-1, "?")])
def test_duration(seconds, text):
    assert progress.duration(seconds) == text


def test_summary_and_early_stop_lines():
    paths = {"checkpoint": "runs/a/checkpoints/step_1", "metrics": "runs/a/metrics.jsonl", "policy": None}
    lines = progress.summary_lines(62, {"eval_return": -198.345, "best": None, "x": math.nan}, paths)
    assert lines == ["done in 1m02s: eval_return=-198.3", "checkpoint runs/a/checkpoints/step_1",
                     "metrics runs/a/metrics.jsonl"]
    # one place a line, relative to the working directory where that is shorter, else as given
    here = progress.summary_lines(1, {}, {"policy": "/home/u/runs/a/final/policy.pt", "metrics": "/tmp/m.jsonl"},
                                  cwd="/home/u")
    assert here == ["done in 1s", "policy runs/a/final/policy.pt", "metrics /tmp/m.jsonl"]
    stopped = progress.summary_lines(2, {"updates": 5}, {}, stopped="SIGINT")
    assert stopped == ["stopped (SIGINT) after 2s: updates=5; resume with --resume"]
    stop = progress.early_stop_line("episode_return_recent 480.2 >= --target-return 475", key="updates", at=40,
                                    total=100, elapsed_s=12)
    assert stop == "stopped early at updates=40/100 after 12s: episode_return_recent 480.2 >= --target-return 475"


def test_run_logger_file_output_is_one_full_line_per_row_and_json_has_no_nan(tmp_path):
    out = io.StringIO()
    log = RunLogger(tmp_path, True, 30, tensorboard=False, progress_every_s=0.0, stream=out)
    log.log({"env_steps": 10, "updates": 1, "episode_return": -3.5, "critic_loss": 1.0})
    log.log({"env_steps": 20, "updates": 2, "episode_return": float("nan"), "critic_loss": float("inf")})
    log.log({"env_steps": 30, "updates": 3, "episode_return": float("nan"), "critic_loss": 0.5})
    log.finish({"eval_return": -2.0}, {"checkpoint": tmp_path / "checkpoints"})
    log.close()
    text = out.getvalue()
    lines = text.splitlines()
    assert "\r" not in text and "nan" not in text.lower()
    assert len(lines) == 6
    assert "return=-3.5 (1 row ago)" in lines[1] and "return=-3.5 (2 rows ago)" in lines[2]
    assert "critic_loss" not in lines[1] and "critic_loss=0.5" in lines[2]  # inf is missing, not "-"
    assert lines[3] == "hpcrl: done in 0s: eval_return=-2"
    shown = [progress.short_path(tmp_path / name, os.getcwd()) for name in ("checkpoints", "metrics.jsonl")]
    assert lines[4:] == [f"hpcrl: checkpoint {shown[0]}", f"hpcrl: metrics {shown[1]}"]  # relative where shorter
    raw = (tmp_path / "metrics.jsonl").read_text()
    rows = [json.loads(line, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}")) for line in
            raw.splitlines()]
    assert rows[1]["episode_return"] is None and rows[1]["critic_loss"] is None  # null, key kept
    assert truncate_rows(tmp_path / "metrics.jsonl", 20) == 2


def test_run_logger_terminal_line_fits_and_ends_with_newline_on_early_stop(tmp_path):
    out = Tty()
    log = RunLogger(tmp_path, True, 100, tensorboard=False, progress_key="updates", stream=out, width=50)
    for u in (10, 20):
        log.log({"env_steps": u * 64, "updates": u, "episode_return": 20.0 + u, "loss": 0.123456, "sps": 999.0})
    log.early_stop("episode_return_recent 480.2 >= --target-return 475", at=20)
    log.finish({"episode_return": 40.0})
    log.close()
    text = out.getvalue()
    shown = [seg.split("\n")[0] for seg in text.split("\r\x1b[K")[1:]]
    assert shown and all(len(s) <= 50 for s in shown)
    assert shown[-1].startswith("[ 20.0%] updates=20/100")
    lines = text.split("\n")
    assert lines[-2].startswith("hpcrl: metrics ")
    lines = lines[:-1]
    assert lines[-3] == "hpcrl: stopped early at updates=20/100 after 0s: episode_return_recent 480.2 >= --target-return 475"
    assert lines[-2].startswith("hpcrl: done in 0s: episode_return=40")


def test_disabled_logger_writes_nothing(tmp_path):
    out = io.StringIO()
    log = RunLogger(tmp_path / "r", False, 10, stream=out)
    log.log({"env_steps": 10, "updates": 1})
    log.finish({})
    log.early_stop("x", at=1)
    log.close()
    assert out.getvalue() == "" and not (tmp_path / "r").exists()


def test_log_lines_are_bounded_and_the_eta_follows_the_recent_rate(tmp_path, monkeypatch):
    """In a file or a Slurm log a line is at most LOG_WIDTH wide however many fields a row has, and the
    ETA comes from the latest rows: fast warm-up rows (random steps) do not make it optimistic."""
    out = io.StringIO()
    clock = [1000.0]
    monkeypatch.setattr("hpcrl.run.metrics.time.time", lambda: clock[0])
    log = RunLogger(tmp_path, True, 100_000, tensorboard=False, progress_every_s=0.0, stream=out)
    wide = {f"field_{i}": 1.2345 for i in range(60)}
    for step in range(1, 21):  # 10 warm-up rows at 10,000 steps/s, then 10 rows at 100 steps/s
        clock[0] += 1.0
        log.log({"env_steps": step * 10_000 if step <= 5 else 50_000 + (step - 5) * 100, "updates": step, **wide})
    log.close()
    lines = out.getvalue().splitlines()
    assert len(lines) == 20 and all(len(line) <= progress.LOG_WIDTH for line in lines)
    assert "eta=" in lines[-1] and progress.duration((100_000 - 51_500) / 100) in lines[-1]


def test_tensorboard_files_follow_the_run_dir_mode(tmp_path):
    log = RunLogger(tmp_path, True, 10, tensorboard=True, stream=io.StringIO())
    log.log({"env_steps": 10, "updates": 1, "loss": 1.0})
    log.close()
    files = list((tmp_path / "tb").iterdir())
    assert files and all(f.stat().st_mode & 0o077 == 0 for f in files), [oct(f.stat().st_mode) for f in files]
