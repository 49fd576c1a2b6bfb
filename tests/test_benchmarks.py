"""Benchmark suite: the --quick entry point, the alpha-beta fit, the projection, the gate."""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from benchmarks.comm import cost_model
from benchmarks.common import compare, schema

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bench")
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "--quick", "--out", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=240,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = list(out.iterdir())
    assert len(runs) == 1, runs
    return runs[0]


def test_quick_suite_report_and_schema(quick_run: Path) -> None:
    names = {p.stem for p in quick_run.glob("*.json")}
    assert {"collectives", "cost_model", "kernels"} <= names
    for p in quick_run.glob("*.json"):
        assert schema.validate_file(p) == [], p
    coll = json.loads((quick_run / "collectives.json").read_text())
    assert coll["header"]["world_size"] == 2 and coll["header"]["backend"] == "gloo"
    rows = coll["results"]["rows"]
    assert {r["op"] for r in rows} == {"all_reduce", "broadcast", "shm_sum"}  # 2 local ranks: shared memory too
    for r in rows:  # nccl-tests definitions
        assert r["time_s"] > 0
        assert math.isclose(r["algbw_GBps"], r["bytes"] / r["time_s"] / 1e9, rel_tol=1e-9)
        assert math.isclose(r["busbw_GBps"], r["algbw_GBps"] * (1.0 if r["op"] == "broadcast" else 2 * (2 - 1) / 2), rel_tol=1e-9)
    assert coll["results"]["flat"]["critic"]["params"] > 900_000  # holosoma-sized critic + log alpha
    cm = json.loads((quick_run / "cost_model.json").read_text())
    assert {p["gpus"] for p in cm["results"]["projection"]} == {8, 64, 512, 1024}
    assert (quick_run / "cost_model.png").stat().st_size > 10_000
    report = (quick_run / "report.md").read_text()
    for needle in ("## Collectives", "## Cost model", "DD-PPO", "busbw", "| 1024 |"):
        assert needle in report, needle


def test_schema_rejects_broken_documents() -> None:
    good = schema.make("x", schema.header("cpu", 2, {"a": 1}), {"t": schema.figure(1.0, "s", False)}, {})
    assert schema.validate(good) == []
    for mutate in (lambda d: d["header"].pop("git_commit"), lambda d: d["header"].update(world_size=0),
                   lambda d: d["figures"]["t"].update(value=float("nan")), lambda d: d.update(schema="v0"),
                   lambda d: d["header"].update(world_size="2"), lambda d: d.pop("results")):
        bad = copy.deepcopy(good)
        mutate(bad)
        assert schema.validate(bad), bad


@pytest.mark.parametrize("op,algo,p", [("all_reduce", "ring", 2), ("all_reduce", "ring", 8),
                                       ("all_reduce", "tree", 16), ("broadcast", "tree", 4)])
def test_alpha_beta_fit_recovers_known_parameters(op: str, algo: str, p: int) -> None:
    alpha, beta = 23e-6, 1.0 / 7.5e9
    sizes = [2 ** k for k in range(3, 27)]
    rng = np.random.default_rng(0)
    times = [cost_model.model_time(op, algo, p, n, alpha, beta) * (1 + 0.02 * rng.standard_normal()) for n in sizes]
    fit = cost_model.fit_alpha_beta(sizes, times, p, op, algo)
    assert fit["alpha_s"] == pytest.approx(alpha, rel=0.05)
    assert fit["beta_s_per_B"] == pytest.approx(beta, rel=0.05)
    assert fit["median_rel_err"] < 0.03
    # a wrong model (the other algorithm's formula) must not fit as well at p > 2
    if p > 2:
        other = cost_model.fit_alpha_beta(sizes, times, p, op, "tree" if algo == "ring" else "ring")
        assert abs(other["alpha_s"] - alpha) / alpha > 0.1 or abs(other["beta_s_per_B"] - beta) / beta > 0.1


