"""PPO math (hpcrl.ppo.losses) against brute force and hand-computed points."""

import math

import pytest
import torch

from hpcrl.ppo.losses import (
    approx_kl,
    entropy_bonus,
    gae,
    last_valid_index,
    masked_mean,
    per_token_kl_penalty,
    policy_loss,
    sequence_rewards_with_kl,
    token_gae,
    value_loss,
    whiten,
)


def gae_brute(r, v, nv, term, done, gamma, lam):
    """Forward-sum definition, per env, in Python floats: A_t = sum_k (gamma lam)^k delta_{t+k},
    stopping after the step where the episode ended."""
    T, N = len(r), len(r[0])
    adv = [[0.0] * N for _ in range(T)]
    for n in range(N):
        for t in range(T):
            total, coef = 0.0, 1.0
            for k in range(t, T):
                delta = r[k][n] + gamma * (1.0 - term[k][n]) * nv[k][n] - v[k][n]
                total += coef * delta
                if done[k][n]:
                    break
                coef *= gamma * lam
            adv[t][n] = total
    return adv


def random_episode_data(T, N, seed):
    g = torch.Generator().manual_seed(seed)
    r = torch.randn(T, N, generator=g, dtype=torch.float64)
    v = torch.randn(T, N, generator=g, dtype=torch.float64)
    nv = torch.randn(T, N, generator=g, dtype=torch.float64)
    u = torch.rand(T, N, generator=g, dtype=torch.float64)
    term = u < 0.15
    trunc = (u >= 0.15) & (u < 0.3)
    return r, v, nv, term, term | trunc


@pytest.mark.parametrize("T,N", [(1, 1), (1, 5), (7, 3), (40, 4)])
@pytest.mark.parametrize("gamma,lam", [(0.99, 0.95), (0.98, 0.8), (1.0, 1.0), (0.9, 0.0)])
def test_gae_matches_brute_force(T, N, gamma, lam):
    r, v, nv, term, done = random_episode_data(T, N, seed=T * 100 + N)
    adv, ret = gae(r, v, nv, term, done, gamma, lam)
    want = torch.tensor(gae_brute(r.tolist(), v.tolist(), nv.tolist(), term.tolist(), done.tolist(), gamma, lam),
                        dtype=torch.float64)
    torch.testing.assert_close(adv, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ret, want + v)
    # Float 0/1 flags (how experience travels) give the same answer as bools.
    adv_f, _ = gae(r, v, nv, term.double(), done.double(), gamma, lam)
    torch.testing.assert_close(adv_f, adv)


def test_gae_single_step_cases():
    r = torch.tensor([[1.0, 1.0, 1.0]])
    v = torch.tensor([[0.5, 0.5, 0.5]])
    nv = torch.tensor([[2.0, 2.0, 2.0]])
    term = torch.tensor([[False, True, False]])
    done = torch.tensor([[False, True, True]])  # env 2 truncated
    adv, ret = gae(r, v, nv, term, done, 0.9, 0.95)
    # ongoing and truncated bootstrap from V(next obs); terminated does not.
    torch.testing.assert_close(adv, torch.tensor([[1 + 0.9 * 2 - 0.5, 1 - 0.5, 1 + 0.9 * 2 - 0.5]]))
    torch.testing.assert_close(ret, torch.tensor([[1 + 0.9 * 2, 1.0, 1 + 0.9 * 2]]))


