"""Collective sweep, nccl-tests style, plus FastSAC's flat-gradient path at its real sizes.

    python -m benchmarks.comm.collectives [--quick] [--world 2] [--json PATH]        # local gloo ranks
    srun python -m benchmarks.comm.collectives --launched --json PATH                 # Slurm / torchrun ranks

Definitions (nccl-tests ``doc/PERFORMANCE.md``): for a message of S bytes taking t seconds,
algbw = S / t; bus bandwidth busbw = algbw * 2 (n-1)/n for all-reduce and busbw = algbw for broadcast.
Ranks on one host add ``shm_sum``: the same all-reduce through the plane's shared memory
(``Plane.sum_``, hpcrl.comm.shm), which hpcrl uses there instead of gloo (busbw as all-reduce's).
t is, per repeat, the slowest rank's mean time over ``inner`` back-to-back calls (a barrier before
each repeat); reported is the median over repeats (and the min).

Flat-gradient path (hpcrl.sac.agent: one collective per optimizer update): gradients of the holosoma-
sized critic (+ log alpha) and actor, ``ops.flatten(grads, out=flat)`` -> ``all_reduce(flat)`` ->
``ops.unflatten_(flat, grads, 1/W)``; compared with the all-reduce alone and with one all-reduce per
tensor. The per-update compute (critic + actor forward/backward at the same sizes) is timed in the
parent process for the cost model.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.common import schema

QUICK_SIZES = [8, 256, 8 << 10, 256 << 10, 1 << 20, 4 << 20]
FULL_SIZES = [1 << k for k in range(3, 27)]  # 8 B .. 64 MiB
OBS_DIM, ACT_DIM = 64, 16


def busbw_factor(op: str, world: int) -> float:
    return 2.0 * (world - 1) / world if op in ("all_reduce", "shm_sum") else 1.0


def fastsac_param_groups(device: str = "cpu", critic_hidden: int | None = None,
                         actor_hidden: int | None = None) -> dict[str, list[torch.Tensor]]:
    """Parameters of the FastSAC networks at holosoma's default sizes (obs 64, action 16), grouped
    as the agent averages them: critic + log alpha in one collective, the actor in another."""
    from hpcrl.sac.config import SACConfig
    from hpcrl.sac.networks import Actor, DistributionalCritic

    cfg = SACConfig()
    ch, ah = critic_hidden or cfg.critic_hidden, actor_hidden or cfg.actor_hidden
    low, high = -torch.ones(ACT_DIM), torch.ones(ACT_DIM)
    actor = Actor(OBS_DIM, ACT_DIM, ah, low, high, cfg.layer_norm, cfg.log_std_min, cfg.log_std_max).to(device)
    critic = DistributionalCritic(OBS_DIM, ACT_DIM, ch, cfg.num_q, cfg.num_atoms, cfg.v_min, cfg.v_max,
                                  cfg.layer_norm).to(device)
    log_alpha = torch.nn.Parameter(torch.zeros((), device=device))
    return {"critic": [*critic.parameters(), log_alpha], "actor": list(actor.parameters()),
            "_modules": [actor, critic]}  # type: ignore[dict-item]


_GROUP = None  # set by run_rank: every collective here runs on the world's device plane


def _timed(fn, inner: int, repeats: int, device: torch.device) -> list[float]:
    out = []
    for _ in range(repeats):
        dist.barrier(group=_GROUP)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) / inner)
    return out


def _inner_for(fn, device: torch.device, target_s: float, cap: int) -> int:
    """Calls per repeat so that one repeat lasts ~target_s; rank 0 decides, all ranks agree."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    n = torch.tensor([max(1, min(cap, int(target_s / max(time.perf_counter() - t0, 1e-7))))],
                     dtype=torch.int64, device=device)
    dist.broadcast(n, 0, group=_GROUP)
    return int(n.item())


