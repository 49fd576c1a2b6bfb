"""Rollout correction of decoupled PPO (hpcrl.ppo.losses.rollout_weights, ``--ppo.is-level`` / ``--ppo.is-mode``
with ``--ppo.truncated-is C``): each level x mode against weights and losses computed by hand in the comments;
token + truncate bit-identical to the formula before the levels existed; micro-batches give the whole
minibatch's stats; the options' refusals as one ConfigError line; the config reaching the learners (lm by
its config, hf through one update in one process)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import nn

from hpcrl.core.config_check import ConfigError
from hpcrl.ppo.losses import loss_weights, policy_loss, rollout_weights, row_weights, weighted_mean
from hpcrl.ppo.sync import NoGradAverage
from hpcrl.ppo.update import Coefs, GradStep, Outputs, Plan, Samples, ppo_update, read_stats
from hpcrl.ppo.workload import PPOConfig
from hpcrl.ppo.workloads.options import PPOOptions

LN = math.log
C = 2.5  # the cap / threshold of every hand case: band [1/C, C] = [0.4, 2.5]
# 3 sequences x 4 tokens; d = log pi_prox - log pi_behaviour per token; the padding's d is garbage (never used)
MASK = torch.tensor([[1.0, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]])
D = torch.tensor([[LN(2), LN(2), 0.0, LN(0.5)],   # token ratios 2, 2, 1, 0.5: W = 2 x 2 x 1 x 0.5 = 2, G = 2^(1/4)
                  [LN(3), LN(3), LN(5), LN(7)],   # 3, 3 (+ padding): W = 9, G = 3
                  [LN(0.5), LN(0.5), LN(0.5), LN(100)]])  # 0.5 x 3: W = 0.125, G = 0.5
ADV = torch.tensor([[1.0], [-1.0], [2.0]]) * MASK
G0 = 2 ** 0.25  # 1.189207

# level, mode: the weights per row (token level: per token), the share truncated / masked, the loss at ratio 1
# (logp = proximal: the clipped surrogate is A itself, loss = -sum over valid tokens (w A) / 9 valid tokens)
HAND = {
    # tokens: min(w, 2.5): row 1's 3s -> 2.5; 2 of 9 tokens hit; sum w A = (2 + 2 + 1 + 0.5) - 2 x 2.5 + 2 x 1.5 = 3.5
    ("token", "truncate"): ([[2, 2, 1, 0.5], [2.5, 2.5], [0.5, 0.5, 0.5]], 2 / 9, -3.5 / 9, 12 / 9, 2.5),
    # tokens over 2.5 dropped: row 1's two 3s -> 0: 5.5 - 0 + 3 = 8.5; mean weight (5.5 + 1.5) / 9
    ("token", "mask"): ([[2, 2, 1, 0.5], [0, 0], [0.5, 0.5, 0.5]], 2 / 9, -8.5 / 9, 7 / 9, 2.0),
    # W = 2, min(9, 2.5) = 2.5, 0.125: 1 of 3 sequences; 2 x 4 x 1 - 2.5 x 2 + 0.125 x 3 x 2 = 3.75
    ("sequence", "truncate"): ([[2] * 4, [2.5] * 2, [0.125] * 3], 1 / 3, -3.75 / 9, (2 + 2.5 + 0.125) / 3, 2.5),
    # 9 > 2.5 and 0.125 < 0.4 dropped: 2 of 3; 2 x 4 = 8
    ("sequence", "mask"): ([[2] * 4, [0] * 2, [0] * 3], 2 / 3, -8 / 9, 2 / 3, 2.0),
    # G = 1.189207, min(3, 2.5), 0.5: 1 of 3; 4 G0 - 5 + 0.5 x 3 x 2 = 4.756828 - 2 = 2.756828
    ("geometric", "truncate"): ([[G0] * 4, [2.5] * 2, [0.5] * 3], 1 / 3, -(4 * G0 - 2) / 9, (G0 + 3) / 3, 2.5),
    # 3 > 2.5 dropped, 0.5 in [0.4, 2.5] kept: 1 of 3; 4 G0 + 3 = 7.756828
    ("geometric", "mask"): ([[G0] * 4, [0] * 2, [0.5] * 3], 1 / 3, -(4 * G0 + 3) / 9, (G0 + 0.5) / 3, G0),
}


def _padded(rows: list[list[float]]) -> torch.Tensor:
    return torch.tensor([r + [0.0] * (4 - len(r)) for r in rows])


@pytest.mark.parametrize("level,mode", list(HAND))
def test_levels_and_modes_by_hand(level, mode):
    rows, frac, loss_want, mean_want, max_want = HAND[level, mode]
    prox = torch.full((3, 4), -1.0)
    behaviour = prox - D
    weights, stats = rollout_weights(prox, behaviour, MASK, C, level, mode)
    torch.testing.assert_close(weights * MASK, _padded(rows), atol=1e-6, rtol=0)
    loss, pstats = policy_loss(prox.clone().requires_grad_(), behaviour, ADV, 0.2, C, prox, mask=MASK,
                               is_level=level, is_mode=mode)
    assert float(loss.detach()) == pytest.approx(loss_want, abs=1e-6)
    for got in (stats, pstats):
        assert float(got["is_trunc_frac"]) == pytest.approx(frac, abs=1e-6)
        assert float(got["is_weight_mean"]) == pytest.approx(mean_want, abs=1e-6)
        assert float(got["is_weight_max"]) == pytest.approx(max_want, abs=1e-6)
    loss.backward()  # the weights are detached: the gradient is the weighted surrogate's only
    assert not weights.requires_grad


def test_an_empty_row_weighs_one_and_is_no_sequence():
    # a row without valid tokens: W = G = exp(0) = 1, kept, and outside the sequence stats (2 sequences, not 3)
    mask = torch.tensor([[1.0, 1, 0, 0], [0, 0, 0, 0], [1, 0, 0, 0]])
    d = torch.tensor([[LN(4), 0.0, 9, 9], [9, 9, 9, 9], [0.0, 9, 9, 9]])
    w, stats = rollout_weights(torch.zeros(3, 4), -d, mask, 2.0, "sequence", "mask")
    assert w[:, 0].tolist() == pytest.approx([0.0, 1.0, 1.0])  # W = 4 > 2 dropped; empty row 1; row 2 W = 1
    assert float(stats["is_trunc_frac"]) == pytest.approx(0.5) and float(stats["is_weight_mean"]) == pytest.approx(0.5)


def _old_policy_loss(logp, behaviour, adv, clip, cap, prox, mask, weights, stat_weights):
    """policy_loss's decoupled branch as it was before the rollout levels (token + truncate only)."""
    ratio = torch.exp(logp - prox)
    surrogate = torch.min(ratio * adv, ratio.clamp(1.0 - clip, 1.0 + clip) * adv)
    weight = torch.exp(prox - behaviour).detach()
    stats = {"is_trunc_frac": weighted_mean((weight > cap).float(), mask, stat_weights)}
    weight = weight.clamp(max=cap)
    surrogate = weight * surrogate
    stats["is_weight_mean"] = weighted_mean(weight, mask, stat_weights)
    loss = -weighted_mean(surrogate, mask, weights)
    stats["clip_frac"] = weighted_mean(((ratio - 1.0).abs() > clip).float(), mask, stat_weights)
    stats["ratio_mean"] = weighted_mean(ratio, mask, stat_weights)
    return loss, stats


