"""FastSAC's cheaper update: the batched critic equals the per-head one, flat parameters equal
per-parameter tensors, and checkpoints keep the per-parameter, per-head format both ways."""

import dataclasses
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from hpcrl.comm import GradAverager, Plane, spawn
from hpcrl.sac import FastSAC
from hpcrl.sac.flat import ALIGN_BYTES, FlatParams, optimizer_state_in, optimizer_state_out
from hpcrl.sac.networks import BatchedCritic, DistributionalCritic

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sac_workers  # noqa: E402

CPU = torch.device("cpu")
LAYOUTS = [(False, False), (True, False), (False, True), (True, True)]  # (flat_params, batched_critic)


def _params(shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=g)) for s in shapes]


# -- the batched critic ------------------------------------------------------------------------------------

@pytest.mark.parametrize("layer_norm", [True, False])
def test_batched_critic_has_the_per_head_weights_outputs_and_gradients(layer_norm):
    torch.manual_seed(3)
    heads = DistributionalCritic(5, 2, 64, num_q=3, num_atoms=11, v_min=-5, v_max=5, layer_norm=layer_norm)
    torch.manual_seed(3)
    batched = BatchedCritic(5, 2, 64, num_q=3, num_atoms=11, v_min=-5, v_max=5, layer_norm=layer_norm)
    ref, mine = heads.state_dict(), batched.state_dict()
    assert list(mine) == list(ref) and all(torch.equal(mine[k], ref[k]) for k in ref)  # same seed, same init
    for _ in range(3):
        obs, action = torch.randn(17, 5), torch.randn(17, 2, requires_grad=True)
        want, got = heads(obs, action), batched(obs, action)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        torch.testing.assert_close(batched.q_value(got), heads.q_value(want), rtol=0, atol=1e-6)
        loss = lambda logits: (logits.sin() * torch.arange(11.0)).sum()  # noqa: E731
        g_want = torch.autograd.grad(loss(want), [action, *heads.parameters()])
        g_got = torch.autograd.grad(loss(got), [action, *batched.parameters()])
        torch.testing.assert_close(g_got[0], g_want[0], rtol=1e-5, atol=1e-6)
        for a, b in zip(batched.to_heads(list(g_got[1:])), g_want[1:], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_batched_critic_loads_per_head_state_and_back():
    heads = DistributionalCritic(4, 1, 32, num_q=2, num_atoms=7)
    batched = BatchedCritic(4, 1, 32, num_q=2, num_atoms=7)
    batched.load_state_dict(heads.state_dict())
    assert all(torch.equal(v, heads.state_dict()[k]) for k, v in batched.state_dict().items())
    with torch.no_grad():
        for p in batched.parameters():
            p.add_(1.0)
    heads.load_state_dict(batched.state_dict())
    obs, action = torch.randn(9, 4), torch.randn(9, 1)
    torch.testing.assert_close(batched(obs, action), heads(obs, action), rtol=0, atol=1e-6)
    broken = {k: v for k, v in heads.state_dict().items() if k != "heads.1.9.bias"}
    with pytest.raises(RuntimeError, match="heads"):
        batched.load_state_dict(broken)


# -- flat parameters ---------------------------------------------------------------------------------------

def test_flat_params_are_aligned_views_that_keep_values_and_grads():
    params = _params([(5, 3), (7,), (2,), (4, 4)])
    params[1].grad = torch.full((7,), 2.0)
    values = [p.detach().clone() for p in params]
    flat = FlatParams(params)
    buffer, grads = flat.buffers[torch.float32], flat.grad_buffers[torch.float32]
    for p, v in zip(params, values):
        assert torch.equal(p, v)
        assert p.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
        assert p.grad.untyped_storage().data_ptr() == grads.untyped_storage().data_ptr()
        assert (p.data_ptr() - buffer.data_ptr()) % ALIGN_BYTES == 0
    assert torch.equal(params[1].grad, torch.full((7,), 2.0))
    alias = flat.alias()
    with torch.no_grad():
        alias.mul_(2.0)  # one op over the alias moves every parameter
    assert all(torch.equal(p, 2 * v) for p, v in zip(params, values))
    r = flat.reshape(params[1:3])
    out = r.forward([flat.alias(params[1:3]).detach()])
    assert [t.shape for t in out] == [torch.Size([7]), torch.Size([2])] and torch.equal(out[1], params[2])
    assert torch.equal(r.inverse(out)[0], flat.alias(params[1:3]).detach())
    with pytest.raises(ValueError, match="consecutive"):
        flat.alias([params[0], params[2]])


def test_flat_adamw_matches_per_parameter_adamw_and_keeps_the_checkpoint_format():
    shapes = [(64, 7), (64,), (2,), (32, 64), (11, 32), (11,)]
    ref, mine = _params(shapes), _params(shapes)
    flat = FlatParams(mine)
    options = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=1e-3, fused=True)
    ref_opt, flat_opt = torch.optim.AdamW(ref, **options), torch.optim.AdamW([flat.alias()], **options)
    reshapes = [flat.reshape()]
    assert optimizer_state_out(flat_opt.state_dict(), reshapes)["param_groups"] == ref_opt.state_dict()["param_groups"]
    g = torch.Generator().manual_seed(1)
    for step in range(50):
        grads = [torch.randn(s, generator=g) for s in shapes]
        for p, q, grad in zip(ref, mine, grads):
            p.grad = grad.clone()
            q.grad.copy_(grad)
        ref_opt.step()
        flat_opt.step()
        if step == 24:  # a checkpoint round trip midway: per-parameter state out, flat state back in
            saved = optimizer_state_out(flat_opt.state_dict(), reshapes)
            _assert_state_close(saved, ref_opt.state_dict())
            flat_opt.load_state_dict(optimizer_state_in(ref_opt.state_dict(), reshapes))
    # Elementwise math, but the fused CPU kernel's vector body and scalar tail round differently in
    # the last bit: parameters whose size is not a multiple of the vector width may differ by ulps.
    for p, q in zip(ref, mine):
        torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-7)
    _assert_state_close(optimizer_state_out(flat_opt.state_dict(), reshapes), ref_opt.state_dict())


