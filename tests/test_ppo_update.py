"""The one PPO update (hpcrl.ppo.update) and the Workload contract (hpcrl.ppo.workload)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode

from hpcrl.core.config_check import ConfigError
from hpcrl.ppo.losses import approx_kl, masked_mean, policy_loss, value_loss
from hpcrl.ppo.sync import NoGradAverage
from hpcrl.ppo.update import (Coefs, GradStep, Outputs, Plan, Samples, minibatch_indices, ppo_update,
                              read_stats)
from hpcrl.ppo.workload import Capabilities, Collector, Learner, PPOConfig, Workload
from hpcrl.ppo.workload_plugin import as_workload
from hpcrl.ppo.workloads import make_workload


class HostReads(TorchDispatchMode):
    """Counts tensor -> host scalar reads (``float(t)``, ``t.item()``, ``bool(t)``), except inside
    optimizer steps (Adam reads its step counters, host tensors by design) and inside the forward of
    ``modules`` (e.g. a transformers model, which inspects its attention mask on the host)."""

    def __init__(self, modules=()) -> None:
        super().__init__()
        self.reads, self.paused, self.modules = 0, 0, modules

    def _pause(self, *_) -> None:
        self.paused += 1

    def _resume(self, *_) -> None:
        self.paused -= 1

    def __enter__(self):
        self._hooks = [register_optimizer_step_pre_hook(self._pause), register_optimizer_step_post_hook(self._resume)]
        for m in self.modules:
            self._hooks += [m.register_forward_pre_hook(self._pause), m.register_forward_hook(self._resume)]
        return super().__enter__()

    def __exit__(self, *exc):
        for hook in self._hooks:
            hook.remove()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and not self.paused:
            self.reads += 1
        return func(*args, **(kwargs or {}))


def _toy(n: int = 6, g: int = 3, seed: int = 0):
    """A linear "policy" and "critic" over token features [n, g, 4], with fixed samples."""
    gen = torch.Generator().manual_seed(seed)
    feats = torch.randn(n, g, 4, generator=gen)
    pi, v = nn.Linear(4, 1), nn.Linear(4, 1)
    mask = (torch.rand(n, g, generator=gen) > 0.3).float()
    samples = Samples(behaviour_logp=-torch.rand(n, g, generator=gen), advantages=torch.randn(n, g, generator=gen),
                      old_values=torch.randn(n, g, generator=gen), returns=torch.randn(n, g, generator=gen),
                      mask=mask)

    def forward(idx):
        logp = -nn.functional.softplus(pi(feats[idx])).squeeze(-1)
        return Outputs(logp, -logp, v(feats[idx]).squeeze(-1))

    return pi, v, samples, forward


def test_one_epoch_one_minibatch_is_the_losses_and_one_step():
    pi, v, samples, forward = _toy()
    params = [*pi.parameters(), *v.parameters()]
    coefs = Coefs(clip=0.2, value_clip=0.5, vf=0.7, ent=0.1)
    # by hand: the losses on all samples (one minibatch: the order does not matter), one SGD step
    out = forward(torch.arange(6))
    pl, pstats = policy_loss(out.logp, samples.behaviour_logp, samples.advantages, 0.2, mask=samples.mask)
    vl = value_loss(out.values, samples.old_values, samples.returns, 0.5, mask=samples.mask)
    ent = masked_mean(out.entropy, samples.mask)
    loss = pl + 0.7 * vl - 0.1 * ent
    grads = torch.autograd.grad(loss, params)
    pl, vl, ent = pl.detach(), vl.detach(), ent.detach()
    norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))
    scale = min(1.0, 0.3 / (float(norm) + 1e-6))
    want = [p.detach() - 0.1 * g * scale for p, g in zip(params, grads)]

    step = GradStep(torch.optim.SGD(params, lr=0.1), params, NoGradAverage(), max_grad_norm=0.3)
    stats = read_stats(ppo_update(forward, samples, coefs, Plan(1, 1), step, torch.Generator().manual_seed(0)))
    assert stats["policy_loss"] == pytest.approx(float(pl), rel=1e-6)
    assert stats["value_loss"] == pytest.approx(float(vl), rel=1e-6)
    assert stats["entropy"] == pytest.approx(float(ent), rel=1e-6)
    assert stats["grad_norm"] == pytest.approx(float(norm), rel=1e-5)
    assert stats["clip_frac"] == pytest.approx(float(pstats["clip_frac"]))
    kl = masked_mean(approx_kl(samples.behaviour_logp, out.logp.detach()), samples.mask)
    assert stats["approx_kl"] == pytest.approx(float(kl), rel=1e-5, abs=1e-9)
    for p, w in zip(params, want):
        torch.testing.assert_close(p.detach(), w, rtol=1e-5, atol=1e-7)


def test_kl_term_and_no_critic():
    pi, _, samples, forward = _toy()
    ref = samples.behaviour_logp - 0.3
    s = Samples(samples.behaviour_logp, samples.advantages, ref_logp=ref, mask=samples.mask)
    params = list(pi.parameters())
    step = GradStep(torch.optim.SGD(params, lr=0.0), params, NoGradAverage(), max_grad_norm=1.0)
    stats = read_stats(ppo_update(lambda idx: dataclasses.replace(forward(idx), values=None), s,
                                  Coefs(clip=0.2, kl=0.5), Plan(1, 1), step, torch.Generator()))
    out = forward(torch.arange(6))
    assert "value_loss" not in stats
    assert stats["kl_loss"] == pytest.approx(float(masked_mean(approx_kl(out.logp.detach(), ref), s.mask)), rel=1e-6)


@pytest.mark.parametrize("n,k", [(10, 4), (3, 4), (12, 3)])
def test_minibatch_split_is_each_workloads_previous_one(n, k):
    """vector_env: randperm on the generator's device, tensor_split; lm / hf: randperm, chunk."""
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    got = minibatch_indices(n, Plan(1, k, "tensor_split"), g1, torch.device("cpu"))
    want = torch.randperm(n, generator=g2, device=g2.device).tensor_split(k)
    assert [t.tolist() for t in got] == [t.tolist() for t in want]
    got = minibatch_indices(n, Plan(1, k, "chunk"), g1, torch.device("cpu"))
    want = torch.randperm(n, generator=g2).chunk(k)
    assert [t.tolist() for t in got] == [t.tolist() for t in want]


