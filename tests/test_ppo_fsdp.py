"""Trainer strategies (hpcrl.ppo.strategy) with real processes on gloo: the FSDP2 weight gather against
DTensor.full_tensor, and ``--strategy fsdp`` against ``ddp`` through the detached roles on the ``hf``
workload (tiny real transformers models built in the test, loaded by path)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

import hf_fixtures as F  # noqa: E402
from hpcrl.comm import spawn  # noqa: E402
from hpcrl.ppo.strategy import shard_lengths  # noqa: E402



def test_shard_lengths_are_torch_chunk_sizes():
    for rows in (0, 1, 2, 5, 7, 26, 64):
        for world in (1, 2, 3, 4):
            want = [c.shape[0] for c in torch.arange(rows).chunk(world)] if rows else []
            assert shard_lengths(rows, world) == want + [0] * (world - len(want)), (rows, world)


class _Odd(torch.nn.Module):
    """Parameters whose dim 0 does not divide by 3 ranks (5, 2 < 3, 1 and 7 rows), one bigger than a bucket."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(3, 5)
        self.b = torch.nn.Parameter(torch.randn(2, 4))
        self.c = torch.nn.Parameter(torch.randn(1))
        self.d = torch.nn.Embedding(7, 6)


def _gather_rank(bucket_sizes: list[int]) -> list[dict]:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    from hpcrl import ops
    from hpcrl.comm import init_distributed, new_plane, shutdown
    from hpcrl.ppo.strategy import gather_flat

    ctx = init_distributed(timeout_s=60)
    try:
        torch.manual_seed(0)  # the same module on every rank
        model = _Odd()
        want = ops.flatten([p.detach().clone() for p in model.parameters()])
        plane = new_plane("device", range(ctx.world_size), ctx.rank, ctx.device, "gloo", ctx.timeout)
        fully_shard(model, mesh=DeviceMesh.from_group(plane.group, "cpu"))
        full = ops.flatten([p.full_tensor() for p in model.parameters()])
        out = []
        for bucket_numel in bucket_sizes:  # one spawn for every bucket size: the ranks' start dominates
            got = gather_flat([p.data for p in model.parameters()], plane, bucket_numel, ctx.rank == 0,
                              torch.device("cpu"))
            out.append({"got": None if got is None else got.tolist(), "want": want.tolist(), "full": full.tolist()})
        return out
    finally:
        shutdown()


def test_gather_flat_is_the_full_tensors_bucket_by_bucket():
    sizes = [1 << 20, 16]  # one bucket for everything; buckets smaller than a parameter
    out = spawn(_gather_rank, 3, args=(sizes,), timeout_s=120)
    for i, size in enumerate(sizes):
        assert out[0][i]["got"] == out[0][i]["want"] == out[0][i]["full"], size  # exact: copies, no arithmetic
        assert out[1][i]["got"] is None and out[2][i]["got"] is None  # only the publisher keeps a snapshot


def _ddp_rank() -> list[str]:
    from hpcrl.comm import RankDivergenceError, init_distributed, new_plane, shutdown
    from hpcrl.ppo.strategy import Strategy

    ctx = init_distributed(timeout_s=60)
    try:
        plane = new_plane("device", range(ctx.world_size), ctx.rank, ctx.device, "gloo", ctx.timeout)
        out = []
        for same in (True, False):  # both cases in one spawn: the ranks' start dominates
            torch.manual_seed(0 if same else ctx.rank)  # a workload whose build is not deterministic for a seed
            model = torch.nn.Linear(4, 3)
            try:
                Strategy("ddp", model, None, plane, ctx.device, keep=ctx.rank == 0)
                out.append("replicas equal")
            except RankDivergenceError as err:
                out.append(str(err))
        return out
    finally:
        shutdown()


def test_ddp_refuses_replicas_that_start_different():
    same, different = zip(*spawn(_ddp_rank, 2, timeout_s=60))
    assert same == ("replicas equal", "replicas equal")
    assert all("weight" in text and "bias" in text for text in different), different  # named, on every rank


# ------------------------------------------------------------------------- through the detached roles


