"""``--compile``: FastSAC's update (hpcrl/sac/update.py) captured by ``torch.compile`` on its pure steps over the
flat buffers (hpcrl/sac/functional.py): ``torch.func.grad`` w.r.t. each model's flat buffer (one gradient
tensor, no autograd engine at update time), the arithmetic of the eager optimizers' fused AdamW/Adam on
their own state, Polyak one lerp. On one rank the whole update is one graph (two variants: with and
without the actor step). With W > 1 ranks each of the update's stages is one graph and the two gradient
all-reduces between them stay eager collectives on the device plane (the named break points,
hpcrl/sac/update.py's docstring).

Same arithmetic in the same order as the eager steps (hpcrl/sac/eager.py), so the two agree to float
rounding (inductor fuses elementwise ops; tests/test_sac_compile.py states the tolerance). Every graph
has static shapes and reads nothing back to the host, so on CUDA it runs as a CUDA graph
(``mode="reduce-overhead"``), and once both variants are compiled only the guards that tell them apart
are checked (:meth:`CompiledUpdate._stance`). On CPU a C++ wrapper calls its kernels (inductor's
``cpp_wrapper``) and each graph is compiled ahead of time and stored per machine (``--compile-cache``,
hpcrl/sac/graph_store.py): a later run loads it in ~1.5 s instead of tracing and compiling again, and runs it
without guards on batches of the compiled shapes. :attr:`CompiledUpdate.compile_s` reports the one-time cost.
Gradients are computed inside a graph, so the bucketed overlap of the all-reduce with backward
(``--overlap-grad-average``) does not apply here: the collective waits for the whole gradient graph.
"""

from __future__ import annotations

import contextlib
import time
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Callable, NamedTuple

import torch
import torch.distributed as dist

from hpcrl.core.config_check import ConfigError

from .functional import Functional, adam_state
from .graph_store import GraphStore, default_dir, graph_key
from .update import Data, Steps, run_update

if TYPE_CHECKING:
    from .agent import FastSAC


def supported(agent: "FastSAC") -> str | None:
    """Why ``agent`` cannot run the captured update (None: it can)."""
    if not agent.layout.flat:
        return "--compile needs flat parameters (flat_params on, grad_average 'flat' or 'view')"
    if agent.scaler is not None:
        return "--compile does not capture the fp16 GradScaler (use --amp bf16 or none)"
    return None


class Bufs(NamedTuple):
    critic: torch.Tensor  # critic + log-alpha parameters
    actor: torch.Tensor
    target: torch.Tensor


class Grads(NamedTuple):
    critic: torch.Tensor
    actor: torch.Tensor


class States(NamedTuple):  # (exp_avg, exp_avg_sq, step) of each optimizer's one flat parameter
    critic: tuple
    actor: tuple
    alpha: tuple


class State(NamedTuple):
    """What the update's steps mutate: the graphs' inputs."""

    bufs: Bufs
    grads: Grads
    states: States


