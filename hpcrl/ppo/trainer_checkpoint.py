"""Detached-PPO trainer checkpoints: ``torch.distributed.checkpoint`` (DCP) shards written by every
trainer in parallel, off the training path, inside hpcrl's manifest / verification / fallback.

Layout of ``checkpoints/step_<N>/`` (committed by :func:`hpcrl.run.checkpoint.save`):

* ``dcp/`` — the model and the optimizer as DCP shards (``__<rank>_<i>.distcp`` per trainer and
  ``.metadata``), from :func:`torch.distributed.checkpoint.state_dict.get_state_dict`: FSDP2
  DTensor shards or, under ddp, the replicated tensors split between the trainers (DCP writes
  each replicated tensor once). Every file is in the manifest with its size and CRC-32.
* ``learner.pt`` (trainer 0) — small: format tag, version, env steps, the learner's state other
  than its optimizer (e.g. the update counter). A ``learner.pt`` holding ``"model"`` is the older
  gathered format; it still resumes (:meth:`TrainerCheckpoints.load`).
* ``rank<t>.h5`` (every trainer) — the per-trainer state: minibatch generator, ``next_credit``,
  ``taken_ahead`` (credits after it whose batches were trained already).

Writing (:meth:`TrainerCheckpoints.save`): the step stages a CPU copy of the trainer's state dict
(DCP's ``DefaultStager``; pinned memory on GPUs) and returns; a writer thread writes the DCP shards
(a collective of the writer threads over the trainers' checkpoint plane, so it never interleaves with the
training loop's collectives), the rank file, then the manifest and the rename. A kill at any moment
leaves the previous committed checkpoint intact: nothing is pruned before a commit. One write is in
flight at a time: the next checkpoint, and the end of the run, wait for it; a write failure (a
:class:`~hpcrl.core.diskfault.DiskFault`, the same line on every trainer) is raised there.

Resuming (:meth:`TrainerCheckpoints.restore` / :meth:`load`) may use another trainer count and the
other strategy: DCP reshards to the model as this job holds it (full tensors under ddp, this
trainer's dim-0 shards under fsdp). Each trainer verifies a share of the ``dcp/`` files (file i by
trainer i mod T') and every rank file; an unusable checkpoint makes every trainer fall back together.

What a trainer-count change does to per-trainer state (the learners are replicated, so model,
optimizer and update counter are the run's, exactly):

* the minibatch generator: trainer t of the new job continues old trainer t's stream when t < T_old;
  a trainer with no predecessor starts ``Generator().manual_seed(seed + 2 + 1000 t + 7919 version)``
  (a new, reproducible stream; at the same trainer count every trainer continues its own);
* ``next_credit``: credit c of trainer t is batch ``c T + t`` (:meth:`Collector.assign`). At the same
  count each trainer continues at its own first untrained credit (exact: what an uninterrupted run
  collects next). At another count T' every new trainer starts at credit ``ceil(B / T')``, B one
  past the highest batch number trained (``taken_ahead`` included): no batch is trained twice; fewer
  than T' (plus the old trainers' spread) batch numbers are skipped. At the same count ``taken_ahead``
  is never granted again.
"""

from __future__ import annotations

import dataclasses
import errno
import math
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch

from hpcrl.run import checkpoint
from hpcrl.run.checkpoint_manifest import LEARNER, CorruptCheckpoint, check_file, rank_file
from hpcrl.run.checkpoint_rows import METRICS, tail_rows
from hpcrl.run.checkpoint_write import FORMAT_VERSION, fsync_dir
from hpcrl.core.diskfault import DiskFault, fault_line, free_space, is_disk_error
from hpcrl.core.h5io import load_h5

__all__ = ["DCP_DIR", "FORMAT", "TrainerCheckpoints", "dcp_fault_line", "deal_rank_state", "read_full", "run_identity",
           "upgrade_identity"]

DCP_DIR, FORMAT = "dcp", "ppo-dcp-1"  # FORMAT: learner.pt["format"] of a sharded checkpoint

