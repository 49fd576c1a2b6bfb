"""The loss variants and micro-batches on the ``hf`` learner with a real transformers model built small
here (random-init Llama, 2 layers; tests/hf_fixtures.py): ``--micro-batch-size`` equals one large
minibatch for ppo and grpo; the adaptive KL coefficient and the lr schedule's position resume exactly
from the learner's state_dict; a reward function returning NaN or the wrong length exits 2 with one
line (CLI runs, which also show kl_coef and lr in metrics.jsonl). All in the ``extended`` tier."""

from __future__ import annotations

import dataclasses
import io
import json
import math
import random
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

import hf_fixtures as F  # noqa: E402
from hpcrl.comm import GradAverager, Plane  # noqa: E402
from hpcrl.core.config_check import ConfigError  # noqa: E402
from hpcrl.ppo.losses import adaptive_kl_coef, lr_at  # noqa: E402
from hpcrl.ppo.workloads.hf import HFWorkload  # noqa: E402

REWARD = "hf_fixtures:target_fraction"
# the extended tier: the module's model fixture alone takes ~15 s here (a tokenizer trained, a model saved);
# the pure cases (hand-computed numbers, micro-batches on a toy) are tests/test_ppo_losses.py, fast tier
pytestmark = pytest.mark.extended


@pytest.fixture(scope="module")
def art(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("hfv")
    varied = d / "varied.jsonl"  # prompts of 1 to 5 words: left padding that differs by row
    rng = random.Random(4)
    varied.write_text("".join(json.dumps({"prompt": " ".join(rng.choice(F.WORDS[2:]) for _ in range(1 + i % 5))})
                              + "\n" for i in range(40)))
    return {"llama": F.build_causal_lm(d / "llama"), "gpt2": F.build_causal_lm(d / "gpt2", arch="gpt2"),
            "prompts": F.write_prompts(d / "prompts.jsonl"), "varied": varied}


def _wl(art, **kw) -> HFWorkload:
    opts = dict(model=str(art["llama"]), reward_fn=REWARD, prompts=str(art["prompts"]), max_prompt_tokens=8,
                max_new_tokens=8, batch_size=6)
    return HFWorkload(**{**opts, **kw})


def _learner(wl: HFWorkload, cfg):
    model = wl.build_model(0)
    avg = GradAverager([p for p in model.parameters() if p.requires_grad], plane=Plane.local("device"))
    return model, wl.make_learner(model, cfg, avg)


def _batches(wl: HFWorkload, k: int) -> list[dict[str, torch.Tensor]]:
    model, collector, gen = wl.build_model(0), wl.make_collector(11), torch.Generator().manual_seed(2)
    return [collector.collect(model, gen)[0] for _ in range(k)]


@pytest.mark.parametrize("algo", ["ppo", "grpo"])
def test_micro_batches_equal_one_large_minibatch_on_a_transformer(art, algo):
    """One update (2 epochs x 2 minibatches) of 6 prompts (x 2 samples with grpo): micro-batches of 1
    and of 4 (pieces of unequal size) leave the parameters where the whole-minibatch passes do."""
    extra = dict(algo="grpo", group_size=2) if algo == "grpo" else {}
    batch = _batches(_wl(art, **extra), 1)
    params = {}
    for micro in (None, 1, 4):
        wl = _wl(art, micro_batch_size=micro, **extra)
        cfg = dataclasses.replace(wl.default_config(), lr=3e-3, max_grad_norm=1e6)
        model, learner = _learner(wl, cfg)
        start = [p.detach().clone() for p in learner.params]
        stats = learner.update(batch, torch.Generator().manual_seed(5))
        params[micro] = [p.detach().clone() for p in learner.params]
        params[micro, "stats"] = stats
    moved = max(float((a - b).abs().max()) for a, b in zip(params[None], start))
    assert moved > 1e-4
    for micro in (1, 4):
        for a, b in zip(params[micro], params[None]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=2e-6)
        for k in ("policy_loss", "entropy", "grad_norm", "approx_kl"):
            assert params[micro, "stats"][k] == pytest.approx(params[None, "stats"][k], rel=1e-4, abs=1e-6), k


@pytest.mark.parametrize("mode", ["trim_padding", "pack_sequences"])
@pytest.mark.parametrize("arch,algo,micro", [("llama", "ppo", None), ("llama", "grpo", 3), ("gpt2", "ppo", 4)])
def test_trimmed_and_packed_forwards_are_the_padded_path(art, mode, arch, algo, micro):
    """--ppo.trim-padding: each forward drops the columns that are padding in all its rows;
    --ppo.pack-sequences: each forward runs on the sequences' real tokens laid end to end in rows (position
    ids and attention per sequence). Either way the update lands on the padded path's parameters and
    stats (the critic's values too: ppo), and computes fewer padding positions."""
    extra = dict(algo="grpo", group_size=2) if algo == "grpo" else {}
    wl = _wl(art, model=str(art[arch]), prompts=str(art["varied"]), micro_batch_size=micro, **extra)
    batch = _batches(wl, 1)
    got = {}
    for on in (False, True):
        cfg = dataclasses.replace(wl.default_config(), lr=3e-3, max_grad_norm=1e6, **{mode: on})
        model, learner = _learner(wl, cfg)
        stats = learner.update(batch, torch.Generator().manual_seed(5))
        got[on] = ([p.detach().clone() for p in learner.params], stats)
    for a, b in zip(got[True][0], got[False][0]):  # float rounding: other shapes, other kernels (max 3e-6 seen)
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    for k in ("policy_loss", "entropy", "approx_kl", "grad_norm") + (("value_loss",) if algo == "ppo" else ()):
        assert got[True][1][k] == pytest.approx(got[False][1][k], rel=1e-4, abs=1e-6), k
    stats = got[True][1]
    # prompts of 1-5 words left-padded to 8 tokens: every forward drops at least 2 leading columns
    share = "trimmed_padding_frac" if mode == "trim_padding" else "packed_padding_frac"
    assert 0 <= stats[share] < stats["padding_frac"] < 1, stats
    assert "padding_frac" not in got[False][1]


@pytest.mark.parametrize("mode", ["padded", "trim_padding", "pack_sequences"])
def test_token_budget_micro_batches_are_one_large_minibatch_on_a_transformer(art, mode):
    """--hf.micro-batch-tokens: each training forward computes at most that many token positions (as the
    mode computes them) and the update lands where one pass over the whole minibatch does (ppo: the critic's
    values too). Prompts of 1-5 words, 8 new tokens: sequences of unequal cost."""
    wl = _wl(art, prompts=str(art["varied"]), batch_size=8)
    batch = _batches(wl, 1)
    got, costs = {}, []
    for budget in (None, 40):
        wl = _wl(art, prompts=str(art["varied"]), batch_size=8, micro_batch_tokens=budget)
        on = {} if mode == "padded" else {mode: True}
        cfg = dataclasses.replace(wl.default_config(), lr=3e-3, max_grad_norm=1e6, **on)
        model, learner = _learner(wl, cfg)
        actor_forward = model.actor.forward

        def counted(*args, **kw):  # the token positions each training forward computes
            ids = kw.get("input_ids", args[0] if args else None)
            costs.append((budget, ids.numel()))
            return actor_forward(*args, **kw)

        model.actor.forward = counted
        stats = learner.update(batch, torch.Generator().manual_seed(5))
        got[budget] = ([p.detach().clone() for p in learner.params], stats)
    for a, b in zip(got[40][0], got[None][0]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    for k in ("policy_loss", "entropy", "approx_kl", "grad_norm", "value_loss"):
        assert got[40][1][k] == pytest.approx(got[None][1][k], rel=1e-4, abs=1e-6), k
    budgeted = [n for b, n in costs if b == 40]
    assert max(n for b, n in costs if b is None) > 40 and len(budgeted) > len(costs) - len(budgeted)
    assert all(n <= 40 for n in budgeted), budgeted


def test_packing_is_refused_where_the_model_does_not_keep_sequences_apart(art, monkeypatch):
    """A model whose attention ignores restarting position ids (transformers before its packed-sequence
    masks, or a model off its shared masking code) would let packed sequences attend to each other: the
    learner's first update refuses in one line instead."""
    import transformers.masking_utils as mu

    monkeypatch.setattr(mu, "find_packed_sequence_indices", lambda position_ids: None)  # no packing support
    wl = _wl(art, prompts=str(art["varied"]))
    cfg = dataclasses.replace(wl.default_config(), pack_sequences=True)
    _, learner = _learner(wl, cfg)
    with pytest.raises(ConfigError, match=r"^--ppo.pack-sequences: this model's attention does not keep packed"):
        learner.update(_batches(wl, 1), torch.Generator().manual_seed(5))
    with pytest.raises(ConfigError, match=r"--ppo.pack-sequences True: must be used without --ppo.trim-padding"):
        dataclasses.replace(wl.default_config(), pack_sequences=True, trim_padding=True)


def test_bad_micro_batch_size_and_group_baseline_without_groups(art):
    with pytest.raises(ConfigError, match=r"^--micro-batch-size 0: must be an integer >= 1"):
        _wl(art, micro_batch_size=0)  # the options' range check: before any rank starts
    from hpcrl.ppo.workloads.hf_learner import check_learner_options

    with pytest.raises(ConfigError, match=r"^--micro-batch-size 0: must be an integer >= 1"):
        check_learner_options("ppo", _wl(art).default_config(), 0, "--")  # the learner's own, for code-built ones
    wl = _wl(art)
    with pytest.raises(ConfigError, match=r"^--ppo.advantage rloo: a group baseline needs --algo grpo"):
        _learner(wl, dataclasses.replace(wl.default_config(), advantage="rloo"))


def _state_roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.mark.parametrize("advantage", ["rloo", "dr-grpo"])
def test_adaptive_kl_and_schedule_resume_exactly(art, advantage):
    """GRPO with the adaptive KL controller and warm-up + cosine: 3 updates straight, or 1 update, a
    checkpoint (model + learner state through torch.save) into a fresh model and learner, then 2 more:
    the same lr and kl_coef in every row and the same parameters, bit for bit. The rows' kl_coef follows
    the controller's formula, their lr the schedule."""
    wl = _wl(art, algo="grpo", group_size=2)
    cfg = dataclasses.replace(wl.default_config(), lr=2e-3, advantage=advantage, loss_norm="dr-grpo",
                              kl_coef=0.1, kl_target=0.5, kl_horizon=24, warmup_updates=1, lr_schedule="cosine",
                              decay_updates=2, min_lr_ratio=0.25)
    batches = _batches(wl, 3)

    model, learner = _learner(wl, cfg)
    gen = torch.Generator().manual_seed(7)
    straight = [learner.update([b], gen) for b in batches]
    want = [p.detach().clone() for p in learner.params]

    model, learner = _learner(wl, cfg)
    gen = torch.Generator().manual_seed(7)
    resumed = [learner.update([batches[0]], gen)]
    saved = _state_roundtrip({"model": model.state_dict(), "learner": learner.state_dict(), "gen": gen.get_state()})
    model, learner = _learner(wl, cfg)
    model.load_state_dict(saved["model"])
    learner.load_state_dict(saved["learner"])
    gen = torch.Generator()
    gen.set_state(saved["gen"])
    resumed += [learner.update([b], gen) for b in batches[1:]]

    assert [(r["lr"], r["kl_coef"]) for r in resumed] == [(r["lr"], r["kl_coef"]) for r in straight]
    for a, b in zip(learner.params, want):
        assert torch.equal(a.detach(), b)
    # lr: warm-up 1 update (2e-3 * 1/1), then the cosine over 2: t = 1/2 -> 2e-3 * (0.25 + 0.75 * 0.5) = 1.25e-3
    assert [r["lr"] for r in straight] == pytest.approx([lr_at(u, 2e-3, "cosine", 1, 2, 0.25) for u in range(3)])
    assert [r["lr"] for r in straight] == pytest.approx([2e-3, 2e-3, 1.25e-3])
    # kl_coef: 0.1, then each update's controller step on its measured KL per sequence over 12 sequences
    coef = 0.1
    for row in straight:
        assert row["kl_coef"] == pytest.approx(coef, rel=1e-12)
        coef = adaptive_kl_coef(coef, row["kl_to_ref"], 0.5, 24, 12)
    assert learner.kl_coef == pytest.approx(coef, rel=1e-12) and coef != 0.1
    assert all(math.isfinite(r["policy_loss"]) for r in straight)


# ---------------------------------------------------------------------------- command line (extended)

_CALLS = {"n": 0}


def nan_on_second_call(prompts, responses):
    """Passes the construction probe, then returns a NaN (a grader that breaks on batch 0 of a run)."""
    _CALLS["n"] += 1
    out = F.target_fraction(prompts, responses)
    return out if _CALLS["n"] < 2 else [float("nan")] + out[1:]


def always_nan(prompts, responses):
    return [float("nan")] * len(responses)


def one_too_many(prompts, responses):
    return [0.0] * (len(responses) + 1)


def _cli(art, tmp_path, reward: str, *extra: str, timeout: float = 300):
    """``python -m hpcrl.ppo --workload hf`` (the front door: --hf.* flags)."""
    return F.run_ppo(["--workload", "hf", "--hf.model", str(art["llama"]), "--hf.prompts", str(art["prompts"]),
                      "--hf.reward-fn", reward, "--hf.max-prompt-tokens", "8", "--hf.max-new-tokens", "8",
                      "--makers", "1", "--trainers", "1", "--run-dir", str(tmp_path / "run"),
                      "--heartbeat-timeout-s", "5", "--timeout-s", "30", *extra], tmp_path, timeout)


def test_cli_reward_nan_or_wrong_length_exits_2_with_one_line(art, tmp_path):
    for reward, want in (("test_ppo_hf_variants:always_nan", "returned non-finite scores (nan); return finite"),
                         ("test_ppo_hf_variants:one_too_many", "returned 3 scores for 2 responses")):
        proc = _cli(art, tmp_path, reward, "--total-steps", "2")
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert lines[-1].startswith("hpcrl.ppo: error:"), lines[-3:]
        assert f"--hf.reward-fn {reward} on batch probe" in lines[-1], lines[-3:]
        assert want in lines[-1], lines[-3:]
        assert "Traceback" not in proc.stderr and not (tmp_path / "run").exists()


def test_cli_reward_nan_mid_run_is_named(art, tmp_path):
    proc = _cli(art, tmp_path, "test_ppo_hf_variants:nan_on_second_call", "--total-steps", "4")
    last = [line for line in proc.stderr.splitlines() if line.startswith("hpcrl.ppo: error:")]
    assert proc.returncode == 2 and last, proc.stderr[-2000:]
    assert "nan_on_second_call on batch 0" in last[-1] and "non-finite" in last[-1], last


def test_cli_micro_batches_and_rows_show_lr_and_kl_coef(art, tmp_path):
    proc = _cli(art, tmp_path, REWARD, "--total-steps", "3", "--hf.micro-batch-size", "3", "--hf.algo", "grpo",
                "--hf.group-size", "2", "--hf.batch-size", "4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rows = {r["updates"]: r for r in rows if "score" in r}  # (the closing row repeats the last update's)
    assert sorted(rows) == [1, 2, 3] and all(r["sequences"] == 8 for r in rows.values())
    rows = list(rows.values())
    # grpo's default KL coefficient is 0 (docs/hf_learning.md); the rows show it all the same
    assert all(r["lr"] == pytest.approx(1e-5) and r["kl_coef"] == 0.0 for r in rows), rows[0]
