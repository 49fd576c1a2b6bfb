#!/usr/bin/env python
"""Experience on the wire: the ``hf`` workload's batch padded (every field whole) vs packed (each row's span).

    python benchmarks/hf/wire_packing.py [--quick] [--json PATH] [--threads 1] [--device cpu|cuda] [--batch 64]
                                         [--prompt-tokens 64] [--episode-tokens 512] [--repeats 9]

Two batches laid out by the workload's own :func:`~hpcrl.ppo.workloads.rollout.layout` (random tokens and
log-probs, ``ref_logp`` from the makers, the collector's fixed fields), sent as the maker sends them
(:func:`~hpcrl.ppo.workloads.rollout.wire_spans`):

* single-turn: ``--batch`` prompts of uniform length in [1, P], responses of uniform length in [1, E];
* multi-turn: the same prompts, episodes of uniform length in [1, E] cut into up to 7 alternating policy and
  observation segments (``turn_reward`` and ``episode_info`` as well).

Per batch: bytes padded (the schema without declarations: what every batch took before) and packed, and the
size the spans' real values predict; pack and unpack time of both (``common.timing.measure_group``, repeats
interleaved); whether the packed batch came back bit for bit; the trainer's padding share of computed token
positions, padded to P + E and with ``--ppo.trim-padding`` / ``--ppo.pack-sequences`` as the learner itself
reports it (``trimmed_padding_frac`` / ``packed_padding_frac``, as in ``hf_trim_padding.py``: one update of a
tiny random Llama on the unpacked batch, its turns' fields left out). Writes JSON (default
``benchmarks/results/hf_wire_packing.json``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
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
from benchmarks.common.timing import loadavg, machine_info, measure_group, print_table, write_json  # noqa: E402
from hf_trim_padding import WORDS  # noqa: E402
from hpcrl.ppo.wire import Schema  # noqa: E402
from hpcrl.ppo.workloads.rollout import Trace, layout, wire_spans  # noqa: E402

PAD = 1  # the benchmark tokenizer's EOS, which pads


def episode(rng: random.Random, gen: torch.Generator, P: int, E: int, vocab: int, turns: bool) -> Trace:
    """A prompt of 1..P tokens, then 1..E tokens: one response, or alternating response / observation pieces."""
    t = Trace(torch.randint(2, vocab, (rng.randint(1, P),), generator=gen).tolist())
    total = rng.randint(1, E)
    pieces = min(total, rng.choice([1, 3, 5, 7]) if turns else 1)
    cuts = [0, *sorted(rng.sample(range(1, total), pieces - 1)), total]
    for i, (a, b) in enumerate(zip(cuts, cuts[1:])):
        policy = i % 2 == 0
        t.add(torch.randint(2, vocab, (b - a,), generator=gen), -torch.rand(b - a, generator=gen) if policy else None)
        if policy:
            t.turns += 1
            t.rewards.append((t.length - 1, rng.random()))
    return t


def batch_of(traces: list[Trace], P: int, E: int, turns: bool, gen: torch.Generator, device: torch.device):
    """The collector's batch of ``traces`` (on ``device``), its stats and its declaration."""
    batch = layout(traces, P, E, PAD)
    if turns:
        batch["episode_info"] = torch.tensor([t.info() for t in traces])
    else:
        batch.pop("turn_reward")
    batch["score"] = torch.randn(len(traces), generator=gen)
    batch["maker_tokens_per_s"] = torch.tensor([1000.0])
    batch["ref_logp"] = (-torch.rand(len(traces), E, generator=gen)).masked_fill(batch["action_mask"] == 0, 0.0)
    sent = ("action_mask", "behaviour_logp", *(("turn_reward",) if turns else ()), "ref_logp")
    stats = {"env_steps": float(batch["action_mask"].sum()), "generate_s": 1.0}
    return {k: v.to(device) for k, v in batch.items()}, stats, wire_spans(P, PAD, sent)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.cpu().contiguous().view(torch.uint8), b.cpu().contiguous().view(torch.uint8)))


def trainer_padding(wl, batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, float]:
    """The learner's own padding shares of one update on ``batch``, trimmed and packed."""
    from hpcrl.comm import GradAverager, Plane

    batch = {k: v for k, v in batch.items() if k not in ("turn_reward", "episode_info")}  # a one-turn learner
    model = wl.build_model(0, device)
    out = {}
    for mode, flag in (("trimmed", "trim_padding"), ("packed", "pack_sequences")):
        cfg = dataclasses.replace(wl.default_config(), **{flag: True})
        learner = wl.make_learner(model, cfg, GradAverager([p for p in model.parameters() if p.requires_grad],
                                                           plane=Plane.local("device", device)))
        out[f"{mode}_padding_frac"] = learner.update([batch], torch.Generator().manual_seed(5))[f"{mode}_padding_frac"]
    return out