# DetachedConfig fields a resume may not change: the run's identity. Everything else (steps, lag,
# makers, trainers, strategy, devices, timeouts, checkpoint cadence) may change between the jobs of
# one run dir. The option groups (--env.*, --lm.*, --hf.*, --ppo.*) are part of it: they change the
# model or the update.
IDENTITY_FIELDS = ("seed", "workload", "env", "lm", "hf", "ppo", "plugin_args")
# option-group fields that change neither the math nor the episodes (the engine, its knobs, timeouts): not identity
NOT_IDENTITY = {"hf": ("micro_batch_size", "micro_batch_tokens", "generate_buckets", "ref_on", "engine",
                       "vllm_enforce_eager", "vllm_gpu_memory_utilization", "vllm_cpu_kvcache_gib", "vllm_prefix_caching",
                       "tool_timeout_s", "tool_workers", "step_timeout_s", "turn_wait_s")}


def _plain(value: Any) -> Any:
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value


def run_identity(cfg: Any) -> dict:
    """What a resume may not change (no trainer count: the learners reshard)."""
    out = {name: _plain(getattr(cfg, name)) for name in IDENTITY_FIELDS}
    for group, names in NOT_IDENTITY.items():
        if isinstance(out.get(group), dict):
            out[group] = {k: v for k, v in out[group].items() if k not in names}
    return out


def _defaults(cls: type) -> dict[str, Any]:
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            out[f.name] = f.default_factory()  # type: ignore[misc]
    return out


def upgrade_identity(cfg: Any) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """A checkpoint's recorded identity in today's layout: without ``trainers`` (identity before
    resharding), without the fields of :data:`NOT_IDENTITY`, and an option-group field added since
    it was written taken at its default (so an older checkpoint matches a run that leaves it there)."""
    def upgrade(saved: dict[str, Any]) -> dict[str, Any]:
        out = {k: v for k, v in saved.items() if k != "trainers"}
        for name in IDENTITY_FIELDS:
            value = getattr(cfg, name)
            if dataclasses.is_dataclass(value) and isinstance(out.get(name), dict):
                group = {**checkpoint_normal(_defaults(type(value))), **out[name]}
                out[name] = {k: v for k, v in group.items() if k not in NOT_IDENTITY.get(name, ())}
        return out

    return upgrade


def checkpoint_normal(values: dict[str, Any]) -> dict[str, Any]:
    from hpcrl.run.rundir import normalize_identity

    return normalize_identity(values)


def deal_rank_state(states: dict[int, dict[str, Any]], old: int, new: int, rank: int, seed: int,
                    version: int) -> tuple[torch.Tensor, int, list[int]]:
    """(generator state, next credit, credits trained ahead of it) of trainer ``rank`` of ``new`` from
    the rank files of the ``old`` trainers that wrote a checkpoint (see the module docstring)."""
    if rank < old:
        generator = states[rank]["generator"]
    else:
        generator = torch.Generator().manual_seed(seed + 2 + 1000 * rank + 7919 * version).get_state()
    credits = {r: int(states[r].get("next_credit", 0)) for r in range(old)}
    ahead = {r: _ints(states[r].get("taken_ahead")) for r in range(old)}
    if old == new:
        return generator, credits[rank], ahead[rank]
    trained = [c for r, c in credits.items() if c > 0 for c in [(c - 1) * old + r + 1]]
    trained += [c * old + r + 1 for r, cs in ahead.items() for c in cs]
    return generator, math.ceil(max(trained, default=0) / new), []


def _ints(value: Any) -> list[int]:
    return [] if value is None else [int(v) for v in torch.as_tensor(value).reshape(-1).tolist()]


