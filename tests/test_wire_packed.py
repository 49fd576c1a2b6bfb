"""Experience as long as the response: the ``hf`` workload's padded fields travel as each row's span
(hpcrl.ppo.ragged, hpcrl.ppo.wire.Schema) and arrive padded bit for bit; what a peer sends is bounded;
a real detached run trains on exactly the batches its maker collected; the benchmark writes its JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))  # wire_probe must be importable here and in spawned ranks

from hpcrl.comm import spawn  # noqa: E402
from hpcrl.ppo.channels import ChannelError, ExperienceChannel, Header, Schema  # noqa: E402
from hpcrl.ppo.ragged import Ragged  # noqa: E402
from hpcrl.ppo.workloads.rollout import Trace, layout, wire_spans  # noqa: E402

PAD = 2
RESPONSE = ("action_mask", "behaviour_logp")


def episode(prompt: int, segments: list[tuple[int, bool]], gen: torch.Generator) -> Trace:
    """A played episode: ``prompt`` tokens, then segments of ``(tokens, policy?)``, a reward after each turn."""
    t = Trace(torch.randint(3, 50, (prompt,), generator=gen).tolist())
    for n, policy in segments:
        # -rand may give -0.0 inside a span: sent as it is
        t.add(torch.randint(3, 50, (n,), generator=gen), -torch.rand(n, generator=gen) if policy else None)
        if policy:
            t.turns += 1
            t.rewards.append((t.length - 1, float(torch.rand((), generator=gen))))
    return t


def hf_batch(traces: list[Trace], P: int, E: int, ref: bool, multi_turn: bool, gen: torch.Generator):
    """What HFCollector.collect returns for ``traces`` (its layout, fixed fields and stats) and its declaration."""
    batch = layout(traces, P, E, PAD)
    n = len(traces)
    batch.update(score=torch.randn(n, generator=gen), maker_tokens_per_s=torch.tensor([123.5]))
    if multi_turn:
        batch["episode_info"] = torch.tensor([t.info() for t in traces])
    else:
        batch.pop("turn_reward")
    sent = RESPONSE + (("turn_reward",) if multi_turn else ()) + (("ref_logp",) if ref else ())
    if ref:  # the collector's: zeros outside the policy's tokens by a fill
        batch["ref_logp"] = (-torch.rand(n, E, generator=gen)).masked_fill(batch["action_mask"] == 0, 0.0)
    stats = {"env_steps": float(batch["action_mask"].sum()), "generate_s": 0.25}
    return batch, stats, (wire_spans(P, PAD, sent),)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape
            and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))


def packed_size(batch: dict, stats: dict, P: int, fields: int) -> int:
    """Spans (two int64 per row), the fixed fields whole, 8 bytes per real token (prompt and episode), 4 per
    episode token of each carried float field, the stats."""
    attn = batch["attention_mask"]
    fixed = sum(t.numel() * t.element_size() for k, t in batch.items()
                if k in ("score", "maker_tokens_per_s", "episode_info"))
    return 16 * attn.shape[0] + fixed + 8 * int(attn.sum()) + 4 * fields * int(attn[:, P:].sum()) + 8 * len(stats)


def layouts(gen: torch.Generator) -> dict[str, tuple[list[Trace], int, int, bool, bool]]:
    """(traces, P, E, ref_logp sent, multi-turn) of hand-made batches at the layout's edges."""
    P, E = 5, 8
    single = [episode(p, [(n, True)], gen) for p, n in [(5, 0), (3, 8), (0, 4), (1, 1), (5, 8), (2, 0)]]
    turns = [episode(3, [(2, True), (3, False), (2, True)], gen),  # observation tokens inside the span
             episode(5, [(1, True), (6, False), (1, True)], gen),  # full width, ending on a policy token
             episode(1, [(0, True)], gen),                         # an empty first response
             episode(4, [(3, True), (2, False)], gen)]             # ends on an observation
    return {"single turn, ref_logp": (single, P, E, True, False), "single turn": (single, P, E, False, False),
            "multi-turn, ref_logp": (turns, P, E, True, True), "multi-turn": (turns, P, E, False, True),
            "all empty": ([episode(0, [], gen) for _ in range(3)], P, E, True, False)}


@pytest.mark.parametrize("case", ["single turn, ref_logp", "single turn", "multi-turn, ref_logp", "multi-turn",
                                  "all empty"])
def test_round_trip_is_bit_exact_and_carries_only_the_spans(case):
    gen = torch.Generator().manual_seed(7)
    traces, P, E, ref, multi = layouts(gen)[case]
    batch, stats, ragged = hf_batch(traces, P, E, ref, multi, gen)
    schema = Schema.of(batch, stats, ragged)
    assert Schema.from_json(schema.to_json()) == schema
    buf = schema.pack(batch, stats)
    fields = len(RESPONSE) + ref + multi
    assert buf.dtype == torch.uint8 and buf.numel() == packed_size(batch, stats, P, fields)
    assert schema.min_nbytes <= buf.numel() <= schema.nbytes < schema.padded_nbytes
    out, out_stats = schema.unpack(buf)
    assert out_stats == stats and list(out) == [k for k, _, _ in schema.fields]
    for k in batch:
        assert same_bits(out[k], batch[k]), k