@pytest.mark.parametrize("weighted", [False, True])
def test_token_truncate_is_bit_identical_to_the_old_formula(weighted):
    gen = torch.Generator().manual_seed(0)
    mask = (torch.rand(6, 5, generator=gen) > 0.3).float()
    behaviour = -torch.rand(6, 5, generator=gen) * 2
    prox = behaviour + torch.randn(6, 5, generator=gen)  # weights from ~0.1 to ~10: some over the cap
    logp = prox + 0.3 * torch.randn(6, 5, generator=gen)
    adv = torch.randn(6, 5, generator=gen)
    w = (loss_weights(mask, "sequence", logp), loss_weights(mask, "token", logp)) if weighted else (None, None)
    want_loss, want = _old_policy_loss(logp.clone().requires_grad_(), behaviour, adv, 0.2, 2.0, prox, mask, *w)
    leaf = logp.clone().requires_grad_()
    got_loss, got = policy_loss(leaf, behaviour, adv, 0.2, 2.0, prox, mask, *w)
    assert torch.equal(got_loss, want_loss)
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    assert 0 < float(got["is_trunc_frac"]) < 1 and float(got["is_weight_max"]) == 2.0  # a cap that bit
    got_loss.backward()
    logp_old = logp.clone().requires_grad_()
    _old_policy_loss(logp_old, behaviour, adv, 0.2, 2.0, prox, mask, *w)[0].backward()
    assert torch.equal(leaf.grad, logp_old.grad)