def test_a_sweep_whose_time_falls_with_size_has_no_bandwidth_figure() -> None:
    # under load a quick sweep can get faster with size (seen in CI: broadcast 932 us at 8 B, 600 us at 1 MiB):
    # beta fits to 0, which is no measured bandwidth, not an infinite one (inf broke the JSON schema)
    sizes = [8, 256, 8192, 262144, 1048576, 4194304]
    fit = cost_model.fit_alpha_beta(sizes, [932e-6, 1247e-6, 1419e-6, 1352e-6, 600e-6, 1089e-6], 2, "broadcast")
    assert fit["beta_s_per_B"] == 0 and fit["bw_GBps"] is None and fit["alpha_s"] > 0
    good = cost_model.fit_alpha_beta(sizes, [cost_model.model_time("all_reduce", "ring", 2, n, 2e-5, 1e-9) for n in sizes], 2)
    figs = cost_model.build_doc({"header": {}, "results": {"world": 2}},
                                {"fits": {"broadcast/ring": fit, "all_reduce/ring": good}, "projection": [], "links": {}}, None)["figures"]
    assert "broadcast_bw" not in figs and "broadcast_alpha" in figs
    assert figs["all_reduce_bw"]["value"] == pytest.approx(1.0, rel=1e-6)


def test_alpha_beta_formulas() -> None:
    a, b, n = 1e-6, 1e-9, 1e6
    assert cost_model.model_time("all_reduce", "ring", 8, n, a, b) == pytest.approx(14 * a + 2 * 7 / 8 * n * b)
    assert cost_model.model_time("all_reduce", "tree", 8, n, a, b) == pytest.approx(6 * a + 2 * n * b)
    assert cost_model.model_time("broadcast", "ring", 4, n, a, b) == pytest.approx(3 * a + n * b)
    assert cost_model.model_time("all_reduce", "ring", 1, n, a, b) == 0.0


LINKS = {"gpus_per_node": 8, "links": {"nvlink_h100": {"bw_Bps": 1e11, "alpha_s": 1e-6},
                                        "ib_ndr": {"bw_Bps": 1e10, "alpha_s": 1e-5}}}


def test_allreduce_time_hierarchical_by_hand() -> None:
    n = 8e6
    # one node: min(ring, tree) on NVLink
    ring8 = 14 * 1e-6 + 2 * 7 / 8 * n / 1e11
    tree8 = 6 * 1e-6 + 2 * n / 1e11
    assert cost_model.allreduce_time(8, n, LINKS)["time_s"] == pytest.approx(min(ring8, tree8))
    # 4 nodes x 8: intra ring + inter all-reduce of n/8 over 4 nodes (ring vs tree on IB)
    shard = n / 8
    inter = min(6 * 1e-5 + 2 * 3 / 4 * shard / 1e10, 4 * 1e-5 + 2 * shard / 1e10)
    assert cost_model.allreduce_time(32, n, LINKS)["time_s"] == pytest.approx(ring8 + inter)
    assert cost_model.allreduce_time(1, n, LINKS)["time_s"] == 0.0


def test_projection() -> None:
    crit, act, pf, t = 3.6e6, 0.8e6, 2, 1e-3
    rows = cost_model.project(t, crit, act, pf, LINKS, gpus=[1, 8, 64, 512, 1024], batch=8192)
    base = [r for r in rows if r["scenario"] == "baseline"]
    assert base[0]["efficiency"] == 1.0 and base[0]["updates_per_s"] == pytest.approx(1000.0)
    effs = [r["efficiency"] for r in base]
    assert all(x >= y for x, y in zip(effs, effs[1:])) and effs[-1] < 1.0
    r8 = base[1]
    comm8 = (cost_model.allreduce_time(8, crit, LINKS)["time_s"] + cost_model.allreduce_time(8, act, LINKS)["time_s"] / pf)
    assert r8["comm_s"] == pytest.approx(comm8)
    assert r8["efficiency"] == pytest.approx(t / (t + comm8))
    assert r8["samples_per_s"] == pytest.approx(8 * 8192 / (t + comm8))
    by = {(r["gpus"], r["scenario"]): r for r in rows}
    for p in (64, 1024):  # every optimisation helps, all together help most
        for sc in ("fused", "bf16", "overlap"):
            assert by[(p, sc)]["comm_s"] < by[(p, "baseline")]["comm_s"]
        assert by[(p, "fused+bf16+overlap")]["comm_s"] <= min(by[(p, s)]["comm_s"] for s in ("fused", "bf16", "overlap"))
    # communication dominates at once when compute is tiny, never when it is huge
    assert cost_model.crossover(1e-7, crit, act, pf, LINKS) == 2
    assert cost_model.crossover(10.0, crit, act, pf, LINKS, max_p=4096) is None


def _run_dir(tmp: Path, name: str, figs: dict) -> Path:
    d = tmp / name
    d.mkdir()
    doc = schema.make("collectives", schema.header("cpu", 2, {}), figs, {})
    (d / "collectives.json").write_text(json.dumps(doc))
    return d