def test_gae_boundary_cuts_recursion_and_lambda_one_is_monte_carlo():
    # One env, episode ends (truncated) at t=1; a new episode runs t=2..3.
    r = torch.tensor([[1.0], [2.0], [3.0], [4.0]], dtype=torch.float64)
    v = torch.zeros(4, 1, dtype=torch.float64)
    nv = torch.tensor([[0.0], [10.0], [0.0], [5.0]], dtype=torch.float64)  # V(final obs)=10, V(last next)=5
    term = torch.zeros(4, 1, dtype=torch.bool)
    done = torch.tensor([[False], [True], [False], [False]])
    adv, _ = gae(r, v, nv, term, done, 0.5, 1.0)
    # lam=1, V=0 inside episodes: discounted rewards + gamma^k * bootstrap, never across t=1 -> t=2.
    want = [1 + 0.5 * 2 + 0.25 * 10, 2 + 0.5 * 10, 3 + 0.5 * 4 + 0.25 * 5, 4 + 0.5 * 5]
    torch.testing.assert_close(adv.squeeze(1), torch.tensor(want, dtype=torch.float64))
    # With the same step terminated instead, the bootstrap 10 disappears.
    adv_t, _ = gae(r, v, nv, done.clone(), done, 0.5, 1.0)
    torch.testing.assert_close(adv_t[:2, 0], torch.tensor([1 + 0.5 * 2, 2.0], dtype=torch.float64))


def test_whiten():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1000, generator=g, dtype=torch.float64) * 7 + 3
    y = whiten(x)
    assert abs(float(y.mean())) < 1e-12
    assert abs(float(y.var(unbiased=False)) - 1) < 1e-6
    # Masked: padding neither moves the statistics nor survives.
    mask = torch.zeros(1200, dtype=torch.bool)
    mask[:1000] = True
    padded = torch.cat([x, torch.full((200,), 1e6, dtype=torch.float64)])
    yp = whiten(padded, mask=mask)
    torch.testing.assert_close(yp[:1000], y)
    assert torch.all(yp[1000:] == 0)
    # One element / constant batch: finite zeros, not NaN.
    assert torch.equal(whiten(torch.tensor([5.0])), torch.tensor([0.0]))
    assert torch.equal(whiten(torch.full((4,), 2.0)), torch.zeros(4))


def _surrogate_grad(ratio, adv, clip, **kw):
    """(loss, d loss / d logp) for one element at the given ratio against behaviour logp 0."""
    logp = torch.tensor([math.log(ratio)], dtype=torch.float64, requires_grad=True)
    loss, stats = policy_loss(logp, torch.zeros(1, dtype=torch.float64), torch.tensor([adv], dtype=torch.float64),
                              clip, **kw)
    loss.backward()
    return float(loss.detach()), float(logp.grad), stats


@pytest.mark.parametrize(
    "ratio,adv,loss,grad_zero,clipped",
    [
        (1.1, 2.0, -1.1 * 2.0, False, False),  # inside the range: plain ratio * A
        (0.95, -1.0, 0.95, False, False),
        (1.5, 2.0, -1.2 * 2.0, True, True),  # A > 0, ratio above 1 + eps: clipped, no gradient
        (0.5, 2.0, -0.5 * 2.0, False, True),  # A > 0, ratio below 1 - eps: pessimistic unclipped term
        (1.5, -1.0, 1.5, False, True),  # A < 0, ratio above: pessimistic unclipped term
        (0.5, -1.0, 0.8, True, True),  # A < 0, ratio below 1 - eps: clipped, no gradient
    ],
)
def test_policy_loss_hand_points(ratio, adv, loss, grad_zero, clipped):
    got, grad, stats = _surrogate_grad(ratio, adv, 0.2)
    assert got == pytest.approx(loss, rel=1e-12)
    if grad_zero:
        assert grad == 0.0
    else:  # d(-ratio * A)/d logp = -ratio * A
        assert grad == pytest.approx(-ratio * adv, rel=1e-12)
    assert float(stats["clip_frac"]) == float(clipped)


def test_policy_loss_mean_and_mask():
    logp = torch.log(torch.tensor([1.1, 1.5, 0.9, 3.0]))
    adv = torch.tensor([1.0, 1.0, -2.0, 5.0])
    mask = torch.tensor([True, True, True, False])
    loss, stats = policy_loss(logp, torch.zeros(4), adv, 0.2, mask=mask)
    assert float(loss) == pytest.approx(-(1.1 + 1.2 - 1.8) / 3, rel=1e-6)
    assert float(stats["clip_frac"]) == pytest.approx(1 / 3)


