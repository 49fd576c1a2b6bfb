"""Detached-PPO trainer checkpoints as DCP shards (hpcrl.ppo.trainer_checkpoint): the trainer count leaves
the run identity, a resume at another trainer count or strategy loads the same learner, a SIGKILL during a
background checkpoint write never loses the previous checkpoint, and the hf actor exports from the shards.
Real processes (``python -m hpcrl.ppo``), real transformers models built small."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hpcrl.run import checkpoint
from hpcrl.ppo.config import DetachedConfig
from hpcrl.ppo.trainer_checkpoint import deal_rank_state, read_full, run_identity, upgrade_identity

CARTPOLE = ["--workload", "cartpole", "--makers", "1", "--env.num-envs", "2", "--env.rollout-len", "8",
            "--ppo.epochs", "1", "--lag", "0", "--checkpoint-every", "1", "--timeout-s", "60"]
# the token-level LM workload, small: one block of width 16, 10 pretraining steps, 8 sequences a batch
LM = ["--workload", "lm", "--makers", "1", "--lm.batch-size", "8", "--lm.pretrain-steps", "10", "--lm.d-model", "16",
      "--lm.n-layers", "1", "--ppo.epochs", "1", "--ppo.minibatches", "1", "--lag", "0", "--checkpoint-every", "1",
      "--timeout-s", "60"]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "SBATCH_", "SRUN_")) and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return {**env, "OMP_NUM_THREADS": "1"}


def _ppo(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hpcrl.ppo", *args], capture_output=True, text=True,
                          timeout=timeout, env=_env())


def _newest(run: Path) -> Path:
    return checkpoint.committed(run)[0]


def _same_learner(a: dict, b: dict) -> float:
    """Largest |difference| over the model and the optimizer's tensors (asserting the same keys)."""
    assert set(a["model"]) == set(b["model"]) and set(a["optim"]) == set(b["optim"])
    diffs = [float((a[g][k].double() - b[g][k].double()).abs().max()) for g in ("model", "optim") for k in a[g]
             if torch.is_tensor(a[g][k]) and a[g][k].numel()]
    return max(diffs)


# ------------------------------------------------------------------------------------------ pure rules


def test_identity_has_no_trainer_count_and_older_identities_match():
    cfg = DetachedConfig(workload="cartpole")
    now = run_identity(cfg)
    assert "trainers" not in now and "micro_batch_size" not in now["hf"]
    # an identity written before: the trainer count in it, the hf fields added since absent
    old = json.loads(json.dumps({"trainers": 2, **now}))
    old["hf"] = {k: v for k, v in old["hf"].items() if k != "dtype"}
    old["hf"]["micro_batch_size"] = 4  # not identity: dropped
    assert upgrade_identity(cfg)(old) == json.loads(json.dumps(now))
    other = DetachedConfig(workload="cartpole")
    other.hf.dtype = "bf16"  # not the default the old checkpoint implies: a difference
    assert upgrade_identity(other)(old)["hf"]["dtype"] == "auto" != run_identity(other)["hf"]["dtype"]


def test_rank_state_is_dealt_by_the_stated_rule():
    gens = {r: {"generator": torch.Generator().manual_seed(r).get_state(), "next_credit": c}
            for r, c in enumerate([5, 5])}
    # same count: each trainer its own
    assert deal_rank_state(gens, 2, 2, 1, 0, 7)[1] == 5
    assert torch.equal(deal_rank_state(gens, 2, 2, 1, 0, 7)[0], gens[1]["generator"])
    # 2 -> 1: batches 0..9 trained (credit c of trainer t is batch 2c + t): the next is batch 10
    assert deal_rank_state(gens, 2, 1, 0, 0, 7)[1] == 10
    # 2 -> 3: batch numbers 3c + t >= 10, none trained twice, 2 skipped (10 and 11 are below 3*4)
    assert [deal_rank_state(gens, 2, 3, t, 0, 7)[1] for t in range(3)] == [4, 4, 4]
    # a trainer with no predecessor: a new stream from (seed, rank, version), reproducible
    a, b = deal_rank_state(gens, 2, 3, 2, 0, 7)[0], deal_rank_state(gens, 2, 3, 2, 0, 7)[0]
    assert torch.equal(a, b) and not torch.equal(a, gens[0]["generator"])


