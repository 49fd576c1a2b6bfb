"""Cost model: per-update compute + alpha-beta communication, fitted to measured sweeps and
projected to 8 / 64 / 512 / 1024 GPUs with the link parameters of ``benchmarks/comm/links.json``.

    python -m benchmarks.comm.cost_model --collectives collectives.json [--json cost_model.json] [--png cost_model.png]

Alpha-beta model (Hockney; Thakur, Rabenseifner & Gropp 2005), n bytes over p ranks, reduction cost
ignored:
    ring all-reduce   t = 2 (p-1) alpha + 2 (p-1)/p * n * beta
    tree all-reduce   t = 2 ceil(log2 p) alpha + 2 n beta        (pipelined double binary tree)
    ring broadcast    t = (p-1) alpha + n beta                   (pipelined)
    tree broadcast    t = ceil(log2 p) alpha + n beta
Both are linear in (alpha, beta), so :func:`fit_alpha_beta` is a least-squares fit with relative
weights (every size counts alike), alpha, beta >= 0. NCCL picks the faster algorithm per size;
:func:`allreduce_time` does the same (min of ring and tree). Past one node the all-reduce is
hierarchical: intra-node reduce-scatter (NVLink), inter-node all-reduce of n/G bytes per GPU (one
NIC per GPU), intra-node all-gather.

FastSAC per update: the critic (+ log alpha) gradients every update and the actor's every
``policy_frequency`` updates (one collective each, hpcrl.sac.agent). Weak scaling (per-rank batch
fixed): efficiency = t_compute / (t_compute + exposed communication). Scenarios: baseline (fp32, no
overlap), fused (critic + actor in one call when both update), bf16 gradients (bytes halved),
overlap (buckets overlapped with the backward pass, ~2/3 of the compute; one bucket stays exposed),
and all three.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from benchmarks.common import schema

HERE = Path(__file__).resolve().parent
PROJECT_GPUS = (8, 64, 512, 1024)
BWD_FRACTION = 2.0 / 3.0
N_BUCKETS = 4


def _log2c(p: int) -> int:
    return max(1, math.ceil(math.log2(p))) if p > 1 else 0


def coeffs(op: str, algo: str, p: int, n: float) -> tuple[float, float]:
    """(alpha coefficient, beta coefficient) so that t = a * alpha + b * beta."""
    if p <= 1:
        return 0.0, 0.0
    if op == "all_reduce":
        return (2.0 * (p - 1), 2.0 * (p - 1) / p * n) if algo == "ring" else (2.0 * _log2c(p), 2.0 * n)
    if op == "broadcast":
        return (float(p - 1), float(n)) if algo == "ring" else (float(_log2c(p)), float(n))
    raise ValueError(f"unknown op {op!r}")


def model_time(op: str, algo: str, p: int, n: float, alpha: float, beta: float) -> float:
    a, b = coeffs(op, algo, p, n)
    return a * alpha + b * beta


def fit_alpha_beta(sizes: Sequence[float], times: Sequence[float], p: int, op: str = "all_reduce",
                   algo: str = "ring") -> dict[str, float]:
    """Least-squares (alpha, beta) >= 0 for measured ``times`` at message ``sizes`` (bytes)."""
    if len(sizes) != len(times) or len(sizes) < 2:
        raise ValueError("need >= 2 (size, time) pairs")
    A = np.array([coeffs(op, algo, p, n) for n in sizes], dtype=float)
    t = np.asarray(times, dtype=float)
    w = 1.0 / t  # relative error
    Aw, tw = A * w[:, None], t * w
    sol = np.linalg.lstsq(Aw, tw, rcond=None)[0]
    if sol[0] < 0 or sol[1] < 0:  # clamp one to 0 and refit the other
        cands = []
        for keep in (0, 1):
            col = Aw[:, keep]
            v = max(0.0, float(col @ tw / (col @ col)))
            s = np.zeros(2)
            s[keep] = v
            cands.append((float(np.sum((Aw @ s - tw) ** 2)), s))
        sol = min(cands, key=lambda c: c[0])[1]
    alpha, beta = float(sol[0]), float(sol[1])
    pred = A @ sol
    rel = np.abs(pred - t) / t
    # beta 0: the sizes did not resolve a bandwidth (under load, time can fall with size): None, not inf
    return {"alpha_s": alpha, "beta_s_per_B": beta, "bw_GBps": (1.0 / beta / 1e9) if beta > 0 else None,
            "median_rel_err": float(np.median(rel)), "max_rel_err": float(np.max(rel)), "op": op, "algo": algo, "p": p}


def bandwidth_text(fit: dict[str, Any]) -> str:
    """A fit's bandwidth for people: "not resolved" where beta fitted to 0."""
    return "not resolved" if fit["bw_GBps"] is None else f"{fit['bw_GBps']:.3f} GB/s"


