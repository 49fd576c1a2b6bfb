import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

# Multi-rank tests run with the default process group poisoned for CPU tensors (hpcrl.comm.planes):
# a collective that forgot to name its plane fails here as it would under NCCL. Spawned ranks and
# subprocesses inherit it; tests of the production layout (device plane = default group) set it to 0.
os.environ.setdefault("HPCRL_STRICT_PLANES", "1")


def pytest_xdist_auto_num_workers(config):
    # `-n auto` (pyproject's addopts): one worker per core, at most 4. Serially the tests leave ~40 % of
    # 2 cores idle (ranks waiting on heartbeats, timeouts, Slurm's scheduler, a peer's step); two workers
    # measured 1.58x faster on a quiet 2-core machine (5 multi-process modules: 294 s -> 186 s).
    # `-n 0` runs serially (one test, a debugger).
    return max(1, min(4, len(os.sched_getaffinity(0))))


def pytest_xdist_make_scheduler(config, log):
    """pyproject's `--dist loadfile`: a module's tests share one pytest-xdist worker, so its module fixtures
    (multi-rank runs several tests assert on) run once; and the modules that submit to the local Slurm
    cluster share one worker (its 2 nodes hold one test's jobs; two at once made a job wait a minute for
    nodes). (`--dist loadgroup` with xdist_group marks did neither: pytest-xdist 3.8 tags a test by rewriting
    `item._nodeid`, which pytest 9's `nodeid` no longer reads, so the groups were ignored.)"""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class ModuleScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = super()._split_scope(nodeid)
            return "slurm" if Path(module).name.startswith("test_slurm") else module

    return ModuleScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    # `cuda` tests are GPU parity checks (benchmarks/gpu_check.sh runs them on a lent GPU).
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run benchmarks/gpu_check.sh on one)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _one_thread():
    # 2-core CI machine: keep each test process at one intra-op thread unless a test asks for more.
    prev = torch.get_num_threads()
    torch.set_num_threads(int(os.environ.get("HPCRL_TEST_THREADS", "1")))
    yield
    torch.set_num_threads(prev)


@pytest.fixture(scope="session")
def hf_demo(tmp_path_factory):
    """``python -m hpcrl.ppo.demo DIR`` built once for the session (test_ppo_demo and test_readme read it;
    nothing writes into it): ``out`` (absolute, so its printed command runs from any directory), ``stdout``."""
    out = tmp_path_factory.mktemp("hf_demo") / "demo"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    built = subprocess.run([sys.executable, "-m", "hpcrl.ppo.demo", str(out)], capture_output=True, text=True,
                           timeout=300, env={**env, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "COLUMNS": "200"},
                           cwd=out.parent)
    assert built.returncode == 0, built.stderr[-2000:]
    return SimpleNamespace(out=out, stdout=built.stdout)