def test_credits_trained_ahead_survive_the_rank_file_and_count_in_a_reshard(tmp_path):
    from hpcrl.core.h5io import load_h5, save_h5
    # trainer 1 handed out credits 6 and 8 ahead of its oldest outstanding one (5): written as its rank
    # file writes them, read back as a resume reads them
    states = {}
    for r, (credit, ahead) in enumerate([(5, []), (5, [6, 8])]):
        save_h5(tmp_path / f"rank{r}.h5", {"generator": torch.Generator().manual_seed(r).get_state(),
                                           "next_credit": credit,
                                           "taken_ahead": torch.tensor(ahead, dtype=torch.int64)})
        states[r] = load_h5(tmp_path / f"rank{r}.h5")
    gen, credit, ahead = deal_rank_state(states, 2, 2, 1, 0, 7)
    assert (credit, ahead) == (5, [6, 8])  # the ledger then never grants 6 and 8 (test_ppo_handout)
    # 2 -> 1: batch 2*8 + 1 = 17 was trained, so the single trainer starts at batch 18 (and skips nothing ahead)
    assert deal_rank_state(states, 2, 1, 0, 0, 7)[1:] == (18, [])


# -------------------------------------------------------------- cartpole and lm: 2 -> 1 -> 3 trainers


@pytest.mark.extended
@pytest.mark.parametrize("workload", [CARTPOLE, LM], ids=["cartpole", "lm"])
def test_resume_at_another_trainer_count_keeps_the_learner(tmp_path, workload):
    """The vector-env and the lm workload (their learners replicated on every trainer): 2 -> 1 -> 3 trainers."""
    a = tmp_path / "a"
    first = _ppo(*workload, "--trainers", "2", "--total-steps", "2", "--run-dir", str(a))
    assert first.returncode == 0, first.stderr[-3000:]
    saved = read_full(_newest(a))
    manifest = checkpoint.read_manifest(_newest(a))
    shards = [n for n in manifest["files"] if n.startswith("dcp/__")]
    assert {n.split("_")[2] for n in shards} == {"0", "1"}, shards  # both trainers wrote shards
    assert "trainers" not in manifest["identity"]

    b = tmp_path / "b"
    shutil.copytree(a, b)
    for trainers in (1, 3):  # resume at the checkpoint's version: the job re-saves what it loaded
        again = _ppo(*workload, "--trainers", str(trainers), "--total-steps", "2", "--run-dir", str(b), "--resume")
        assert again.returncode == 0, again.stderr[-3000:]
        assert f"resharded {2 if trainers == 1 else 1} -> {trainers} trainer(s)" in again.stdout, again.stdout
        resaved = read_full(_newest(b))
        assert checkpoint.read_manifest(_newest(b))["world_size"] == trainers
        assert _same_learner(saved, resaved) == 0.0  # bit-exact: parameters, both Adam moments, steps
        assert resaved["learner"] == saved["learner"] and resaved["version"] == 2

    # and it trains on at 3 trainers: the version continues, the Adam step counts too
    more = _ppo(*workload, "--trainers", "3", "--total-steps", "3", "--run-dir", str(b), "--resume")
    assert more.returncode == 0, more.stderr[-3000:]
    last = read_full(_newest(b))
    assert last["version"] == 3 and last["learner"]["updates"] == 3
    steps = {float(v) for k, v in last["optim"].items() if k.endswith(".step")}
    assert steps == {3.0}, steps  # one optimizer step per update (1 epoch x 1 minibatch)
    credits = [checkpoint.load_h5(_newest(b) / f"rank{r}.h5", 1)["next_credit"] for r in range(3)]
    assert len(set(credits)) == 1, credits


# ------------------------------------------------------------------ SIGKILL during a background write


def _writing(run: Path) -> str | None:
    try:
        return next((p.name for p in checkpoint.checkpoint_root(run).iterdir() if p.name.startswith(".tmp-")), None)
    except FileNotFoundError:
        return None