class CompiledUpdate(Steps):
    """The captured update of one :class:`FastSAC` (same parameters, optimizers and averagers). As
    :class:`Steps` it is the update's stages as graphs (W > 1 ranks)."""

    def __init__(self, agent: "FastSAC") -> None:
        reason = supported(agent)
        if reason is not None:
            raise ConfigError(reason)
        self.agent = agent
        self.fn = Functional(agent)
        dtype = torch.float32
        critic, actor, target = agent.layout.flats()
        if {*critic.buffers, *actor.buffers, *target.buffers} != {dtype}:
            raise ConfigError("--compile needs fp32 parameters")
        self.bufs = Bufs(critic.buffers[dtype], actor.buffers[dtype], target.buffers[dtype])
        self.grads = Grads(critic.grad_buffers[dtype], actor.grad_buffers[dtype])
        cuda = agent.log_alpha.device.type == "cuda"
        # CPU: a C++ wrapper calls the kernels (the Python one cost ~0.2 ms of a 2 ms pendulum update)
        compile_ = dict(dynamic=False, fullgraph=True, **({"mode": "reduce-overhead"} if cuda
                                                          else {"options": {"cpp_wrapper": True}}))
        # one rank: nothing to average, the whole update is one graph
        self.local = agent.critic_average.world_size == 1 and agent.actor_average.world_size == 1
        if self.local:
            self._whole = torch.compile(partial(run_update, self.fn), **compile_)
        else:
            self._critic_stage = torch.compile(self.fn.critic_stage, **compile_)
            self._middle_stage = torch.compile(self.fn.middle_stage, **compile_)
            self._actor_stage = torch.compile(self.fn.actor_stage, **compile_)
        if cuda:  # buffers the graphs mutate keep their addresses: CUDA graphs may capture them
            for t in (*self.bufs, *self.grads):
                torch._dynamo.mark_static_address(t)
        # CPU: the graphs compiled once per machine (hpcrl/sac/graph_store.py). CUDA (its graphs are not
        # serialised here) and --compile-cache none: Dynamo's guarded graphs, compiled in every process.
        cache = agent.cfg.compile_cache
        self.store = None if cuda or cache == "none" else GraphStore(Path(cache) if cache else default_dir())
        self._stored: dict[str, Callable] = {}
        self._use_stored = False  # this update runs the stored graphs (its batch fits them)
        # A CUDA graph's outputs are overwritten by its next replay; the loop keeps metrics across updates.
        self._keep = (lambda t: t.detach().clone()) if cuda else (lambda t: t.detach())
        self.compile_s = 0.0  # wall seconds of the first update without and with the actor step (compilation)
        self._warm = {False: False, True: False}
        self._spec: tuple | None = None  # the batch's shapes, strides and dtypes the graphs were compiled for
        self.unguarded = 0  # updates that ran without Dynamo's guards (stored graphs, or all but the variant's)

    def state(self) -> State:
        """The buffers and the optimizers' state tensors, read each update (a resume replaces the latter)."""
        agent = self.agent
        return State(self.bufs, self.grads,
                     States(adam_state(agent.critic_opt), adam_state(agent.actor_opt), adam_state(agent.alpha_opt)))

    def update(self, data: Data, actor_due: bool) -> dict[str, torch.Tensor]:
        """hpcrl/sac/update.py's run_update, captured: one graph (one rank), else a graph per stage."""
        start = time.perf_counter()
        state = self.state()
        fits = self._fits(data)
        self._use_stored = fits and self.store is not None
        with self._stance(fits):
            if self.local:
                out = self._run(f"whole-{int(actor_due)}", run_update, self._whole, self.fn, state, data, actor_due)
            else:
                out = run_update(self, state, data, actor_due)
        self._count_compile(actor_due, start)
        return {k: self._keep(v) for k, v in out.items()}

    # -- W > 1: the update's stages as graphs, the all-reduces between them eager collectives

    def critic_stage(self, state: State, data: Data) -> tuple:
        return self._run("critic_grad", Functional.critic_stage, self._critic_stage, self.fn, state, data)

    def reduce_critic(self) -> None:
        self.agent.critic_average.all_reduce()

    def middle_stage(self, state: State, data: Data, alpha: torch.Tensor, actor_due: bool) -> dict:
        return self._run(f"critic_step-{int(actor_due)}", Functional.middle_stage, self._middle_stage, self.fn,
                         state, data, alpha, actor_due)

    def reduce_actor(self) -> None:
        self.agent.actor_average.all_reduce()

    def actor_stage(self, state: State) -> torch.Tensor:
        return self._run("actor_step", Functional.actor_stage, self._actor_stage, self.fn, state)

    def _run(self, name: str, fn: Callable, guarded: Callable, owner: object, *args):
        """The stored graph of ``fn`` (a function of ``owner``) on a batch that fits, else Dynamo's."""
        return self._stored_graph(name, fn, owner, args)(owner, *args) if self._use_stored else guarded(*args)

    def _fits(self, data: Data) -> bool:
        """Whether the batch has the shapes, strides and dtypes of the first one (what the graphs were compiled
        for; the buffers, optimizer state and devices are fixed for the agent's life, and a resume loads tensors
        of the same shapes)."""
        spec = tuple((t.shape, t.stride(), t.dtype) for t in data)
        if self._spec is None:
            self._spec = spec
        return spec == self._spec

    def _stored_graph(self, name: str, fn: Callable, owner: object, args: tuple) -> Callable:
        """The stored graph ``name``, loaded or compiled on its first call; it keeps no guards, so it is only
        called on batches that :meth:`_fits`."""
        graph = self._stored.get(name)
        if graph is None:
            key = graph_key(name, (owner, *args), self.agent.cfg, self.modules(), self.fn.constants())
            graph = self._stored[name] = self.store.graph(name, fn, (owner, *args), key)
        return graph

    def modules(self) -> dict[str, torch.nn.Module]:
        """The modules the graphs run (their structure is part of a stored graph's key)."""
        agent = self.agent
        return {"actor": agent.actor, "critic": agent.critic, "critic_target": agent.critic_target}

    def _stance(self, fits: bool):
        """Dynamo's guards, checked on every call, cost ~0.1 ms per update at the pendulum preset (~5 %):
        thousands of them (module structure, layouts, tensor metadata) for graphs whose inputs never change
        in a run. Stored graphs (CPU) have none; on Dynamo's path, once both variants are compiled and the
        batch :meth:`_fits`, only the guards that tell the two variants apart run (``skip_guard_eval_unsafe``).
        Anything else runs fully guarded (and recompiles if it must)."""
        if fits and (self.store is not None or all(self._warm.values())):
            self.unguarded += 1
            if self.store is None:
                return torch.compiler.set_stance("default", skip_guard_eval_unsafe=True)
        return contextlib.nullcontext()

    def _count_compile(self, actor_due: bool, start: float) -> None:
        """Add a first call's wall time to :attr:`compile_s`; once both variants ran, report it (one line, rank 0)."""
        if self._warm[actor_due]:
            return
        self._warm[actor_due] = True
        self.compile_s += time.perf_counter() - start
        if not all(self._warm.values()) or (dist.is_initialized() and dist.get_rank() != 0):
            return
        store = self.store
        if store is None:
            from torch._inductor.runtime.cache_dir_utils import cache_dir  # inductor: ~1 s to import, --compile only

            print(f"hpcrl.sac: --compile: update compiled in {self.compile_s:.1f} s "
                  f"(inductor cache {cache_dir()})", flush=True)
            return
        print(f"hpcrl.sac: --compile: update ready in {self.compile_s:.1f} s: {store.loaded} graphs loaded from, "
              f"{store.compiled} compiled into {store.directory}", flush=True)
        if store.unstored:
            print(f"hpcrl.sac: --compile: could not store a compiled graph ({store.unstored}): the next run "
                  "compiles it again", flush=True)