def test_no_host_read_inside_the_update():
    pi, v, samples, forward = _toy(n=12)
    params = [*pi.parameters(), *v.parameters()]
    step = GradStep(torch.optim.Adam(params), params, NoGradAverage(), max_grad_norm=0.5)
    with HostReads() as counter:
        stats = ppo_update(forward, samples, Coefs(clip=0.2), Plan(3, 4), step, torch.Generator().manual_seed(1))
    assert counter.reads == 0
    with HostReads() as counter:
        float(stats["policy_loss"])
    assert counter.reads == 1  # the counter sees a host read


@pytest.mark.parametrize("name", ["swingup", "lm"])
def test_learner_update_reads_the_host_once(name):
    """The whole learner update (advantages, epochs x minibatches, stats) reads no scalar from the
    device one by one: its stats come back in one transfer at the end."""
    if name == "lm":
        from hpcrl.ppo.workloads.lm import LMWorkload

        wl = LMWorkload(pretrain_steps=2, batch_size=8)
    else:
        wl = make_workload(name, num_envs=4, rollout_len=8)
    model = wl.build_model(0, torch.device("cpu"))
    batch, _ = wl.make_collector(0, torch.device("cpu")).collect(model, torch.Generator().manual_seed(0))
    cfg = dataclasses.replace(wl.default_config(), epochs=2, minibatches=2)
    learner = wl.make_learner(model, cfg, NoGradAverage())
    with HostReads() as counter:
        stats = learner.update([batch], torch.Generator().manual_seed(0))
    assert counter.reads == 0 and all(isinstance(v, float) for v in stats.values())
    assert {"policy_loss", "value_loss", "entropy", "approx_kl", "grad_norm", "clip_frac"} <= stats.keys()


# ------------------------------------------------------------------------------------ the contract


class DuckCollector:
    def collect(self, model, generator):
        return {"behaviour_logp": torch.zeros(1)}, {"env_steps": 1.0, "episode_return_sum": 0.0, "episodes": 0.0}

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