@pytest.mark.extended
def test_sigkill_during_an_async_checkpoint_keeps_the_previous_one(tmp_path):
    run = tmp_path / "run"
    rng = random.Random(0)
    args = [sys.executable, "-m", "hpcrl.ppo", *CARTPOLE, "--trainers", "2", "--total-steps", "400",
            "--run-dir", str(run)]
    kills = 0
    for trial in range(3):
        extra = ["--resume"] if trial else []
        proc = subprocess.Popen(args + extra, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        deadline, seen = time.time() + 120, None
        before = [p.name for p in checkpoint.committed(run)]
        while proc.poll() is None and time.time() < deadline:  # a write after the job's first commit
            name = _writing(run)
            if name is not None and checkpoint.committed(run) and [p.name for p in checkpoint.committed(run)] != before:
                seen = name
                break
            time.sleep(0.001)
        assert seen is not None, "no checkpoint write seen"
        time.sleep(rng.uniform(0, 0.02))
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
        kills += 1
        good = checkpoint.latest(run)  # the newest verified one: never lost
        assert good is not None
        assert all(checkpoint.verify(p) for p in checkpoint.committed(run)), "a committed checkpoint is damaged"
    resumed = _ppo(*CARTPOLE, "--trainers", "1", "--total-steps", str(int(good.name.split("_")[-1]) + 1),
                   "--run-dir", str(run), "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming from {good}" in resumed.stdout or "resharded 2 -> 1" in resumed.stdout, resumed.stdout
    assert kills == 3


# -------------------------------------------------------------------- hf: ddp <-> fsdp, 2 -> 1 -> 3, export


@pytest.fixture(scope="module")
def art(tmp_path_factory) -> dict[str, Path]:
    pytest.importorskip("transformers")
    import hf_fixtures as F

    d = tmp_path_factory.mktemp("reshard")
    return {"llama": F.build_causal_lm(d / "llama"), "prompts": F.write_prompts(d / "prompts.jsonl")}


def _hf(art, run: Path, *extra: str) -> subprocess.CompletedProcess:
    import hf_fixtures as F

    args = ["--workload", "hf", "--hf.model", str(art["llama"]), "--hf.reward-fn", "hf_fixtures:target_fraction",
            "--hf.prompts", str(art["prompts"]), "--hf.max-prompt-tokens", "8", "--hf.max-new-tokens", "8",
            "--hf.batch-size", "8", "--ppo.lr", "2e-3", "--lag", "0", "--run-dir", str(run), *extra]
    return F.run_ppo(args, run.parent, 400)


@pytest.mark.extended
def test_hf_resume_across_ddp_fsdp_and_trainer_counts(art, tmp_path):
    common = ["--makers", "1", "--trainers", "2"]
    ddp = _hf(art, tmp_path / "ddp", *common, "--total-steps", "2")
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    want = read_full(_newest(tmp_path / "ddp"))
    figures = {}
    # fsdp for update 1, ddp for update 2 (and the other way round): the same parameters as ddp throughout
    for first, second in (("fsdp", "ddp"), ("ddp", "fsdp")):
        run = tmp_path / f"{first}-{second}"
        one = _hf(art, run, *common, "--total-steps", "1", "--strategy", first)
        assert one.returncode == 0, one.stderr[-3000:]
        two = _hf(art, run, *common, "--total-steps", "2", "--strategy", second, "--resume")
        assert two.returncode == 0, two.stderr[-3000:]
        got = read_full(_newest(run))
        assert got["version"] == 2
        figures[f"{first}->{second}"] = _same_learner(want, got)
    # measured: max |diff| ~1e-7 (float32 reduction order; Adam's first steps move each parameter by ~lr)
    assert all(v < 1e-5 for v in figures.values()), figures

    # fsdp at 2 trainers -> 1 -> 3 (dim-0 chunks that do not divide): the learner loads unchanged
    src = tmp_path / "fsdp-ddp"
    saved = read_full(_newest(src))
    run = tmp_path / "counts"
    shutil.copytree(src, run)
    for trainers, strategy in ((1, "fsdp"), (3, "fsdp"), (1, "ddp")):
        again = _hf(art, run, "--makers", "1", "--trainers", str(trainers), "--total-steps", "2", "--strategy",
                    strategy, "--resume")
        assert again.returncode == 0, (trainers, strategy, again.stderr[-3000:])
        figures[f"counts:{trainers}:{strategy}"] = _same_learner(saved, read_full(_newest(run)))
    assert all(figures[k] == 0.0 for k in figures if k.startswith("counts")), figures
    print("figures", figures)

    # the actor exported from the shards loads with transformers and is the checkpoint's actor
    from transformers import AutoModelForCausalLM

    out = tmp_path / "exported"
    here = str(Path(__file__).resolve().parent)  # the run's reward function (hf_fixtures) is importable
    proc = subprocess.run([sys.executable, "-m", "hpcrl.ppo.export", str(run), "--out", str(out)], capture_output=True,
                          text=True, timeout=120, env={**_env(), "PYTHONPATH": here, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    actor = AutoModelForCausalLM.from_pretrained(out)
    model = {k.removeprefix("actor."): v for k, v in saved["model"].items() if k.startswith("actor.")}
    assert all(torch.equal(p, model[n]) for n, p in actor.named_parameters())
    per_ckpt = AutoModelForCausalLM.from_pretrained(run / "hf" / "actor")  # trainer 0's, from the shards too
    assert all(torch.equal(p, model[n]) for n, p in per_ckpt.named_parameters())
    bad = subprocess.run([sys.executable, "-m", "hpcrl.ppo.export", str(tmp_path / "nope"), "--out", str(out)],
                         capture_output=True, text=True, timeout=60, env=_env())
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr


# ------------------------------------------------------------------------ the older gathered format


def _to_old_format(path: Path, trainers: int) -> dict:
    """Rewrite committed checkpoint ``path`` as the gathered format written before DCP (one learner.pt with
    the full model and the optimizer's state_dict by parameter index; the trainer count in the identity)."""
    full = read_full(path)
    manifest = checkpoint.read_manifest(path)
    groups = [dict(g) for g in full["param_groups"]]
    names = [n for g in groups for n in g["params"]]  # the optimizer's order: its indices
    for g in groups:
        g["params"] = [names.index(n) for n in g["params"]]
    state = {i: {k: full["optim"][f"state.{n}.{k}"] for k in ("step", "exp_avg", "exp_avg_sq")}
             for i, n in enumerate(names)}
    learner = {"model": full["model"], "version": full["version"], "env_steps": full["env_steps"],
               "learner": {"model": full["model"], "optimizer": {"state": state, "param_groups": groups},
                           **full["learner"]}}
    ranks = [checkpoint.load_h5(path / f"rank{r}.h5", 1) for r in range(manifest["world_size"])]
    identity = {"trainers": trainers, **manifest["identity"]}
    identity["hf"] = {k: v for k, v in identity["hf"].items() if k != "dtype"}  # before --hf.dtype existed
    run = path.parent.parent
    shutil.rmtree(checkpoint.checkpoint_root(run))
    assert trainers == len(ranks) == 1  # one process writes it (its barriers are no-ops)
    checkpoint.save(run, full["version"], 0, 1, learner, ranks[0], lambda name: None, identity=identity)
    return full


@pytest.mark.extended
def test_an_older_gathered_checkpoint_resumes_at_another_trainer_count(tmp_path):
    run = tmp_path / "run"
    first = _ppo(*CARTPOLE, "--trainers", "1", "--total-steps", "2", "--run-dir", str(run))
    assert first.returncode == 0, first.stderr[-3000:]
    saved = _to_old_format(_newest(run), 1)
    assert "model" in torch.load(_newest(run) / "learner.pt", weights_only=True)  # the old layout
    again = _ppo(*CARTPOLE, "--trainers", "2", "--total-steps", "2", "--run-dir", str(run), "--resume")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resharded 1 -> 2 trainer(s)" in again.stdout, again.stdout
    got = read_full(_newest(run))
    assert checkpoint.read_manifest(_newest(run))["world_size"] == 2 and (_newest(run) / "dcp").is_dir()
    assert _same_learner(saved, got) == 0.0
