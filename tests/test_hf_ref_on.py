"""``--hf.ref-on trainers|makers`` (hpcrl.ppo.workloads.hf): where the frozen reference's log-probs are
computed. The same numbers either way (kl_to_ref, score, losses), a maker under ``trainers`` holds no
reference and sends no ``ref_logp``, LoRA's trainer-side reference is the actor's base with the adapters
disabled, and a resume may switch the option. Tiny real models built here (a random 2-layer Llama, hidden
64), real ranks for the detached runs (2 trainers, ddp and fsdp, lag 0), one thread per rank."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

import hf_fixtures as F  # noqa: E402
from hpcrl.comm import GradAverager, Plane  # noqa: E402
from hpcrl.core.config_check import ConfigError  # noqa: E402
from hpcrl.ppo.workloads.hf import HFWorkload  # noqa: E402
from hpcrl.ppo.workloads.hf_options import HFGroupOptions  # noqa: E402

REWARD = "hf_fixtures:target_fraction"
# what both modes must agree on; metrics.jsonl rounds to 6 decimals
KEYS = ("kl_to_ref", "kl_to_ref_k3", "score", "policy_loss", "grad_norm", "reward")


@pytest.fixture(scope="module")
def art(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("refon")
    return {"llama": F.build_causal_lm(d / "llama"), "prompts": F.write_prompts(d / "prompts.jsonl")}


# ---------------------------------------------------------------------- in one process (collector + learner)


def _loop(art, ref_on: str, iters: int = 3, **kw) -> tuple[list[dict], list[dict], HFWorkload]:
    """``iters`` collect -> update steps on one model (a lag-0 loop without publishing: a LoRA trainer's
    adapters stay unmerged); returns the updates' stats, the batches' keys and the workload."""
    wl = HFWorkload(model=str(art["llama"]), reward_fn=REWARD, prompts=str(art["prompts"]), max_prompt_tokens=8,
                    max_new_tokens=8, batch_size=8, ref_on=ref_on, **kw)
    cfg = dataclasses.replace(wl.default_config(), lr=2e-3)
    model = wl.build_model(0)
    collector = wl.make_collector(11)
    learner = wl.make_learner(model, cfg, GradAverager([p for p in model.parameters() if p.requires_grad],
                                                   plane=Plane.local("device")))
    gen = torch.Generator().manual_seed(2)
    hist, keys = [], []
    for _ in range(iters):
        batch, stats = collector.collect(model, gen)
        keys.append({"batch": set(batch), "stats": set(stats)})
        hist.append(learner.update([batch], gen))
    return hist, keys, wl


@pytest.mark.parametrize("kw", [dict(algo="ppo"), dict(algo="ppo", kl_estimator="k3"), dict(algo="grpo"),
                                dict(algo="ppo", lora_rank=4)], ids=["ppo", "ppo-k3", "grpo", "lora"])
def test_trainer_reference_gives_the_makers_numbers_in_one_process(art, kw, capfd):
    if kw.get("lora_rank"):
        pytest.importorskip("peft")
    makers, mkeys, mwl = _loop(art, "makers", **kw)
    trainers, tkeys, twl = _loop(art, "trainers", **kw)
    # the same forward on the same shapes: bit-equal on one thread
    for key in KEYS:
        assert [h[key] for h in trainers] == [h[key] for h in makers], key
    assert makers[-1]["kl_to_ref"] > 0.01 and makers[-1]["score"] > 0  # a KL term that could differ
    # ref_logp travels only from makers that compute it; the trainers' model holds the reference instead
    assert all("ref_logp" in k["batch"] and "kl_to_ref_sum" in k["stats"] for k in mkeys)
    assert all("ref_logp" not in k["batch"] and "kl_to_ref_sum" not in k["stats"] for k in tkeys)
    assert len(mwl.models.references) == 1 and not twl.models.references  # the maker side loaded no reference
    lines = capfd.readouterr().err.splitlines()
    makers_line, trainers_line = (next(x for x in lines if f"ref_logp on the {m};" in x)
                                  for m in ("makers", "trainers"))
    assert "reference (" in makers_line and "reference" not in trainers_line, lines
    held = next(x for x in lines if x.startswith("hpcrl.ppo hf trainer:"))
    assert ("LoRA adapters disabled (no second model)" in held) == bool(kw.get("lora_rank")), held


def test_lora_trainers_hold_no_second_model(art):
    pytest.importorskip("peft")
    wl = HFWorkload(model=str(art["llama"]), reward_fn=REWARD, prompts=str(art["prompts"]), ref_on="trainers",
                    lora_rank=4, max_prompt_tokens=8, max_new_tokens=8, batch_size=8)
    assert wl.build_model(0).reference is None
    full = dataclasses.replace(wl, lora_rank=0)
    ref = full.build_model(0).reference
    assert ref is not None and not any(p.requires_grad for p in ref.parameters()) and not ref.training
    assert wl.build_maker_model(0).reference is None and full.build_maker_model(0).reference is None


def test_micro_batches_split_the_reference_forward(art):
    makers, _, _ = _loop(art, "makers", iters=2)
    pieces, _, _ = _loop(art, "trainers", iters=2, micro_batch_size=3)  # 8 rows: forwards of 3, 3, 2
    for key in KEYS:  # other shapes (the training passes' too), other float summation order
        assert [h[key] for h in pieces] == pytest.approx([h[key] for h in makers], rel=1e-4, abs=1e-6), key


def test_ref_on_is_checked():
    HFGroupOptions(ref_on="trainers").check_ranges()
    with pytest.raises(ConfigError, match=r"^--hf\.ref-on 'both': must be one of makers, trainers; e\.g\. "
                                          r"--hf\.ref-on trainers"):
        HFGroupOptions(ref_on="both").check_ranges()  # type: ignore[arg-type]
    from hpcrl.ppo.config import parse_args

    with pytest.raises(ConfigError, match=r"invalid choice 'both' for argument '--hf\.ref-on'"):
        parse_args(["--workload", "hf", "--hf.ref-on", "both"])  # the typed flag: refused by the parser


# ------------------------------------------------------------------------- detached runs (real ranks)


def _run(art, run: Path, ref_on: str, *extra: str) -> tuple[dict[int, dict], str]:
    """A lag-0 run of 1 maker : 2 trainers; its rows by policy version (the last of each) and stderr."""
    args = ["--workload", "hf", "--hf.model", str(art["llama"]), "--hf.reward-fn", REWARD,
            "--hf.prompts", str(art["prompts"]), "--hf.max-prompt-tokens", "8", "--hf.max-new-tokens", "8",
            "--hf.batch-size", "16", "--ppo.lr", "2e-3", "--makers", "1", "--trainers", "2", "--lag", "0",
            "--hf.ref-on", ref_on, "--run-dir", str(run), *extra]
    proc = F.run_ppo(args, run.parent, 300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["policy_version"]: r for r in rows if "score" in r}, proc.stderr


def _maker_line(stderr: str) -> str:
    return next(line for line in stderr.splitlines() if line.startswith("hpcrl.ppo hf maker:"))


def _same(a: dict[int, dict], b: dict[int, dict], keys=KEYS, rel: float = 1e-5) -> None:
    assert sorted(a) == sorted(b) == [1, 2, 3], (sorted(a), sorted(b))
    for v in a:
        for key in keys:
            if key in a[v]:
                assert b[v][key] == pytest.approx(a[v][key], rel=rel, abs=2e-6), (v, key, a[v][key], b[v][key])


CASES = {"ppo-ddp": [], "ppo-k3-fsdp": ["--hf.kl-estimator", "k3", "--strategy", "fsdp"],
         "grpo-ddp": ["--hf.algo", "grpo", "--hf.batch-size", "4", "--hf.group-size", "4"],
         "grpo-fsdp": ["--hf.algo", "grpo", "--hf.batch-size", "4", "--hf.group-size", "4", "--strategy", "fsdp"]}


@pytest.fixture(scope="module")
def ppo_makers(art, tmp_path_factory) -> tuple[dict[int, dict], str]:
    """The ppo-ddp run with the makers' reference: the baseline of two tests."""
    return _run(art, tmp_path_factory.mktemp("ppo_makers") / "run", "makers", "--total-steps", "3")


