#!/usr/bin/env python
"""FastSAC update ladder: updates/s of ``FastSAC.update`` per rung, the rungs timed interleaved.

    python benchmarks/sac/sac_ladder.py [--quick] [--json PATH] [--sizes ...] [--world] [--cleanrl] [--leanrl]

Rungs (``SACConfig`` fields): ``per_head`` (per-head critic, per-parameter tensors: the old path),
``flat`` (flat parameters only: the default), ``batched`` (batched critic only), ``batched_flat`` (both),
``compiled`` (flat + ``--compile``: the whole update captured by torch.compile, hpcrl/sac/compiled.py; its
one-time compile is done before timing and reported as ``compile_s``).
Sizes: the pendulum preset (obs 3, action 1, batch 256, hidden 128) and the halfcheetah preset (obs 17,
action 6, batch 4096, critic 512, actor 256), and ``halfcheetah-cpu`` (the same env, batch 256, hidden 256:
what a CPU run of docs/mujoco_cpu.md updates). One torch thread, CPU, one process. Every rung starts
from the same seed (hence the same weights) and runs on the same fixed batch and noise; one timed call
is ``policy_frequency`` updates (one actor step among them). Repeats of all rungs are interleaved
(benchmarks/common/timing.py), so load from other processes hits every rung alike: compare ratios, not
absolute figures. Under load the process CPU time per update (``cpu_update_s``) is the steadier
measure on one thread: it does not count the time the process waited for a core. The JSON follows
benchmarks/common/schema.py.

``--world`` adds the W = 1 vs W = 2 rung (the default eager flat path, 1 thread per process, the same
global batch): W = 1 at the full batch and at half of it (what each of 2 ranks computes) timed
interleaved in this process before and after a 2-process job (hpcrl.comm.spawn) in which each rank
times the update on its half three ways, interleaved: summing through shared memory (hpcrl.comm.shm,
the default on one host), through gloo, and through gloo with --overlap-grad-average. Beside the gloo
path the alpha-beta prediction: t(W=2) = t(half batch, W=1) + the critic and 1/policy_frequency of the
actor all-reduce from the all_reduce/ring fit in results/cost_model.json (gloo, this machine), and the
ideal-split one t(W=1)/2 + that communication.

``--cleanrl`` and ``--leanrl`` add the peers: the real CleanRL SAC (``sac_continuous_action.py``) and LeanRL's
compiled fork of it (``sac_continuous_action_torchcompile.py --compile``), unmodified, got at run time by
benchmarks/peers/sources.py (or from ``--cleanrl-src`` / ``--leanrl-src DIR``) and run by
benchmarks/peers/run_cleanrl.py in the peer venv (tools/peer_venv.sh), on Pendulum-v1, 1 thread, at their own
sizes (hidden 256, batch 256). Past its warm-up (``--learning-starts``) every loop iteration of a peer is one
env step and one update of its two Q networks plus, on average, one of its actor and alpha (policy_frequency 2:
two actor steps every second iteration), with its replay write and sample. A peer runs paced (run_cleanrl.py
``--pace``): each round of the interleaved timing runs ``PEER_STEPS`` of its iterations between the hpcrl
rungs below, so load hits them alike. The hpcrl rungs of that comparison are the pendulum preset's ``flat``
(the default) and ``compiled`` updates at two amounts of work: ``policy_frequency`` 1 (one critic and one
actor update per update: a peer iteration's work, the equal-work figure) and the preset's 2 (one critic
and half an actor update per update: what a FastSAC update costs). The peers' figures include their env
step (``env_share``) and replay; hpcrl's are the update alone on a fixed batch.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: benchmarks.common, hpcrl
from benchmarks.common import schema  # noqa: E402
from benchmarks.common.paths import RESULTS  # noqa: E402
from benchmarks.common.timing import (calls_per_repeat, fmt_time, loadavg, machine_info, measure_group,  # noqa: E402
                                      print_table, write_json)
from benchmarks.peers.sources import PEERS, PeerSourceError  # noqa: E402
from benchmarks.sac import vs_cleanrl  # noqa: E402
from hpcrl.comm import Plane  # noqa: E402
from hpcrl.replay import Batch  # noqa: E402
from hpcrl.sac import FastSAC, UpdateNoise, preset  # noqa: E402

CPU = torch.device("cpu")
RUNGS: dict[str, dict[str, bool]] = {
    "per_head": dict(flat_params=False, batched_critic=False),
    "flat": dict(flat_params=True, batched_critic=False),
    "batched": dict(flat_params=False, batched_critic=True),
    "batched_flat": dict(flat_params=True, batched_critic=True),
    "compiled": dict(flat_params=True, batched_critic=False, compile=True),
}
SIZES = {"pendulum": (3, 1), "halfcheetah": (17, 6), "halfcheetah-cpu": (17, 6)}  # (obs_dim, action_dim) of each preset's env
BASE = "per_head"
PEER_WARMUP, PEER_STEPS = 512, 100  # a peer's env steps before its first update; its iterations per timed segment
PEER_SETTLE = 50  # iterations after the first update before timing (LeanRL compiles its update, actor step, policy)


def fixed_batch(batch: int, obs_dim: int, action_dim: int) -> tuple[Batch, UpdateNoise]:
    g = torch.Generator().manual_seed(1)
    data = Batch(obs=torch.randn(batch, obs_dim, generator=g), action=torch.rand(batch, action_dim, generator=g) * 2 - 1,
                 reward=torch.randn(batch, generator=g), next_obs=torch.randn(batch, obs_dim, generator=g),
                 discount=(torch.rand(batch, generator=g) > 0.01).float() * 0.99, n=torch.ones(batch, dtype=torch.int64))
    return data, UpdateNoise.draw(batch, action_dim, g, CPU)


def rung_call(name: str, rung: dict[str, Any], batch: int | None, compile_s: dict[str, float],
              key: str = "compiled") -> Callable[[], None]:
    cfg = preset(name, **rung, **({} if batch is None else {"batch_size": batch}))
    obs_dim, action_dim = SIZES[name]
    torch.manual_seed(0)
    agent = FastSAC(cfg, obs_dim, action_dim, -torch.ones(action_dim), torch.ones(action_dim), CPU,
                    plane=Plane.local("device"))
    data, noise = fixed_batch(cfg.batch_size, obs_dim, action_dim)

    def call() -> None:
        for _ in range(cfg.policy_frequency):
            agent.update(data, noise)
    if agent.compiled is not None:  # compile (critic and actor parts) outside the timed calls
        call()
        compile_s[key] = agent.compiled.compile_s
    return call


def bench_size(name: str, repeats: int, min_repeat_s: float, batch: int | None) -> dict[str, Any]:
    cfg = preset(name, **({} if batch is None else {"batch_size": batch}))
    compile_s: dict[str, float] = {}
    calls = {rung: rung_call(name, flags, batch, compile_s) for rung, flags in RUNGS.items()}
    load_before = loadavg()
    timed = measure_group(calls, CPU, warmup=2, repeats=repeats, min_repeat_s=min_repeat_s, max_inner=200)
    per_update = {rung: t["median_s"] / cfg.policy_frequency for rung, t in timed.items()}
    cpu = {rung: t["cpu_median_s"] / cfg.policy_frequency for rung, t in timed.items()}
    return {
        "batch_size": cfg.batch_size, "critic_hidden": cfg.critic_hidden, "actor_hidden": cfg.actor_hidden,
        "num_q": cfg.num_q, "num_atoms": cfg.num_atoms, "obs_dim": SIZES[name][0], "action_dim": SIZES[name][1],
        "updates_per_call": cfg.policy_frequency, "loadavg_before": load_before, "loadavg_after": loadavg(),
        "rungs": {rung: {**RUNGS[rung], "update_s": s, "updates_per_s": 1.0 / s, "speedup_vs_per_head": per_update[BASE] / s,
                         "cpu_update_s": cpu[rung], "cpu_speedup_vs_per_head": cpu[BASE] / cpu[rung],
                         "min_update_s": timed[rung]["min_s"] / cfg.policy_frequency, "cpu_frac": timed[rung]["cpu_frac"],
                         "inner": timed[rung]["inner"], "repeats": repeats,
                         **({"compile_s": compile_s[rung]} if rung in compile_s else {})}
                  for rung, s in per_update.items()},
    }


def _agent(name: str, batch: int, plane: Plane, **flags) -> tuple[FastSAC, Callable[[], None], Any]:
    cfg = preset(name, batch_size=batch, **flags)
    obs_dim, action_dim = SIZES[name]
    torch.manual_seed(0)
    agent = FastSAC(cfg, obs_dim, action_dim, -torch.ones(action_dim), torch.ones(action_dim), CPU, plane=plane)
    data, noise = fixed_batch(batch, obs_dim, action_dim)

    def call() -> None:
        for _ in range(cfg.policy_frequency):
            agent.update(data, noise)
    return agent, call, cfg


W2_PATHS = ("shm", "gloo", "gloo_overlap")  # the default (shared memory), gloo, gloo + --overlap-grad-average


def world_rank(name: str, global_batch: int, repeats: int, inner: int) -> dict[str, Any]:
    """One of 2 ranks: seconds per update on its half of the global batch, summing through shared memory
    (the default on one host), through gloo, and through gloo overlapped with backward; interleaved."""
    import dataclasses

    from hpcrl.comm import init_distributed

    torch.set_num_threads(1)
    ctx = init_distributed(timeout_s=300)
    gloo = dataclasses.replace(ctx.device_plane, shm=None)  # the same group, its sums on gloo
    planes = {"shm": ctx.device_plane, "gloo": gloo, "gloo_overlap": gloo}
    calls = {}
    for path in W2_PATHS:
        _, call, cfg = _agent(name, global_batch // ctx.world_size, planes[path],
                              overlap_grad_average=path == "gloo_overlap")
        call()
        calls[path] = call
    wall: dict[str, list[float]] = {k: [] for k in calls}
    cpu: dict[str, list[float]] = {k: [] for k in calls}
    for _ in range(repeats):
        for key, call in calls.items():
            w0, c0 = time.perf_counter(), time.process_time()
            for _ in range(inner):
                call()
            wall[key].append((time.perf_counter() - w0) / inner / cfg.policy_frequency)
            cpu[key].append((time.process_time() - c0) / inner / cfg.policy_frequency)
    return {"shared_memory": ctx.device_plane.shm is not None, "wall": wall, "cpu": cpu}


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else 0.5 * (xs[len(xs) // 2 - 1] + xs[len(xs) // 2])


def alpha_beta_fit() -> dict[str, float] | None:
    path = RESULTS / "cost_model.json"
    if not path.exists():
        return None
    fit = json_load(path)["results"]["fits"]["all_reduce/ring"]
    return {"alpha_s": fit["alpha_s"], "beta_s_per_B": fit["beta_s_per_B"], "source": str(path.name)}


def json_load(path: Path) -> dict:
    return json.loads(path.read_text())


def bench_world(name: str, repeats: int, min_repeat_s: float, batch: int | None) -> dict[str, Any]:
    from benchmarks.comm import cost_model as cm
    from hpcrl.comm import spawn

    cfg = preset(name, **({} if batch is None else {"batch_size": batch}))
    B = cfg.batch_size
    local = Plane.local("device")
    full, half = _agent(name, B, local)[1], _agent(name, B // 2, local)[1]
    sandwich = []
    load = [loadavg()]
    for phase in ("before", "after"):
        t = measure_group({"w1_full": full, "w1_half": half}, CPU, warmup=2, repeats=max(3, repeats // 2),
                          min_repeat_s=min_repeat_s, max_inner=200)
        sandwich.append({k: {"wall": v["median_s"] / cfg.policy_frequency, "cpu": v["cpu_median_s"] / cfg.policy_frequency}
                         for k, v in t.items()})
        if phase == "before":
            per = sandwich[0]["w1_full"]["wall"] * cfg.policy_frequency
            inner = max(1, min(200, int(min_repeat_s / max(per, 1e-6))))
            ranks = spawn(world_rank, 2, args=(name, B, repeats, inner), timeout_s=3000)
            load.append(loadavg())
    w1 = {k: _median([s[k]["wall"] for s in sandwich]) for k in ("w1_full", "w1_half")}
    w1_cpu = {k: _median([s[k]["cpu"] for s in sandwich]) for k in ("w1_full", "w1_half")}
    if not all(r["shared_memory"] for r in ranks):
        raise RuntimeError("sac_ladder --world: the 2 ranks got no shared-memory segment (see the warning above)")
    w2 = {k: max(_median(r["wall"][k]) for r in ranks) for k in W2_PATHS}
    w2_cpu = {k: max(_median(r["cpu"][k]) for r in ranks) for k in W2_PATHS}
    agent = _agent(name, 8, local)[0]
    critic_b = sum(b.numel() * b.element_size() for b in agent.layout.flat_critic.grad_buffers.values())
    actor_b = sum(b.numel() * b.element_size() for b in agent.layout.flat_actor.grad_buffers.values())
    fit = alpha_beta_fit()
    model = None
    if fit is not None:
        comm = (cm.model_time("all_reduce", "ring", 2, critic_b, fit["alpha_s"], fit["beta_s_per_B"])
                + cm.model_time("all_reduce", "ring", 2, actor_b, fit["alpha_s"], fit["beta_s_per_B"]) / cfg.policy_frequency)
        model = {**fit, "critic_bytes": critic_b, "actor_bytes": actor_b, "comm_s": comm,
                 "w2_pred_s": w1["w1_half"] + comm, "w2_pred_ideal_split_s": w1["w1_full"] / 2 + comm,
                 "measured_dp_overhead_s": w2["gloo"] - w1["w1_half"],
                 "dp_overhead_vs_model": (w2["gloo"] - w1["w1_half"]) / comm}
    return {"global_batch": B, "w1_update_s": w1["w1_full"], "w1_half_batch_update_s": w1["w1_half"],
            "w2_update_s": w2["shm"], "w2_gloo_update_s": w2["gloo"], "w2_overlap_update_s": w2["gloo_overlap"],
            "w2_vs_w1": w2["shm"] / w1["w1_full"], "w2_gloo_vs_w1": w2["gloo"] / w1["w1_full"],
            "w2_overlap_vs_w1": w2["gloo_overlap"] / w1["w1_full"],
            "shm_dp_overhead_s": w2["shm"] - w1["w1_half"],
            "cpu_update_s": {**w1_cpu, **{f"w2_{k}": v for k, v in w2_cpu.items()}},
            "sandwich": sandwich, "ranks": ranks, "alpha_beta": model, "loadavg": load + [loadavg()],
            "threads_per_rank": 1, "note": "W=2 runs 2 processes on the machine's cores; W=1 one process"}


def peer_command(peer: str, src: Path, quick: bool, steps: int, segments: int, log: Path) -> tuple[list[str], list[str]]:
    """run_cleanrl.py's command for ``peer`` in timing mode (``segments`` of ``steps`` iterations after its warm-up),
    and the peer script's own flags."""
    warmup = 100 if quick else PEER_WARMUP
    start = warmup + PEER_SETTLE
    script = ["--env-id", "Pendulum-v1", "--total-timesteps", str(start + steps * (segments + 1) + 10),
              "--learning-starts", str(warmup), "--no-cuda", "--seed", "0", *(["--compile"] if peer == "leanrl" else [])]
    cmd = [str(vs_cleanrl.PEER_PYTHON), str(vs_cleanrl.RUNNER), "--peer", peer, "--src", str(src), "--out", str(log.with_suffix(".json")),
           "--eval-every", str(10**9), "--eval-episodes", "1", "--threads", "1", "--workdir", str(log.parent),
           "--pace", str(steps), "--pace-from", str(start), "--", *script]
    return cmd, script


