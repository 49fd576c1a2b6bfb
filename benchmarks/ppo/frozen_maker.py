#!/usr/bin/env python
"""Detached PPO throughput with one of two makers frozen (SIGSTOP for good) vs the healthy run.

    python benchmarks/ppo/frozen_maker.py [--workload cartpole|hf] [--pairs 2] [--steps N] [--json PATH]

2 makers : 1 trainer, ``--heartbeat-timeout-s 3``, real processes (torchrun-style variables, gloo on
loopback, ``OMP_NUM_THREADS=1``). Runs alternate healthy / frozen (interleaved, so load drifts hit both
alike). In a frozen run maker 1 is SIGSTOPped once the 5th metrics row is written and never woken
(killed at the end). Throughput = ``env_steps`` / s from the metrics rows' ``env_steps`` and ``time``,
over the same window in both: from row 5 to the last step row; in the frozen run that window holds the
detection (up to the heartbeat timeout) and the rest of the run on the live maker alone. Target: frozen
>= 40 % of healthy.

``--workload cartpole`` (default; ``--steps 300``, ``benchmarks/results/frozen_maker.json``): env steps / s.
``--workload hf`` (``--steps 400``, ``benchmarks/results/frozen_maker_hf.json``): the embedded demo
(``python -m hpcrl.ppo.demo``, built once per invocation into a temp dir) trained with the demo's own
arguments (:func:`hpcrl.ppo.demo.command`) but ``--makers 2``; an hf row's ``env_steps`` counts response
tokens (real masks), so the figure is generated response tokens / s consumed by the trainer (updates / s
is kept per run too: one batch of ``--hf.batch-size`` sequences per update).

``--spawned N`` (printed, not written; cartpole): N runs under local spawn (``python -m hpcrl.ppo``
starting its ranks), maker 1 frozen for good: seconds from the freeze to its drop, the longest gap
between updates after the freeze, and seconds from the trainer's last line to the parent's exit."""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.common import schema  # noqa: E402
from benchmarks.common.paths import RESULTS  # noqa: E402
from benchmarks.common.timing import write_json  # noqa: E402

