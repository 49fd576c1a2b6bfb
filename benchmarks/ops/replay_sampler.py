"""Replay sampling: ``ReplayShard.sample`` (torch.randint + index ops, fresh outputs) vs ``Sampler``
(indices drawn inside the kernel, preallocated outputs) vs the bare ``index_select`` floor, and the
CPU gather's software prefetch on vs off on the same storage and indices. All cases of a shape are
timed interleaved (benchmarks/common/timing.py), so load from other processes hits them alike.

    python benchmarks/ops/replay_sampler.py [--quick] [--device cpu|cuda] [--json FILE]

The floor copies the same bytes a batch needs (obs, next obs, action rows by index) with
``index_select`` into preallocated buffers and computes no n-step window: nothing does less. It is
cold like the sampler: the sampler reads fresh random rows every call, so the floor and the gathers
cycle through index sets drawn beforehand whose rows add up to more than twice the last-level cache
(:func:`cold_index_sets`), so a set's rows were evicted before it comes round again (a few fixed sets
would stay in cache and time a hot copy). Drawing the sets is not timed.
Minor page faults per call (``getrusage``) are measured in this process, whose heap also holds a
131,072-slot ring: fresh outputs of ~4.7 MB per call are what glibc's allocator hands back and forth.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: benchmarks.common, hpcrl
from benchmarks.common.timing import (fmt_time, loadavg, machine_info, measure_group, print_table,  # noqa: E402
                                      write_json)

from hpcrl import ops  # noqa: E402
from hpcrl.replay import ReplayShard, Sampler  # noqa: E402


def filled_shard(num_envs: int, capacity: int, obs_dim: int, act_dim: int, device: str) -> ReplayShard:
    shard = ReplayShard(num_envs, capacity, obs_dim, act_dim, n_step=3, gamma=0.99, device=device)
    g = torch.Generator().manual_seed(0)
    for _ in range(capacity + 5):  # wrapped once: every slot written, episodes ending now and then
        done = torch.rand(num_envs, generator=g) < 0.01
        shard.add(*(torch.randn(num_envs, d, generator=g).to(device) for d in (obs_dim,)),
                  torch.rand(num_envs, act_dim, generator=g).to(device), torch.randn(num_envs, generator=g).to(device),
                  torch.randn(num_envs, obs_dim, generator=g).to(device), done.to(device), torch.zeros_like(done).to(device))
    return shard


def faults_per_call(fn, calls: int = 50) -> float:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(calls):
        fn()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / calls


def llc_bytes() -> int:
    """Size of the CPU's last-level cache (sysfs, cpu0's highest level), 32 MiB if unreadable."""
    best = (0, 32 << 20)
    for d in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            level, size = int((d / "level").read_text()), (d / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:].upper(), 1)
        if level > best[0] and size.rstrip("KMGkmg").isdigit():
            best = (level, int(size.rstrip("KMGkmg")) * scale)
    return best[1]


def row_bytes(shard: ReplayShard) -> int:
    """Bytes the floor copies per sampled row: obs, next obs and action."""
    return (2 * shard.row_dim + shard.action_dim) * shard.obs.element_size()


def cold_index_sets(shard: ReplayShard, batch: int, llc: int, min_sets: int = 32) -> list[tuple[torch.Tensor, ...]]:
    """(env, slot) index sets drawn like ``ReplayShard.sample`` draws them, enough of them that one
    cycle through all reads more than twice ``llc`` bytes of rows."""
    sets = max(min_sets, -(-2 * llc // (batch * row_bytes(shard))))
    filled = min(shard.ptr, shard.capacity)
    g = torch.Generator().manual_seed(1)
    i = torch.randint(shard.num_envs * filled, (sets, batch), generator=g).to(shard.device)
    env = i % shard.num_envs
    slot = (shard.ptr - filled + torch.div(i, shard.num_envs, rounding_mode="floor")) % shard.capacity
    return list(zip(env.unbind(), slot.unbind()))


def cases(shard: ReplayShard, batch: int, drawn: list[tuple[torch.Tensor, ...]]) -> dict:
    """The timed calls. The floor and the gathers take their indices from ``drawn`` in turn; the samplers
    draw their own."""
    sampler = Sampler(shard, batch, seed=0)
    gen = torch.Generator(device=shard.device).manual_seed(0)
    flat_obs, flat_act = shard.obs.view(-1, shard.row_dim), shard.action.view(-1, shard.action_dim)
    rows = [s * shard.num_envs + e for e, s in drawn]
    nxt = [(r + shard.num_envs) % flat_obs.shape[0] for r in rows]
    f32 = dict(dtype=torch.float32, device=shard.device)
    out_obs, out_next = torch.empty(batch, shard.row_dim, **f32), torch.empty(batch, shard.row_dim, **f32)
    out_act = torch.empty(batch, shard.action_dim, **f32)
    turn = [0]

    def next_set() -> int:
        turn[0] = (turn[0] + 1) % len(drawn)
        return turn[0]

    def floor():
        k = next_set()
        torch.index_select(flat_obs, 0, rows[k], out=out_obs)
        torch.index_select(flat_act, 0, rows[k], out=out_act)
        torch.index_select(flat_obs, 0, nxt[k], out=out_next)

    def gather(prefetch):
        def call():
            env, slot = drawn[next_set()]
            return ops.replay_gather(shard.obs, shard.action, shard.reward, shard.flags, shard.final_ref,
                                     shard.final_pool, shard.head_next_obs, env, slot, shard.ptr, 3, 0.99,
                                     prefetch_rows=prefetch, out=sampler.buffers)
        return call

    return {"shard.sample": lambda: shard.sample(batch, generator=gen), "Sampler.sample": sampler.sample,
            "gather prefetch 0": gather(0), "gather prefetch 16": gather(16), "index_select floor": floor}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    machine = machine_info(args.device, args.threads)  # the load as the run starts
    # 131 k and 1 M stored transitions (the second far larger than the last-level cache), batch 256 and 8,192
    shapes = [(64, 2048, 17, 6, 256), (64, 2048, 17, 6, 8192)] if args.quick else \
        [(16, 8192, 17, 6, 256), (16, 8192, 17, 6, 8192), (128, 8192, 17, 6, 256), (128, 8192, 17, 6, 8192)]
    ring = torch.empty(131_072, 64)  # a large heap, as a training process has (see the docstring)
    ring.fill_(1.0)
    llc, results, shard = llc_bytes(), [], None
    for E, C, D, A, B in shapes:
        if shard is None or (shard.num_envs, shard.capacity, shard.obs_dim) != (E, C, D):
            del shard  # the previous one freed before the next is filled
            shard = filled_shard(E, C, D, A, args.device)
        drawn = cold_index_sets(shard, B, llc)
        fns = cases(shard, B, drawn)
        timed = measure_group(fns, args.device, repeats=5 if args.quick else 15)
        floor = timed["index_select floor"]["median_s"]
        row = {"num_envs": E, "capacity": C, "obs_dim": D, "act_dim": A, "batch": B, "index_sets": len(drawn),
               **{name: {"median_s": t["median_s"], "vs_floor": t["median_s"] / floor,
                         # process CPU time per call: what is left of the call when other processes take the core
                         "cpu_median_s": t["cpu_median_s"],
                         "vs_floor_cpu": None if t["cpu_median_s"] is None
                         else t["cpu_median_s"] / timed["index_select floor"]["cpu_median_s"],
                         "minor_faults_per_call": faults_per_call(fns[name]) if args.device == "cpu" else None}
                  for name, t in timed.items()}}
        row["sampler_speedup"] = timed["shard.sample"]["median_s"] / timed["Sampler.sample"]["median_s"]
        row["prefetch16_vs_0"] = timed["gather prefetch 16"]["median_s"] / timed["gather prefetch 0"]["median_s"]
        results.append(row)
    del ring
    names = list(fns)
    print_table("replay sampling (median per call, wall and process CPU time; x = vs the index_select floor; "
                "faults = minor page faults per call)",
                ["E x C, D/A, batch", *names, "Sampler speed-up", "prefetch16/0"],
                [[f"{r['num_envs']}x{r['capacity']}, {r['obs_dim']}/{r['act_dim']}, {r['batch']}",
                  *[f"{fmt_time(r[n]['median_s'])} {r[n]['vs_floor']:.2f}x"
                    + (f", cpu {fmt_time(r[n]['cpu_median_s'])} {r[n]['vs_floor_cpu']:.2f}x"
                       if r[n]['vs_floor_cpu'] else "")
                    + (f" {r[n]['minor_faults_per_call']:.0f}f" if r[n]['minor_faults_per_call'] is not None else "")
                    for n in names], f"{r['sampler_speedup']:.2f}x", f"{r['prefetch16_vs_0']:.2f}"] for r in results])
    machine = {**machine, "loadavg_end": loadavg(), "llc_bytes": llc,
               "allocator": os.environ.get("LD_PRELOAD") or "default (glibc malloc, no LD_PRELOAD)"}
    payload = {"benchmark": "replay_sampler", "machine": machine, "results": results}
    if args.json:
        write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    main()
