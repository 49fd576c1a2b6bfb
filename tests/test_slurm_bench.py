"""slurm/bench.sbatch on the real local Slurm cluster (slurm/local_cluster.sh: node1, node2): the collective
sweep over both nodes, then the scaling sweeps as one srun step per point, W=2 spanning the two nodes, and
one report. Quick sizes (QUICK=1 SCALING=1); skip rules as in tests/test_slurm.py."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from benchmarks.common import schema
from test_slurm import FINAL_STATES, REPO, cluster, job_env, job_fields, needs_slurm, wait_for  # noqa: F401

# The benchmark suite's own sbatch machinery (one srun step per point, ~1 min of CPU): extended tier, run by CI.
pytestmark = [pytest.mark.timeout(720), pytest.mark.extended]


@needs_slurm
def test_bench_sbatch_sweeps_across_two_nodes_into_one_report(cluster, tmp_path: Path) -> None:  # noqa: F811
    run_dir = tmp_path / "run"
    # 2:1 needs three tasks: the two-task allocation must skip it and say why, not fail the report
    env = {**job_env(), "QUICK": "1", "SCALING": "1", "SCALING_TOPOLOGIES": "1:1,2:1", "RUN_DIR": str(run_dir)}
    cmd = ["sbatch", "--parsable", "--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=0", "--time=15",
           f"--output={tmp_path}/%j.out", "--export=ALL", str(REPO / "slurm" / "bench.sbatch")]
    job_id = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, check=True).stdout.strip()
    fields = wait_for(lambda: (f := job_fields(job_id))["JobState"] in FINAL_STATES and f, 600,
                      f"bench job {job_id}", poll_s=1.0)
    log = (tmp_path / f"{job_id}.out").read_text()
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), log

    problems = [e for p in sorted(run_dir.glob("*.json")) for e in schema.validate_file(p)]
    assert problems == [] and {"collectives.json", "cost_model.json", "kernels.json", "scaling.json"} <= {
        p.name for p in run_dir.glob("*.json")}, problems
    assert json.loads((run_dir / "collectives.json").read_text())["results"]["world"] == 2

    res = json.loads((run_dir / "scaling.json").read_text())["results"]
    assert res["launcher"] == {"kind": "srun", "nodes": 2, "tasks_per_node": 1, "gpus_per_node": 0, "cpus_per_task": 0}
    sac = {(p["mode"], p["world"]): p for p in res["sac"]}
    assert set(sac) == {("weak", 1), ("weak", 2), ("strong", 1), ("strong", 2)}
    for (mode, w), p in sac.items():
        assert p["status"] == "ok" and p["updates_per_s"] > 0, p
        # each point was its own Slurm step, bootstrapped from Slurm variables, on W nodes
        assert p["launcher"] == "slurm" and p["nodes"] == w and p["command"].startswith(f"srun --nodes={w} "), p
    ppo = {p["topology"]: p for p in res["ppo"]}
    assert ppo["1:1"]["status"] == "ok" and ppo["1:1"]["nodes"] == 2 and ppo["1:1"]["samples_per_s"] > 0
    assert 0.0 <= ppo["1:1"]["maker_idle_frac"] <= 1.0 and 0.0 <= ppo["1:1"]["trainer_idle_frac"] <= 1.0
    assert ppo["2:1"]["status"].startswith("skipped: needs 3 tasks, the allocation has 2 node(s) x 1"), ppo["2:1"]
    assert not list(run_dir.glob("scaling_runs_*")), "the points' run directories were not cleaned up"

    report = (run_dir / "report.md").read_text()
    for needle in ("## Scaling sweeps", "One srun step per point over up to 2 node(s)", "| weak | 2 | 2 |",
                   "| 1:1 | 2 |", "![scaling](scaling.png)"):
        assert needle in report, needle
    assert (run_dir / "scaling.png").stat().st_size > 0
    assert os.path.getsize(run_dir / "cost_model.png") > 0