HEARTBEAT_S = 3.0
FROM_ROW = 5
STEPS = {"cartpole": 300, "hf": 400}
JSON = {"cartpole": RESULTS / "frozen_maker.json", "hf": RESULTS / "frozen_maker_hf.json"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rows(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _step_rows(rows: list[dict]) -> list[dict]:
    """The trainer's step rows: not the hf eval rows (``eval_*``), not the closing accounts."""
    return [r for r in rows if "policy_version" in r and "samples_produced" not in r]


def cartpole_args(steps: int) -> list[str]:
    return ["--workload", "cartpole", "--makers", "2", "--trainers", "1", "--total-steps", str(steps)]


def build_hf_demo(out: Path) -> Path:
    """``python -m hpcrl.ppo.demo out`` (model, tokenizer, prompt records; the reward is in the package)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "hpcrl.ppo.demo", str(out)], env=env, capture_output=True,
                          text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"hpcrl.ppo.demo exited {done.returncode}: {done.stderr[-2000:]}")
    return out


def hf_args(demo: Path, steps: int) -> list[str]:
    """The demo's training arguments (:func:`hpcrl.ppo.demo.command`), with 2 makers : 1 trainer."""
    from hpcrl.ppo.demo import command

    cmd = command(demo, total_steps=steps, run_dir="-")[3:]  # drop python -m hpcrl.ppo
    cmd = cmd[:cmd.index("--run-dir")] + cmd[cmd.index("--run-dir") + 2:]
    for flag, value in (("--makers", "2"), ("--trainers", "1")):
        cmd[cmd.index(flag) + 1] = value
    return cmd


def _launch(run: Path, args: list[str]) -> list[subprocess.Popen]:
    port, procs = _free_port(), []
    for rank in range(3):
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}, "RANK": str(rank),
               "WORLD_SIZE": "3", "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "hpcrl.ppo", *args, "--heartbeat-timeout-s", str(HEARTBEAT_S), "--timeout-s",
             "60", "--run-dir", str(run)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    return procs


def one_run(args: list[str], freeze: bool) -> dict:
    """One run of ``python -m hpcrl.ppo *args``; its env steps / s from row FROM_ROW to the last step row,
    and the makers it lost."""
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        procs = _launch(run, args)
        try:
            while len(_rows(run)) < FROM_ROW:
                if procs[0].poll() is not None:
                    raise RuntimeError(f"trainer exited {procs[0].returncode}: {procs[0].stderr.read()[-2000:]}")
                time.sleep(0.01)
            if freeze:
                procs[2].send_signal(signal.SIGSTOP)
            _, err = procs[0].communicate(timeout=300)
            if procs[0].returncode != 0:
                raise RuntimeError(f"trainer exited {procs[0].returncode}: {err[-2000:]}")
        finally:
            for p in procs:
                p.kill()
                p.wait()
        rows = _rows(run)
    # rows[-1] repeats the last step with the closing accounts; hf eval rows (every 50 updates) are skipped
    start, last = rows[FROM_ROW - 1], _step_rows(rows)[-1]
    rate = (last["env_steps"] - start["env_steps"]) / max(last["time"] - start["time"], 1e-9)
    updates_s = (last["updates"] - start["updates"]) / max(last["time"] - start["time"], 1e-9)
    return {"frozen": freeze, "env_steps_per_s": rate, "updates_per_s": updates_s,
            "window_s": last["time"] - start["time"], "makers_lost": rows[-1].get("makers_lost"),
            "policy_version": rows[-1].get("policy_version")}


def spawned_run(steps: int) -> dict:
    """``python -m hpcrl.ppo`` spawning its 3 ranks, maker 1 frozen for good at row FROM_ROW: seconds from
    the freeze to the drop (the trainer's point-to-point line), the longest gap between two updates after
    the freeze, and seconds from the trainer's last line to the parent's exit."""
    from tests.test_spawn import _ranks_of

    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}, "OMP_NUM_THREADS": "1"}
        proc = subprocess.Popen(
            [sys.executable, "-m", "hpcrl.ppo", "--workload", "cartpole", "--makers", "2", "--trainers", "1",
             "--heartbeat-timeout-s", str(HEARTBEAT_S), "--timeout-s", "60", "--total-steps", str(steps),
             "--run-dir", str(run)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True)
        lines: list[tuple[float, str]] = []
        readers = [threading.Thread(target=lambda f=f: lines.extend((time.monotonic(), x) for x in f), daemon=True)
                   for f in (proc.stdout, proc.stderr)]
        for r in readers:
            r.start()
        try:
            while len(_rows(run)) < FROM_ROW:
                if proc.poll() is not None:
                    raise RuntimeError(f"exited {proc.returncode}: {''.join(x for _, x in lines)[-2000:]}")
                time.sleep(0.01)
            os.kill(_ranks_of(proc.pid)[2], signal.SIGSTOP)
            frozen_at, at_row = time.monotonic(), len(_rows(run))
            proc.wait(timeout=300)
            exited = time.monotonic()
            for r in readers:
                r.join(timeout=10)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        rows = [r for r in _rows(run) if "samples_produced" not in r]
    drop = next((t for t, x in lines if "weights go point-to-point" in x), float("nan"))
    done = next((t for t, x in lines if x.startswith("hpcrl: done in")), float("nan"))
    times = [r["time"] for r in rows[at_row - 1:]]
    return {"rc": proc.returncode, "freeze_to_drop_s": drop - frozen_at,
            "longest_update_gap_after_freeze_s": max(b - a for a, b in zip(times, times[1:])),
            "median_update_gap_s": statistics.median(b - a for a, b in zip(times, times[1:])),
            "parent_exit_after_done_s": exited - done}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--workload", choices=sorted(STEPS), default="cartpole")
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=None, help="total updates (default: cartpole 300, hf 400)")
    ap.add_argument("--spawned", type=int, default=0, metavar="N",
                    help="instead: N cartpole runs under local spawn, maker 1 frozen for good (see spawned_run)")
    ap.add_argument("--json", default=None, help="default: benchmarks/results/frozen_maker.json (cartpole), "
                    "frozen_maker_hf.json (hf)")
    args = ap.parse_args()
    steps = args.steps or STEPS[args.workload]
    out = args.json or str(JSON[args.workload])
    if args.spawned:
        if args.workload != "cartpole":
            ap.error("--spawned runs cartpole only")
        for _ in range(args.spawned):
            print(json.dumps(spawned_run(steps)), flush=True)
        return
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        run_args = (cartpole_args(steps) if args.workload == "cartpole"
                    else hf_args(build_hf_demo(Path(tmp) / "demo"), steps))
        for _ in range(args.pairs):
            for freeze in (False, True):
                runs.append(one_run(run_args, freeze))
                print(json.dumps(runs[-1]), flush=True)
    healthy = statistics.median(r["env_steps_per_s"] for r in runs if not r["frozen"])
    frozen = statistics.median(r["env_steps_per_s"] for r in runs if r["frozen"])
    ratio = frozen / healthy
    config = {"workload": args.workload, "makers": 2, "trainers": 1, "heartbeat_timeout_s": HEARTBEAT_S,
              "total_steps": steps, "pairs": args.pairs, "from_row": FROM_ROW}
    if args.workload == "cartpole":
        unit, name, what = "env steps/s", "env_steps_per_s", "env steps/s"
    else:
        unit, name, what = "response tokens/s", "response_tokens_per_s", "response tokens/s (env_steps)"
        config["args"] = run_args
    doc = schema.make("frozen_maker", schema.header("cpu", 3, config),
                      {"frozen_over_healthy": schema.figure(ratio, "ratio", True),
                       f"healthy_{name}": schema.figure(healthy, unit, True),
                       f"frozen_{name}": schema.figure(frozen, unit, True)},
                      {"runs": runs, "target": 0.4, "meets_target": ratio >= 0.4})
    write_json(out, doc)
    print(f"frozen_maker ({args.workload}): healthy {healthy:.0f} {what}, one of two makers frozen {frozen:.0f} "
          f"{what}: {100 * ratio:.0f} % (target >= 40 %); {out}", flush=True)


if __name__ == "__main__":
    main()
