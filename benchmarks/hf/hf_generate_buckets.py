#!/usr/bin/env python
"""Maker generation in length buckets (``--hf.generate-buckets K``) vs one call, on prompts of varied length.

    python benchmarks/hf/hf_generate_buckets.py [--quick] [--json PATH] [--reps 3] [--threads 1] [--device cpu|cuda]

The ``hf`` workload's :func:`~hpcrl.ppo.workloads.hf_generate.generate_by_length` with K = 1 (one
``model.generate`` call over the batch, from its longest prompt), 2 and 4 (rows ordered by prompt length,
each sub-batch from its own longest prompt). A random-init Llama (4 layers, hidden 256; built from a config,
no download), ``--batch`` prompts of uniformly random length in [4, P] left-padded to P, for P in
``--prompt-tokens``; EOS is an id the model cannot emit, so every row generates ``--new-tokens`` tokens and
the variants do the same sampling work. One warm-up call each, then ``--reps`` rounds, the variants
interleaved; tokens/s = batch x new tokens / median wall time. Writes JSON (default
``benchmarks/results/hf_generate_buckets.json``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
for p in (HERE, REPO):  # this folder's modules; the repository's benchmarks.common and hpcrl
    if p not in sys.path:
        sys.path.insert(0, p)
from benchmarks.common.paths import RESULTS  # noqa: E402
from benchmarks.common.timing import loadavg, machine_info, print_table, write_json  # noqa: E402
from hf_generate import build  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--quick", action="store_true", help="tiny model, P = 32, 8 new tokens, 1 rep (CI)")
    ap.add_argument("--json", default=str(RESULTS / "hf_generate_buckets.json"))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-tokens", default="64,256", help="prompt limits P, comma-separated")
    ap.add_argument("--new-tokens", type=int, default=32)
    args = ap.parse_args(argv)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from hpcrl.ppo.workloads.hf_generate import SamplingParams, generate_by_length, left_pad

    torch.set_num_threads(args.threads)
    size, limits, new, reps = ("tiny", [32], 8, 1) if args.quick else (
        "small", [int(p) for p in args.prompt_tokens.split(",")], args.new_tokens, args.reps)
    vocab, buckets = 128, (1, 2, 4)
    never = vocab  # the EOS id: outside the vocabulary, so no row stops early
    params = SamplingParams(max_new_tokens=new)
    rows = []
    for limit in limits:
        g = torch.Generator().manual_seed(0)
        lengths = torch.randint(4, limit + 1, (args.batch,), generator=g)
        prompts = [torch.randint(1, never, (int(n),), generator=g).tolist() for n in lengths]
        ids, mask = (t.to(args.device) for t in left_pad(prompts, limit, pad_id=0))
        model = build(size, vocab, limit + new, args.device)
        call = lambda k: generate_by_length(model, ids, mask.long(), params, never, 0, 1, k)  # noqa: E731
        times: dict[int, list[float]] = {k: [] for k in buckets}
        for k in buckets:  # warm-up
            call(k)
        for r in range(reps):
            for k in (buckets if r % 2 == 0 else buckets[::-1]):
                t0 = time.perf_counter()
                _, am = call(k)
                times[k].append(time.perf_counter() - t0)
                assert int(am.sum()) == args.batch * new, "a row stopped early"
        med = {k: statistics.median(v) for k, v in times.items()}
        rows.append({"model": size, "batch": args.batch, "prompt_tokens": limit, "new_tokens": new,
                     "prompt_len_mean": float(lengths.float().mean()),
                     **{f"buckets_{k}_tok_s": args.batch * new / med[k] for k in buckets},
                     **{f"buckets_{k}_vs_1": med[1] / med[k] for k in buckets[1:]}, "times": times})
    info = machine_info(args.device, args.threads)
    info["loadavg_end"] = loadavg()
    path = write_json(args.json, {"benchmark": "hf_generate_buckets", "machine": info, "reps": reps, "rows": rows})
    print_table(f"maker generation in length buckets, {size} model, tokens/s (median)",
                ["prompt limit", "mean prompt", "1 call", "2 buckets", "4 buckets"],
                [[r["prompt_tokens"], f"{r['prompt_len_mean']:.0f}", f"{r['buckets_1_tok_s']:.0f}",
                  f"{r['buckets_2_tok_s']:.0f} ({r['buckets_2_vs_1']:.2f}x)",
                  f"{r['buckets_4_tok_s']:.0f} ({r['buckets_4_vs_1']:.2f}x)"] for r in rows])
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
