"""The frozen-maker case on the hf workload (tests/test_ppo_frozen.py has it on cartpole): a tiny real
Llama built by tests/hf_fixtures.py, 2 makers : 1 trainer, torchrun-style processes, maker 1 SIGSTOPped
for good after the 3rd row. It is dropped and counted, the run finishes rc 0 on the live maker with
every sample accounted for; with one-turn completions and with multi-turn episodes. Extended tier: the ranks load transformers (~40 s here)."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))

import hf_fixtures as F  # noqa: E402
from test_ppo_frozen import HEARTBEAT_S, _check_accounts, _launch, _rows, _wait_rows  # noqa: E402

pytest.importorskip("transformers")
pytestmark = [pytest.mark.extended, pytest.mark.timeout(420)]


EPISODES = {"one-turn": ["--hf.reward-fn", "hf_fixtures:target_fraction"],
            "multi-turn": ["--hf.env", "episode_fixtures:UntilYes", "--hf.max-turns", "3"]}


@pytest.mark.parametrize("episodes", sorted(EPISODES))
def test_hf_maker_frozen_for_good_is_dropped_and_the_run_finishes(tmp_path, episodes):
    model, prompts = F.build_causal_lm(tmp_path / "llama"), F.write_prompts(tmp_path / "prompts.jsonl")
    run, steps = tmp_path / "run", 12
    args = ["--workload", "hf", "--hf.model", str(model), *EPISODES[episodes],
            "--hf.prompts", str(prompts), "--hf.max-prompt-tokens", "8", "--hf.max-new-tokens", "8",
            "--hf.batch-size", "8", "--makers", "2", "--heartbeat-timeout-s", str(HEARTBEAT_S), "--timeout-s", "90"]
    path = os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])
    procs = _launch(run, steps, args=args, extra_env={"PYTHONPATH": path, "HF_HUB_OFFLINE": "1"})
    trainer, healthy, frozen = procs
    try:
        _wait_rows(run, 3, procs, timeout=240)
        frozen.send_signal(signal.SIGSTOP)
        at_freeze, t0 = int(_rows(run)[-1]["updates"]), time.monotonic()
        out, err = trainer.communicate(timeout=150)
        assert trainer.returncode == 0, err[-3000:]
        assert healthy.wait(timeout=60) == 0
    finally:
        for p in procs:
            p.kill()
    final = [r for r in _rows(run) if "samples_produced" in r][-1]
    assert final["policy_version"] == steps and steps > at_freeze
    _check_accounts(final)
    assert "weights go point-to-point to the 1 live maker(s)" in out, out[-2000:]
    if episodes == "multi-turn":
        assert all(r["turns"] >= 1 for r in _rows(run) if "turns" in r) and any("turns" in r for r in _rows(run))
    print(f"hf ({episodes}), one of two makers frozen at update {at_freeze}: run finished {time.monotonic() - t0:.1f} s later")