@pytest.mark.parametrize("level,mode", [("sequence", "truncate"), ("sequence", "mask"), ("geometric", "mask"),
                                        ("token", "mask")])
def test_micro_batches_give_the_minibatch_stats(level, mode):
    """2 epochs x 2 minibatches of 7 sequences: micro-batches of 1, 3 and 7 rows give the parameters and the
    stats (the rollout ones: a mean over sequences, and a max) of the whole-minibatch passes."""
    gen = torch.Generator().manual_seed(1)
    n, g = 14, 4
    feats = torch.randn(n, g, 4, generator=gen)
    mask = (torch.rand(n, g, generator=gen) > 0.3).float()
    mask[3] = 0.0  # an empty sequence
    blogp = -torch.rand(n, g, generator=gen) - 0.5
    prox = blogp + 0.4 * torch.randn(n, g, generator=gen)
    samples = Samples(blogp, torch.randn(n, g, generator=gen), proximal_logp=prox, mask=mask)
    coefs = Coefs(clip=0.2, truncated_is=1.5, ent=0.01, is_level=level, is_mode=mode)
    results = {}
    for micro in (None, 1, 3, 7):
        torch.manual_seed(0)
        pi = nn.Linear(4, 1)
        params = list(pi.parameters())

        def forward(idx):
            logp = -nn.functional.softplus(pi(feats[idx])).squeeze(-1)
            return Outputs(logp, -logp)

        step = GradStep(torch.optim.SGD(params, lr=0.5), params, NoGradAverage(), max_grad_norm=1e6)
        stats = read_stats(ppo_update(forward, samples, coefs, Plan(2, 2), step, torch.Generator().manual_seed(3),
                                      micro_batch_size=micro))
        results[micro] = ([p.detach().clone() for p in params], stats)
    want_params, want = results[None]
    assert 0 < want["is_trunc_frac"] < 1 and want["is_weight_max"] > 0
    for micro in (1, 3, 7):
        got_params, got = results[micro]
        for a, b in zip(got_params, want_params):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert got.keys() == want.keys()
        for k in want:
            assert got[k] == pytest.approx(want[k], rel=1e-5, abs=1e-7), (micro, k)


def test_row_weights_average_over_non_empty_sequences():
    mask = torch.tensor([[1.0, 1, 0], [0, 0, 0], [1, 1, 1]])
    w = row_weights(mask, mask)
    assert w.sum(-1).tolist() == pytest.approx([0.5, 0.0, 0.5])
    assert float(row_weights(torch.zeros(2, 3), mask).sum()) == 0.0  # all empty: no NaN


# ------------------------------------------------------------------------------ configuration


@pytest.mark.parametrize("kw,want", [
    (dict(is_level="sequence"), "--ppo.is-level sequence: needs --ppo.truncated-is C"),
    (dict(is_mode="mask"), "--ppo.is-mode mask: needs --ppo.truncated-is C"),
    (dict(is_level="seq", truncated_is=2.0), "--ppo.is-level seq: must be token, sequence or geometric"),
    (dict(is_mode="clip", truncated_is=2.0), "--ppo.is-mode clip: must be truncate or mask"),
    (dict(is_mode="mask", truncated_is=1.0), "--ppo.truncated-is 1.0: must be a finite number > 1 with --ppo.is-mode"),
    (dict(is_level="geometric", truncated_is=0.5), "--ppo.truncated-is 0.5: must be a finite number >= 1"),
])
def test_bad_combinations_are_one_line(kw, want):
    with pytest.raises(ConfigError) as err:
        dataclasses.replace(PPOConfig(), **kw)
    assert want in str(err.value) and "\n" not in str(err.value)