def allreduce_time(p: int, n: float, links: dict[str, Any]) -> dict[str, float]:
    """Hierarchical all-reduce time of n bytes over p GPUs (min of ring / tree at each level)."""
    G = int(links["gpus_per_node"])
    nv, ib = links["links"]["nvlink_h100"], links["links"]["ib_ndr"]
    a_nv, b_nv, a_ib, b_ib = nv["alpha_s"], 1.0 / nv["bw_Bps"], ib["alpha_s"], 1.0 / ib["bw_Bps"]
    if p <= 1:
        return {"time_s": 0.0, "intra_s": 0.0, "inter_s": 0.0, "latency_s": 0.0}
    if p <= G:
        ring = model_time("all_reduce", "ring", p, n, a_nv, b_nv)
        tree = model_time("all_reduce", "tree", p, n, a_nv, b_nv)
        lat = min(coeffs("all_reduce", "ring", p, n)[0], coeffs("all_reduce", "tree", p, n)[0]) * a_nv
        return {"time_s": min(ring, tree), "intra_s": min(ring, tree), "inter_s": 0.0, "latency_s": lat}
    nodes = math.ceil(p / G)
    # reduce-scatter + all-gather inside the node = one ring all-reduce's worth of NVLink traffic
    intra = model_time("all_reduce", "ring", G, n, a_nv, b_nv)
    shard = n / G
    inter = min(model_time("all_reduce", "ring", nodes, shard, a_ib, b_ib),
                model_time("all_reduce", "tree", nodes, shard, a_ib, b_ib))
    lat = 2 * (G - 1) * a_nv + min(2 * (nodes - 1), 2 * _log2c(nodes)) * a_ib
    return {"time_s": intra + inter, "intra_s": intra, "inter_s": inter, "latency_s": lat}


SCENARIOS = ("baseline", "fused", "bf16", "overlap", "fused+bf16+overlap")


def fastsac_comm(p: int, critic_bytes: float, actor_bytes: float, pf: int, links: dict[str, Any],
                 scenario: str, t_compute: float) -> float:
    """Exposed communication seconds per update."""
    scale = 0.5 if "bf16" in scenario else 1.0
    c, a = critic_bytes * scale, actor_bytes * scale
    T = lambda n: allreduce_time(p, n, links)["time_s"]  # noqa: E731
    if "fused" in scenario:
        comm = (T(c + a) + (pf - 1) * T(c)) / pf
    else:
        comm = T(c) + T(a) / pf
    if "overlap" in scenario:
        comm = max(comm - BWD_FRACTION * t_compute, comm / N_BUCKETS)
    return comm


def project(t_compute: float, critic_bytes: float, actor_bytes: float, pf: int, links: dict[str, Any],
            gpus: Sequence[int] = PROJECT_GPUS, batch: int | None = None) -> list[dict[str, Any]]:
    rows = []
    for p in gpus:
        for sc in SCENARIOS:
            comm = fastsac_comm(p, critic_bytes, actor_bytes, pf, links, sc, t_compute)
            ups = 1.0 / (t_compute + comm)
            rows.append({"gpus": p, "scenario": sc, "comm_s": comm, "compute_s": t_compute, "updates_per_s": ups,
                         "efficiency": t_compute / (t_compute + comm), "comm_dominates": comm > t_compute,
                         "samples_per_s": None if batch is None else ups * p * batch})
    return rows


