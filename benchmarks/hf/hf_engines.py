#!/usr/bin/env python
"""Maker engines: ``--hf.engine hf`` (transformers' generate) vs ``vllm``, tokens/s and swap time per MiB.

    python benchmarks/hf/hf_engines.py [--quick] [--json PATH] [--reps 3] [--threads 1]

Each engine behind the makers' :class:`~hpcrl.ppo.workloads.engine.Engine` calls, so both include what a
maker gets back (responses and their behaviour log-probs). Random-init Llamas (built from a config and saved,
no download; head size 64, which vLLM's CPU attention runs) of two sizes, ``--batch`` prompts of uniformly
random length in [4, ``--prompt-tokens``], ``--new-tokens`` sampled at T = 1 (rows that reach EOS stop
early: lengths are ragged as in a run). One warm-up call each, then ``--reps`` rounds, the engines
interleaved; tokens/s = generated tokens / median wall time, and per CPU-second of this process (the
load-independent figure on a shared machine). ``swap_ms_per_mib``: ``load_weights`` of a new version of
every parameter (the ``hf`` engine copies into the actor; ``vllm`` reloads in place). The vLLM engine's start
is reported separately. Writes JSON (default ``benchmarks/results/hf_engines.json``). Needs vLLM
(``tools/setup_vllm_cpu.sh`` on CPU).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
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

SIZES = {"tiny": (128, 2, 2), "small": (256, 4, 4)}
"""name -> (hidden, layers, heads): head size 64."""


def build(out: Path, hidden: int, layers: int, heads: int, max_positions: int) -> Path:
    from transformers import AutoModelForCausalLM, LlamaConfig

    from hpcrl.ppo import demo_task as T

    words = [f"w{i}" for i in range(120)]
    tok = T.build_tokenizer(out, [" ".join(words)], "wordlevel", None)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=4 * hidden,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                         max_position_embeddings=max_positions, eos_token_id=tok.eos_token_id,
                         bos_token_id=tok.eos_token_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    return out


def engines(model_dir: Path, prompt_tokens: int, new_tokens: int):
    """(hf engine, vllm engine, their model, vLLM start seconds), both over the same maker model."""
    from hpcrl.ppo.workloads.hf_engine import HFEngine
    from hpcrl.ppo.workloads.hf_factory import HFModelFactory
    from hpcrl.ppo.workloads.hf_options import HFOptions
    from hpcrl.ppo.workloads.vllm_engine import VLLMEngine

    o = HFOptions(model=str(model_dir), engine="vllm", max_prompt_tokens=prompt_tokens, max_new_tokens=new_tokens)
    models = HFModelFactory(o)
    model = models.build(0, "cpu", critic=False)
    eos = model.actor.config.eos_token_id
    t0 = time.perf_counter()
    vllm = VLLMEngine(o, model, models, eos, torch.device("cpu"))
    start_s = time.perf_counter() - t0
    return HFEngine(model, models, eos, eos), vllm, model, start_s


def timed(call) -> tuple[float, float, object]:
    t0, c0 = time.perf_counter(), time.process_time()
    out = call()
    return time.perf_counter() - t0, time.process_time() - c0, out


def swap_ms_per_mib(engine, model, version: int) -> float:
    fresh = [(n, p.detach().clone() + 1e-3) for n, p in model.actor.named_parameters()]
    mib = sum(t.numel() * t.element_size() for _, t in fresh) / 2**20
    wall, _, _ = timed(lambda: engine.load_weights(fresh, version))
    return 1e3 * wall / mib


def run_size(name: str, args, limit: int, new: int, reps: int) -> dict:
    from hpcrl.ppo.workloads.engine import SamplingParams

    hidden, layers, heads = SIZES[name]
    with tempfile.TemporaryDirectory() as d:
        hf, vllm, model, start_s = engines(build(Path(d), hidden, layers, heads, limit + new), limit, new)
        g = torch.Generator().manual_seed(0)
        vocab = model.actor.config.vocab_size
        prompts = [torch.randint(2, vocab, (int(n),), generator=g).tolist()
                   for n in torch.randint(4, limit + 1, (args.batch,), generator=g)]
        params = SamplingParams(max_new_tokens=new)
        both = {"hf": hf, "vllm": vllm}
        wall: dict[str, list[float]] = {k: [] for k in both}
        cpu: dict[str, list[float]] = {k: [] for k in both}
        tokens: dict[str, list[int]] = {k: [] for k in both}
        for e in both.values():  # warm-up
            e.generate(prompts, params, 0)
        for r in range(reps):
            for k in (list(both) if r % 2 == 0 else list(both)[::-1]):
                w, c, gen = timed(lambda: both[k].generate(prompts, params, r + 1))
                wall[k].append(w)
                cpu[k].append(c)
                tokens[k].append(int(gen.tokens.numel()))
        swaps = {k: [swap_ms_per_mib(e, model, v) for v in (1, 2, 3)] for k, e in both.items()}
        vllm.close()
    n = {k: statistics.mean(v) for k, v in tokens.items()}
    row = {"model": name, "hidden": hidden, "layers": layers, "vllm_start_s": start_s}  # the headline first
    row |= {f"{k}_tok_per_cpu_s": n[k] / statistics.median(cpu[k]) for k in both}
    row |= {f"{k}_tok_s": n[k] / statistics.median(wall[k]) for k in both}
    row |= {f"{k}_swap_ms_per_mib": statistics.median(swaps[k]) for k in both}
    row |= {"batch": args.batch, "prompt_tokens": limit, "new_tokens": new}
    row |= {f"{k}_mean_response": n[k] / args.batch for k in both}
    return row | {f"{k}_{what}": times[k] for k in both for what, times in (("wall", wall), ("cpu", cpu))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--quick", action="store_true", help="the tiny model only, 8 prompts x 8 tokens, 1 rep")
    ap.add_argument("--json", default=str(RESULTS / "hf_engines.json"))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=48)
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args(argv)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    torch.set_num_threads(args.threads)
    if args.quick:
        args.batch = 8
    sizes, limit, new, reps = ((["tiny"], 8, 8, 1) if args.quick else
                               (list(SIZES), args.prompt_tokens, args.new_tokens, args.reps))
    rows = [run_size(s, args, limit, new, reps) for s in sizes]
    info = machine_info("cpu", args.threads)
    info["loadavg_end"] = loadavg()
    path = write_json(args.json, {"benchmark": "hf_engines", "machine": info, "reps": reps, "rows": rows})
    print_table("maker engines, tokens/s (median wall | per CPU-second), swap ms/MiB",
                ["model", "hf tok/s", "vllm tok/s", "hf tok/CPU-s", "vllm tok/CPU-s", "hf swap", "vllm swap",
                 "vllm start s"],
                [[f"{r['model']} ({r['hidden']}x{r['layers']})", f"{r['hf_tok_s']:.0f}", f"{r['vllm_tok_s']:.0f}",
                  f"{r['hf_tok_per_cpu_s']:.0f}", f"{r['vllm_tok_per_cpu_s']:.0f}", f"{r['hf_swap_ms_per_mib']:.2f}",
                  f"{r['vllm_swap_ms_per_mib']:.2f}", f"{r['vllm_start_s']:.1f}"] for r in rows])
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