# The fast tier keeps one detached case (grpo under fsdp: the sharded reference and the k3 term); the
# in-process tests above cover every variant bit for bit. The other real-rank runs: extended tier.
@pytest.mark.slow
@pytest.mark.parametrize("case", [c if c == "grpo-fsdp" else pytest.param(c, marks=pytest.mark.extended)
                                  for c in CASES])
def test_detached_trainer_reference_gives_the_makers_numbers(art, tmp_path, case, request):
    extra = CASES[case]
    if case == "ppo-ddp":
        makers, mlog = request.getfixturevalue("ppo_makers")
    else:
        makers, mlog = _run(art, tmp_path / "makers", "makers", "--total-steps", "3", *extra)
    trainers, tlog = _run(art, tmp_path / "trainers", "trainers", "--total-steps", "3", *extra)
    assert makers[3]["kl_to_ref"] > 0.05 and makers[3]["score"] > 0, makers[3]  # a KL term that could differ
    _same(makers, trainers)
    # the makers of the trainers-mode run loaded no reference; the fsdp trainers hold half of theirs
    assert "reference (" in _maker_line(mlog) and "reference" not in _maker_line(tlog), (_maker_line(mlog),
                                                                                         _maker_line(tlog))
    held = [line for line in tlog.splitlines() if line.startswith("hpcrl.ppo hf trainer:")]
    want = "sharded, 0.04M of 0.08M parameters here" if "fsdp" in extra else "a full copy, 0.08M of 0.08M"
    assert len(held) == 2 and all(want in line for line in held), held


@pytest.mark.slow
@pytest.mark.extended
def test_a_resume_may_switch_ref_on(art, tmp_path, ppo_makers):
    # not part of the run's identity: 2 updates with the trainers' reference, the third after a resume
    # with the makers', and the run is the one that never switched
    run = tmp_path / "run"
    _run(art, run, "trainers", "--total-steps", "2", "--checkpoint-every", "1")
    switched, log = _run(art, run, "makers", "--total-steps", "3", "--resume")
    assert "reference (" in _maker_line(log)
    _same(ppo_makers[0], switched)


@pytest.mark.slow
@pytest.mark.extended
def test_detached_lora_reference_is_the_base_with_adapters_off(art, tmp_path):
    pytest.importorskip("peft")
    lora = ["--hf.lora-rank", "4", "--total-steps", "3", "--ppo.lr", "2e-2"]
    makers, mlog = _run(art, tmp_path / "makers", "makers", *lora)
    # fsdp with the reference on the trainers: the adapters-off forward (peft freezes the adapters for it)
    # is each update's first and must leave them trainable; the tolerance of fsdp against ddp
    trainers, tlog = _run(art, tmp_path / "trainers", "trainers", *lora, "--strategy", "fsdp")
    assert makers[3]["kl_to_ref"] > 1e-3 and makers[2]["grad_norm"] > 0.01, makers
    _same(makers, trainers, (*KEYS, "value_loss"), rel=1e-4)
    assert "reference (" in _maker_line(mlog) and "reference" not in _maker_line(tlog)
    held = [line for line in tlog.splitlines() if line.startswith("hpcrl.ppo hf trainer:")]
    assert len(held) == 2 and all("(no second model)" in line for line in held), held
