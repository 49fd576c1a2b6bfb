"""Loss variants (hpcrl.ppo.losses): RLOO / Dr. GRPO group baselines, the three loss normalisations,
the adaptive KL controller and the warm-up + cosine schedule, each against numbers computed by hand in
the comments; micro-batch gradient accumulation in :func:`hpcrl.ppo.update.ppo_update` equal to one
pass over the whole minibatch; the options' bad values as one ConfigError line."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import nn

from hpcrl.core.config_check import ConfigError
from hpcrl.ppo.losses import adaptive_kl_coef, group_advantages, loss_weights, lr_at
from hpcrl.ppo.sync import NoGradAverage
from hpcrl.ppo.update import (Coefs, GradStep, Outputs, Plan, Samples, micro_batches, ppo_losses, ppo_update, read_stats,
                              token_micro_batches)
from hpcrl.ppo.workload import PPOConfig


# ------------------------------------------------------------------------------ group baselines


def test_group_advantages_by_hand():
    # group 1 = [3, 0, 0]: mean 1, centred [2, -1, -1], population std sqrt((4 + 1 + 1) / 3) = sqrt(2)
    # group 2 = [2, 2, 2]: every variant gives 0 (no signal, no NaN)
    score = torch.tensor([3.0, 0.0, 0.0, 2.0, 2.0, 2.0])
    r2 = math.sqrt(2.0)
    grpo = group_advantages(score, 3, "grpo")
    torch.testing.assert_close(grpo, torch.tensor([2 / r2, -1 / r2, -1 / r2, 0, 0, 0]), atol=1e-5, rtol=0)
    # Dr. GRPO: centred only, no std division
    torch.testing.assert_close(group_advantages(score, 3, "dr-grpo"), torch.tensor([2.0, -1, -1, 0, 0, 0]))
    # RLOO: r_i - mean of the other two: 3 - (0 + 0) / 2 = 3; 0 - (3 + 0) / 2 = -1.5 (= 3/2 x centred)
    torch.testing.assert_close(group_advantages(score, 3, "rloo"), torch.tensor([3.0, -1.5, -1.5, 0, 0, 0]))
    # groups of 2: [1, 0] -> rloo [1, -1] (= 2 x centred [0.5, -0.5])
    torch.testing.assert_close(group_advantages(torch.tensor([1.0, 0.0]), 2, "rloo"), torch.tensor([1.0, -1.0]))
    with pytest.raises(ValueError, match="advantage must be"):
        group_advantages(score, 3, "gae")  # type: ignore[arg-type]


# ------------------------------------------------------------------------------ normalisation


def test_loss_weights_by_hand():
    # two sequences of G = 4 response tokens: row 0 has 2 valid tokens, row 1 has 4; x = 1 on row 0, 4 on row 1
    mask = torch.tensor([[1.0, 1, 0, 0], [1, 1, 1, 1]])
    x = torch.tensor([[1.0, 1, 9, 9], [4, 4, 4, 4]])  # the 9s are padding: weight 0 in every norm
    # token: 6 valid tokens, each 1/6: (1 + 1 + 4 * 4) / 6 = 3
    w = loss_weights(mask, "token", x)
    torch.testing.assert_close(w, mask / 6)
    assert float((w * x).sum()) == pytest.approx(3.0)
    # sequence: each row's mean (1 and 4), then their mean: 2.5; row 0's tokens weigh 1/(2*2), row 1's 1/(4*2)
    w = loss_weights(mask, "sequence", x)
    torch.testing.assert_close(w, torch.tensor([[0.25, 0.25, 0, 0], [0.125, 0.125, 0.125, 0.125]]))
    assert float((w * x).sum()) == pytest.approx(2.5)
    # dr-grpo: the tokens' sum over the constant G x rows = 4 x 2: (2 + 16) / 8 = 2.25, every token 1/8
    w = loss_weights(mask, "dr-grpo", x)
    torch.testing.assert_close(w, mask / 8)
    assert float((w * x).sum()) == pytest.approx(2.25)
    # no mask: all three are the plain mean (8 elements)
    for norm in ("token", "sequence", "dr-grpo"):
        torch.testing.assert_close(loss_weights(None, norm, x), torch.full_like(x, 1 / 8))
    # an empty minibatch: weights 0, no NaN
    assert float(loss_weights(torch.zeros(2, 4), "sequence", x).sum()) == 0.0


def test_dr_grpo_policy_loss_by_hand():
    # at ratio 1 (logp = behaviour) the clipped surrogate is A itself: loss = -sum(w * A);
    # advantages +1 on the short row (2 tokens), -1 on the long one (4 tokens)
    mask = torch.tensor([[1.0, 1, 0, 0], [1, 1, 1, 1]])
    adv = torch.tensor([[1.0], [-1.0]]) * mask
    logp = torch.full((2, 4), -1.0)
    s = Samples(behaviour_logp=logp, advantages=adv, mask=mask)
    out = Outputs(logp, torch.zeros(2, 4))
    got = {}
    for norm in ("token", "sequence", "dr-grpo"):
        w = (loss_weights(mask, norm, logp), loss_weights(mask, "token", logp))
        got[norm] = float(ppo_losses(out, s, Coefs(clip=0.2), w)[0])
    # token: -(2 - 4) / 6 = 1/3 (the long wrong answer dominates); sequence: -(1 - 1) / 2 = 0 (length cancels);
    # dr-grpo: -(2 - 4) / 8 = 1/4
    assert got == pytest.approx({"token": 1 / 3, "sequence": 0.0, "dr-grpo": 0.25})
    # and without weights the loss is the token mean, as before
    assert float(ppo_losses(out, s, Coefs(clip=0.2))[0]) == pytest.approx(1 / 3)


# ------------------------------------------------------------------------------ KL controller, schedule


def test_adaptive_kl_coef_by_hand():
    # Ziegler et al.: e = clip(KL / target - 1, -0.2, 0.2); coef * (1 + e * n / horizon); n / horizon = 256 / 1e4
    # KL 9 vs target 6: e = 0.5 -> clipped to 0.2: 0.1 * (1 + 0.2 * 0.0256) = 0.100512
    assert adaptive_kl_coef(0.1, 9.0, 6.0, 10_000, 256) == pytest.approx(0.100512, rel=1e-12)
    # KL 5.4: e = -0.1: 0.1 * (1 - 0.1 * 0.0256) = 0.099744
    assert adaptive_kl_coef(0.1, 5.4, 6.0, 10_000, 256) == pytest.approx(0.099744, rel=1e-12)
    # on target: unchanged; KL 0: e = -1 -> -0.2: 0.1 * (1 - 0.2 * 1) = 0.08 (horizon = n)
    assert adaptive_kl_coef(0.1, 6.0, 6.0, 10_000, 256) == 0.1
    assert adaptive_kl_coef(0.1, 0.0, 6.0, 16, 16) == pytest.approx(0.08)


def test_lr_warmup_and_cosine_by_hand():
    lr = 1e-3
    # warm-up over 4 updates: lr * (u + 1) / 4 = 2.5e-4, 5e-4, 7.5e-4, 1e-3
    assert [lr_at(u, lr, "constant", 4) for u in range(5)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3])
    # then a cosine over 4 updates down to 0.1 * lr: lr * (0.1 + 0.9 * 0.5 * (1 + cos(pi * t))), t = (u - 4) / 4
    # u 4: t 0 -> 1e-3; u 5: t 1/4, cos = 0.707107 -> 0.1 + 0.9 * 0.853553 = 0.868198; u 6: t 1/2 -> 0.55;
    # u 8: t 1 -> 0.1; later: stays at 0.1
    got = [lr_at(u, lr, "cosine", 4, 4, 0.1) for u in (0, 4, 5, 6, 8, 100)]
    assert got == pytest.approx([2.5e-4, 1e-3, 8.68198e-4, 5.5e-4, 1e-4, 1e-4], rel=1e-5)
    assert lr_at(7, lr) == lr  # constant, no warm-up: the lr itself


# ------------------------------------------------------------------------------ micro-batches


def _toy(n: int, g: int = 3, seed: int = 0, critic: bool = True):
    """A linear "policy" and "critic" over token features [n, g, 4] with fixed samples (ppo: a critic;
    grpo: none, a KL term to a reference instead)."""
    gen = torch.Generator().manual_seed(seed)
    feats = torch.randn(n, g, 4, generator=gen)
    torch.manual_seed(seed)
    pi, v = nn.Linear(4, 1), nn.Linear(4, 1)
    mask = (torch.rand(n, g, generator=gen) > 0.3).float()
    mask[:, 0] = 1.0
    blogp = -torch.rand(n, g, generator=gen) - 0.5
    kw = dict(old_values=torch.randn(n, g, generator=gen), returns=torch.randn(n, g, generator=gen)) if critic else \
        dict(ref_logp=blogp - 0.2 * torch.rand(n, g, generator=gen))
    samples = Samples(behaviour_logp=blogp, advantages=torch.randn(n, g, generator=gen), mask=mask, **kw)

    def forward(idx):
        logp = -nn.functional.softplus(pi(feats[idx])).squeeze(-1)
        return Outputs(logp, -logp, v(feats[idx]).squeeze(-1) if critic else None)

    params = [*pi.parameters(), *v.parameters()] if critic else list(pi.parameters())
    return params, samples, forward


def test_micro_batches_cut_consecutive_pieces():
    assert micro_batches(5, None) == [slice(0, 5)] and micro_batches(5, 8) == [slice(0, 5)]
    assert micro_batches(5, 2) == [slice(0, 2), slice(2, 4), slice(4, 5)]


def test_token_micro_batches_fill_a_budget():
    """Pieces grow while the forward's cost stays within the budget; one sample over it runs alone; a size
    cap closes a piece too. Costs as the hf forwards count them: packed (sum) and rectangular (rows x max)."""
    lengths = {0: 2, 1: 3, 2: 3, 3: 5, 4: 9, 5: 4}
    packed = lambda rows: sum(lengths[i] for i in rows)  # noqa: E731
    rect = lambda rows: len(rows) * max(lengths[i] for i in rows)  # noqa: E731
    rows = [0, 1, 2, 3, 4, 5]
    assert token_micro_batches(rows, 8, packed) == [slice(0, 3), slice(3, 4), slice(4, 5), slice(5, 6)]
    assert token_micro_batches(rows, 10, rect) == [slice(0, 3), slice(3, 4), slice(4, 5), slice(5, 6)]
    assert token_micro_batches(rows, 100, packed, size=4) == [slice(0, 4), slice(4, 6)]
    for budget in (1, 6, 13, 100):
        for cost in (packed, rect):
            pieces = token_micro_batches(rows, budget, cost)
            assert [i for p in pieces for i in rows[p]] == rows  # consecutive, every sample once
            assert all(p.stop - p.start == 1 or cost(rows[p]) <= budget for p in pieces)


@pytest.mark.parametrize("critic", [True, False], ids=["ppo", "grpo"])
@pytest.mark.parametrize("norm", ["token", "sequence", "dr-grpo"])
def test_micro_batches_equal_one_large_minibatch(critic, norm):
    """2 epochs x 2 minibatches of 7 sequences: micro-batches of 1, 3 (pieces 3 + 3 + 1) and 7 give the
    parameters and stats of the whole-minibatch passes, for ppo (critic) and grpo (KL term)."""
    coefs = Coefs(clip=0.2, value_clip=0.5, vf=0.7, ent=0.01, kl=0.3 if not critic else 0.0)
    results = {}
    for micro in (None, 1, 3, 7):
        params, samples, forward = _toy(14, critic=critic)
        step = GradStep(torch.optim.SGD(params, lr=0.5), params, NoGradAverage(), max_grad_norm=1e6)
        stats = read_stats(ppo_update(forward, samples, coefs, Plan(2, 2), step, torch.Generator().manual_seed(3),
                                      logp_gap=True, micro_batch_size=micro, loss_norm=norm))
        results[micro] = ([p.detach().clone() for p in params], stats)
    want_params, want_stats = results[None]
    start, _, _ = _toy(14, critic=critic)
    assert any((a - b).abs().max() > 1e-3 for a, b in zip(want_params, start))  # the step moved them
    for micro in (1, 3, 7):
        got_params, got_stats = results[micro]
        for a, b in zip(got_params, want_params):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert got_stats.keys() == want_stats.keys()
        for k in want_stats:
            assert got_stats[k] == pytest.approx(want_stats[k], rel=1e-5, abs=1e-7), (micro, k)


@pytest.mark.parametrize("norm", ["token", "sequence"])
def test_token_budget_micro_batches_equal_one_large_minibatch(norm):
    """Pieces cut by a token budget over samples of unequal cost (ordered by it, pieces of 1 to 5 samples)
    give the whole-minibatch update's parameters and stats."""
    coefs = Coefs(clip=0.2, value_clip=0.5, vf=0.7, ent=0.01)
    lengths = torch.tensor([1, 7, 3, 2, 9, 4, 4, 1, 6, 2, 3, 8, 5, 1])
    cost = lambda rows: sum(int(lengths[i]) for i in rows)  # noqa: E731
    results, cuts = {}, []
    for budget in (None, 9, 12):
        params, samples, forward = _toy(14)
        step = GradStep(torch.optim.SGD(params, lr=0.5), params, NoGradAverage(), max_grad_norm=1e6)
        counted = lambda idx: cuts.append((budget, len(idx))) or forward(idx)  # noqa: E731
        stats = read_stats(ppo_update(counted, samples, coefs, Plan(2, 2), step, torch.Generator().manual_seed(3),
                                      loss_norm=norm, piece_key=lengths, micro_batch_tokens=budget,
                                      piece_cost=cost))
        results[budget] = ([p.detach().clone() for p in params], stats)
    assert max(n for b, n in cuts if b == 9) < 7 == max(n for b, n in cuts if b is None)  # 9 cut the minibatches
    for budget in (9, 12):
        for a, b in zip(results[budget][0], results[None][0]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        for k, v in results[None][1].items():
            assert results[budget][1][k] == pytest.approx(v, rel=1e-5, abs=1e-7), (budget, k)
    with pytest.raises(ValueError, match="micro_batch_tokens needs piece_cost"):
        ppo_update(forward, samples, coefs, Plan(1, 1), step, torch.Generator(), micro_batch_tokens=4)


def test_micro_batch_gradients_equal_the_minibatch_gradient():
    """One minibatch, no step (lr 0): the accumulated gradient is the whole minibatch's, per parameter,
    also with the pieces cut after ordering the samples by a key (lengths: ``piece_key``)."""
    grads = {}
    for micro, key in ((None, None), (2, None), (2, torch.tensor([3, 1, 2, 1, 0]))):
        params, samples, forward = _toy(5)
        seen = []
        step = GradStep(torch.optim.SGD(params, lr=0.0), params, NoGradAverage(), max_grad_norm=1e6)
        ppo_update(lambda idx: seen.append(idx.tolist()) or forward(idx), samples, Coefs(clip=0.2), Plan(1, 1), step,
                   torch.Generator().manual_seed(0), micro_batch_size=micro, piece_key=key)
        grads[micro, key is None] = [p.grad.clone() for p in params]
        if key is not None:  # pieces of like keys: [4 (key 0), 1 or 3 (key 1)], [the other key-1 one, 2], [0]
            assert [key[i].item() for piece in seen for i in piece] == [0, 1, 1, 2, 3]
    for got in (grads[2, True], grads[2, False]):
        for a, b in zip(got, grads[None, True]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    assert any(g.abs().max() > 0 for g in grads[None, True])


# ------------------------------------------------------------------------------ bad values


@pytest.mark.parametrize("field,value,want", [
    ("advantage", "gae", "--ppo.advantage gae: must be grpo, dr-grpo or rloo"),
    ("loss_norm", "mean", "--ppo.loss-norm mean: must be token, sequence or dr-grpo"),
    ("kl_target", 0.0, "--ppo.kl-target 0.0: must be a finite number > 0"),
    ("kl_horizon", 0, "--ppo.kl-horizon 0: must be an integer >= 1"),
    ("warmup_updates", -1, "--ppo.warmup-updates -1: must be an integer >= 0"),
    ("lr_schedule", "cosine", "--ppo.lr-schedule cosine: needs --ppo.decay-updates N"),
    ("min_lr_ratio", 1.5, "--ppo.min-lr-ratio 1.5: must be in [0, 1]"),
])
def test_bad_variant_values_are_one_line(field, value, want):
    with pytest.raises(ConfigError) as err:
        dataclasses.replace(PPOConfig(), **{field: value})
    assert want in str(err.value) and "\n" not in str(err.value)