class DuckLearner:
    def __init__(self, model):
        self.optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def update(self, batches, generator):
        return {}

    def state_dict(self):
        return {"optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state):
        pass


class DuckWorkload:
    """A plugin written against the old names, not subclassing Workload."""

    name = "duck"

    def build_model(self, seed, device):
        return nn.Linear(2, 2)

    def sync_tensors(self, model):  # the old name of publish_tensors: still accepted, with a warning
        return [p.data for p in model.parameters()]

    def make_collector(self, rank_seed, device):
        return DuckCollector()

    def make_learner(self, model, cfg, grad_average):
        return DuckLearner(model)


def test_a_duck_typed_plugin_gets_every_hook(capsys):
    wl = as_workload(DuckWorkload())
    assert "DuckWorkload.sync_tensors is now called publish_tensors" in capsys.readouterr().err
    assert isinstance(wl, Workload) and wl.name == "duck" and as_workload(wl) is wl
    model = wl.build_maker_model(0, torch.device("cpu"))
    assert len(wl.publish_tensors(model)) == 2
    assert [t.data_ptr() for t in wl.publish_tensors(model)] == [t.data_ptr() for t in wl.publish_tensors(model)]
    assert wl.default_config() == PPOConfig()
    wl.after_publish(model)
    assert wl.save_artifacts(model.state_dict()) is None
    assert wl.rank_modules() == ()  # a plugin's own code is not preloaded unless it names it
    assert Workload.rank_modules(DuckWorkload()) == ()  # nor a Workload subclass's outside hpcrl
    with pytest.raises(ConfigError, match="--strategy fsdp: workload 'duck' does not say which submodules"):
        wl.shard_units(model)
    collector = wl.make_collector(0, torch.device("cpu"))
    assert isinstance(collector, Collector)
    collector.assign(3, 0)  # a collector without assign ignores it
    learner = wl.make_learner(model, PPOConfig(), NoGradAverage())
    assert isinstance(learner, Learner) and learner.optimizer is learner.inner.optimizer
    assert wl.capabilities() == Capabilities()  # no export, built in host memory under fsdp
    with pytest.raises(ValueError, match="workload 'duck' built its model on the meta device but has no materialize"):
        wl.materialize(model)


def test_a_duck_typed_plugin_declares_what_it_has():
    """A plugin's optional hooks (a meta build, an export) become its declared capabilities; its own
    ``capabilities()`` wins where it has one."""
    saved, filled = [], []

    class Exporting(DuckWorkload):
        builds_on_meta = True

        def materialize(self, model):
            filled.append(model)

        def save_artifacts(self, state, out_dir=None):
            saved.append((sorted(state), out_dir))
            return "written"

    wl = as_workload(Exporting())
    assert wl.capabilities() == Capabilities(builds_on_meta=True, saves_artifacts=True)
    model = wl.build_model(0, torch.device("cpu"))
    wl.materialize(model)
    assert filled == [model]
    assert wl.save_artifacts(model.state_dict()) == "written" and wl.save_artifacts({}, "out") == "written"
    assert saved == [(["bias", "weight"], None), ([], "out")]

    class Declaring(DuckWorkload):
        def capabilities(self):
            return Capabilities(exports_from_shards=True)

    assert as_workload(Declaring()).capabilities() == Capabilities(exports_from_shards=True)


def test_a_plugin_missing_methods_is_refused_by_name():
    class Half:
        def build_model(self, seed, device):
            return nn.Linear(1, 1)

    with pytest.raises(ConfigError, match="has no make_collector, make_learner, publish_tensors method"):
        as_workload(Half(), "--workload pkg:Half")


def test_built_in_workloads_are_on_the_contract():
    wl = make_workload("cartpole", num_envs=2, rollout_len=4)
    assert isinstance(wl, Workload) and as_workload(wl) is wl and wl.capabilities() == Capabilities()
    assert wl.rank_modules() == (type(wl).__module__,) and wl.rank_modules()[0].startswith("hpcrl.ppo.workloads")
    model = wl.build_model(0, torch.device("cpu"))
    assert isinstance(wl.make_collector(0, torch.device("cpu")), Collector)
    learner = wl.make_learner(model, wl.default_config(), NoGradAverage())
    assert isinstance(learner.optimizer, torch.optim.Optimizer) and "optimizer" in learner.state_dict()