def crossover(t_compute: float, critic_bytes: float, actor_bytes: float, pf: int, links: dict[str, Any],
              scenario: str = "baseline", max_p: int = 1 << 20) -> int | None:
    """Smallest power-of-two GPU count where exposed communication exceeds compute (None: never up to max_p)."""
    p = 2
    while p <= max_p:
        if fastsac_comm(p, critic_bytes, actor_bytes, pf, links, scenario, t_compute) > t_compute:
            return p
        p *= 2
    return None


def load_links(path: str | Path | None = None) -> dict[str, Any]:
    return json.loads(Path(path or HERE / "links.json").read_text())


def analyse(coll: dict[str, Any], links: dict[str, Any]) -> dict[str, Any]:
    res = coll["results"]
    world = res["world"]
    fits: dict[str, Any] = {}
    for op in ("all_reduce", "broadcast"):
        rows = [r for r in res["rows"] if r["op"] == op]
        if len(rows) >= 2:
            for algo in ("ring", "tree"):
                fits[f"{op}/{algo}"] = fit_alpha_beta([r["bytes"] for r in rows], [r["time_s"] for r in rows],
                                                      world, op, algo)
    # validate on the flat-gradient path: predicted all-reduce of the critic / actor buffers vs measured
    check = {}
    f = fits.get("all_reduce/ring")
    for name, d in res.get("flat", {}).items():
        if f:
            pred = model_time("all_reduce", "ring", world, d["bytes"], f["alpha_s"], f["beta_s_per_B"])
            check[name] = {"bytes": d["bytes"], "measured_s": d["allreduce_only_s"], "model_s": pred,
                           "ratio": pred / d["allreduce_only_s"]}
    flat = res.get("flat", {})
    critic_b = flat.get("critic", {}).get("bytes", 907211 * 4)
    actor_b = flat.get("actor", {}).get("bytes", 203424 * 4)
    comp = res.get("update_compute") or {}
    pf = comp.get("policy_frequency", 2)
    gpu = links["fastsac_gpu"]
    on_gpu = str(comp.get("device", "cpu")).startswith("cuda")
    t_gpu = comp["per_update_s"] if on_gpu else gpu["per_update_compute_s"]
    b_gpu = comp.get("batch") if on_gpu else gpu["batch_per_rank"]
    proj = project(t_gpu, critic_b, actor_b, pf, links, batch=b_gpu)
    local = None
    if f and comp:
        t_local = comp["per_update_s"]
        comm = (model_time("all_reduce", "ring", world, critic_b, f["alpha_s"], f["beta_s_per_B"])
                + model_time("all_reduce", "ring", world, actor_b, f["alpha_s"], f["beta_s_per_B"]) / pf)
        local = {"world": world, "compute_s": t_local, "comm_model_s": comm,
                 "efficiency_model": t_local / (t_local + comm), "batch": comp.get("batch")}
    return {"fits": fits, "flat_check": check, "critic_bytes": critic_b, "actor_bytes": actor_b,
            "policy_frequency": pf, "gpu_compute_s": t_gpu, "gpu_compute_source": "measured" if on_gpu else "assumed (links.json)",
            "gpu_batch": b_gpu, "projection": proj,
            "crossover_gpus": {sc: crossover(t_gpu, critic_b, actor_b, pf, links, sc) for sc in SCENARIOS},
            "local": local, "reference": links.get("reference_points", {}), "links": links}