def test_compare_flags_planted_regression(tmp_path: Path, capsys) -> None:
    figs = {"allreduce_time": schema.figure(2e-3, "s", False), "busbw": schema.figure(0.5, "GB/s", True),
            "eff": schema.figure(0.9, "fraction", True)}
    old = _run_dir(tmp_path, "old", figs)
    same = _run_dir(tmp_path, "same", copy.deepcopy(figs))
    assert compare.main([str(old), str(same)]) == 0
    assert "REGRESSION" not in capsys.readouterr().out
    slow = copy.deepcopy(figs)
    slow["allreduce_time"]["value"] *= 1.2  # 20 % slower
    assert compare.main([str(old), str(_run_dir(tmp_path, "slow", slow))]) == 1
    out = capsys.readouterr().out
    assert "collectives/allreduce_time" in out and "REGRESSION" in out and out.count("REGRESSION") == 1
    lowbw = copy.deepcopy(figs)
    lowbw["busbw"]["value"] *= 0.8  # 20 % less bandwidth
    rows = compare.compare(compare.load_figures(old), compare.load_figures(_run_dir(tmp_path, "lowbw", lowbw)))
    assert [r["figure"] for r in rows if r["regression"]] == ["collectives/busbw"]
    better = copy.deepcopy(figs)
    better["allreduce_time"]["value"] *= 0.8
    better["busbw"]["value"] *= 1.05
    assert compare.main([str(old), str(_run_dir(tmp_path, "better", better))]) == 0
    assert compare.main([str(old), str(_run_dir(tmp_path, "slow2", slow)), "--threshold", "0.25"]) == 0


def test_compare_on_real_quick_run(quick_run: Path, tmp_path: Path) -> None:
    assert compare.main([str(quick_run), str(quick_run)]) == 0
    planted = tmp_path / "planted"
    planted.mkdir()
    doc = json.loads((quick_run / "collectives.json").read_text())
    name = next(k for k, f in doc["figures"].items() if not f["higher_is_better"])
    doc["figures"][name]["value"] *= 1.2
    (planted / "collectives.json").write_text(json.dumps(doc))
    rows = compare.compare(compare.load_figures(quick_run), compare.load_figures(planted))
    assert [r["figure"] for r in rows if r["regression"]] == [f"collectives/{name}"]