@pytest.fixture(scope="module")
def art(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("fsdp")
    return {"llama": F.build_causal_lm(d / "llama"), "prompts": F.write_prompts(d / "prompts.jsonl")}


def _run(art, run: Path, *extra: str, log: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    args = ["--workload", "hf", "--hf.model", str(art["llama"]), "--hf.reward-fn", "hf_fixtures:logged_target_fraction",
            "--hf.prompts", str(art["prompts"]), "--hf.max-prompt-tokens", "8", "--hf.max-new-tokens", "8",
            "--hf.batch-size", "8", "--ppo.lr", "2e-3", "--run-dir", str(run), *extra]
    return F.run_ppo(args, run.parent, timeout, env=None if log is None else {"HF_TEST_PROMPT_LOG": str(log)})


def _final(run: Path) -> dict:
    from hpcrl.ppo.trainer_checkpoint import read_full

    return read_full(sorted((run / "checkpoints").glob("step_*"))[-1])


def _rows(run: Path) -> list[dict]:
    return [r for r in (json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()) if "score" in r]


@pytest.mark.slow
def test_fsdp_gives_the_ddp_update_and_resumes(art, tmp_path):
    # 2 makers : 2 trainers at lag 0: trainer t's credits all go to maker t, so both strategies see the
    # same batches and the only difference is how the update is computed (sharded or replicated)
    common = ["--makers", "2", "--trainers", "2", "--lag", "0"]
    ddp = _run(art, tmp_path / "ddp", *common, "--total-steps", "2")
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    fsdp = _run(art, tmp_path / "fsdp", *common, "--total-steps", "1", "--strategy", "fsdp",
                "--checkpoint-every", "1")
    assert fsdp.returncode == 0, fsdp.stderr[-3000:]
    first_fsdp = _final(tmp_path / "fsdp")
    assert first_fsdp["version"] == 1
    # the same process group and the same losses; parameters after update 1 equal to float32 reduction
    # order (measured: max |diff| 1.2e-7 after 2 updates at lr 2e-3; Adam's first step moves each by ~lr)
    ddp_rows, fsdp_rows = _rows(tmp_path / "ddp"), _rows(tmp_path / "fsdp")
    for key in ("policy_loss", "value_loss", "grad_norm", "score", "approx_kl"):
        assert fsdp_rows[0][key] == pytest.approx(ddp_rows[0][key], rel=1e-4, abs=1e-6), key

    # resume the fsdp run (v1 -> v2) and compare it with the ddp run's second update: exact resume of the
    # sharded Adam moments, and the prompts continue where the first job stopped
    again = _run(art, tmp_path / "fsdp", *common, "--total-steps", "2", "--strategy", "fsdp", "--resume")
    assert again.returncode == 0, again.stderr[-3000:]
    a, b = _final(tmp_path / "ddp"), _final(tmp_path / "fsdp")
    assert a["version"] == b["version"] == 2 and set(a["model"]) == set(b["model"])
    diff = max(float((a["model"][k].float() - b["model"][k].float()).abs().max()) for k in a["model"])
    assert diff < 1e-5, diff
    moments = [{k: v for k, v in x["optim"].items() if k.endswith(".exp_avg")} for x in (a, b)]
    assert moments[0] and set(moments[0]) == set(moments[1])
    assert max(float((moments[0][k] - moments[1][k]).abs().max()) for k in moments[0]) < 1e-6
    # the actor exported at the end (gathered from the shards) is the checkpoint's
    from transformers import AutoModelForCausalLM

    actor = AutoModelForCausalLM.from_pretrained(tmp_path / "fsdp" / "hf" / "actor")
    saved = {k.removeprefix("actor."): v for k, v in b["model"].items() if k.startswith("actor.")}
    assert all(torch.equal(p, saved[n]) for n, p in actor.named_parameters())


def _one_update(art, run: Path, *extra: str) -> dict:
    """Update 1's row of a 1 maker : 2 trainers run (batches are fixed by their number: prompts and seed)."""
    proc = _run(art, run, "--makers", "1", "--trainers", "2", "--lag", "1", "--total-steps", "1",
                "--hf.batch-size", "16", *extra)
    assert proc.returncode == 0, (run.name, proc.stderr[-3000:])
    return _rows(run)[0]


@pytest.fixture(scope="module")
def plain_fsdp(art, tmp_path_factory) -> dict:
    row = _one_update(art, tmp_path_factory.mktemp("plain") / "run", "--strategy", "fsdp")
    assert row["grad_norm"] > 0.1, row  # a batch with some reward: a gradient to compare
    return row


@pytest.mark.slow
def test_fsdp_offload_and_gradient_checkpointing_give_the_plain_update(art, plain_fsdp, tmp_path):
    # offload moves shards, gradients and the Adam step to host memory, and gradient checkpointing
    # recomputes activations: on CPU trainers the same numbers
    o = _one_update(art, tmp_path / "off", "--strategy", "fsdp", "--offload", "--hf.gradient-checkpointing")
    assert o["policy_loss"] == pytest.approx(plain_fsdp["policy_loss"], abs=1e-6)
    assert o["grad_norm"] == pytest.approx(plain_fsdp["grad_norm"], rel=1e-5)


@pytest.mark.slow
def test_fsdp_bf16_trainers_give_the_plain_update_to_bf16_rounding(art, plain_fsdp, tmp_path):
    h = _one_update(art, tmp_path / "bf16", "--strategy", "fsdp", "--trainer-dtype", "bf16")
    # bf16 compute: the same update up to bf16 rounding (8 mantissa bits), not bit-equal
    assert h["grad_norm"] == pytest.approx(plain_fsdp["grad_norm"], rel=0.1) and h["grad_norm"] != plain_fsdp["grad_norm"]
    assert all(v.dtype == torch.float32 for v in _final(tmp_path / "bf16")["model"].values())  # fp32 masters


@pytest.mark.slow
@pytest.mark.extended  # two runs; LoRA under DDP is in the fast tier (tests/test_ppo_hf.py)
def test_fsdp_lora_gives_the_ddp_lora_update(art, tmp_path):
    # the frozen base sharded with its adapters; the same update as ddp's (the adapters' random
    # A matrices come from the seed, so both trainers of the ddp run start as one replica)
    ld = _one_update(art, tmp_path / "lora_ddp", "--hf.lora-rank", "4")
    lf = _one_update(art, tmp_path / "lora_fsdp", "--strategy", "fsdp", "--hf.lora-rank", "4")
    for key in ("policy_loss", "value_loss", "grad_norm"):
        assert lf[key] == pytest.approx(ld[key], rel=1e-4, abs=1e-6), key
    a, b = _final(tmp_path / "lora_ddp")["model"], _final(tmp_path / "lora_fsdp")["model"]
    assert max(float((a[k] - b[k]).abs().max()) for k in a if "lora_" in k) < 1e-5


@pytest.mark.slow
def test_makers_split_the_prompts_and_a_resume_continues_with_the_next(art, tmp_path):
    from hpcrl.ppo.workloads.hf_prompts import PromptStream

    texts = [json.loads(line)["prompt"] for line in art["prompts"].read_text().splitlines()]
    stream = PromptStream(len(texts), 0)  # the run's order: seed 0, epoch after epoch
    order = [texts[i] for i in stream.take(8 * 12)]
    log1, log2 = tmp_path / "job1.jsonl", tmp_path / "job2.jsonl"
    run = tmp_path / "run"
    common = ["--makers", "2", "--trainers", "1", "--lag", "0", "--batches-per-step", "2"]
    first = _run(art, run, *common, "--total-steps", "2", log=log1)
    assert first.returncode == 0, first.stderr[-3000:]
    second = _run(art, run, *common, "--total-steps", "4", "--resume", log=log2)
    assert second.returncode == 0, second.stderr[-3000:]

    def batches(log: Path) -> list[tuple[int, list[str]]]:
        rows = map(json.loads, log.read_text().splitlines())  # less the 2-prompt probe each process makes
        return [(r["pid"], r["prompts"]) for r in rows if len(r["prompts"]) == 8]

    one, two = batches(log1), batches(log2)
    slices = [order[8 * b:8 * (b + 1)] for b in range(12)]
    # job 1 trained on batches 0-3 (2 per update), both makers served some, none twice; the 2 batches
    # in flight when it stopped (4, 5) were dropped at shutdown
    assert sorted(slices.index(p) for _, p in one) == [0, 1, 2, 3, 4, 5]
    assert len({pid for pid, _ in one}) == 2
    # job 2 starts with batch 4: the first the trainer had not trained on, not batch 0 again
    assert sorted(slices.index(p) for _, p in two) == [4, 5, 6, 7, 8, 9]
    assert [r["policy_version"] for r in _rows(run)][-1] == 4