def test_policy_loss_truncated_is():
    # Decoupled form: ratio against the proximal policy, weight pi_prox / pi_behaviour (detached).
    behaviour = torch.log(torch.tensor([0.1, 0.4, 0.2], dtype=torch.float64))
    proximal = torch.log(torch.tensor([0.4, 0.2, 0.2], dtype=torch.float64))  # weights 4, 0.5, 1
    logp = torch.log(torch.tensor([0.44, 0.2, 0.3], dtype=torch.float64)).requires_grad_(True)  # ratios 1.1, 1, 1.5
    adv = torch.tensor([1.0, -1.0, 2.0], dtype=torch.float64)
    loss, stats = policy_loss(logp, behaviour, adv, 0.2, truncated_is=2.0, proximal_logp=proximal)
    # weights capped at 2: [2, 0.5, 1]; surrogates [1.1, -1, min(3, 2.4)=2.4]
    assert float(loss.detach()) == pytest.approx(-(2 * 1.1 + 0.5 * -1 + 1 * 2.4) / 3, rel=1e-12)
    loss.backward()
    # d/d logp of -w * ratio * A where unclipped; the clipped third element has none.
    want = torch.tensor([-2 * 1.1 * 1.0, -0.5 * 1.0 * -1.0, 0.0], dtype=torch.float64) / 3
    torch.testing.assert_close(logp.grad, want)
    assert float(stats["is_trunc_frac"]) == pytest.approx(1 / 3)
    assert float(stats["is_weight_mean"]) == pytest.approx((2 + 0.5 + 1) / 3)
    # Uncapped decoupled weight, and lag 0 (proximal == behaviour) equals plain PPO.
    loss_uncapped, _ = policy_loss(logp, behaviour, adv, 0.2, proximal_logp=proximal)
    assert float(loss_uncapped.detach()) == pytest.approx(-(4 * 1.1 + 0.5 * -1 + 2.4) / 3, rel=1e-12)
    plain, _ = policy_loss(logp, behaviour, adv, 0.2)
    lag0, _ = policy_loss(logp, behaviour, adv, 0.2, truncated_is=2.0, proximal_logp=behaviour)
    assert float(lag0.detach()) == pytest.approx(float(plain.detach()), rel=1e-12)
    with pytest.raises(ValueError, match="proximal_logp"):
        policy_loss(logp, behaviour, adv, 0.2, truncated_is=2.0)


def test_value_loss_clipping():
    old = torch.tensor([1.0, 1.0, 1.0])
    returns = torch.tensor([3.0, 3.0, 0.0])
    values = torch.tensor([2.0, 1.2, 3.0])
    # Unclipped: 0.5 * mean((V - R)^2).
    assert float(value_loss(values, old, returns, None)) == pytest.approx(0.5 * (1.0 + 1.8**2 + 9.0) / 3)
    # Clip 0.5: V_clip = [1.5, 1.2, 1.5]; max of errors: [2.25, 3.24, 9] (the pessimistic one).
    assert float(value_loss(values, old, returns, 0.5)) == pytest.approx(0.5 * (2.25 + 3.24 + 9.0) / 3)
    # Moving toward the return beyond the clip range gets no gradient from the clipped term.
    v = torch.tensor([2.0], requires_grad=True)
    value_loss(v, torch.tensor([1.0]), torch.tensor([3.0]), 0.5).backward()
    assert float(v.grad) == 0.0


def test_entropy_bonus_and_masked_mean():
    ent = torch.tensor([1.0, 2.0, 3.0])
    assert float(entropy_bonus(ent, 0.01)) == pytest.approx(-0.02)
    assert float(entropy_bonus(ent, 0.5, mask=torch.tensor([1, 0, 1]))) == pytest.approx(-1.0)
    assert float(masked_mean(ent, torch.zeros(3, dtype=torch.bool))) == 0.0


