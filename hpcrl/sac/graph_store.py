"""``--compile`` on CPU: the captured update's graphs compiled once per machine, not once per process.

A graph is compiled ahead of time (``torch.compile(...).aot_compile``: Dynamo's trace and inductor's
kernels, C++ wrapper included) and written to ``--compile-cache`` under a key of everything that can
change it; a later run with the same key loads it (~1.5 s, most of it importing inductor) instead of
tracing and compiling again (Dynamo's trace alone was 3.8 s of a 6 s warm compile at the pendulum preset,
and a compile with a cold inductor cache 40 s). A stored graph keeps no guards: the caller runs it only on
inputs of the shapes, strides and dtypes it was compiled for (:class:`hpcrl.sac.compiled.CompiledUpdate`
checks them every update and otherwise takes Dynamo's guarded path).

The key (sha-256) covers: the graph's name, torch, Python, the CPU's vector ISA and the torch thread count
(inductor bakes both into its kernels), every hpcrl source file, the learner's config less its run-level
fields, the modules' structure and scalar attributes, the update's constants (learning rates, tau, layouts)
and every input's shape, stride, dtype and device. :data:`RUN_FIELDS` lists the config fields that never
reach the update (seeds, paths, run length): leaving one of them out of the key lets every seed of a
preset share its graphs; a field missing from that set only costs a needless compile.
"""

from __future__ import annotations

import dataclasses
import hashlib
import platform
import sys
import warnings
from functools import cache
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

import hpcrl
from hpcrl.core.rundir_files import atomic_path

# SACConfig fields that never reach the update's graphs (the rest are part of the key).
RUN_FIELDS = frozenset({
    "preset", "config", "env", "num_envs", "total_env_steps", "run_dir", "resume", "overwrite", "resume_missing",
    "seed", "seeds", "device", "nproc", "threads", "timeout_s", "heartbeat_timeout_s", "shared_memory", "buffer_size",
    "learning_starts", "random_steps", "nonfinite", "num_updates", "alpha_init", "log_every", "checkpoint_every",
    "keep_checkpoints", "check_replicas_every", "eval_episodes", "eval_every", "wandb_project", "wandb_mode",
    "compile_cache",
})
_SCALARS = (bool, int, float, str, type(None), torch.dtype, torch.Size)


def default_dir() -> Path:
    """Beside inductor's own cache (``TORCHINDUCTOR_CACHE_DIR``, else its default under /tmp)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / "hpcrl_update"


@cache
def _source_digest() -> str:
    root = Path(hpcrl.__file__).parent
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def _scalars(obj: object) -> list[tuple[str, str]]:
    """The plain attributes of ``obj`` (what a trace can bake into a graph as constants), by name."""
    return sorted((k, repr(v)) for k, v in vars(obj).items() if isinstance(v, _SCALARS + (tuple,)))


def _describe(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return ("tensor", tuple(x.shape), x.stride(), x.storage_offset(), str(x.dtype), str(x.device),
                x.requires_grad)
    if isinstance(x, _SCALARS):
        return repr(x)
    return type(x).__qualname__  # the owner object (its constants are described separately)


def graph_key(name: str, args: tuple, cfg: Any, modules: dict[str, nn.Module], constants: dict[str, Any]) -> str:
    """The sha-256 of everything a compiled graph of ``name`` on ``args`` depends on (module docstring)."""
    parts = [
        name, torch.__version__, sys.version, platform.machine(), torch.backends.cpu.get_cpu_capability(),
        torch.get_num_threads(), _source_digest(),
        sorted((f.name, repr(getattr(cfg, f.name))) for f in dataclasses.fields(cfg) if f.name not in RUN_FIELDS),
        {k: (repr(m), [(n, type(s).__qualname__, _scalars(s)) for n, s in m.named_modules()]) for k, m in modules.items()},
        sorted((k, repr(v)) for k, v in constants.items()),
        [_describe(x) for x in tree_leaves(args)],
    ]
    return hashlib.sha256(repr(parts).encode()).hexdigest()


class GraphStore:
    """Compiled graphs on disk under ``directory``, one file per key."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.loaded = 0  # graphs read from disk
        self.compiled = 0  # graphs compiled in this process
        self.unstored: str | None = None  # why the last compiled graph could not be written, if it could not

    def graph(self, name: str, fn: Callable, args: tuple, key: str) -> Callable:
        """``fn`` compiled for ``args`` (the graph stored under ``key``, or compiled and stored now)."""
        path = self.directory / f"{name}-{key[:40]}.bin"
        if path.exists():
            try:
                with path.open("rb") as f:
                    graph = torch.compiler.load_compiled_function(f)
                graph.disable_guard_check()
                self.loaded += 1
                return graph
            except Exception as e:  # a truncated or foreign file: compile again and replace it
                warnings.warn(f"hpcrl.sac: --compile: stored graph {path} unreadable ({type(e).__name__}: {e}); "
                              "compiling it again", stacklevel=2)
        compiled = torch.compile(fn, dynamic=False, fullgraph=True, options={
            "cpp_wrapper": True,  # the kernels called from C++ (the Python wrapper cost ~10 % of an update)
            "guard_filter_fn": torch.compiler.skip_all_guards_unsafe,  # the caller checks the inputs
        })
        graph = compiled.aot_compile((args, {}))
        graph.disable_guard_check()
        self.compiled += 1
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            data = type(graph).serialize(graph).serialized_data
            with atomic_path(path) as tmp:  # a reader never sees half a file, a full disk leaves none
                tmp.write_bytes(data)
        except OSError as e:  # a full or read-only disk costs the next run a compile, not this one
            self.unstored = f"{path}: {e.strerror or e}"
        return graph
