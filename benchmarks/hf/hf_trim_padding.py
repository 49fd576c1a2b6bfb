#!/usr/bin/env python
"""Trainer update of the ``hf`` workload padded, trimmed (``--ppo.trim-padding``) or packed
(``--ppo.pack-sequences``): tokens/s and padding.

    python benchmarks/hf/hf_trim_padding.py [--quick] [--json PATH] [--reps 3] [--threads 1] [--device cpu|cuda]
                                         [--budget 256]

One random-init Llama (4 layers, hidden 256; built here, no download) and its word-level tokenizer;
prompts of 1 to 12 words left-padded to 16 tokens, responses sampled up to 48 tokens (the random model
emits EOS at random, so lengths vary). The makers' work is done once: the same experience batches go
through every variant, and the variants run interleaved ``--reps`` times, each from the same initial
weights: padded (as before), trimmed or packed, each with the whole minibatch per forward,
micro-batches of 4, or micro-batches of at most ``--budget`` computed token positions
(``--hf.micro-batch-tokens``: 4 padded rows' worth by default; trimmed and packed pieces are ordered by
length first). Per variant: the median of the
learner's own ``trainer_tokens_per_s`` (real tokens x epochs / update wall time) and the padding share
of the computed token positions (``padding_frac`` padded, ``trimmed_padding_frac`` /
``packed_padding_frac``), which does not depend on timing. Writes JSON (default ``benchmarks/results/hf_trim_padding.json``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
for p in (HERE, REPO):  # this folder's modules; the repository's benchmarks.common and hpcrl
    if p not in sys.path:
        sys.path.insert(0, p)
from benchmarks.common.paths import RESULTS  # noqa: E402
from benchmarks.common.timing import loadavg, machine_info, print_table, write_json  # noqa: E402

WORDS = ["yes", "no", "red", "blue", "green", "cat", "dog", "bird", "one", "two", "three", "four", "sun", "moon"]


def reward(prompts: list[str], responses: list[str]) -> list[float]:
    """Share of the response's words that are "yes" (the benchmark's reward; its value does not matter)."""
    return [sum(w == "yes" for w in r.split()) / max(len(r.split()), 1) for r in responses]


def build(out: Path, hidden: int, layers: int) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    from hpcrl.ppo import demo_task as T

    rng = random.Random(0)
    corpus = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 10))) for _ in range(300)]
    tok = T.build_tokenizer(out, corpus)
    eos = tok.eos_token_id
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128, eos_token_id=eos,
                      bos_token_id=eos, tie_word_embeddings=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    with open(out / "prompts.jsonl", "w") as f:
        for i in range(64):
            f.write(json.dumps({"prompt": " ".join(rng.choice(WORDS) for _ in range(1 + i % 12))}) + "\n")


MODES = {"padded": {}, "trimmed": {"trim_padding": True}, "packed": {"pack_sequences": True}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--quick", action="store_true", help="2 layers, hidden 64, 1 rep (CI)")
    ap.add_argument("--json", default=str(RESULTS / "hf_trim_padding.json"))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--budget", type=int, default=4 * 64, help="--hf.micro-batch-tokens of the budget variants")
    args = ap.parse_args(argv)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    torch.set_num_threads(args.threads)
    from hpcrl.comm import GradAverager, Plane
    from hpcrl.ppo.workloads.hf import HFWorkload

    hidden, layers, reps = (64, 2, 1) if args.quick else (256, 4, args.reps)
    device = torch.device(args.device)
    info = machine_info(device, args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        build(out, hidden, layers)
        common = dict(model=str(out), prompts=str(out / "prompts.jsonl"), reward_fn="hf_trim_padding:reward",
                      max_prompt_tokens=16, max_new_tokens=48, batch_size=args.batch)
        micros = {None: {}, 4: {"micro_batch_size": 4}, f"{args.budget} tok": {"micro_batch_tokens": args.budget}}
        wls = {micro: HFWorkload(**common, **kw) for micro, kw in micros.items()}
        model = wls[None].build_model(0, device)
        collector = wls[None].make_collector(11, device)
        gen = torch.Generator().manual_seed(2)
        batch = collector.collect(model, gen)[0]
        init = {k: v.detach().clone() for k, v in model.state_dict().items()}
        variants = [(mode, micro) for micro in micros for mode in MODES]
        runs: dict[tuple[str, int | str | None], list[dict[str, float]]] = {v: [] for v in variants}
        for _ in range(reps + 1):  # the first round warms up (not counted)
            for mode, micro in variants:
                wl = wls[micro]
                model.load_state_dict(init)
                cfg = dataclasses.replace(wl.default_config(), **MODES[mode])
                learner = wl.make_learner(model, cfg, GradAverager([p for p in model.parameters() if p.requires_grad],
                                                                   plane=Plane.local("device", device)))
                runs[mode, micro].append(learner.update([batch], torch.Generator().manual_seed(5)))
        rows, results = [], []
        for (mode, micro), hist in runs.items():
            hist = hist[1:]
            tps = statistics.median(h["trainer_tokens_per_s"] for h in hist)
            pad = hist[0].get(f"{mode}_padding_frac")  # padded: the batch's own share, below
            results.append({"forward": mode, "micro_batch_size": micros[micro].get("micro_batch_size"),
                            "micro_batch_tokens": micros[micro].get("micro_batch_tokens"), "trainer_tokens_per_s": tps,
                            "trainer_tokens_per_s_all": [h["trainer_tokens_per_s"] for h in hist],
                            "computed_padding_frac": pad, "policy_loss": hist[0]["policy_loss"]})
        # the untrimmed share of padding positions: every forward computes P + G columns per sequence
        real = float(batch["attention_mask"].sum())
        full_pad = 1.0 - real / batch["attention_mask"].numel()
        for r in results:
            if r["computed_padding_frac"] is None:
                r["computed_padding_frac"] = full_pad
            micro = r["micro_batch_size"] or (f"{r['micro_batch_tokens']} tok" if r["micro_batch_tokens"] else "-")
            rows.append([r["forward"], micro, f"{r['trainer_tokens_per_s']:.0f}",
                         f"{r['computed_padding_frac']:.3f}", f"{r['policy_loss']:.6f}"])
        mask = batch["action_mask"]
        info["loadavg_end"] = loadavg()
        payload = {"benchmark": "hf_trim_padding", "machine": info,
                   "setup": {"hidden": hidden, "layers": layers, "batch": args.batch, "max_prompt_tokens": 16,
                             "max_new_tokens": 48, "reps": reps, "epochs": wls[None].default_config().epochs,
                             "minibatches": wls[None].default_config().minibatches,
                             "response_len_mean": float(mask.sum(-1).float().mean()),
                             "prompt_len_mean": float(batch["attention_mask"][:, :16].sum(-1).float().mean())},
                   "results": results}
    print_table(f"hf trainer update, {layers} layers x {hidden} ({args.device}, {args.threads} thread(s))",
                ["forward", "micro", "tokens/s", "padding share", "policy_loss"], rows)
    path = write_json(args.json, payload)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