def test_config_reaches_the_lm_learner():
    from hpcrl.ppo.workloads.lm import LMWorkload

    wl = LMWorkload(batch_size=8)
    cfg = dataclasses.replace(wl.default_config(), truncated_is=2.0, is_level="geometric", is_mode="mask")
    learner = wl.make_learner(wl.build_model(0), cfg, NoGradAverage())
    c = Coefs.of(learner.cfg)
    assert (c.truncated_is, c.is_level, c.is_mode) == (2.0, "geometric", "mask")


HAS_FLAGS = {"is_level", "is_mode"} <= {f.name for f in dataclasses.fields(PPOOptions)}


@pytest.mark.skipif(not HAS_FLAGS, reason="PPOOptions (hpcrl/ppo/workloads/options.py) has no is_level / is_mode yet")
def test_flags_parse_and_reach_the_learner_config():
    from hpcrl.ppo.config import parse_args
    from hpcrl.ppo.run import build_workload

    cfg = parse_args(["--workload", "lm", "--ppo.truncated-is", "2", "--ppo.is-level", "sequence", "--ppo.is-mode",
                      "mask"])
    cfg.check()
    _, ppo = build_workload(cfg)
    assert (ppo.truncated_is, ppo.is_level, ppo.is_mode) == (2.0, "sequence", "mask")
    with pytest.raises(ConfigError, match="--ppo.is-level sequence: needs --ppo.truncated-is C"):
        build_workload(parse_args(["--workload", "lm", "--ppo.is-level", "sequence"]))


@pytest.mark.skipif(not HAS_FLAGS, reason="PPOOptions (hpcrl/ppo/workloads/options.py) has no is_level / is_mode yet")
def test_cli_refuses_a_level_without_a_cap(monkeypatch, capsys):
    import hpcrl.ppo.__main__ as ppo_main

    def started(*a, **kw):
        raise AssertionError("ranks were started for a bad configuration")

    monkeypatch.setattr(ppo_main, "spawn", started)
    monkeypatch.setattr(ppo_main, "train", started)
    rc = ppo_main.main(["--trainer-device", "cpu", "--maker-device", "cpu", "--workload", "lm",
                        "--ppo.is-level", "sequence"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2 and len(err) == 1 and "--ppo.is-level sequence: needs --ppo.truncated-is C" in err[0], err


# ------------------------------------------------------------------------------ hf, one process


def test_hf_update_with_sequence_level_correction(tmp_path):
    pytest.importorskip("transformers")
    import hf_fixtures as F
    from hpcrl.comm import GradAverager, Plane
    from hpcrl.ppo.workloads.hf import HFWorkload

    wl = HFWorkload(model=str(F.build_causal_lm(tmp_path / "llama")), reward_fn="hf_fixtures:target_fraction",
                    prompts=str(F.write_prompts(tmp_path / "prompts.jsonl")), max_prompt_tokens=8, max_new_tokens=8,
                    batch_size=8)
    cfg = dataclasses.replace(wl.default_config(), truncated_is=2.0, is_level="sequence", epochs=1, minibatches=2)
    model = wl.build_model(0)
    learner = wl.make_learner(model, cfg, GradAverager([p for p in model.parameters() if p.requires_grad],
                                                       plane=Plane.local("device")))
    gen = torch.Generator().manual_seed(2)
    batch, _ = wl.make_collector(11).collect(model, gen)
    mask = batch["action_mask"].float()
    # a stale-looking half: its behaviour log-probs 0.3 nats lower per token, W = exp(0.3 x tokens) (> 2 from 3 tokens)
    batch["behaviour_logp"] = batch["behaviour_logp"] - 0.3 * mask * (torch.arange(8) % 2 == 0).float()[:, None]
    stats = learner.update([batch], gen)
    for k in ("is_weight_mean", "is_weight_max", "is_trunc_frac"):
        assert math.isfinite(stats[k]), (k, stats)
    assert 0 < stats["is_trunc_frac"] <= 0.5 + 1e-9 and stats["is_weight_max"] <= 2.0 + 1e-6
    assert math.isfinite(stats["policy_loss"])
