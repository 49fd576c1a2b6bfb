"""``--cdq``: clipped double Q on the distributional critic. Every head regresses onto the target head
whose expected value is lowest for that sample, and the actor maximises the lowest head; the eager update
and the pure functions that ``--compile`` captures compute the same thing."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch

from hpcrl.comm import Plane
from hpcrl.sac import FastSAC, losses
from hpcrl.sac.functional import Functional
from hpcrl.sac.update import Data

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sac_workers import ACT, OBS, global_data, small_config  # noqa: E402


def test_lowest_head_takes_each_samples_lower_head():
    support = torch.tensor([0.0, 1.0, 2.0])
    probs = torch.tensor([[[1.0, 0, 0], [0, 0, 1]],    # head 0: expected values 0 and 2
                          [[0, 1.0, 0], [0, 1, 0]]])   # head 1: 1 and 1
    assert torch.equal(losses.lowest_head(probs, support), torch.tensor([[[1.0, 0, 0], [0, 1, 0]]]))


def test_the_clipped_actor_loss_takes_the_lowest_head():
    q = torch.tensor([[1.0, 5.0], [3.0, 2.0]])
    log_prob, alpha = torch.tensor([0.5, -0.5]), torch.tensor(0.2)
    assert torch.allclose(losses.actor_loss(log_prob, q, alpha, clipped=True), torch.tensor((0.1 - 1 - 0.1 - 2) / 2))
    assert torch.allclose(losses.actor_loss(log_prob, q, alpha), torch.tensor((0.1 - 2 - 0.1 - 3.5) / 2))


def agent(cdq: bool) -> FastSAC:
    torch.manual_seed(0)
    cfg = dataclasses.replace(small_config("flat"), cdq=cdq, num_q=3)
    return FastSAC(cfg, OBS, ACT, -torch.ones(ACT), torch.ones(ACT), torch.device("cpu"), plane=Plane.local("device"))


def by_hand(a: FastSAC, batch, noise) -> torch.Tensor:
    """The critic loss with each sample's target taken from its lowest target head, one sample at a time."""
    with torch.no_grad():
        next_action, next_log_prob = a.actor.sample(batch.next_obs, noise.next_eps)
        probs = torch.softmax(a.critic_target(batch.next_obs, next_action), -1)  # [H, B, N]
        support = a.critic.support
        chosen = torch.stack([probs[int((probs[:, b] * support).sum(-1).argmin()), b] for b in range(probs.shape[1])])
        reward = losses.soft_reward(batch.reward, batch.discount, a.alpha, next_log_prob)
        target = losses.categorical_projection(chosen, reward, batch.discount, support)
        log_p = torch.log_softmax(a.critic(batch.obs, batch.action), -1)
        return -(target * log_p).sum(-1).mean(-1).sum()


def test_an_update_regresses_every_head_onto_the_lowest_target_head():
    batch, noise = global_data(0)
    clipped, plain = agent(True), agent(False)
    want = by_hand(clipped, batch, noise)
    got = clipped.update(batch, noise)["critic_loss"]
    torch.testing.assert_close(got, want)
    assert not torch.allclose(plain.update(batch, noise)["critic_loss"], want)  # holosoma's targets differ


def test_the_captured_pieces_compute_the_same_losses():
    batch, noise = global_data(0)
    a = agent(True)
    fn, f32 = Functional(a), torch.float32
    bufs = [flat.buffers[f32] for flat in a.layout.flats()]  # critic, actor, target
    data = Data.of(batch, noise)
    _, (critic_loss, _, alpha) = fn.critic_loss(*bufs, data)
    torch.testing.assert_close(critic_loss, by_hand(a, batch, noise))
    actor_loss, _ = fn.actor_loss(bufs[1], bufs[0], data, alpha)
    with torch.no_grad():
        action, log_prob = a.actor.sample(batch.obs, noise.actor_eps)
        q = a.critic.q_value(a.critic(batch.obs, action))
    torch.testing.assert_close(actor_loss.detach(), (alpha * log_prob - q.min(0).values).mean())
