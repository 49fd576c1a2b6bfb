"""Replay sampling of two builds of ``hpcrl._C`` in one process, interleaved: another build's
``replay_sample`` (``--base-so``, e.g. the parent commit's ``_C*.so``) vs this tree's, and the cold
``index_select`` floor of ``replay_sampler.py``, at 131 k and 1 M slots, batch 256 and 8,192.

    python benchmarks/ops/replay_build_ab.py --base-so /path/to/old/_C.cpython-311-x86_64-linux-gnu.so \\
        [--repeats 101] [--json FILE]

Both builds draw the same rows of the same stream and must return the same batch bit for bit (checked
before timing). The base build gets reward and flags as contiguous [C, E] copies (builds before the
env-major step layout require them); this tree's gets the shard's own views. Reported per case: the
median wall and process-CPU time per call, and ratios taken round by round (paired), which stay
meaningful when other processes load the machine unevenly; on a loaded machine the CPU time is the figure
to read (wall time there mostly measures waiting for a core).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository: benchmarks, hpcrl
from benchmarks.common.timing import loadavg, machine_info, measure_group, write_json  # noqa: E402
from benchmarks.ops import replay_sampler as rs  # noqa: E402

from hpcrl import _C  # noqa: E402


def load_build(path: str):
    spec = importlib.util.spec_from_file_location("hpcrl_base._C", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sample_call(ext, shard, reward, flags, batch: int):
    """One build's replay_sample into its own buffers; each call draws the stream's next rows."""
    f32 = dict(dtype=torch.float32)
    out = [torch.empty(batch, shard.row_dim, **f32), torch.empty(batch, shard.action_dim, **f32),
           torch.empty(batch, **f32), torch.empty(batch, shard.row_dim, **f32), torch.empty(batch, **f32),
           torch.empty(batch, dtype=torch.int64)]
    env, slot = torch.empty(batch, dtype=torch.int64), torch.empty(batch, dtype=torch.int64)
    offset = [0]

    def call():
        ext.replay_sample(shard.obs, shard.action, reward, flags, shard.final_ref, shard.final_pool,
                          shard.head_next_obs, shard.ptr, shard.n_step, shard.gamma, 7, offset[0], env, slot, 16, out)
        offset[0] += batch
    return call, (env, slot, *out)


def paired(a: list[float], b: list[float]) -> dict[str, float]:
    r = sorted(x / y for x, y in zip(a, b))
    return {"median": statistics.median(r), "q25": r[len(r) // 4], "q75": r[(3 * len(r)) // 4]}


def one_shape(base, shard, batch: int, llc: int, repeats: int) -> dict:
    drawn = rs.cold_index_sets(shard, batch, llc)
    old, old_out = sample_call(base, shard, shard.reward.contiguous(), shard.flags.contiguous(), batch)
    new, new_out = sample_call(_C, shard, shard.reward, shard.flags, batch)
    old()
    new()
    if not all(torch.equal(x, y) for x, y in zip(old_out, new_out)):
        raise SystemExit("the two builds returned different batches for the same rows of the stream")
    timed = measure_group({"base Sampler": old, "new Sampler": new,
                           "cold floor": rs.cases(shard, batch, drawn)["index_select floor"]}, "cpu", repeats=repeats)
    row = {"num_envs": shard.num_envs, "capacity": shard.capacity, "batch": batch, "index_sets": len(drawn)}
    for name, t in timed.items():
        row[name] = {k: t[k] for k in ("median_s", "min_s", "max_s", "cpu_median_s", "inner", "repeats")}
    floor = timed["cold floor"]
    for name in ("base Sampler", "new Sampler"):
        row[name]["vs_floor_cpu"] = timed[name]["cpu_median_s"] / floor["cpu_median_s"]
        row[name]["vs_floor_wall_paired"] = paired(timed[name]["samples_s"], floor["samples_s"])
    row["new_vs_base_cpu"] = timed["new Sampler"]["cpu_median_s"] / timed["base Sampler"]["cpu_median_s"]
    row["new_vs_base_wall_paired"] = paired(timed["new Sampler"]["samples_s"], timed["base Sampler"]["samples_s"])
    return row


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--base-so", required=True)
    p.add_argument("--repeats", type=int, default=101)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    machine = machine_info("cpu", 1)  # the load as the run starts
    base, llc, results = load_build(args.base_so), rs.llc_bytes(), []
    for envs in (16, 128):  # x 8192 slots: 131 k and 1 M stored transitions
        shard = rs.filled_shard(envs, 8192, 17, 6, "cpu")
        for batch in (256, 8192):
            row = one_shape(base, shard, batch, llc, args.repeats)
            results.append(row)
            us = {name: row[name]["cpu_median_s"] * 1e6 for name in ("base Sampler", "new Sampler", "cold floor")}
            print(f"{envs}x8192, batch {batch}: CPU us per call base {us['base Sampler']:.1f}, new "
                  f"{us['new Sampler']:.1f}, floor {us['cold floor']:.1f} | new/floor "
                  f"{row['new Sampler']['vs_floor_cpu']:.2f}, base/floor {row['base Sampler']['vs_floor_cpu']:.2f}, "
                  f"new/base {row['new_vs_base_cpu']:.2f}", flush=True)
        del shard
    machine = {**machine, "loadavg_end": loadavg(), "llc_bytes": llc, "base_so": args.base_so,
               "allocator": os.environ.get("LD_PRELOAD") or "default (glibc malloc, no LD_PRELOAD)"}
    payload = {"benchmark": "replay_build_ab", "machine": machine, "results": results}
    if args.json:
        write_json(args.json, payload)
    return payload


if __name__ == "__main__":
    main()