class PacedPeer:
    """A peer's script in timing mode (run_cleanrl.py ``--pace``), its stderr in ``log``: ``segment()`` runs one
    segment of its loop iterations and returns their seconds as the peer measured them."""

    def __init__(self, name: str, cmd: list[str], log: Path) -> None:
        self.name, self.log, self.buf = name, log, b""
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log.open("wb"),
                                     env={**os.environ, "OMP_NUM_THREADS": "1"})

    def segment(self, timeout_s: float = 600.0) -> dict[str, float]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(b"go\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout_s  # the first segment waits for the warm-up (LeanRL: its compile)
        while True:
            line, nl, rest = self.buf.partition(b"\n")
            if nl:
                self.buf = rest
                if line.startswith(b"[pace] "):
                    return json.loads(line[len(b"[pace] "):])
                continue
            ready, _, _ = select.select([self.proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            chunk = os.read(self.proc.stdout.fileno(), 65536) if ready else b""
            if not chunk:
                self.proc.kill()
                self.proc.wait()
                why = "ended" if ready else f"sent no timing in {timeout_s:.0f} s"
                raise RuntimeError(f"sac_ladder: the {self.name} peer {why}; its log {self.log}:\n"
                                   f"{self.log.read_text(errors='replace')[-3000:]}")
            self.buf += chunk

    def close(self) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()  # end of stdin: the paced script exits at its next segment
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


EQUAL_WORK = {"flat_pf1": ("flat", 1), "compiled_pf1": ("compiled", 1), "flat": ("flat", 2), "compiled": ("compiled", 2)}


def bench_peers(srcs: dict[str, Path], quick: bool, repeats: int, min_repeat_s: float,
                rungs: tuple[str, ...] = tuple(EQUAL_WORK)) -> dict[str, Any]:
    """The peers' loop iterations and hpcrl's pendulum update at equal work and at its own, timed interleaved (the
    module doc). Raises RuntimeError when a peer fails or stalls."""
    compile_s: dict[str, float] = {}
    calls = {key: (rung_call("pendulum", {**RUNGS[rung], "policy_frequency": pf}, None, compile_s, key), pf)
             for key, (rung, pf) in EQUAL_WORK.items() if key in rungs}
    steps = 20 if quick else PEER_STEPS
    inner = {key: calls_per_repeat(call, CPU, 1, min_repeat_s, 200) for key, (call, _) in calls.items()}
    hpcrl = {key: {"wall": [], "cpu": []} for key in calls}
    peers = {name: {"wall": [], "cpu": [], "env": []} for name in srcs}
    load = loadavg()
    with tempfile.TemporaryDirectory(prefix="sac_ladder_peers_") as tmp:
        commands = {name: peer_command(name, src, quick, steps, repeats + 1, Path(tmp) / f"{name}.log")
                    for name, src in srcs.items()}
        paced = {name: PacedPeer(name, cmd, Path(tmp) / f"{name}.log") for name, (cmd, _) in commands.items()}
        try:
            for peer in paced.values():
                peer.segment()  # the first segment: a warm-up, not kept
            for _ in range(repeats):
                for key, (call, pf) in calls.items():
                    w0, c0 = time.perf_counter(), time.process_time()
                    for _ in range(inner[key]):
                        call()
                    hpcrl[key]["wall"].append((time.perf_counter() - w0) / inner[key] / pf)
                    hpcrl[key]["cpu"].append((time.process_time() - c0) / inner[key] / pf)
                for name, peer in paced.items():
                    got = peer.segment()
                    peers[name]["wall"].append(got["wall_s"] / got["steps"])
                    peers[name]["cpu"].append(got["cpu_s"] / got["steps"])
                    peers[name]["env"].append(got["env_s"] / got["wall_s"])
        finally:
            for peer in paced.values():
                peer.close()
    return {
        "hpcrl": {key: {"rung": EQUAL_WORK[key][0], "policy_frequency": EQUAL_WORK[key][1],
                        "update_s": _median(t["wall"]), "cpu_update_s": _median(t["cpu"]), "inner": inner[key],
                        "samples_s": t["wall"], **({"compile_s": compile_s[key]} if key in compile_s else {})}
                  for key, t in hpcrl.items()},
        "peers": {name: {"step_s": _median(t["wall"]), "cpu_step_s": _median(t["cpu"]), "env_share": _median(t["env"]),
                         "steps_per_segment": steps, "samples_s": t["wall"],
                         "command": "python " + PEERS[name].script + " " + " ".join(commands[name][1]),
                         "repo": PEERS[name].repo, "commit": PEERS[name].commit}
                  for name, t in peers.items()},
        "repeats": repeats, "loadavg": [load, loadavg()],
        "work_per_step": {"peers": "1 env step + replay write and sample + 1 critic update (2 Q nets, hidden 256, batch "
                                   "256) + on average 1 actor and alpha update",
                          "hpcrl_pf1": "1 critic update + 1 actor and alpha update (pendulum preset), fixed batch",
                          "hpcrl": "1 critic update + 1/2 actor and alpha update (pendulum preset), fixed batch"},
    }


def peer_sources(args: argparse.Namespace) -> dict[str, Path] | None:
    """The checked source folder of each peer asked for, or None after one line on stderr saying how to get it."""
    try:
        return {name: PEERS[name].locate(getattr(args, f"{name}_src")) for name in PEERS if getattr(args, name)}
    except PeerSourceError as e:
        print(f"sac_ladder: {e}", file=sys.stderr)
        return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--quick", action="store_true", help="few, short repeats; halfcheetah at batch 1024")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--sizes", default="pendulum,halfcheetah", help="comma-separated presets to run")
    ap.add_argument("--world", action="store_true", help="add the W = 1 vs W = 2 rung (2 processes)")
    ap.add_argument("--no-rungs", action="store_true", help="skip the single-process rungs (with --world)")
    ap.add_argument("--cleanrl", action="store_true", help="add the real CleanRL SAC on Pendulum, interleaved")
    ap.add_argument("--leanrl", action="store_true", help="add LeanRL's compiled SAC on Pendulum, interleaved")
    ap.add_argument("--leanrl-src", default=None, help="with --leanrl: a checkout of meta-pytorch/LeanRL at the pinned "
                    "commit (default: $HPCRL_LEANRL_SRC, else the cache, fetched into when empty)")
    ap.add_argument("--cleanrl-src", default=None, help="with --cleanrl: a checkout of vwxyzjn/cleanrl at the pinned "
                    "commit (default: $HPCRL_CLEANRL_SRC, else the cache, fetched into when empty)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    repeats, min_repeat_s = (3, 0.05) if args.quick else (9, 0.3)
    default = "sac_ladder_quick.json" if args.quick else "sac_ladder.json"
    out_path = args.json or RESULTS / default
    names = [n.strip() for n in args.sizes.split(",") if n.strip()]
    unknown = [n for n in names if n not in SIZES]
    if unknown:
        print(f"sac_ladder: --sizes {','.join(unknown)}: choose from {','.join(SIZES)}", file=sys.stderr)
        return 2
    qbatch = {"halfcheetah": 1024 if args.quick else None}
    srcs = peer_sources(args)  # before the rungs: a missing one ends it
    if srcs is None:
        return 2
    if srcs and not vs_cleanrl.PEER_PYTHON.exists():
        print(f"sac_ladder: {vs_cleanrl.PEER_PYTHON} missing: run `bash tools/peer_venv.sh` first", file=sys.stderr)
        return 2
    sizes = {} if args.no_rungs else {n: bench_size(n, repeats, min_repeat_s, qbatch.get(n)) for n in names}
    world = {n: bench_world(n, repeats, min_repeat_s, qbatch.get(n)) for n in names} if args.world else {}
    peers = bench_peers(srcs, args.quick, repeats, min_repeat_s) if srcs else None
    rows = [[name, rung, fmt_time(r["update_s"]), f"{r['updates_per_s']:.1f}", f"{r['speedup_vs_per_head']:.2f}x",
             fmt_time(r["cpu_update_s"]), f"{r['cpu_speedup_vs_per_head']:.2f}x", f"{r['cpu_frac']:.2f}"] for name, size in sizes.items() for rung, r in size["rungs"].items()]
    print_table("FastSAC.update, 1 thread, rungs interleaved (median)",
                ["preset", "rung", "update", "updates/s", "vs per_head", "CPU time", "vs per_head (CPU)", "cpu_frac"],
                rows)
    figures = {f"{name}_{rung}_update_s": schema.figure(r["update_s"], "s", False)
               for name, size in sizes.items() for rung, r in size["rungs"].items()}
    figures.update({f"{name}_speedup_batched_flat": schema.figure(size["rungs"]["batched_flat"]["speedup_vs_per_head"],
                                                                  "x", True) for name, size in sizes.items()})
    # compiled vs the default eager path (flat), by wall and by process CPU time (the steadier under load)
    for name, w in world.items():
        print(f"{name}: W=1 {fmt_time(w['w1_update_s'])}, W=1 half batch {fmt_time(w['w1_half_batch_update_s'])}, "
              f"W=2 shared memory {fmt_time(w['w2_update_s'])} ({w['w2_vs_w1']:.2f}x of W=1), gloo "
              f"{fmt_time(w['w2_gloo_update_s'])} ({w['w2_gloo_vs_w1']:.2f}x), gloo overlapped "
              f"{fmt_time(w['w2_overlap_update_s'])} ({w['w2_overlap_vs_w1']:.2f}x)"
              + (f"; alpha-beta (gloo) W=2 {fmt_time(w['alpha_beta']['w2_pred_s'])}" if w["alpha_beta"] else ""))
        figures[f"{name}_w2_vs_w1"] = schema.figure(w["w2_vs_w1"], "x", False)
        figures[f"{name}_w2_gloo_vs_w1"] = schema.figure(w["w2_gloo_vs_w1"], "x", False)
        figures[f"{name}_w2_overlap_vs_w1"] = schema.figure(w["w2_overlap_vs_w1"], "x", False)
        if w["alpha_beta"]:
            figures[f"{name}_w2_gloo_vs_alpha_beta"] = schema.figure(w["w2_gloo_update_s"] / w["alpha_beta"]["w2_pred_s"],
                                                                     "x", False)
    for name, size in sizes.items():
        r = size["rungs"]
        figures[f"{name}_compiled_vs_flat"] = schema.figure(r["flat"]["update_s"] / r["compiled"]["update_s"], "x", True)
        figures[f"{name}_compiled_vs_flat_cpu"] = schema.figure(r["flat"]["cpu_update_s"] / r["compiled"]["cpu_update_s"],
                                                               "x", True)
        figures[f"{name}_compile_s"] = schema.figure(r["compiled"]["compile_s"], "s", False)
    if peers is not None:
        rows = [[key, fmt_time(r["update_s"]), fmt_time(r["cpu_update_s"])] for key, r in peers["hpcrl"].items()]
        rows += [[f"{name} (iteration)", fmt_time(r["step_s"]), fmt_time(r["cpu_step_s"])]
                 for name, r in peers["peers"].items()]
        print_table("Pendulum: hpcrl's update (pf1: a peer iteration's work) and the peers' loop iterations, "
                    "interleaved (median)", ["what", "wall", "CPU time"], rows)
        for name, r in peers["peers"].items():
            figures[f"{name}_pendulum_update_step_s"] = schema.figure(r["step_s"], "s", False)
            for key, h in peers["hpcrl"].items():
                suffix = "equal_work" if h["policy_frequency"] == 1 else "step"
                figures[f"pendulum_{h['rung']}_vs_{name}_{suffix}"] = schema.figure(r["step_s"] / h["update_s"], "x", True)
    config = {"quick": args.quick, "sizes": names, "world": args.world, "repeats": repeats, "min_repeat_s": min_repeat_s, "threads": 1,
              "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "cleanrl": args.cleanrl,
              "leanrl": args.leanrl}
    results = {"machine": machine_info(CPU, 1), "sizes": sizes, "world": world, "peers": peers,
               "note": "ratios are what counts: the machine may be shared (see loadavg and cpu_frac)"}
    path = write_json(out_path, schema.make("sac_ladder", schema.header("cpu", 1, config), figures, results))
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