def test_payload_is_the_real_tokens_plus_the_spans():
    # prompts 4, 2, 0, 3 and episodes 0, 6, 3, 1 (P 4, E 6): 19 real tokens, 10 of them after the prompts
    gen = torch.Generator().manual_seed(1)
    traces = [episode(p, [(n, True)], gen) for p, n in [(4, 0), (2, 6), (0, 3), (3, 1)]]
    batch, stats, ragged = hf_batch(traces, 4, 6, True, False, gen)
    schema = Schema.of(batch, stats, ragged)
    # spans 4 x 16, score 16, maker_tokens_per_s 4, tokens 19 x 8, three float fields 3 x 10 x 4, stats 16
    assert schema.pack(batch, stats).numel() == 64 + 16 + 4 + 152 + 120 + 16 == 372
    # as before: every field whole (tokens 320, attention_mask 160, three fields 288, score, rate, stats)
    assert Schema.of(batch, stats).nbytes == schema.padded_nbytes == 320 + 160 + 288 + 16 + 4 + 16 == 804


def test_fixed_schemas_keep_their_exact_size():
    batch, stats = {"obs": torch.randn(3, 4), "act": torch.tensor([1, 0, 1])}, {"env_steps": 3.0}
    schema = Schema.of(batch, stats)
    assert schema.nbytes == schema.min_nbytes == schema.padded_nbytes == 48 + 24 + 8
    assert schema.pack(batch, stats).numel() == schema.nbytes and Schema.from_json(schema.to_json()) == schema
    with pytest.raises(ChannelError, match="from rank 2.*81 bytes, the schema says 80"):
        schema.check_payload(torch.zeros(81, dtype=torch.uint8), "rank 2")


def test_a_batch_that_breaks_its_declaration_is_refused_not_sent_changed():
    gen = torch.Generator().manual_seed(3)
    traces, P, E, _, _ = layouts(gen)["single turn, ref_logp"]
    batch, stats, ragged = hf_batch(traces, P, E, True, False, gen)
    schema = Schema.of(batch, stats, ragged)
    # the product the collector used to take: -0.0 where a negative log-prob meets a 0 of the mask
    product = {**batch, "ref_logp": -torch.rand(batch["ref_logp"].shape, generator=gen) * batch["action_mask"]}
    holes = {**batch, "attention_mask": batch["attention_mask"].clone()}
    holes["attention_mask"][1, P + 2] = 0.0  # not one run
    stray = {**batch, "tokens": batch["tokens"].clone()}
    stray["tokens"][2, 0] = PAD + 1  # row 2 has no prompt: its span starts at P
    for bad, name in [(product, "ref_logp"), (holes, "attention_mask"), (stray, "tokens")]:
        with pytest.raises(ValueError, match=f"break their ragged declaration.*{name} \\("):
            schema.pack(bad, stats)


@pytest.mark.parametrize("ragged, match", [
    ((Ragged("attention_mask", (("nope", 0, 0.0),)),), "'nope': not in the batch"),
    ((Ragged("attention_mask", (("tokens", 0, 2.5),)),), "'tokens'.*fill 2.5"),
    ((Ragged("attention_mask", (("score", 0, 0.0),)),), "'score': shape"),
    ((Ragged("attention_mask", (("tokens", 0, 2.0),)), Ragged("tokens")), "'tokens': declared twice"),
])
def test_declarations_are_checked(ragged, match):
    gen = torch.Generator().manual_seed(2)
    traces, P, E, _, _ = layouts(gen)["single turn"]
    batch, stats, _ = hf_batch(traces, P, E, False, False, gen)
    with pytest.raises(ValueError, match=match):
        Schema.of(batch, stats, ragged)
    forged = json.loads(Schema.of(batch, stats).to_json())
    forged["ragged"] = [r.to_json() for r in ragged]
    with pytest.raises(ChannelError, match=f"from maker rank 3 refused: .*{match}"):
        Schema.from_json(json.dumps(forged), source="maker rank 3")


@pytest.mark.parametrize("text, match", [
    # 2^20 x 2^20 floats rebuilt from 16 bytes a row: refused for what unpacking would allocate
    ('{"fields": [["m", [1048576, 1048576], "float32"]], "stats": [], "ragged": [{"mask": "m", "fields": []}]}',
     "padded"),
    ('{"fields": [["m", [2, 3], "float32"]], "stats": [], "ragged": [{"mask": "m", "fields": [["m", 0]]}]}',
     "malformed"),
    ('{"fields": [["m", [2, 3], "float32"]], "stats": [], "ragged": {"mask": "m"}}', "malformed"),
    ('{"fields": [["m", [2, 3], "float32"], ["t", [2, 3], "int64"]], "stats": [], '
     '"ragged": [{"mask": "m", "fields": [["t", 0, NaN]]}]}', "fill nan"),
])
def test_forged_ragged_schemas_are_refused(text, match):
    with pytest.raises(ChannelError, match=f"from maker rank 3.*{match}"):
        Schema.from_json(text, source="maker rank 3")