def plot(coll: dict[str, Any], ana: dict[str, Any], png: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = coll["results"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    ax = axes[0]
    for op, color in (("all_reduce", "C0"), ("broadcast", "C1")):
        rows = [r for r in res["rows"] if r["op"] == op]
        if not rows:
            continue
        x = np.array([r["bytes"] for r in rows], dtype=float)
        ax.loglog(x, [r["time_s"] for r in rows], "o", color=color, label=f"{op} measured (W={res['world']})")
        xs = np.logspace(np.log10(x.min()), np.log10(x.max()), 100)
        for algo, ls in (("ring", "-"), ("tree", ":")):
            fdat = ana["fits"].get(f"{op}/{algo}")
            if fdat:
                ax.loglog(xs, [model_time(op, algo, res["world"], n, fdat["alpha_s"], fdat["beta_s_per_B"]) for n in xs],
                          ls, color=color, label=f"{op} {algo} fit a={fdat['alpha_s'] * 1e6:.0f}us "
                                                  f"bw={bandwidth_text(fdat)}")
    ax.set_xlabel("message bytes")
    ax.set_ylabel("time per call (s)")
    ax.set_title(f"measured vs alpha-beta model ({res['backend']}, {res['device']})")
    ax.legend(fontsize=7)
    ax = axes[1]
    gpus = sorted({r["gpus"] for r in ana["projection"]})
    dense = [2 ** k for k in range(0, 11)]
    for sc in SCENARIOS:
        eff = [project(ana["gpu_compute_s"], ana["critic_bytes"], ana["actor_bytes"], ana["policy_frequency"],
                       ana["links"], gpus=[p])[SCENARIOS.index(sc)]["efficiency"] for p in dense]
        ax.semilogx(dense, eff, "-o", ms=3, label=sc)
    ref = ana["reference"].get("ddppo_128_gpus")
    if ref:
        ax.semilogx([ref["gpus"]], [ref["efficiency"]], "k*", ms=12, label="DD-PPO 84% @128 GPUs")
    ax.set_xticks(gpus)
    ax.set_xticklabels([str(g) for g in gpus])
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("GPUs")
    ax.set_ylabel("weak-scaling efficiency")
    ax.set_title(f"FastSAC projection (compute {ana['gpu_compute_s'] * 1e3:.2f} ms/update, "
                 f"{ana['gpu_compute_source']})", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def build_doc(coll: dict[str, Any], ana: dict[str, Any], png: str | None) -> dict[str, Any]:
    figs = {}
    for key, f in ana["fits"].items():
        if key.endswith("/ring"):
            figs[f"{key.split('/')[0]}_alpha"] = schema.figure(f["alpha_s"], "s", False)
            if f["bw_GBps"] is not None:
                figs[f"{key.split('/')[0]}_bw"] = schema.figure(f["bw_GBps"], "GB/s", True)
    for r in ana["projection"]:
        if r["scenario"] == "baseline":
            figs[f"proj_eff_{r['gpus']}gpus"] = schema.figure(r["efficiency"], "fraction", True)
    hdr = dict(coll["header"])
    hdr["config"] = {"links": "benchmarks/comm/links.json", "bwd_fraction": BWD_FRACTION, "n_buckets": N_BUCKETS,
                     "collectives_config": coll["header"].get("config", {})}
    out = {k: v for k, v in ana.items() if k != "links"}
    out["links_file"] = ana["links"]
    out["png"] = png
    return schema.make("cost_model", hdr, figs, out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--collectives", required=True)
    ap.add_argument("--links", default=None)
    ap.add_argument("--json", default="cost_model.json")
    ap.add_argument("--png", default=None)
    args = ap.parse_args(argv)
    coll = json.loads(Path(args.collectives).read_text())
    ana = analyse(coll, load_links(args.links))
    png = args.png or str(Path(args.json).with_suffix(".png"))
    plot(coll, ana, png)
    from benchmarks.common.timing import write_json
    doc = build_doc(coll, ana, Path(png).name)
    write_json(args.json, doc)
    print_summary(ana)
    return 0


def print_summary(ana: dict[str, Any]) -> None:
    for k, f in ana["fits"].items():
        print(f"fit {k:>18}: alpha {f['alpha_s'] * 1e6:8.1f} us, bw {bandwidth_text(f)}, "
              f"median rel err {f['median_rel_err']:.2f}")
    print(f"{'GPUs':>6} {'scenario':>20} {'comm ms':>8} {'upd/s':>8} {'eff':>6}")
    for r in ana["projection"]:
        print(f"{r['gpus']:>6} {r['scenario']:>20} {r['comm_s'] * 1e3:>8.3f} {r['updates_per_s']:>8.0f} "
              f"{r['efficiency']:>6.3f}")
    print("comm > compute from (GPUs):", ana["crossover_gpus"])


if __name__ == "__main__":
    sys.exit(main())
