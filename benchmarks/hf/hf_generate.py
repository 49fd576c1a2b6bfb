#!/usr/bin/env python
"""Maker generation: transformers ``generate`` with the KV cache vs a recompute-every-token loop.

    python benchmarks/hf/hf_generate.py [--quick] [--json PATH] [--reps 3] [--threads 1] [--device cpu|cuda]

Both paths are the ``hf`` workload's (:mod:`hpcrl.ppo.workloads.hf_generate`): :func:`generate`
(``model.generate``, KV cache, sampling) and :func:`generate_recompute` (one full forward over the
whole sequence per new token, what the in-house ``lm`` workload does). Same random-init Llama (built
from a config, no download), same left-padded prompt batch, same sampling parameters; EOS is an id
the model cannot emit, so every row generates exactly ``new_tokens`` tokens and the two paths do the
same amount of sampling work. Per (model size, new tokens): one warm-up call of each, then ``--reps``
interleaved calls; the median wall time gives tokens/s = batch x new_tokens / time. The tiny model
(2 layers, hidden 64) is the tests' model; ``small`` (4 layers, hidden 256) shows how the gap grows
with width. Writes JSON (default ``benchmarks/results/hf_generate.json``).
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
from benchmarks.common.timing import machine_info, print_table, write_json  # noqa: E402

SIZES = {"tiny": dict(hidden=64, layers=2, heads=4), "small": dict(hidden=256, layers=4, heads=8)}


def build(size: str, vocab: int, positions: int, device: str):
    from transformers import AutoModelForCausalLM, LlamaConfig

    s = SIZES[size]
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=s["hidden"], intermediate_size=2 * s["hidden"],
                      num_hidden_layers=s["layers"], num_attention_heads=s["heads"], num_key_value_heads=s["heads"],
                      max_position_embeddings=positions, eos_token_id=0, bos_token_id=0)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).to(device).eval()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--quick", action="store_true", help="tiny model, 16 new tokens, 1 rep (CI)")
    ap.add_argument("--json", default=str(RESULTS / "hf_generate.json"))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=16)
    args = ap.parse_args(argv)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from hpcrl.ppo.workloads.hf import left_pad
    from hpcrl.ppo.workloads.hf_generate import SamplingParams, generate, generate_recompute

    torch.set_num_threads(args.threads)
    vocab = 128
    never = vocab  # the EOS id: outside the vocabulary, so no row stops early
    grid = [("tiny", 16)] if args.quick else [("tiny", 16), ("tiny", 64), ("small", 16), ("small", 64)]
    reps = 1 if args.quick else args.reps
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, never, (int(n),), generator=g).tolist()
               for n in torch.randint(args.prompt_tokens // 2, args.prompt_tokens + 1, (args.batch,), generator=g)]
    ids, mask = left_pad(prompts, args.prompt_tokens, pad_id=0)
    ids, mask = ids.to(args.device), mask.long().to(args.device)
    rows = []
    for size, new in grid:
        model = build(size, vocab, args.prompt_tokens + new, args.device)
        params = SamplingParams(max_new_tokens=new)
        calls = {"kv_cache": lambda: generate(model, ids, mask, params, never, 0, seed=1),
                 "recompute": lambda: generate_recompute(model, ids, mask, params, never, 0,
                                                         torch.Generator().manual_seed(1))}
        times: dict[str, list[float]] = {k: [] for k in calls}
        for k, fn in calls.items():  # warm-up
            fn()
        for r in range(reps):
            for k in (list(calls) if r % 2 == 0 else list(calls)[::-1]):
                t0 = time.perf_counter()
                resp, am = calls[k]()
                times[k].append(time.perf_counter() - t0)
                assert int(am.sum()) == args.batch * new, "a row stopped early"
        med = {k: statistics.median(v) for k, v in times.items()}
        row = {"model": size, **SIZES[size], "batch": args.batch, "prompt_tokens": args.prompt_tokens,
               "new_tokens": new, "kv_cache_tok_s": args.batch * new / med["kv_cache"],
               "recompute_tok_s": args.batch * new / med["recompute"], "kv_cache_s": med["kv_cache"],
               "recompute_s": med["recompute"], "speedup": med["recompute"] / med["kv_cache"],
               "times": times}
        rows.append(row)
    payload = {"benchmark": "hf_generate", "machine": machine_info(args.device, args.threads), "reps": reps,
               "rows": rows}
    path = write_json(args.json, payload)
    print_table("maker generation, tokens/s (median)", ["model", "new tokens", "KV cache", "recompute", "speedup"],
                [[r["model"], r["new_tokens"], f"{r['kv_cache_tok_s']:.0f}", f"{r['recompute_tok_s']:.0f}",
                  f"{r['speedup']:.2f}x"] for r in rows])
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