def test_token_gae_ends_each_sequence_at_its_last_token():
    """The sequence ends at its last action token (right padding): what a one-hot end marker gives."""
    g = torch.Generator().manual_seed(3)
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    rewards, values = torch.randn(3, 4, generator=g) * mask, torch.randn(3, 4, generator=g)
    adv, ret = token_gae(rewards, values, mask, 0.9, 0.8, normalize=False)
    last = torch.nn.functional.one_hot(torch.clamp(mask.sum(-1).long() - 1, min=0), 4).float()
    nxt = torch.cat([values[:, 1:], torch.zeros(3, 1)], 1)
    want_adv, want_ret = gae(rewards.T, values.T, nxt.T, last.T, last.T, 0.9, 0.8)
    assert torch.equal(adv, want_adv.T * mask) and torch.equal(ret, want_ret.T)
    assert float(adv[1, 2:].abs().sum()) == 0.0
    whitened, _ = token_gae(rewards, values, mask, 0.9, 0.8, normalize=True)
    assert float(masked_mean(whitened, mask)) == pytest.approx(0.0, abs=1e-6)


def test_approx_kl_k3():
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(10_000, generator=g), torch.randn(10_000, generator=g)
    assert torch.all(approx_kl(a, b) >= 0)
    assert torch.equal(approx_kl(a, a), torch.zeros_like(a))
    # Unbiased for KL(p || q) with samples from p (direction check).
    p = torch.tensor([0.8, 0.15, 0.05], dtype=torch.float64)
    q = torch.tensor([0.3, 0.3, 0.4], dtype=torch.float64)  # KL(p||q) 0.58, KL(q||p) 0.75
    x = torch.multinomial(p, 200_000, replacement=True, generator=g)
    est = float(approx_kl(p.log()[x], q.log()[x]).mean())
    kl_pq = float((p * (p / q).log()).sum())
    assert est == pytest.approx(kl_pq, rel=0.03)
    assert abs(est - float((q * (q / p).log()).sum())) > 0.1  # not the reverse KL


def test_per_token_kl_penalty():
    logp = torch.log(torch.tensor([[0.5, 0.25, 0.9], [0.1, 0.1, 0.1]], dtype=torch.float64))
    ref = torch.log(torch.tensor([[0.25, 0.25, 0.3], [0.2, 0.1, 0.05]], dtype=torch.float64))
    mask = torch.tensor([[True, True, False], [True, True, True]])
    out = per_token_kl_penalty(logp, ref, mask, 0.1)
    k3 = lambda p, q: (q / p - 1) - math.log(q / p)  # noqa: E731
    want = [[-0.1 * k3(0.5, 0.25), 0.0, 0.0], [-0.1 * k3(0.1, 0.2), 0.0, -0.1 * k3(0.1, 0.05)]]
    torch.testing.assert_close(out, torch.tensor(want, dtype=torch.float64))
    k1 = per_token_kl_penalty(logp, ref, mask, 0.1, estimator="k1")
    torch.testing.assert_close(k1[0, 0], torch.tensor(-0.1 * math.log(2), dtype=torch.float64))
    assert k1[0, 2] == 0
    with pytest.raises(ValueError):
        per_token_kl_penalty(logp, ref, mask, 0.1, estimator="k2")


def test_sequence_rewards_with_kl():
    logp = torch.zeros(4, 5)
    ref = torch.zeros(4, 5)
    ref[1, 1] = math.log(2.0)  # one token with KL (k3: 2 - 1 - ln 2)
    mask = torch.tensor(
        [
            [1, 1, 1, 0, 0],  # right padding: last valid 2
            [0, 1, 1, 1, 1],  # left padding: last valid 4
            [0, 0, 0, 0, 0],  # empty: no reward at all
            [1, 0, 1, 1, 0],  # holes: last true entry
        ],
        dtype=torch.bool,
    )
    assert last_valid_index(mask)[[0, 1, 3]].tolist() == [2, 4, 3]
    score = torch.tensor([1.0, 2.0, 3.0, 4.0])
    out = sequence_rewards_with_kl(score, logp, ref, mask, kl_coef=0.5)
    want = torch.zeros(4, 5)
    want[0, 2], want[1, 4], want[3, 3] = 1.0, 2.0, 4.0
    want[1, 1] = -0.5 * (1.0 - math.log(2.0))
    torch.testing.assert_close(out, want)