def dcp_fault_line(where: Path, err: BaseException) -> str:
    """The line of a failed DCP save: the first disk error among the ranks' failures (DCP wraps them in one
    ``CheckpointException``) as :func:`~hpcrl.core.diskfault.fault_line`; torch's zip writer reports a failed
    write as a position mismatch, the disk error lost: then ENOSPC where ``where``'s disk is full, else what
    DCP said, with the free space."""
    failures = getattr(err, "failures", None)
    causes = [e[0] if isinstance(e, tuple) else e for e in (failures or {}).values()] + [err]
    for cause in causes:
        while cause is not None and not is_disk_error(cause):
            cause = cause.__cause__ or cause.__context__
        if cause is not None:
            return fault_line(cause.filename or where, cause)
    try:
        full = free_space(where)[0] == 0  # the disk error lost on its way (gathered over the ranks)
    except OSError:
        full = False
    if full:
        return fault_line(where, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
    first = next((f"{type(c).__name__}: {str(c).splitlines()[0]}" for c in causes if str(c)), type(err).__name__)
    return fault_line(where, OSError(f"checkpoint shards not written: {first}"))


def _dcp_files(tmp: Path, rank: int) -> list[str]:
    names = sorted(f"{DCP_DIR}/{p.name}" for p in (tmp / DCP_DIR).glob(f"__{rank}_*"))
    if rank == 0:
        names.append(f"{DCP_DIR}/.metadata")
    return names


def _is_dcp(learner: dict[str, Any]) -> bool:
    return learner.get("format") == FORMAT


class TrainerCheckpoints:
    """One trainer's side of the checkpoints (see the module docstring). ``barrier(name)``: the
    trainers' store barrier; ``identity``: :func:`run_identity` of the config."""

    def __init__(self, cfg: Any, rank: int, trainers: int, model: torch.nn.Module, learner: Any,
                 device: torch.device, barrier: Callable[[str], None], agree: checkpoint.Agree,
                 group: Any) -> None:
        self.cfg, self.rank, self.trainers, self.model, self.learner = cfg, rank, trainers, model, learner
        self.device, self.barrier, self.agree, self.group = device, barrier, agree, group
        self.identity, self.upgrade = run_identity(cfg), upgrade_identity(cfg)
        self._stager: Any = None
        self._thread: threading.Thread | None = None
        self._result: Path | None = None
        self._error: BaseException | None = None
        self.after_commit: Callable[[Path], None] | None = None  # trainer 0: e.g. the hf actor export
        self.stage_s: list[float] = []  # per checkpoint: on the training thread (the copy)
        self.write_s: list[float] = []  # per checkpoint: on the writer thread (shards, files, commit)

    def timing_line(self) -> str:
        """One line: how long checkpoints held the step (staging) and how long they took behind it."""
        if not self.write_s:
            return ""
        ms = lambda xs: 1000.0 * sum(xs) / len(xs)  # noqa: E731
        return (f"{len(self.write_s)} checkpoint(s): the step waited {ms(self.stage_s):.1f} ms each (staging "
                f"copy), the writer thread took {ms(self.write_s):.1f} ms each (shards, checksums, commit)")

    # -- the state --------------------------------------------------------------------------------
    def _optimizer(self) -> torch.optim.Optimizer | None:
        return getattr(self.learner, "optimizer", None)

    def state_dict(self) -> dict[str, Any]:
        """``{"model": ..., "optim": ...}`` as DCP saves and loads it (references to the live tensors)."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        opt = self._optimizer()
        if opt is None:
            return {"model": get_model_state_dict(self.model)}
        model_sd, optim_sd = get_state_dict(self.model, opt)
        return {"model": model_sd, "optim": optim_sd}

    def _learner_rest(self) -> dict[str, Any]:
        """The learner's state less its optimizer and the model (both in the DCP shards)."""
        state = self.learner.state_dict()
        if self._optimizer() is None:
            return {"all": state}
        return {k: v for k, v in state.items() if k not in ("optimizer", "model")}

    # -- writing ----------------------------------------------------------------------------------
    def save(self, version: int, env_steps: float, rank_state: dict[str, Any], wait: bool = False) -> Path | None:
        """Stage this trainer's state and write it in the background (collective: every trainer calls
        it at the same version). ``wait``: return the committed path (the end of a run)."""
        previous = self.wait()  # one write in flight; its failure is raised here, on every trainer
        del previous
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        if self._stager is None:
            cuda = self.device.type == "cuda"
            self._stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                                        use_async_staging=False, use_non_blocking_copy=False))
        t0 = time.perf_counter()
        staged = self._stager.stage(self.state_dict())  # a copy: the next update cannot change it
        learner = ({"format": FORMAT, "version": version, "env_steps": env_steps, "learner": self._learner_rest(),
                    "trainers": self.trainers} if self.rank == 0 else None)
        rows = tail_rows(Path(self.cfg.run_dir) / METRICS) if self.rank == 0 else None  # this step's rows
        group = self.group
        self.stage_s.append(time.perf_counter() - t0)

        def write_dcp(tmp: Path) -> list[str]:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.api import CheckpointException

            try:
                dcp.save(staged, storage_writer=dcp.FileSystemWriter(str(tmp / DCP_DIR), sync_files=True),
                         process_group=group)
            # DCP gathers every rank's failure into one CheckpointException, a BaseException
            except (Exception, CheckpointException) as err:  # noqa: BLE001
                raise DiskFault(dcp_fault_line(tmp / DCP_DIR, err)) from None
            fsync_dir(tmp / DCP_DIR)
            return _dcp_files(tmp, self.rank)

        def run() -> None:
            start = time.perf_counter()
            try:
                self._result = checkpoint.save(self.cfg.run_dir, version, self.rank, self.trainers, learner,
                                               rank_state, self.barrier, identity=self.identity, extra=write_dcp,
                                               rows=rows)
                self.write_s.append(time.perf_counter() - start)
                if self.after_commit is not None:
                    self.after_commit(self._result)
            except BaseException as err:  # noqa: BLE001  (raised on the training thread at the next wait)
                self._error = err

        self._result, self._error = None, None
        self._thread = threading.Thread(target=run, name=f"checkpoint-v{version}", daemon=True)
        self._thread.start()
        return self.wait() if wait else None

    def wait(self) -> Path | None:
        """Until the write in flight (if any) is committed; its path, or its failure raised."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise err
        return self._result

    # -- reading ----------------------------------------------------------------------------------
    def _loader(self, path: Path, manifest: dict[str, Any]) -> tuple[dict[str, Any], dict[int, dict[str, Any]]]:
        old = int(manifest["world_size"])
        for name in (LEARNER, *(rank_file(r) for r in range(old))):
            check_file(path, name, manifest)
        try:
            learner = torch.load(path / LEARNER, map_location="cpu", weights_only=True)
            states = {r: load_h5(path / rank_file(r), FORMAT_VERSION) for r in range(old)}
        except Exception as err:  # noqa: BLE001  (any unpickling failure means the same: unusable)
            raise CorruptCheckpoint(path, f"cannot be loaded: {type(err).__name__}: {err}") from None
        if _is_dcp(learner):
            shards = sorted(n for n in manifest["files"] if n.startswith(f"{DCP_DIR}/"))
            if f"{DCP_DIR}/.metadata" not in shards:
                raise CorruptCheckpoint(path, f"{DCP_DIR}/.metadata is not in the manifest")
            for i, name in enumerate(shards):  # each trainer checks a share; the agreement makes it everyone's
                if i % self.trainers == self.rank:
                    check_file(path, name, manifest)
        return learner, states

    def preflight(self) -> Path | None:
        return checkpoint.preflight(self.cfg.run_dir, self.trainers, identity=self.identity, reshard=True,
                                    upgrade=self.upgrade)

    def restore(self, device: torch.device) -> checkpoint.Restored | None:
        """The newest checkpoint every trainer can load (collective over the trainers), its small files
        loaded; :meth:`load` then loads the model and the optimizer."""
        return checkpoint.restore(self.cfg.run_dir, self.rank, self.trainers, device, identity=self.identity,
                                  agree=self.agree, reshard=True, upgrade=self.upgrade, loader=self._loader)

    def load(self, found: checkpoint.Restored, strategy: Any) -> tuple[int, float, torch.Tensor, int, list[int]]:
        """Load ``found`` into the model and the learner (collective over the trainers); returns
        (version, env steps, this trainer's generator state, its next credit, credits taken ahead)."""
        meta = found.learner
        version = int(meta["version"])
        generator, credit, ahead = deal_rank_state(found.rank_states or {}, found.world_size, self.trainers, self.rank,
                                            int(self.cfg.seed), version)
        if not _is_dcp(meta):  # the older format: full tensors on every trainer
            learner_state = meta["learner"]
            model_state = {k: v.to(strategy.restore_device) for k, v in meta["model"].items()}
            strategy.load_full_state(self.learner, model_state, _to(learner_state, strategy.restore_device))
            return version, float(meta["env_steps"]), generator, credit, ahead
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        rest = meta["learner"]
        if "all" in rest:
            self.learner.load_state_dict(rest["all"])
        else:  # the learner's own fields first; the optimizer it loads is then filled by DCP
            current = self.learner.state_dict()
            self.learner.load_state_dict({**current, **rest})
        state = self.state_dict()
        try:
            dcp.load(state, storage_reader=dcp.FileSystemReader(str(found.path / DCP_DIR)), process_group=self.group)
        except Exception as err:  # noqa: BLE001  (verified files that DCP cannot read: say which checkpoint)
            raise checkpoint.CheckpointError(f"--resume: {found.path / DCP_DIR} verified but not loadable: "
                                             f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
                                             ) from None
        opt = self._optimizer()
        if opt is None:
            set_model_state_dict(self.model, state["model"])
        else:
            set_state_dict(self.model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        return version, float(meta["env_steps"]), generator, credit, ahead

    def close(self) -> None:
        try:
            self.wait()
        finally:
            if self._stager is not None:
                self._stager.close()
                self._stager = None


def _to(obj: Any, device: torch.device) -> Any:
    if torch.is_tensor(obj):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to(v, device) for v in obj)
    return obj


def read_full(path: str | Path, keys: Callable[[str], bool] | None = None) -> dict[str, Any]:
    """A checkpoint directory's contents as full tensors in this process (no process group): ``{"model":
    {name: tensor}, "optim": {...}, "version", "env_steps", "learner"}``, for tests and tools; the older
    gathered format gives its ``model`` and ``learner``. ``keys``: which flattened DCP keys
    (``model.<name>``, ``optim.state.<name>.exp_avg``, ...) to read (default: all)."""
    path = Path(path)
    meta = torch.load(path / LEARNER, map_location="cpu", weights_only=True)
    if not _is_dcp(meta):
        return meta
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from torch.distributed.checkpoint._nested_dict import unflatten_state_dict

    reader = dcp.FileSystemReader(str(path / DCP_DIR))
    metadata = reader.read_metadata()
    flat: dict[str, Any] = {}
    for key, md in metadata.state_dict_metadata.items():
        if keys is not None and not keys(key):
            continue
        # tensors into buffers of their full size; other entries (the optimizer's param groups) replaced
        flat[key] = torch.empty(md.size, dtype=md.properties.dtype) if isinstance(md, TensorStorageMetadata) else None
    dcp.load(flat, storage_reader=reader, no_dist=True)
    out: dict[str, Any] = {"model": {}, "optim": {}, **{k: meta[k] for k in ("version", "env_steps", "learner")}}
    groups = {k: v for k, v in flat.items() if k.startswith("optim.param_groups.")}
    for key, value in flat.items():
        if key not in groups:
            top, _, rest = key.partition(".")
            out.setdefault(top, {})[rest] = value
    if groups:  # as the optimizer's state_dict has them (parameters named by FQN)
        mapping = {k: v for k, v in (metadata.planner_data or {}).items() if k in groups}
        out["param_groups"] = unflatten_state_dict(groups, mapping)["optim"]["param_groups"]
    return out