def _assert_state_close(got: dict, want: dict) -> None:
    assert got["param_groups"] == want["param_groups"]
    assert set(got["state"]) == set(want["state"])
    for i, st in want["state"].items():
        assert set(got["state"][i]) == set(st)
        for key, value in st.items():
            assert got["state"][i][key].shape == value.shape, (i, key)
            torch.testing.assert_close(got["state"][i][key], value, rtol=1e-5, atol=1e-8)


def test_grad_averager_averages_a_given_flat_buffer_in_place():
    params = _params([(3, 2), (5,)])
    flat = FlatParams(params)
    buffer = flat.grad_buffers[torch.float32]
    averager = GradAverager(params, "flat", plane=Plane.local("device"), grad_buffers=[buffer])
    (params[0].sum() + 2 * params[1].sum()).backward()
    averager.all_reduce()
    assert torch.equal(params[1].grad, torch.full((5,), 2.0))
    averager.zero_grad()
    assert not buffer.any() and params[0].grad.data_ptr() == buffer.data_ptr()
    with pytest.raises(ValueError, match="ddp"):
        GradAverager(params, "ddp", plane=Plane.local("device"), grad_buffers=[buffer])
    with pytest.raises(ValueError, match="no grad viewing"):
        GradAverager([*params, nn.Parameter(torch.zeros(2))], "flat", plane=Plane.local("device"),
                     grad_buffers=[buffer])


# -- the agent ---------------------------------------------------------------------------------------------

def _agent(flat: bool, batched: bool, **overrides) -> FastSAC:
    torch.manual_seed(0)
    cfg = dataclasses.replace(sac_workers.small_config("flat"), flat_params=flat, batched_critic=batched,
                              **overrides)
    return FastSAC(cfg, sac_workers.OBS, sac_workers.ACT, -torch.ones(sac_workers.ACT), torch.ones(sac_workers.ACT),
                   CPU, plane=Plane.local("device"))


def _run(agent: FastSAC, steps: range) -> FastSAC:
    for step in steps:
        agent.update(*sac_workers.global_data(step % 6))
    return agent


