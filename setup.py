"""Build hpcrl._C: C++ kernels always, CUDA kernels when torch has CUDA and a toolkit exists.

HPCRL_CUDA=auto (default) | 1 (require CUDA) | 0 (CPU only). Install with
``pip install --no-build-isolation -e .`` (torch is deliberately not a build requirement: an
isolated build would compile against a different torch than the one that imports the module).
"""

import os
import platform
import shutil
import sys
from pathlib import Path

from setuptools import find_packages, setup


def find_cuda_home() -> str | None:
    # Must run before torch.utils.cpp_extension is imported: it reads CUDA_HOME at import time,
    # and guesses /usr/local when nvcc is a wrapper script in /usr/local/bin.
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(str(Path(nvcc).resolve().parent.parent))
    candidates.append("/usr/local/cuda")
    for c in candidates:
        if c and (Path(c) / "include/cuda_runtime.h").exists() and (Path(c) / "bin/nvcc").exists():
            return str(Path(c).resolve())
    return None


cuda_home = find_cuda_home()
if cuda_home:
    os.environ["CUDA_HOME"] = cuda_home

try:
    import torch
    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension
except ImportError:
    sys.exit("hpcrl: torch must be installed before building hpcrl; install it, then run: "
             "pip install --no-build-isolation -e .")

mode = os.environ.get("HPCRL_CUDA", "auto").lower()
if mode not in ("auto", "1", "0"):
    sys.exit(f"hpcrl: HPCRL_CUDA={mode!r} is not one of auto, 1, 0")
cuda_possible = bool(torch.version.cuda) and cuda_home is not None
if mode == "1" and not cuda_possible:
    sys.exit(f"hpcrl: HPCRL_CUDA=1 but torch.version.cuda={torch.version.cuda}, CUDA toolkit={cuda_home!r}; "
             "install a CUDA build of torch and the CUDA toolkit, or build with HPCRL_CUDA=0")
use_cuda = mode == "1" or (mode == "auto" and cuda_possible)

cpp_sources = ["csrc/bindings.cpp", "csrc/cpu/multi_tensor_cpu.cpp", "csrc/cpu/replay_cpu.cpp"]
cxx_flags = ["-O3", "-g0"]  # -g0 last: the 10 MB debug .so is of no use here
if platform.machine() in ("x86_64", "AMD64"):
    # F16C (every x86-64 CPU since 2012): c10::Half converts with one instruction instead of bit
    # twiddling, which made the fp16 scaled unflatten 5x slower than torch's own ops.
    cxx_flags.append("-mf16c")
if use_cuda:
    # No GPU at build time means no arch to detect; Hopper (H100/H200) is the target we test on.
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
    print(f"hpcrl: building CPU+CUDA extension (CUDA_HOME {cuda_home}, arch {os.environ['TORCH_CUDA_ARCH_LIST']})")
    ext = CUDAExtension(
        "hpcrl._C",
        cpp_sources + ["csrc/cuda/glue.cpp", "csrc/cuda/multi_tensor.cu", "csrc/cuda/replay.cu"],
        define_macros=[("HPCRL_WITH_CUDA", "1")],
        extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3", "-std=c++17", "--fmad=false", "-DHPCRL_NVCC_FMAD_OFF"]},
    )
else:
    print("hpcrl: building CPU-only extension")
    ext = CppExtension("hpcrl._C", cpp_sources, extra_compile_args=cxx_flags)

setup(
    packages=find_packages(include=["hpcrl", "hpcrl.*"]),
    ext_modules=[ext],
    cmdclass={"build_ext": BuildExtension},
)