def test_malformed_payloads_and_sizes_are_refused_naming_the_rank():
    import wire_probe

    schema, good = wire_probe.small_schema()
    schema.check_payload(good, "rank 1")
    wants = {"negative length": "row 0: span start 2 length -1", "start past the width": "row 0: span start 11",
             "span past the width": "row 1: span start 3 length 10, not within its 10 columns",
             "spans longer than the values": "its spans make", "values longer than the spans": "its spans make"}
    for case, buf in wire_probe.forged().items():
        with pytest.raises(ChannelError, match=f"payload from rank 1 refused: .*{wants[case]}"):
            schema.unpack(buf, source="rank 1")
    channel = ExperienceChannel(None, schema=lambda src: schema, max_version=lambda: 3, maker_index=lambda r: r - 1)
    channel.check(Header(0, 0, 0, 0, 9, schema.nbytes), 1)
    for size in (schema.min_nbytes - 1, schema.nbytes + 1):
        with pytest.raises(ChannelError, match=f"header from rank 1 refused: payload of {size} bytes, the "
                                               f"schema's ragged batches take {schema.min_nbytes} to {schema.nbytes}"):
            channel.check(Header(0, 0, 0, 0, 9, size), 1)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_forged_spans_off_the_wire_are_refused_naming_the_sender():
    import wire_probe

    out = spawn(wire_probe.payload_bounds, 2, timeout_s=90)[0]
    assert set(out) == set(wire_probe.forged())
    for case, err in out.items():
        assert err is not None and err.startswith("experience payload from rank 1 refused: "), (case, err)


@pytest.mark.cuda
def test_round_trip_on_the_gpu_is_bit_exact():
    gen = torch.Generator().manual_seed(5)
    traces, P, E, ref, multi = layouts(gen)["multi-turn, ref_logp"]
    batch, stats, ragged = hf_batch(traces, P, E, ref, multi, gen)
    schema = Schema.of(batch, stats, ragged)
    on_gpu = {k: v.cuda() for k, v in batch.items()}
    buf = schema.pack(on_gpu, stats)
    assert buf.device.type == "cpu" and torch.equal(buf, schema.pack(batch, stats))
    out, _ = schema.unpack(buf, "cuda")
    assert all(out[k].is_cuda and same_bits(out[k].cpu(), batch[k]) for k in batch)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_detached_hf_run_trains_on_the_makers_batches_bit_for_bit(tmp_path):
    """Every batch a trainer's learner got equals, bit for bit, the padded batch its maker collected: the
    losses are those of the padded wire by construction (ref_logp from the makers: five fields ragged)."""
    pytest.importorskip("transformers")
    import hf_fixtures as F

    model, prompts = F.build_causal_lm(tmp_path / "llama"), F.write_prompts(tmp_path / "p.jsonl")
    record = tmp_path / "rec"
    record.mkdir()
    proc = F.run_ppo(["--workload", "wire_probe:RecordingHF", "--model", str(model), "--reward-fn",
                      "hf_fixtures:target_fraction", "--prompts", str(prompts), "--max-prompt-tokens", "8",
                      "--max-new-tokens", "16", "--batch-size", "8", "--makers", "1", "--trainers", "1",
                      "--total-steps", "3", "--run-dir", str(tmp_path / "run")], tmp_path, 150,
                     env={"WIRE_PROBE_DIR": str(record)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    from transformers import AutoTokenizer

    pad = float(AutoTokenizer.from_pretrained(model).eos_token_id)  # the fixture has no pad token: EOS pads
    assert json.loads((record / "ragged.json").read_text()) == [{"mask": "attention_mask", "fields": [
        ["tokens", 0, pad], ["action_mask", 8, 0.0], ["behaviour_logp", 8, 0.0], ["ref_logp", 8, 0.0]]}]
    shortest = 16
    for k in range(3):  # one trainer, one maker: update k trains batch k
        made, trained = (torch.load(record / f"{kind}-{k}.pt") for kind in ("made", "trained"))
        assert set(made) == set(trained) and "ref_logp" in made
        assert all(same_bits(trained[f], made[f]) for f in made), k
        shortest = min(shortest, int(made["attention_mask"][:, 8:].sum(-1).min()))
    assert shortest < 16, "every response full width: no response was ragged"


@pytest.mark.slow
def test_wire_packing_benchmark_quick_writes_json(tmp_path):
    out = tmp_path / "wire.json"
    proc = subprocess.run([sys.executable, str(TESTS.parent / "benchmarks" / "hf" / "wire_packing.py"), "--quick",
                           "--json", str(out)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    assert [r["layout"] for r in data["results"]] == ["single-turn", "multi-turn"]
    for r in data["results"]:
        assert r["bit_exact"] and r["packed_bytes"] < r["padded_bytes"] and r["packed_bytes"] == r["expected_bytes"]
        assert r["pack_s"] > 0 and r["unpack_s"] > 0
        assert 0 <= r["packed_padding_frac"] <= r["trimmed_padding_frac"] <= r["padding_frac"] < 1
