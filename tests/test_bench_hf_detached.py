"""benchmarks/hf/hf_detached.py --quick: detached PPO on the real hf workload, lag 1 vs lag 0, publish size."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.extended  # a benchmark script's quick mode (two detached hf runs)
def test_hf_detached_quick_writes_ratio_and_publish(tmp_path):
    out = tmp_path / "x.json"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "SBATCH_", "SRUN_")) and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "hf" / "hf_detached.py"), "--quick", "--json", str(out)],
                          capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    d = json.loads(out.read_text())
    assert d["benchmark"] == "hf_detached" and d["quick"] is True
    ratio = d["ratio"]
    for lag in ("lag1", "lag0"):
        tps = ratio[lag]["tokens_per_s"]
        assert math.isfinite(tps) and tps > 0, (lag, tps)
        assert ratio[lag]["lag_mean"] <= 1
        assert ratio[lag]["collect_ms"] > 0 and ratio[lag]["update_ms"] > 0
    assert ratio["lag0"]["lag_mean"] == 0
    assert ratio["lag1_over_lag0"] == pytest.approx(ratio["lag1"]["tokens_per_s"] / ratio["lag0"]["tokens_per_s"])

    # the published bytes are the actor's fp32 parameters, counted here on the same model built afresh
    sys.path.insert(0, str(REPO / "benchmarks" / "hf"))
    try:
        from hf_detached import build_llama
    finally:
        sys.path.remove(str(REPO / "benchmarks" / "hf"))
    from transformers import AutoModelForCausalLM

    [pub] = d["publish"]
    build_llama(tmp_path / "llama", pub["hidden"])
    actor = AutoModelForCausalLM.from_pretrained(tmp_path / "llama")
    expected = sum(p.numel() for p in actor.parameters()) * 4
    assert pub["publish_nbytes"] == [expected] and pub["param_bytes"] == expected
    assert pub["publish_ms_median"] > 0 and pub["tokens_per_s"] > 0
