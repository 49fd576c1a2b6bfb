"""A duck-typed ``--workload package.module:Class`` plugin brought onto the :class:`~.workload.Workload`
contract (:func:`as_workload`): each declared hook is the plugin's own method where it has one (the
hooks' names before "publish" became the one word for sending weights, with a warning), the contract's
default otherwise; its collectors and learners likewise. The plugin is read here, once, when it is
adapted: the roles see only the declared hooks."""

from __future__ import annotations

import sys
from typing import Any, Callable

import torch
from torch import nn

from hpcrl.core.config_check import ConfigError

from .workload import Capabilities, Collector, Learner, PPOConfig, Workload

__all__ = ["PluginCollector", "PluginLearner", "PluginWorkload", "as_workload"]

REQUIRED = ("build_model", "make_collector", "make_learner")
# Hook names before "publish" became the one word for sending weights to the makers: accepted, with
# a warning, for one release.
OLD_NAMES = {"publish_tensors": "sync_tensors", "after_publish": "after_sync"}
HOOKS = ("publish_tensors", "after_publish", "default_config", "build_maker_model", "shard_units", "rank_modules",
         "capabilities", "materialize", "save_artifacts", "export_checkpoint")
_WARNED: set[tuple[type, str]] = set()


def plugin_method(obj: Any, name: str) -> Callable[..., Any] | None:
    """``obj``'s own ``name`` (or its old name, with a warning), or None."""
    found = getattr(obj, name, None)
    if callable(found):
        return found
    old = getattr(obj, OLD_NAMES.get(name, name), None)
    if callable(old) and (type(obj), name) not in _WARNED:
        _WARNED.add((type(obj), name))
        print(f"hpcrl.ppo: warning: {type(obj).__name__}.{OLD_NAMES[name]} is now called {name}; the old name "
              "goes in the next release", file=sys.stderr, flush=True)
    return old if callable(old) else None


class PluginCollector(Collector):
    """A plugin's collector (``inner``) on the contract: ``assign`` is ignored where it has none."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.assign_hook = plugin_method(inner, "assign")

    def collect(self, model: nn.Module, generator: torch.Generator) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        return self.inner.collect(model, generator)

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)

    def assign(self, batch: int, seed: int) -> None:
        if self.assign_hook is not None:
            self.assign_hook(batch, seed)


class PluginLearner(Learner):
    """A plugin's learner (``inner``) on the contract: its ``optimizer`` where it has a torch one."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        found = getattr(inner, "optimizer", None)
        self.optimizer = found if isinstance(found, torch.optim.Optimizer) else None

    def update(self, batches: list[dict[str, torch.Tensor]], generator: torch.Generator) -> dict[str, float]:
        return self.inner.update(batches, generator)

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)


class PluginWorkload(Workload):
    """A duck-typed workload (``inner``) on the contract. Its capabilities are its own ``capabilities()``
    where it has one, else read off it: ``builds_on_meta`` (an attribute), ``save_artifacts`` and
    ``export_checkpoint`` (methods)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.name = str(getattr(inner, "name", "") or type(inner).__name__)
        self.hooks = {name: plugin_method(inner, name) for name in HOOKS}
        self.builds_on_meta = bool(getattr(inner, "builds_on_meta", False))

    def _call(self, name: str, *args: Any) -> Any:
        hook = self.hooks[name]
        return getattr(Workload, name)(self, *args) if hook is None else hook(*args)

    def build_model(self, seed: int, device: torch.device) -> nn.Module:
        return self.inner.build_model(seed, device)

    def publish_tensors(self, model: nn.Module) -> list[torch.Tensor]:
        return self.hooks["publish_tensors"](model)

    def make_collector(self, rank_seed: int, device: torch.device) -> Collector:
        found = self.inner.make_collector(rank_seed, device)
        return found if isinstance(found, Collector) else PluginCollector(found)

    def make_learner(self, model: nn.Module, cfg: PPOConfig, grad_average: Any) -> Learner:
        found = self.inner.make_learner(model, cfg, grad_average)
        return found if isinstance(found, Learner) else PluginLearner(found)

    def after_publish(self, model: nn.Module) -> None:
        self._call("after_publish", model)

    def default_config(self) -> PPOConfig:
        return self._call("default_config")

    def build_maker_model(self, seed: int, device: torch.device) -> nn.Module:
        return self._call("build_maker_model", seed, device)

    def shard_units(self, model: nn.Module) -> list[nn.Module]:
        return self._call("shard_units", model)

    def rank_modules(self) -> tuple[str, ...]:
        hook = self.hooks["rank_modules"]  # a plugin's own imports are preloaded only where it names them
        return tuple(hook()) if hook is not None else ()

    def capabilities(self) -> Capabilities:
        own = self.hooks["capabilities"]
        if own is not None:
            return own()
        return Capabilities(builds_on_meta=self.builds_on_meta,
                            saves_artifacts=self.hooks["save_artifacts"] is not None,
                            exports_from_shards=self.hooks["export_checkpoint"] is not None)

    def materialize(self, model: nn.Module) -> None:
        self._call("materialize", model)

    def save_artifacts(self, model_state: dict[str, torch.Tensor], out_dir: Any = None) -> Any:
        return self._call("save_artifacts", model_state, *([] if out_dir is None else [out_dir]))

    def export_checkpoint(self, dcp_dir: Any, out_dir: Any = None) -> Any:
        return self._call("export_checkpoint", dcp_dir, *([] if out_dir is None else [out_dir]))


def as_workload(obj: Any, what: str = "the workload") -> Workload:
    """``obj`` itself if it subclasses :class:`Workload`, else ``obj`` adapted onto the contract; a
    ConfigError (exit 2) naming the methods it lacks if it cannot be."""
    if isinstance(obj, Workload):
        return obj
    missing = [name for name in (*REQUIRED, "publish_tensors") if plugin_method(obj, name) is None]
    if missing:
        raise ConfigError(f"{what} ({type(obj).__name__}) has no {', '.join(missing)} method(s): a workload needs "
                          f"{', '.join(REQUIRED)} and publish_tensors (see hpcrl.ppo.workload.Workload)")
    return PluginWorkload(obj)