def test_sac_throughput_baseline_matches_and_train_events_time_the_loop(tmp_path: Path, monkeypatch) -> None:
    """benchmarks/sac/sac_throughput.py's pieces: the baseline's update equals hpcrl's, and its timings of
    hpcrl.sac.train come from the events hook (one UpdatesDone per learning env step, the rows' sps)."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks" / "sac"))
    for k in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(k)
    import sac_throughput as st

    assert st.equivalence_check()["ok"]
    cfg = st.loop_config(3, run_dir=str(tmp_path))
    rec = st.train_and_record(cfg)
    assert sorted(rec.updates) == [cfg.learning_starts + i for i in (1, 2, 3)] and min(rec.updates.values()) > 0
    assert len(rec.rates) == math.ceil(cfg.total_env_steps / cfg.num_envs / cfg.log_every) and min(rec.rates) > 0


def test_weight_publish_quick_delivers_with_both_transports(tmp_path: Path) -> None:
    out = tmp_path / "weight_publish.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "ppo" / "weight_publish.py"), "--quick", "--reps", "2",
                           "--json", str(out)], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    assert sorted((r["makers"], r["mib"], r["transport"]) for r in rows) == sorted(
        (m, s, t) for m in (1, 2) for s in (1.0, 16.0) for t in ("broadcast", "point-to-point"))
    for r in rows:  # every maker's checksum of what it received == trainer 0's checksum of what it sent
        assert r["checksum_ok"], r
        assert len(r["times_s"]) == 2 and all(t > 0 for t in r["times_s"]) and r["ms"] > 0
    assert doc["summary"]["broadcast_time_ratio_m2_m1_16mib"] > 0 and len(doc["reading"]) == 2


def test_checkpoint_size_writes_the_filled_part_only(tmp_path: Path) -> None:
    out = tmp_path / "checkpoint_size.json"
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "sac" / "checkpoint_size.py"), "--envs", "64", "--slots",
                           "512", "--steps", "8", "--json", str(out)], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = json.loads(out.read_text())["figures"]
    # 8 of 512 slots filled: the file holds a small fraction of the ring (plus HDF5's own overhead)
    assert figures["written_mb"]["value"] * 10 < figures["capacity_mb"]["value"]


def test_replay_floor_is_cold() -> None:
    """The replay floor cycles through index sets whose rows add up to more than the last-level cache, so
    no set is still cached when it comes round again (as no row is for the sampler's fresh draws)."""
    from benchmarks.ops import replay_sampler

    llc = replay_sampler.llc_bytes()
    sysfs = Path("/sys/devices/system/cpu/cpu0/cache/index3/size")
    if sysfs.exists() and sysfs.read_text().strip().endswith("K"):
        assert llc == int(sysfs.read_text().strip().rstrip("K")) * 1024
    shard = replay_sampler.filled_shard(8, 64, 17, 6, "cpu")
    batch = 256
    drawn = replay_sampler.cold_index_sets(shard, batch, llc)
    assert replay_sampler.row_bytes(shard) == (2 * 17 + 6) * 4
    assert len(drawn) * batch * replay_sampler.row_bytes(shard) > 2 * llc
    rows = {(int(e), int(s)) for env, slot in drawn for e, s in zip(env, slot)}
    assert len(rows) == 8 * 64  # fresh rows: every stored pair is read in one cycle, not one set again and again
    fns = replay_sampler.cases(shard, batch, drawn)
    for _ in range(3):
        fns["index_select floor"]()
        fns["gather prefetch 16"]()


# ---------------------------------------------------------------- scaling sweeps (pure parts, no subprocess)

from benchmarks.comm import scaling  # noqa: E402


def test_scaling_topology_and_worlds_parsing() -> None:
    assert [scaling.parse_topology(s) for s in ("1:1", "2:1", "4:1", " 4:2 ")] == [(1, 1), (2, 1), (4, 1), (4, 2)]
    for bad in ("4", "4:2:1", "0:1", "1:0", "a:b"):
        with pytest.raises(ValueError):
            scaling.parse_topology(bad)
    assert scaling.parse_worlds("4,1,2,2") == [1, 2, 4]
    with pytest.raises(ValueError):
        scaling.parse_worlds("0,1")


def test_scaling_efficiency_definitions() -> None:
    # weak: per-rank throughput vs W=1 (updates/s is per rank: every rank does one update's work)
    assert scaling.weak_efficiency({1: 40.0, 2: 30.0, 4: 20.0}) == {1: 1.0, 2: 0.75, 4: 0.5}
    # strong: speedup / W
    se = scaling.strong_efficiency({1: 10.0, 2: 16.0, 4: 20.0})
    assert se[1] == (1.0, 1.0)
    assert se[2] == pytest.approx((1.6, 0.8)) and se[4] == pytest.approx((2.0, 0.5))
    assert scaling.strong_efficiency({2: 10.0, 4: 20.0})[4] == pytest.approx((2.0, 1.0))  # base = smallest W
    assert scaling.sac_args(2, "weak", 4, 128, 300) == {"num_envs": 8, "batch_size": 256, "total_env_steps": 2400}
    assert scaling.sac_args(2, "strong", 4, 128, 300) == {"num_envs": 4, "batch_size": 128, "total_env_steps": 1200}
    with pytest.raises(ValueError):
        scaling.sac_args(3, "strong", 4, 128, 300)
    assert scaling.oversubscribed(4, cpus=2) and not scaling.oversubscribed(2, cpus=2)


def test_scaling_steady_rate() -> None:
    rows = [{"time": 0.0, "updates": 0}, {"time": 10.0, "updates": 100}, {"time": 12.0, "updates": 140},
            {"time": 14.0, "updates": 180}]
    assert scaling.steady_rate(rows, "updates") == pytest.approx(20.0)  # warm-up row 0 skipped
    assert scaling.steady_rate(rows, "updates", skip=0) == pytest.approx(180 / 14)
    assert scaling.steady_rate(rows[:2], "updates") == pytest.approx(10.0)  # too few rows: use what there is
    assert scaling.steady_rate(rows[:1], "updates") is None
    assert scaling.steady_rate(rows, "missing") is None


def _sac_pt(mode: str, w: int, ups: float) -> dict:
    return {"mode": mode, "world": w, "status": "ok", "updates_per_s": ups, "env_steps_per_s": ups * 2 * w,
            "env_steps_per_s_per_rank": ups * 2, "s_per_update": 1 / ups, "oversubscribed": w > 2,
            "num_envs": 4 * w, "batch_size": 128 * w, "policy_frequency": 2, "critic_hidden": 128,
            "actor_hidden": 128, "num_q": 2, "num_atoms": 101}


def test_scaling_doc_validates_and_reports(tmp_path: Path) -> None:
    pts = [_sac_pt("weak", 1, 40.0), _sac_pt("weak", 2, 30.0), _sac_pt("strong", 1, 40.0), _sac_pt("strong", 2, 50.0)]
    ana = scaling.analyse(pts)
    assert [p["efficiency"] for p in ana["weak"]] == [1.0, 0.75]
    assert ana["strong"][1]["speedup"] == pytest.approx(1.25) and ana["strong"][1]["efficiency"] == pytest.approx(0.625)
    ppo = [{"topology": "4:2", "makers": 4, "trainers": 2, "status": "ok", "samples_per_s": 900.0,
            "trainer_idle_frac": 0.1, "lag_mean": 1.0, "lag_max": 1.0, "dropped_stale": 0.0, "oversubscribed": True}]
    # measured vs modelled from a synthetic alpha-beta sweep: alpha 1 ms, 1 GB/s
    rows = [{"op": "all_reduce", "bytes": n, "time_s": cost_model.model_time("all_reduce", "ring", 2, n, 1e-3, 1e-9)}
            for n in (8, 1 << 10, 1 << 20, 1 << 24)]
    (tmp_path / "collectives.json").write_text(json.dumps({"results": {"world": 2, "rows": rows}}))
    model = scaling.model_weak(ana["weak"], tmp_path / "collectives.json")
    crit, act = scaling.pendulum_param_bytes(pts[0])
    want = 1 / 40 + cost_model.model_time("all_reduce", "ring", 2, crit, 1e-3, 1e-9) \
        + cost_model.model_time("all_reduce", "ring", 2, act, 1e-3, 1e-9) / 2
    assert model[0]["model_s"] == pytest.approx(1 / 40) and model[1]["model_s"] == pytest.approx(want, rel=1e-3)
    doc = schema.make("scaling", schema.header("cpu", 2, {}), scaling.figures(ana, ppo),
                      {"sac": pts, "ppo": ppo, "model_weak": model, "sizes": scaling.SAC_SIZES[False], "cpu_count": 2,
                       "png": None})
    assert schema.validate(doc) == []
    assert doc["figures"]["sac_weak_w2_efficiency"]["value"] == 0.75 and "ppo_4x2_samples_per_s" in doc["figures"]
    (tmp_path / "scaling.json").write_text(json.dumps(doc))
    from benchmarks.common.report import write_report

    rep = write_report(tmp_path).read_text()
    for needle in ("## Scaling sweeps", "| weak | 2 |", "| 4:2* |", "measured vs modelled"):
        assert needle in rep, needle


def test_ppo_bottleneck_reading() -> None:
    assert scaling.ppo_bottleneck(0.01, 0.55).startswith("trainer-bound")
    assert scaling.ppo_bottleneck(0.6, 0.05).startswith("maker-bound")
    assert scaling.ppo_bottleneck(0.1, 0.15) == "balanced" and scaling.ppo_bottleneck(None, 0.3) == "-"


def test_scaling_launcher_from_slurm_and_srun_prefix() -> None:
    with pytest.raises(ValueError, match="needs a Slurm allocation"):
        scaling.Launcher.from_slurm({})
    la = scaling.Launcher.from_slurm({"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "4", "SLURM_NTASKS_PER_NODE": "8",
                                      "SLURM_GPUS_PER_NODE": "h100:8"})
    assert (la.kind, la.nodes, la.tasks_per_node, la.gpus_per_node, la.capacity) == ("srun", 4, 8, 8, 32)
    # W <= G: one node; W > G: ceil(W / G) full nodes; ranks bind cuda:$SLURM_LOCALID
    assert la.prefix(2) == ["srun", "--nodes=1", "--ntasks=2", "--ntasks-per-node=2", "--distribution=block",
                            "--kill-on-bad-exit=1", "--gpus-per-node=8"]
    assert la.prefix(16)[1:4] == ["--nodes=2", "--ntasks=16", "--ntasks-per-node=8"]
    assert la.per_node(16) == 8 and la.per_node(3) == 3
    with pytest.raises(ValueError, match="needs 33 tasks, the allocation has 4 node"):
        la.prefix(33)
    # without --ntasks-per-node Slurm gives SLURM_TASKS_PER_NODE like "2(x3)"; CPU allocations add no GPU flag
    cpu = scaling.Launcher.from_slurm({"SLURM_JOB_ID": "7", "SLURM_NNODES": "3", "SLURM_TASKS_PER_NODE": "2(x3)",
                                       "SLURM_CPUS_PER_TASK": "4"})
    assert (cpu.nodes, cpu.tasks_per_node, cpu.gpus_per_node, cpu.cpus_per_task) == (3, 2, 0, 4)
    assert "--gpus-per-node" not in " ".join(cpu.prefix(6)) and cpu.prefix(6)[-1] == "--cpus-per-task=4"
    uneven = scaling.Launcher.from_slurm({"SLURM_JOB_ID": "7", "SLURM_NNODES": "3", "SLURM_TASKS_PER_NODE": "3(x2),1"})
    assert (uneven.tasks_per_node, uneven.capacity) == (1, 3)  # every step must fit on every node
    local = scaling.Launcher()
    assert local.prefix(64) == [] and local.per_node(4) == 4


def test_learning_quick_writes_curves(tmp_path: Path) -> None:
    """benchmarks/sac/learning.py --quick: FastSAC (CLI) and the CleanRL-style baseline on HalfCheetah at equal
    samples, tiny sizes, in seconds (Playground is skipped under --quick: its JAX compilation alone is ~40 s)."""
    proc = subprocess.run([sys.executable, "benchmarks/sac/learning.py", "--quick", "--out", str(tmp_path / "out"),
                           "--work", str(tmp_path / "runs")], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    path = tmp_path / "out" / "learning_halfcheetah.json"
    assert schema.validate_file(path) == []
    doc = json.loads(path.read_text())
    res = doc["results"]
    fast, base = res["fastsac"], res["baseline_cleanrl_style"]
    assert fast["returncode"] == 0 and fast["env_steps"] == 96 and not fast["stopped_by_budget"]
    assert base["env_steps"] == fast["env_steps"] and base["reached_equal_samples"] and res["equal_samples"]
    for run in (fast, base):
        assert run["eval_curve"]["env_steps"] == [48, 96] and len(run["eval_curve"]["eval_return"]) == 2
        assert run["env_steps_per_s"] > 0 and run["updates_per_s"] > 0 and run["wall_s"] > 0
    assert base["updates"] == fast["updates_at_last_row"] == (96 // 2 - 8) * 2
    assert res["at_equal_samples"]["eval_env_steps"] == 96
    assert res["cleanrl_published"]["value"] == 9634.89 and res["cleanrl_published"]["env_steps"] == 1_000_000
    for key in ("fastsac_env_steps", "fastsac_final_eval_return", "baseline_final_eval_return",
                "fastsac_updates_per_s", "baseline_env_steps_per_s"):
        assert key in doc["figures"], key
    assert (tmp_path / "out" / "learning_halfcheetah.png").stat().st_size > 10_000
    assert not (tmp_path / "out" / "learning_playground.json").exists()


def test_world_loop_times_updates_inside_the_window() -> None:
    """benchmarks/sac/world_loop.py: seconds per update between the first training row at or past the window's start
    and the last one; eval rows (their own times) and rows before the window do not count."""
    from benchmarks.sac import world_loop

    rows = [{"time": 1.0, "env_steps": 500, "updates": 100}, {"time": 2.0, "env_steps": 1000, "updates": 300},
            {"time": 2.5, "env_steps": 1000, "updates": 300, "eval_return": -200.0},
            {"time": 4.0, "env_steps": 2000, "updates": 700}, {"time": 9.0, "env_steps": 2000, "eval_return": -150.0}]
    assert world_loop.per_update_s(rows, 1000) == (2.0 / 400, 400)
    with pytest.raises(ValueError, match="no updates"):
        world_loop.per_update_s(rows[:2], 1000)


@pytest.mark.extended  # two short training runs: the fast tier keeps the pure part above
def test_world_loop_quick_runs_one_and_two_ranks(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "benchmarks/sac/world_loop.py", "--quick", "--json", str(tmp_path / "w.json")],
                          cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((tmp_path / "w.json").read_text())
    assert schema.validate(doc) == []
    s = doc["results"]["summary"]
    assert s["w1_update_s"] > 0 and s["w2_update_s"] > 0 and s["w2_over_w1"] == pytest.approx(s["w2_update_s"] / s["w1_update_s"])
    assert all(r["updates_timed"] > 0 for runs in doc["results"]["runs"].values() for r in runs)