def _assert_learner_close(got: dict, want: dict, tol: float) -> None:
    for group in ("actor", "critic", "critic_target"):
        assert list(got[group]) == list(want[group])
        for k, v in want[group].items():
            torch.testing.assert_close(got[group][k], v, rtol=tol, atol=tol, msg=lambda m: f"{group}.{k}: {m}")
    torch.testing.assert_close(got["log_alpha"], want["log_alpha"], rtol=tol, atol=tol)
    for group in ("critic_opt", "actor_opt", "alpha_opt"):
        _assert_state_close(got[group], want[group])
    assert got["counters"] == want["counters"]


@pytest.mark.parametrize("max_grad_norm", [0.0, 0.5])
@pytest.mark.parametrize("layout", LAYOUTS[1:])
def test_each_layout_updates_like_the_per_parameter_per_head_agent(layout, max_grad_norm):
    want = _run(_agent(False, False, max_grad_norm=max_grad_norm), range(20)).learner_state()
    got = _run(_agent(*layout, max_grad_norm=max_grad_norm), range(20)).learner_state()
    _assert_learner_close(got, want, tol=1e-5)


@pytest.mark.parametrize("saver, loader", [(LAYOUTS[0], LAYOUTS[3]), (LAYOUTS[3], LAYOUTS[0])])
def test_checkpoints_resume_across_layouts(saver, loader, tmp_path):
    """An old-layout checkpoint resumes in the new layout (and back), as if never interrupted."""
    path = tmp_path / "learner.pt"
    torch.save(_run(_agent(*saver), range(10)).learner_state(), path)
    resumed = _agent(*loader)
    resumed.load_learner_state(torch.load(path, weights_only=True))
    uninterrupted = _run(_agent(*saver), range(20)).learner_state()
    _assert_learner_close(_run(resumed, range(10, 20)).learner_state(), uninterrupted, tol=1e-5)


def test_flat_agent_steps_once_per_model_and_keeps_every_view():
    agent = _run(_agent(True, True), range(4))
    assert [len(g["params"]) for g in agent.critic_opt.param_groups] == [1]
    assert [len(g["params"]) for g in agent.actor_opt.param_groups] == [1]
    flat_critic, flat_actor, flat_target = agent.layout.flats()
    for model, flat in ((agent.actor, flat_actor), (agent.critic, flat_critic)):
        grads = flat.grad_buffers[torch.float32].untyped_storage().data_ptr()
        for p in model.parameters():
            assert p.grad is not None and p.grad.untyped_storage().data_ptr() == grads
    target = flat_target.buffers[torch.float32].untyped_storage().data_ptr()
    assert all(p.untyped_storage().data_ptr() == target for p in agent.critic_target.parameters())
    assert not any(p.requires_grad for p in agent.critic_target.parameters())
    ddp = _agent(True, True, grad_average="ddp")
    assert not ddp.flat and len(ddp.critic_opt.param_groups[0]["params"]) == len(list(ddp.critic.parameters()))


def _batched(fn, *args):
    """``fn`` with the data-parallel workers' config switched to the batched critic (flat is the default)."""
    original = sac_workers.small_config
    sac_workers.small_config = lambda mode: dataclasses.replace(original(mode), batched_critic=True)
    try:
        return fn(*args)
    finally:
        sac_workers.small_config = original


def _batched_dp_rank(modes: list[str]) -> dict:
    return _batched(sac_workers.dp_rank, modes)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_batched_flat_two_ranks_equal_one_rank():
    single = _batched(sac_workers.run_updates, "flat")
    for by_mode in spawn(_batched_dp_rank, 2, args=(["flat", "view"],), timeout_s=100):
        for mode, res in by_mode.items():
            for name, g in single["grads"].items():
                torch.testing.assert_close(res["grads"][name], g, rtol=1e-5, atol=1e-6, msg=lambda m: f"{mode} {name}: {m}")
            for group in ("actor", "critic", "critic_target"):
                for name, value in single[group].items():
                    torch.testing.assert_close(res[group][name], value, rtol=1e-5, atol=1e-5,
                                               msg=lambda m: f"{mode} {group}.{name}: {m}")