def run_rank(cfg: dict[str, Any]) -> dict[str, Any]:
    """Body of one rank (spawned or launched); returns this rank's raw per-repeat times."""
    from hpcrl import ops
    from hpcrl.comm import init_distributed

    backend = cfg.get("backend") or ("nccl" if torch.cuda.is_available() else "gloo")
    # The raw collectives of the world's default group: what a user calling torch.distributed measures.
    global _GROUP
    ctx = init_distributed(backend=backend, timeout_s=300, device="cuda" if backend == "nccl" else "cpu")
    device = ctx.device
    _GROUP = ctx.device_plane.group  # the world's device plane: the default group outside strict-planes mode
    world, rank = dist.get_world_size(), dist.get_rank()
    rep, target, cap = cfg["repeats"], cfg["target_s"], cfg["max_inner"]
    # Ranks of one host also sum through the plane's shared memory (hpcrl.comm.shm), what hpcrl uses there.
    ops_here = cfg["ops"] + (["shm_sum"] if ctx.device_plane.shm is not None else [])
    sweep: dict[str, dict[int, list[float]]] = {op: {} for op in ops_here}
    for op in ops_here:
        for size in cfg["sizes"]:
            x = torch.ones(max(1, size // 4), dtype=torch.float32, device=device)
            fn = {"all_reduce": lambda x=x: dist.all_reduce(x, group=_GROUP),
                  "broadcast": lambda x=x: dist.broadcast(x, 0, group=_GROUP),
                  "shm_sum": lambda x=x: ctx.device_plane.sum_(x)}[op]
            for _ in range(cfg["warmup"]):
                fn()
            sweep[op][size] = _timed(fn, _inner_for(fn, device, target, cap), rep, device)

    flat: dict[str, dict[str, Any]] = {}
    if cfg["flat_path"]:
        groups = fastsac_param_groups(str(device))
        gen = torch.Generator(device=device).manual_seed(rank)
        for name in ("critic", "actor"):
            grads = [torch.randn(p.shape, generator=gen, device=device) for p in groups[name]]
            numel = sum(g.numel() for g in grads)
            buf = torch.empty(numel, device=device)
            scale = 1.0 / world

            def flat_path(grads=grads, buf=buf, scale=scale):
                ops.flatten(grads, out=buf)
                dist.all_reduce(buf, group=_GROUP)
                ops.unflatten_(buf, grads, scale)

            cases = {"flat_path": flat_path, "allreduce_only": lambda buf=buf: dist.all_reduce(buf, group=_GROUP),
                     "per_tensor": lambda grads=grads: [dist.all_reduce(g, group=_GROUP) for g in grads]}
            res = {"params": numel, "tensors": len(grads), "bytes": numel * 4}
            for cname, fn in cases.items():
                for _ in range(cfg["warmup"]):
                    fn()
                    for g in grads:  # keep magnitudes bounded across repeated sums
                        g.mul_(1.0 / world)
                res[cname] = _timed(fn, _inner_for(fn, device, target, cap), rep, device)
            flat[name] = res
    return {"rank": rank, "world": world, "device": str(device), "backend": ctx.backend,
            "sweep": {op: {str(k): v for k, v in d.items()} for op, d in sweep.items()}, "flat": flat}


def _spawned(cfg: dict[str, Any]) -> dict[str, Any]:
    from hpcrl.comm import shutdown

    try:
        return run_rank(cfg)
    finally:
        shutdown()


def measure_update_compute(device: str = "cpu", batch: int = 256, repeats: int = 5) -> dict[str, Any]:
    """Per-update compute of FastSAC at holosoma sizes: critic forward/backward on (obs, action) plus,
    every update (policy_frequency folded in as 1/2), actor forward + critic forward + backward.
    A stand-in for the full update (no target network, no optimizer step): a lower bound."""
    from hpcrl.sac.config import SACConfig

    dev = torch.device(device)
    groups = fastsac_param_groups(device)
    actor, critic = groups["_modules"]
    gen = torch.Generator(device=dev).manual_seed(0)
    obs = torch.randn(batch, OBS_DIM, generator=gen, device=dev)
    act = torch.rand(batch, ACT_DIM, generator=gen, device=dev) * 2 - 1
    pf = SACConfig().policy_frequency

    def critic_step():
        critic(obs, act).logsumexp(-1).mean().backward()

    def actor_step():
        mean, log_std = actor(obs)
        critic(obs, torch.tanh(mean + log_std.exp())).logsumexp(-1).mean().backward()

    def wait():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    times = {}
    for name, fn in (("critic", critic_step), ("actor", actor_step)):
        fn(); fn()  # noqa: E702 - warm-up
        xs = []
        for _ in range(repeats):
            wait()
            t0 = time.perf_counter()
            fn()
            wait()
            xs.append(time.perf_counter() - t0)
        times[name] = statistics.median(xs)
    per_update = times["critic"] + times["actor"] / pf
    return {"device": device, "batch": batch, "policy_frequency": pf, "critic_s": times["critic"],
            "actor_s": times["actor"], "per_update_s": per_update, "threads": torch.get_num_threads()}


def summarize(ranks: list[dict[str, Any]], sizes: list[int]) -> dict[str, Any]:
    world = ranks[0]["world"]
    rows = []
    for op in ranks[0]["sweep"]:
        for size in sizes:
            per_rep = [max(r["sweep"][op][str(size)][i] for r in ranks)
                       for i in range(len(ranks[0]["sweep"][op][str(size)]))]
            t, tmin = statistics.median(per_rep), min(per_rep)
            algbw = size / t
            rows.append({"op": op, "bytes": size, "time_s": t, "time_min_s": tmin, "algbw_GBps": algbw / 1e9,
                         "busbw_GBps": algbw * busbw_factor(op, world) / 1e9, "samples_s": per_rep})
    flat = {}
    for name, res in ranks[0]["flat"].items():
        d = {k: res[k] for k in ("params", "tensors", "bytes")}
        for case in ("flat_path", "allreduce_only", "per_tensor"):
            per_rep = [max(r["flat"][name][case][i] for r in ranks) for i in range(len(res[case]))]
            d[case + "_s"] = statistics.median(per_rep)
        d["copy_overhead_s"] = d["flat_path_s"] - d["allreduce_only_s"]
        flat[name] = d
    return {"world": world, "backend": ranks[0]["backend"], "device": ranks[0]["device"], "rows": rows,
            "flat": flat}


def config_for(quick: bool) -> dict[str, Any]:
    return {"sizes": QUICK_SIZES if quick else FULL_SIZES, "ops": ["all_reduce", "broadcast"],
            "repeats": 5 if quick else 11, "warmup": 2 if quick else 5, "target_s": 0.02 if quick else 0.05,
            "max_inner": 50 if quick else 200, "flat_path": True}


def build_doc(summary: dict[str, Any], cfg: dict[str, Any], compute: dict[str, Any] | None) -> dict[str, Any]:
    figs = {}
    for r in summary["rows"]:
        if r["bytes"] in (cfg["sizes"][0], cfg["sizes"][-1]):
            tag = f"{r['op']}_{r['bytes']}B"
            figs[tag + "_time"] = schema.figure(r["time_s"], "s", False)
            figs[tag + "_busbw"] = schema.figure(r["busbw_GBps"], "GB/s", True)
    for name, d in summary["flat"].items():
        figs[f"flat_{name}_time"] = schema.figure(d["flat_path_s"], "s", False)
    if compute:
        figs["fastsac_update_compute"] = schema.figure(compute["per_update_s"], "s", False)
    device = compute["device"] if compute and str(compute["device"]).startswith("cuda") else summary["device"]
    hdr = schema.header(device, summary["world"], dict(cfg), summary["backend"])
    return schema.make("collectives", hdr, figs, {**summary, "update_compute": compute})


def print_table(summary: dict[str, Any]) -> None:
    print(f"\n{'op':>10} {'bytes':>10} {'time_us':>10} {'algbw GB/s':>11} {'busbw GB/s':>11}")
    for r in summary["rows"]:
        print(f"{r['op']:>10} {r['bytes']:>10} {r['time_s'] * 1e6:>10.1f} {r['algbw_GBps']:>11.4f} "
              f"{r['busbw_GBps']:>11.4f}")
    for name, d in summary["flat"].items():
        print(f"flat {name}: {d['params']} params / {d['tensors']} tensors: flat path "
              f"{d['flat_path_s'] * 1e3:.2f} ms, all-reduce only {d['allreduce_only_s'] * 1e3:.2f} ms, "
              f"per tensor {d['per_tensor_s'] * 1e3:.2f} ms")


def run_local(quick: bool, world: int = 2, compute_batch: int | None = None,
              compute_device: str = "cpu", backend: str = "gloo") -> dict[str, Any]:
    """Spawned local ranks (gloo on CPU tensors by default; nccl needs one GPU per rank)."""
    from hpcrl.comm import spawn

    cfg = config_for(quick)
    cfg["world"] = world
    cfg["backend"] = backend
    ranks = spawn(_spawned, world, (cfg,), timeout_s=600, num_threads=1)
    summary = summarize(ranks, cfg["sizes"])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        default_batch = 8192 if compute_device.startswith("cuda") else (256 if quick else 1024)
        compute = measure_update_compute(compute_device, batch=compute_batch or default_batch,
                                         repeats=3 if quick else 7)
    finally:
        torch.set_num_threads(threads)
    return build_doc(summary, cfg, compute)


def run_launched(quick: bool, compute_batch: int) -> dict[str, Any] | None:
    """Under srun / torchrun: every rank runs; rank 0 returns the document."""
    cfg = config_for(quick)
    mine = run_rank(cfg)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine, group=_GROUP)
    doc = None
    if dist.get_rank() == 0:
        summary = summarize(gathered, cfg["sizes"])
        compute = measure_update_compute(mine["device"], batch=compute_batch)
        cfg["world"] = summary["world"]
        doc = build_doc(summary, cfg, compute)
    dist.barrier(group=_GROUP)
    from hpcrl.comm import shutdown
    shutdown()
    return doc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--world", type=int, default=2, help="local gloo ranks (ignored with --launched)")
    ap.add_argument("--launched", action="store_true", help="ranks come from srun / torchrun")
    ap.add_argument("--compute-batch", type=int, default=None,
                    help="batch of the per-update compute timing (default 256 quick / 1024 full; 8192 on GPU)")
    ap.add_argument("--json", default="collectives.json")
    args = ap.parse_args(argv)
    if args.launched:
        batch = args.compute_batch or (8192 if torch.cuda.is_available() else 256)
        doc = run_launched(args.quick, batch)
    else:
        doc = run_local(args.quick, args.world, args.compute_batch)
    if doc is not None:
        from benchmarks.common.timing import write_json
        write_json(args.json, doc)
        print_table(doc["results"])
        print(f"JSON: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
