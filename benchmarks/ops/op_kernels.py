#!/usr/bin/env python
"""Kernel benchmarks of hpcrl._C against the code it replaces.

    python benchmarks/ops/op_kernels.py [--quick] [--json PATH] [--device cpu|cuda] [--threads N]

Two parts, every row timed in the same run as its baselines (repeats interleaved, see benchmarks/common/timing.py):

1. Gradient "all-reduce copy path" without the collective: pack the gradient list into one flat
   buffer and scatter it back multiplied by scale = 1/W (the world-size average). Cases:
     hpcrl          ops.flatten(grads, out=persistent_flat); ops.unflatten_(flat, grads, 1/W)
     holosoma       flat = torch.cat([g.view(-1)]); flat.div_(W); per tensor g.copy_(flat[slice].view_as(g))
                    (FastSACAgent._all_reduce_model_grads with the all_reduce removed, docs/holosoma.md#data-parallelism)
     torch._utils   _flatten_dense_tensors; flat.mul_(1/W); per tensor g.copy_(view) over
                    _unflatten_dense_tensors
     memcpy         the physical limit: two contiguous buffers A (the grads, as one block) and F (the
                    flat buffer), both P bytes; F.copy_(A) then A.copy_(F). That is exactly the traffic a
                    flatten + unflatten cannot avoid: read P + write P, twice.
   "GB/s" is the same 4P bytes (P = payload = numel * element size) divided by each case's time, so
   GB/s ratios equal time ratios. The holosoma and torch._utils cases actually move ~6P (their
   separate divide / mul pass reads and writes the flat buffer once more); hpcrl and memcpy move 4P.
   W alternates between 2 and 1/2 from call to call (exact in every dtype): repeatedly dividing the
   same gradients by W would drive them into subnormals, which are ~100x slower on x86.
   Sizes: the holosoma FastSAC critic (hidden 768, 101 atoms, 2 heads, LayerNorm, obs 64, action 16:
   907,210 params in 28 tensors, counted by critic_shapes() below) and the same architecture at hidden 2752
   (10.08 M params, 28 tensors); fp16 / bf16 at 10 M as well.

2. Replay sample + gather with n-step returns, batch 256 / 8192 / 65536, from 1e5 and 1e6 stored
   transitions (256 envs x 391 and 256 envs x 3907 slots; 256 envs so that the holosoma sampler's
   per-env count k = batch / 256 is whole at every batch), obs 64, action 16, n-step 1 and 3.
     hpcrl          ReplayShard.sample(batch, generator): uniform (env, slot) pairs, one fused C++ call
                    for obs, action, n-step reward, bootstrap next_obs, discount, n.
     holosoma       HolosomaStyleReplay below: holosoma's SimpleReplayBuffer.sample semantics
                    (docs/holosoma.md#replay-and-n-step-returns): env-major [n_env, T, dim] storage with obs AND next_obs,
                    the same k indices per env, per-field torch.gather with expanded indices, and for
                    n > 1 the window gather + cumprod done mask + discounted sum + first-done/trunc
                    bootstrap gather, including the temporary truncation mark at the write head.
                    Critic observations are left out (hpcrl stores none; holosoma would gather two
                    more obs-sized fields) and the batch is returned as a dict, not a TensorDict
                    (a fixed cost per call): both choices make the baseline faster, not slower.
   The ring is filled through the public add()/extend() with random data (terminated p=0.02,
   truncated p=0.01) and wrapped once (ptr = T + 37); the n = 3 shard is the n = 1
   shard's state loaded with n_step=3 (same stored data).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repository
from benchmarks.common.paths import RESULTS  # noqa: E402
from benchmarks.common.timing import OtherLoad, fmt_time, loadavg, machine_info, measure_group, print_table, write_json  # noqa: E402

from hpcrl import ops  # noqa: E402
from hpcrl.replay.shard import ReplayShard  # noqa: E402

OBS_DIM, ACT_DIM, GAMMA = 64, 16, 0.97
KEEP = ("median_s", "min_s", "max_s", "cpu_median_s", "cpu_frac", "inner", "repeats", "samples_s")
P_TERM, P_TRUNC = 0.02, 0.01

def _fmt_opt(seconds):
    return "-" if seconds is None else fmt_time(seconds)


def _div(a, b):
    return None if a is None or b is None or b == 0 else a / b


def _ratio_opt(a, b):
    return "-" if a is None or b is None or b == 0 else f"{a / b:.2f}"


# ---------------------------------------------------------------------------------------------------
# 1. gradient flatten / unflatten
# ---------------------------------------------------------------------------------------------------


def critic_shapes(hidden: int, obs: int = OBS_DIM, act: int = ACT_DIM, atoms: int = 101, heads: int = 2):
    """Parameter shapes of holosoma's FastSAC Critic, in module order (docs/holosoma.md#critic-a-distributional-ensemble):
    per head Linear(in,H) LN Linear(H,H/2) LN Linear(H/2,H/4) LN Linear(H/4,atoms)."""
    dims = [obs + act, hidden, hidden // 2, hidden // 4]
    shapes: list[tuple[int, ...]] = []
    for _ in range(heads):
        for i in range(3):
            shapes += [(dims[i + 1], dims[i]), (dims[i + 1],), (dims[i + 1],), (dims[i + 1],)]
        shapes += [(atoms, dims[3]), (atoms,)]
    return shapes


def make_params(shapes, dtype: torch.dtype, device: torch.device) -> list[torch.nn.Parameter]:
    params = []
    for shape in shapes:
        p = torch.nn.Parameter(torch.empty(shape, dtype=dtype, device=device))
        p.grad = torch.randn(shape, dtype=dtype, device=device)
        params.append(p)
    return params


class Alternating:
    """World size W = 2, 1/2, 2, ... : scale 1/W stays exact and values stay normal forever."""

    def __init__(self) -> None:
        self.k = 0

    def __call__(self) -> float:
        self.k += 1
        return 2.0 if self.k % 2 else 0.5


def grad_cases(params: list[torch.nn.Parameter]) -> dict[str, Callable[[], None]]:
    total = sum(p.numel() for p in params)
    ref = params[0].grad
    flat_buf = torch.empty(total, dtype=ref.dtype, device=ref.device)  # persistent, as in a trainer
    mem_a = torch.randn(total, device=ref.device).to(ref.dtype)
    mem_f = torch.empty_like(mem_a)
    w_h, w_t, w_x = Alternating(), Alternating(), Alternating()

    def hpcrl_case() -> None:
        grads = [p.grad for p in params]
        ops.flatten(grads, out=flat_buf)
        ops.unflatten_(flat_buf, grads, 1.0 / w_h())

    def holosoma_case() -> None:
        grads = [p.grad.view(-1) for p in params if p.grad is not None]
        flat = torch.cat(grads)
        # dist.all_reduce(flat, op=SUM) would go here
        flat.div_(w_t())
        offset = 0
        for p in params:
            if p.grad is not None:
                n = p.numel()
                p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
                offset += n

    def torch_utils_case() -> None:
        grads = [p.grad for p in params]
        flat = _flatten_dense_tensors(grads)
        flat.mul_(1.0 / w_x())
        for g, v in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(v)

    def memcpy_case() -> None:
        mem_f.copy_(mem_a)
        mem_a.copy_(mem_f)

    return {"hpcrl": hpcrl_case, "holosoma": holosoma_case, "torch._utils": torch_utils_case,
            "memcpy": memcpy_case}


def check_grad_ops(device: torch.device) -> None:
    """Sanity check before timing: an hpcrl flatten + unflatten_(scale) round trip is exactly grads * scale."""
    params = make_params(critic_shapes(64), torch.float32, device)
    expect = [p.grad.clone() / 4.0 for p in params]
    flat = torch.empty(sum(p.numel() for p in params), device=device)
    grads = [p.grad for p in params]
    ops.flatten(grads, out=flat)
    ops.unflatten_(flat, grads, 0.25)
    for g, e in zip(grads, expect):
        torch.testing.assert_close(g, e, rtol=0, atol=0)


def bench_grads(args, device, timing) -> list[dict[str, Any]]:
    configs = [("FastSAC critic", 768, torch.float32), ("10M", 2752, torch.float32)]
    if not args.quick:
        configs += [("10M", 2752, torch.float16), ("10M", 2752, torch.bfloat16)]
    rows = []
    for label, hidden, dtype in configs:
        params = make_params(critic_shapes(hidden), dtype, device)
        numel = sum(p.numel() for p in params)
        payload = numel * params[0].grad.element_size()
        res = measure_group(grad_cases(params), device, **timing)
        mem_t = res["memcpy"]["median_s"]
        for case, r in res.items():
            rows.append({
                "size": label, "hidden": hidden, "dtype": str(dtype).replace("torch.", ""),
                "tensors": len(params), "params": numel, "payload_bytes": payload, "case": case,
                **{k: r[k] for k in KEEP},
                "gbps": 4 * payload / r["median_s"] / 1e9,
                "vs_memcpy_bw": mem_t / r["median_s"],
                "hpcrl_speedup": r["median_s"] / res["hpcrl"]["median_s"],
                # the same two ratios from the fastest repeat and from process CPU time (less
                # sensitive to other processes on a shared machine; cpu is meaningful on 1 thread)
                "vs_memcpy_bw_min": res["memcpy"]["min_s"] / r["min_s"],
                "hpcrl_speedup_min": r["min_s"] / res["hpcrl"]["min_s"],
                "hpcrl_speedup_cpu": _div(r["cpu_median_s"], res["hpcrl"]["cpu_median_s"]),
                "vs_memcpy_bw_cpu": _div(res["memcpy"]["cpu_median_s"], r["cpu_median_s"]),
            })
        del params
    print_table(
        "Gradient flatten + unflatten(scale=1/W), no collective. GB/s = 4 x payload / time; "
        "'x hpcrl' = case time / hpcrl time",
        ["size", "dtype", "params", "tensors", "case", "median", "min-max", "cpu time", "GB/s", "bw / memcpy",
         "x hpcrl"],
        [[r["size"], r["dtype"], f"{r['params']:,}", r["tensors"], r["case"], fmt_time(r["median_s"]),
          f"{fmt_time(r['min_s'])} - {fmt_time(r['max_s'])}", _fmt_opt(r["cpu_median_s"]), f"{r['gbps']:.2f}",
          f"{r['vs_memcpy_bw']:.2f}", f"{r['hpcrl_speedup']:.2f}"] for r in rows])
    return rows


# ---------------------------------------------------------------------------------------------------
# 2. replay sample + gather
# ---------------------------------------------------------------------------------------------------


class HolosomaStyleReplay:
    """holosoma SimpleReplayBuffer semantics (docs/holosoma.md#replay-and-n-step-returns), critic observations left out.

    Storage env-major [n_env, T, dim] with obs and next_obs, dones/truncations int64; one extend()
    writes column ptr % T of every field. sample(k) returns n_env * k rows, env-major, k per env.
    """

    def __init__(self, n_env: int, T: int, n_obs: int, n_act: int, n_steps: int, gamma: float, device):
        self.n_env, self.T, self.n_obs, self.n_act = n_env, T, n_obs, n_act
        self.n_steps, self.gamma, self.device = n_steps, gamma, device
        f32 = dict(dtype=torch.float32, device=device)
        self.observations = torch.zeros(n_env, T, n_obs, **f32)
        self.next_observations = torch.zeros(n_env, T, n_obs, **f32)
        self.actions = torch.zeros(n_env, T, n_act, **f32)
        self.rewards = torch.zeros(n_env, T, **f32)
        self.dones = torch.zeros(n_env, T, dtype=torch.long, device=device)
        self.truncations = torch.zeros(n_env, T, dtype=torch.long, device=device)
        self.ptr = 0

    def extend(self, obs, action, reward, next_obs, done, trunc) -> None:
        col = self.ptr % self.T
        self.observations[:, col] = obs
        self.actions[:, col] = action
        self.rewards[:, col] = reward
        self.dones[:, col] = done
        self.truncations[:, col] = trunc
        self.next_observations[:, col] = next_obs
        self.ptr += 1

    @torch.no_grad()
    def sample(self, k: int) -> dict[str, torch.Tensor]:
        E, T, D, A, n = self.n_env, self.T, self.n_obs, self.n_act, self.n_steps
        if n == 1:
            idx = torch.randint(0, min(T, self.ptr), (E, k), device=self.device)
            i_obs = idx.unsqueeze(-1).expand(-1, -1, D)
            i_act = idx.unsqueeze(-1).expand(-1, -1, A)
            dones = torch.gather(self.dones, 1, idx).reshape(E * k)
            return {
                "observations": torch.gather(self.observations, 1, i_obs).reshape(E * k, D),
                "next_observations": torch.gather(self.next_observations, 1, i_obs).reshape(E * k, D),
                "actions": torch.gather(self.actions, 1, i_act).reshape(E * k, A),
                "rewards": torch.gather(self.rewards, 1, idx).reshape(E * k),
                "dones": dones,
                "truncations": torch.gather(self.truncations, 1, idx).reshape(E * k),
                "effective_n_steps": torch.ones_like(dones),
            }

        full = self.ptr >= T
        if full:  # mark the newest column as a cut point (unless done) while sampling
            head = self.ptr % T
            saved = self.truncations[:, head - 1].clone()
            self.truncations[:, head - 1] = torch.logical_not(self.dones[:, head - 1])
            idx = torch.randint(0, T, (E, k), device=self.device)
        else:
            idx = torch.randint(0, max(1, self.ptr - n + 1), (E, k), device=self.device)
        i_obs = idx.unsqueeze(-1).expand(-1, -1, D)
        i_act = idx.unsqueeze(-1).expand(-1, -1, A)
        obs = torch.gather(self.observations, 1, i_obs).reshape(E * k, D)
        act = torch.gather(self.actions, 1, i_act).reshape(E * k, A)

        win = (idx.unsqueeze(-1) + torch.arange(n, device=self.device).view(1, 1, -1)) % T  # [E, k, n]
        rew = torch.gather(self.rewards.unsqueeze(-1).expand(-1, -1, n), 1, win)
        done = torch.gather(self.dones.unsqueeze(-1).expand(-1, -1, n), 1, win)
        trunc = torch.gather(self.truncations.unsqueeze(-1).expand(-1, -1, n), 1, win)
        done_before = torch.cat([torch.zeros_like(done[:, :, :1]), done[:, :, :-1]], dim=2)
        mask = torch.cumprod(1.0 - done_before, dim=2)  # stop after the first done
        eff_n = mask.sum(2)
        disc = torch.pow(self.gamma, torch.arange(n, device=self.device))
        ret = (rew * mask * disc.view(1, 1, -1)).sum(dim=2)
        first_done = torch.argmax((done > 0).float(), dim=2)
        first_trunc = torch.argmax((trunc > 0).float(), dim=2)
        first_done = torch.where(done.sum(dim=2) == 0, n - 1, first_done)
        first_trunc = torch.where(trunc.sum(dim=2) == 0, n - 1, first_trunc)
        last = torch.minimum(first_done, first_trunc)
        last_col = torch.gather(win, 2, last.unsqueeze(-1)).squeeze(-1)  # [E, k]
        next_obs = self.next_observations.gather(1, last_col.unsqueeze(-1).expand(-1, -1, D))
        out = {
            "observations": obs,
            "actions": act,
            "rewards": ret.reshape(E * k),
            "dones": self.dones.gather(1, last_col).reshape(E * k),
            "truncations": self.truncations.gather(1, last_col).reshape(E * k),
            "next_observations": next_obs.reshape(E * k, D),
            "effective_n_steps": eff_n.reshape(E * k),
        }
        if full:
            self.truncations[:, head - 1] = saved
        return out


def fill(num_envs: int, capacity: int, device, seed: int = 0):
    """hpcrl shards for n = 1 and 3 and one holosoma-style buffer holding the same random stream."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    shard = ReplayShard(num_envs, capacity, OBS_DIM, ACT_DIM, n_step=1, gamma=GAMMA, device=device)
    holo = HolosomaStyleReplay(num_envs, capacity, OBS_DIM, ACT_DIM, 1, GAMMA, device)
    E = num_envs
    obs = torch.randn(E, OBS_DIM, generator=g).to(device)
    for _ in range(capacity + 37):  # wraps the ring once
        action = (torch.rand(E, ACT_DIM, generator=g) * 2 - 1).to(device)
        reward = torch.randn(E, generator=g).to(device)
        nxt = torch.randn(E, OBS_DIM, generator=g).to(device)
        u = torch.rand(E, generator=g).to(device)
        term = u < P_TERM
        trunc = (u >= P_TERM) & (u < P_TERM + P_TRUNC)
        shard.add(obs, action, reward, nxt, term, trunc)
        holo.extend(obs, action, reward, nxt, (term | trunc).long(), trunc.long())
        ended = (term | trunc).unsqueeze(1)
        obs = torch.where(ended, torch.randn(E, OBS_DIM, generator=g).to(device), nxt)
    # The same stored data read with 3-step returns: n_step is read-time configuration only, so the
    # n = 3 shard is loaded from the n = 1 shard's state (cheaper than a second round of add()).
    shard3 = ReplayShard(num_envs, capacity, OBS_DIM, ACT_DIM, n_step=3, gamma=GAMMA, device=device)
    shard3.load_state_dict({**shard.state_dict(), "n_step": 3})
    return {1: shard, 3: shard3}, holo


def bench_replay(args, device, timing) -> list[dict[str, Any]]:
    num_envs = 256
    storages = [("1e5", 391), ("1e6", 3907)]
    batches = [256, 8192, 65536]
    gen = torch.Generator(device=device).manual_seed(1)
    torch.manual_seed(1)  # the holosoma-style sampler draws from the global generator, like holosoma
    rows = []
    for label, capacity in storages:
        shards, holo = fill(num_envs, capacity, device)
        stored = len(shards[1])
        for n in (1, 3):
            shard = shards[n]
            for batch in batches:
                k = batch // num_envs
                holo.n_steps = n
                cases = {"hpcrl": lambda s=shard, b=batch: s.sample(b, gen),
                         "holosoma": lambda k=k: holo.sample(k)}
                res = measure_group(cases, device, **timing)
                h, b = res["hpcrl"], res["holosoma"]
                rows.append({
                    "stored": stored, "storage": f"{num_envs}x{capacity}", "n_step": n, "batch": batch,
                    "hpcrl": {x: h[x] for x in KEEP},
                    "holosoma": {x: b[x] for x in KEEP},
                    "speedup": b["median_s"] / h["median_s"],
                    "speedup_min": b["min_s"] / h["min_s"],
                    "speedup_cpu": _div(b["cpu_median_s"], h["cpu_median_s"]),
                    "hpcrl_rows_per_s": batch / h["median_s"],
                })
        del shards, holo
    print_table(
        "Replay sample + gather (+ n-step returns), obs 64, action 16, 256 envs; speedup = holosoma / hpcrl",
        ["stored", "n", "batch", "hpcrl median", "hpcrl min-max", "holosoma median", "holosoma min-max",
         "speedup", "cpu-time speedup", "hpcrl Mrows/s"],
        [[f"{r['stored']:.0e} ({r['storage']})", r["n_step"], r["batch"], fmt_time(r["hpcrl"]["median_s"]),
          f"{fmt_time(r['hpcrl']['min_s'])} - {fmt_time(r['hpcrl']['max_s'])}",
          fmt_time(r["holosoma"]["median_s"]),
          f"{fmt_time(r['holosoma']['min_s'])} - {fmt_time(r['holosoma']['max_s'])}",
          f"{r['speedup']:.2f}", _ratio_opt(r["holosoma"]["cpu_median_s"], r["hpcrl"]["cpu_median_s"]),
          f"{r['hpcrl_rows_per_s'] / 1e6:.2f}"] for r in rows])
    return rows


# ---------------------------------------------------------------------------------------------------


def targets(grad_rows, replay_rows) -> dict[str, Any]:
    """Issue 2's targets. value: ratio of medians (the one judged); value_min: ratio of the fastest
    repeats; value_cpu: ratio of median process CPU times."""

    def grad(size, case, dtype="float32"):
        return next(r for r in grad_rows if r["size"] == size and r["case"] == case and r["dtype"] == dtype)

    m, h = grad("10M", "hpcrl"), grad("FastSAC critic", "holosoma")
    out = {
        "flatten_unflatten_10M_bw_vs_memcpy": {"value": m["vs_memcpy_bw"], "value_min": m["vs_memcpy_bw_min"],
                                               "value_cpu": m["vs_memcpy_bw_cpu"], "target": 0.8},
        "flatten_unflatten_fastsac_vs_holosoma": {"value": h["hpcrl_speedup"], "value_min": h["hpcrl_speedup_min"],
                                                  "value_cpu": h["hpcrl_speedup_cpu"], "target": 2.0},
    }
    for r in replay_rows:
        if r["batch"] == 8192 and r["n_step"] == 3:
            out[f"replay_8192_n3_{r['stored']:.0e}_vs_holosoma"] = {
                "value": r["speedup"], "value_min": r["speedup_min"], "value_cpu": r["speedup_cpu"], "target": 5.0}
    for v in out.values():
        v["met"] = v["value"] >= v["target"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats, no fp16/bf16 (< 60 s on 2 CPU cores)")
    ap.add_argument("--json", default=None, help="output path (default benchmarks/results/kernels_<device>.json)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    args = ap.parse_args()

    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            sys.exit("--device cuda: torch.cuda.is_available() is False")
        if not ops.with_cuda():
            sys.exit(f"--device cuda: hpcrl._C is not built with CUDA (backend={ops.backend()}); "
                     "build with HPCRL_CUDA=1 pip install --no-build-isolation -e .")
    torch.set_num_threads(args.threads)
    timing = (dict(warmup=2, repeats=7, min_repeat_s=0.01) if args.quick
              else dict(warmup=3, repeats=21, min_repeat_s=0.05))

    info = machine_info(device, torch.get_num_threads())
    info["hpcrl_backend"] = ops.backend()
    info["hpcrl_with_cuda"] = ops.with_cuda()
    # Built with -fopenmp: without it the CPU kernels ignore --threads (at::parallel_for runs serially).
    info["hpcrl_openmp"] = bool(getattr(getattr(ops, "_C", None), "openmp", False))
    print(f"hpcrl kernels benchmark: {info['cpu_model']} ({info['cpu_count']} cpus), torch {info['torch']}, "
          f"threads {info['torch_threads']}, device {device}, hpcrl backend {info['hpcrl_backend']} "
          f"(openmp {'on' if info['hpcrl_openmp'] else 'off'}), load {info['loadavg_start']}, "
          f"{'quick' if args.quick else 'full'}")

    check_grad_ops(device)
    meter = OtherLoad()
    grad_rows = bench_grads(args, device, timing)
    info["other_load_cores_grad"] = meter.cores()
    meter = OtherLoad()
    replay_rows = bench_replay(args, device, timing)
    info["other_load_cores_replay"] = meter.cores()
    info["loadavg_end"] = loadavg()

    tg = targets(grad_rows, replay_rows)
    print("\nTargets:")
    for name, v in tg.items():
        extra = "" if v["value_cpu"] is None else f", cpu-time {v['value_cpu']:.2f}"
        print(f"  {name}: {v['value']:.2f} (target >= {v['target']}) {'MET' if v['met'] else 'MISSED'}"
              f"  [fastest repeats {v['value_min']:.2f}{extra}]")
    print(f"load average at end: {info['loadavg_end']}; cores kept busy by other processes: "
          f"{info['other_load_cores_grad']} (gradient part), {info['other_load_cores_replay']} (replay part)")

    path = args.json or os.path.join(RESULTS,
                                     f"kernels_{device.type}.json")
    write_json(path, {"benchmark": "kernels", "machine": info,
                      "args": {**vars(args), "timing": timing}, "targets": tg,
                      "grad": grad_rows, "replay": replay_rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
