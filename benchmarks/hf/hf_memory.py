#!/usr/bin/env python
"""Peak host memory per trainer of the ``hf`` workload: the sharded load (meta init, each trainer reads
its own rows) against the full-model path, for N = 1, 2, 4 trainers, and a run under a memory cap.

    python benchmarks/hf/hf_memory.py [--quick] [--json PATH] [--layers 16] [--hidden 512] [--trainers 1 2 4]

Each trainer is a real rank (gloo) that builds its :class:`hpcrl.ppo.replica.Replica` exactly as
``python -m hpcrl.ppo --workload hf`` does (``Replica.build``: the workload, the strategy, the learner) and
runs one real GRPO update (``HFLearner.update``: forward, backward, FSDP reduce-scatter, Adam step) on a
synthetic batch of the collector's format. GRPO: the actor alone (no critic trunk), so the model part is
one model. No makers: they are not trainers (they hold a full actor; see the README).

Modes: ``sharded`` (``--strategy fsdp``, built on ``meta``, shards read from the safetensors),
``full`` (``--strategy fsdp`` as before this change: every trainer builds the whole model in host memory,
then ``fully_shard`` cuts it) and ``ddp`` (every trainer holds everything; N = 1 only, the reference).

Measured per rank, from ``/proc/self/status``: ``VmHWM`` (peak resident set) is reset
(``/proc/self/clear_refs`` = 5) after the imports and the process group, so ``model part`` = peak - the
resident set at that point = what the build and the update added. ``--cap-mib M`` sets each rank's
``RLIMIT_DATA`` to its data size at that point + M MiB (a per-process cap on what it may allocate):
the capped rows show which paths fit.

The model: a random Llama of ``--layers`` x ``--hidden`` (vocab 4096, untied) saved with
``save_pretrained`` to a temporary directory (fp32 safetensors), the tokenizer of ``tests/hf_fixtures``.
Writes JSON (default ``benchmarks/results/hf_memory.json``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import resource
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
for p in (HERE, REPO, os.path.join(REPO, "tests")):
    if p not in sys.path:
        sys.path.insert(0, p)

MIB = 1 << 20


def status() -> dict[str, float]:
    """VmHWM / VmRSS / VmData of this process in MiB (``/proc/self/status``)."""
    out = {}
    for line in open("/proc/self/status"):
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS", "VmData"):
            out[key] = int(value.split()[0]) / 1024
    return out


def build_model_dir(out: Path, layers: int, hidden: int, vocab: int = 4096, seed: int = 0) -> tuple[Path, int]:
    """A random Llama saved with save_pretrained (fp32 safetensors) and the fixtures' tokenizer; returns
    the directory and its parameter count."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    import hf_fixtures as F

    tok = F.build_tokenizer(out)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=int(hidden * 2.75) // 64 * 64,
                      num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
                      num_key_value_heads=max(1, hidden // 128), max_position_embeddings=64,
                      eos_token_id=tok.eos_token_id, bos_token_id=tok.eos_token_id, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    n = sum(p.numel() for p in model.parameters())
    model.save_pretrained(out)
    del model
    return out, n


def _batch(vocab: int, sequences: int, prompt: int, response: int, seed: int) -> dict[str, Any]:
    """A batch in the collector's format (random tokens; uniform behaviour / reference log-probs)."""
    import math

    import torch

    g = torch.Generator().manual_seed(seed)
    shape = (sequences, response)
    return {"tokens": torch.randint(2, vocab, (sequences, prompt + response), generator=g),
            "attention_mask": torch.ones(sequences, prompt + response, dtype=torch.long),
            "action_mask": torch.ones(shape), "behaviour_logp": torch.full(shape, -math.log(vocab)),
            "ref_logp": torch.full(shape, -math.log(vocab)), "score": torch.rand(sequences, generator=g),
            "maker_tokens_per_s": torch.ones(sequences)}


def rank_main(model_dir: str, warm_dir: str, prompts: str, mode: str, lora: int,
              cap_mib: float | None, checkpointing: bool = False) -> dict[str, Any]:
    """One trainer: Replica.build + one update; its memory figures (or how it failed under the cap)."""
    import torch.distributed as dist

    from hpcrl.comm import init_distributed, new_plane, shutdown
    from hpcrl.ppo.replica import Replica
    from hpcrl.ppo.workloads.hf import HFWorkload

    ctx = init_distributed(timeout_s=600)
    if not dist.is_initialized():  # one rank: hpcrl starts no process group (a real run has makers too)
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        plane = new_plane("device", range(ctx.world_size), ctx.rank, ctx.device, "gloo", ctx.timeout)
        cfg = SimpleNamespace(seed=0, strategy="ddp" if mode == "ddp" else "fsdp", offload=False,
                              trainer_dtype="fp32")

        def workload(path: str) -> Any:
            wl = HFWorkload(model=path, prompts=prompts, reward_fn="hf_fixtures:target_fraction", algo="grpo",
                            group_size=2, batch_size=2, max_prompt_tokens=8, max_new_tokens=8, lora_rank=lora,
                            gradient_checkpointing=checkpointing)
            if mode == "full":  # the path before the sharded load: build everything, then shard
                full = dataclasses.replace(wl.capabilities(), builds_on_meta=False)
                wl.capabilities = lambda: full
            return wl

        # the same path once on the tests' tiny model first: what any run imports or allocates once
        # (modeling code, FSDP and autograd's first calls, gloo buffers) is not the model's part
        tiny = workload(warm_dir)
        warm = Replica.build(cfg, tiny, tiny.default_config(), plane, ctx.device, ctx.rank)
        warm.learner.update([_batch(len(tiny.task.tokenizer), 4, 8, 8, seed=1)], warm.generator)
        del warm, tiny
        wl = workload(model_dir)
        ppo = wl.default_config()
        batch = _batch(len(wl.task.tokenizer), 4, 8, 8, seed=1)
        with open("/proc/self/clear_refs", "w") as f:  # VmHWM := VmRSS: the peak from here on
            f.write("5")
        base = status()
        if cap_mib is not None:
            limit = int((base["VmData"] + cap_mib) * MIB)
            resource.setrlimit(resource.RLIMIT_DATA, (limit, resource.getrlimit(resource.RLIMIT_DATA)[1]))
        t0 = time.perf_counter()
        try:
            replica = Replica.build(cfg, wl, ppo, plane, ctx.device, ctx.rank)
            built = status()
            t1 = time.perf_counter()
            stats = replica.learner.update([batch], replica.generator)
            after = status()
        except (MemoryError, RuntimeError) as err:  # the cap: an allocation refused
            line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            return {"rank": ctx.rank, "ok": False, "error": f"{type(err).__name__}: {line[:200]}",
                    "base_rss_mib": base["VmRSS"], "peak_rss_mib": status()["VmHWM"]}
        local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in replica.model.parameters())
        return {"rank": ctx.rank, "ok": True, "base_rss_mib": base["VmRSS"], "build_peak_mib": built["VmHWM"],
                "peak_rss_mib": after["VmHWM"], "model_part_mib": after["VmHWM"] - base["VmRSS"],
                "build_part_mib": built["VmHWM"] - base["VmRSS"], "local_params": local,
                "build_s": t1 - t0, "update_s": time.perf_counter() - t1,
                "grad_norm": float(stats["grad_norm"]), "ru_maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    finally:
        shutdown()


def run(model_dir: Path, prompts: Path, mode: str, n: int, lora: int = 0, cap_mib: float | None = None,
        timeout_s: float = 900, checkpointing: bool = False) -> dict[str, Any]:
    """``n`` trainer ranks of ``mode``; the ranks' rows, or the first failure's line."""
    from hpcrl.comm import spawn
    from hpcrl.comm.spawn_errors import SpawnError

    import hf_fixtures as F

    warm_dir = Path(model_dir).parent / "warm_up_model"
    if not (warm_dir / "config.json").is_file():
        F.build_causal_lm(warm_dir)
    t0 = time.perf_counter()
    try:
        ranks = spawn(rank_main, n, args=(str(model_dir), str(warm_dir), str(prompts), mode, lora, cap_mib,
                                          checkpointing), timeout_s=timeout_s)
    except SpawnError as err:
        return {"mode": mode, "trainers": n, "lora": lora, "cap_mib": cap_mib, "checkpointing": checkpointing, "ok": False,
                "error": str(err).strip().splitlines()[0][:300], "wall_s": time.perf_counter() - t0}
    ok = all(r["ok"] for r in ranks)
    return {"mode": mode, "trainers": n, "lora": lora, "cap_mib": cap_mib, "checkpointing": checkpointing, "ok": ok,
            "ranks": ranks,
            "max_peak_rss_mib": max(r["peak_rss_mib"] for r in ranks),
            "max_model_part_mib": max(r.get("model_part_mib", float("nan")) for r in ranks),
            "wall_s": time.perf_counter() - t0, "loadavg": os.getloadavg()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--quick", action="store_true", help="a 4-layer hidden-256 model, N = 1 and 2, no cap run")
    ap.add_argument("--json", default=str(Path(REPO) / "benchmarks" / "results" / "hf_memory.json"))
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--trainers", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--cap-trainers", type=int, default=4, help="trainers of the capped runs")
    ap.add_argument("--cap-frac", type=float, default=0.85,
                    help="the cap: this fraction of the fp32 model's size, above each rank's own start")
    ap.add_argument("--cap-only", action="store_true", help="only the capped runs (full and sharded, LoRA)")
    args = ap.parse_args(argv)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from benchmarks.common.timing import machine_info, write_json

    import hf_fixtures as F

    if args.quick:
        args.layers, args.hidden, args.trainers = 4, 256, [1, 2]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="hf_memory_") as tmp:
        model_dir, params = build_model_dir(Path(tmp) / "model", args.layers, args.hidden)
        prompts = F.write_prompts(Path(tmp) / "prompts.jsonl", n=8)
        model_mib = params * 4 / MIB
        print(f"model: {args.layers} layers x hidden {args.hidden}: {params / 1e6:.1f}M parameters, "
              f"{model_mib:.0f} MiB fp32", flush=True)
        # sharded at every N; the references: ddp at N = 1 and the full-build path at the largest N
        plan = ([] if args.cap_only else [("sharded", n, 0, None) for n in args.trainers] + [("ddp", 1, 0, None)]
                + [("full", max(args.trainers), 0, None)])
        if not args.quick:  # LoRA: the optimizer state is the adapters', so the cap is about the weights;
            # gradient checkpointing, as a run short of memory would: activations of one layer at a time
            cap = args.cap_frac * model_mib
            plan += [(m, args.cap_trainers, 8, cap) for m in ("full", "sharded")]
        for mode, n, lora, cap in plan:
            row = run(model_dir, prompts, mode, n, lora, cap, checkpointing=cap is not None)
            rows.append(row)
            print(f"{mode:8s} N={n} lora={lora} cap={'-' if cap is None else f'{cap:.0f} MiB'}: "
                  + (f"peak RSS {row['max_peak_rss_mib']:.0f} MiB, model part {row['max_model_part_mib']:.0f} MiB"
                     if row["ok"] else f"FAILED ({row.get('error') or [r.get('error') for r in row['ranks']]})")
                  + f"  [{row['wall_s']:.0f} s, load {os.getloadavg()[0]:.1f}]", flush=True)
    payload = {"benchmark": "hf_memory", "machine": machine_info("cpu", 1),
               "model": {"layers": args.layers, "hidden": args.hidden, "params": params, "fp32_mib": model_mib},
               "rows": rows}
    path = write_json(args.json, payload)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