def measure_layout(name: str, schema: Schema, padded: Schema, batch, stats, P: int, device, repeats: int,
                   shares: dict[str, float]) -> dict:
    """One batch's row: bytes, times, exactness, and the trainer's padding shares (``shares``: trimmed, packed)."""
    buf, flat = schema.pack(batch, stats), padded.pack(batch, stats)
    back, _ = schema.unpack(buf, device)
    times = measure_group({"pack": lambda: schema.pack(batch, stats), "unpack": lambda: schema.unpack(buf, device),
                           "pack_padded": lambda: padded.pack(batch, stats),
                           "unpack_padded": lambda: padded.unpack(flat, device)}, device, repeats=repeats)
    attn = batch["attention_mask"]
    carried = len(schema.ragged[0].fields) - 1  # the float fields after tokens
    fixed = sum(batch[k].numel() * batch[k].element_size() for k in schema.layout.fixed)
    real, episode_tokens = int(attn.sum()), int(attn[:, P:].sum())
    return {"layout": name, "padded_bytes": flat.numel(), "packed_bytes": buf.numel(),
            "bytes_ratio": flat.numel() / buf.numel(), "padding_frac": 1.0 - real / attn.numel(), **shares,
            **{f"{k}_s": v["median_s"] for k, v in times.items()},
            "bit_exact": all(same_bits(back[k], batch[k]) for k in batch),
            "expected_bytes": 16 * attn.shape[0] + fixed + 8 * real + 4 * carried * episode_tokens + 8 * len(stats),
            "rows": attn.shape[0], "real_tokens": real, "episode_tokens": episode_tokens, "timing": times}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--quick", action="store_true", help="B 8, P 8, E 32, 3 repeats (CI)")
    ap.add_argument("--json", default=str(RESULTS / "hf_wire_packing.json"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--episode-tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args(argv)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    torch.set_num_threads(args.threads)
    from hpcrl.ppo import demo_task as T
    from hpcrl.ppo.workloads.hf import HFWorkload

    B, P, E, repeats = (8, 8, 32, 3) if args.quick else (args.batch, args.prompt_tokens, args.episode_tokens,
                                                         args.repeats)
    device = torch.device(args.device)
    info = machine_info(device, args.threads)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        rng = random.Random(0)
        _, tok = T.build_causal_lm(out, [" ".join(rng.choice(WORDS) for _ in range(8)) for _ in range(200)],
                                   max_positions=P + E)
        assert tok.eos_token_id == PAD
        (out / "prompts.jsonl").write_text(json.dumps({"prompt": "yes no"}) + "\n")
        wl = HFWorkload(model=str(out), prompts=str(out / "prompts.jsonl"), reward_fn="hf_trim_padding:reward",
                        max_prompt_tokens=P, max_new_tokens=E, batch_size=B)
        for name, turns in (("single-turn", False), ("multi-turn", True)):
            gen = torch.Generator().manual_seed(1)
            traces = [episode(rng, gen, P, E, len(tok), turns) for _ in range(B)]
            batch, stats, ragged = batch_of(traces, P, E, turns, gen, device)
            schema, padded = Schema.of(batch, stats, (ragged,)), Schema.of(batch, stats)
            shares = trainer_padding(wl, schema.unpack(schema.pack(batch, stats), device)[0], device)
            results.append(measure_layout(name, schema, padded, batch, stats, P, device, repeats, shares))
    info["loadavg_end"] = loadavg()
    payload = {"benchmark": "wire_packing", "machine": info,
               "setup": {"batch": B, "prompt_tokens": P, "episode_tokens": E, "repeats": repeats,
                         "model": "random Llama, 2 layers, hidden 64 (the trainer's padding shares only)"},
               "results": results}
    ms = lambda r, k: f"{1e3 * r[k]:.3f}"  # noqa: E731
    print_table(f"hf experience on the wire, B {B}, P {P}, E {E} ({args.device}, {args.threads} thread(s))",
                ["layout", "padded B", "packed B", "ratio", "pack ms", "unpack ms", "padded pack/unpack ms",
                 "padding: padded / trimmed / packed"],
                [[r["layout"], r["padded_bytes"], r["packed_bytes"], f"{r['bytes_ratio']:.2f}", ms(r, "pack_s"),
                  ms(r, "unpack_s"), f"{ms(r, 'pack_padded_s')} / {ms(r, 'unpack_padded_s')}",
                  f"{r['padding_frac']:.3f} / {r['trimmed_padding_frac']:.3f} / {r['packed_padding_frac']:.3f}"]
                 for r in results])
    path = write_json(args.json, payload)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
