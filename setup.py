"""Build hpcrl._C: C++ kernels always, CUDA kernels when torch has CUDA and a toolkit exists.

HPCRL_CUDA=auto (default) | 1 (require CUDA) | 0 (CPU only). HPCRL_OPENMP=0: no -fopenmp (the CPU
kernels then run on one thread; by default it is used whenever the compiler accepts it). Install with
``pip install --no-build-isolation -e .`` (torch is deliberately not a build requirement: an
isolated build would compile against a different torch than the one that imports the module).
"""

import os
import platform
import shutil
import subprocess
import sys
import tempfile
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


def openmp_flags() -> list[str]:
    """["-fopenmp"] when the C++ compiler the build uses accepts it, else [] (and a note).

    at::parallel_for is an inline template: it only forks threads in a translation unit compiled with
    _OPENMP defined (ATen/ParallelOpenMP.h); without it every hpcrl._C kernel runs on one thread
    whatever torch.set_num_threads says. torch's ATen backend is OpenMP (libgomp on Linux wheels), so
    the same flag on the link line records a NEEDED libgomp.so.1, which the loader resolves to the
    copy torch already loaded (same soname): one OpenMP runtime, one thread pool. Try-compiled rather
    than assumed: Apple clang and some cross compilers reject -fopenmp; those keep the serial build.
    HPCRL_OPENMP=0 forces the serial build.
    """
    if os.environ.get("HPCRL_OPENMP", "1") == "0" or sys.platform == "win32":
        return []
    from torch.utils.cpp_extension import get_cxx_compiler  # the compiler BuildExtension runs

    cxx = get_cxx_compiler()
    probe = "#include <omp.h>\nint hpcrl_omp_probe() { int n = 0;\n#pragma omp parallel reduction(+ : n)\n" \
            "  n += omp_get_num_threads();\n  return n; }\n"
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "probe.cpp"
        src.write_text(probe)
        cmd = [cxx, "-fopenmp", "-fPIC", "-shared", str(src), "-o", str(Path(tmp) / "probe.so")]
        try:
            ok = subprocess.run(cmd, capture_output=True, timeout=120).returncode == 0
        except (OSError, subprocess.SubprocessError):
            ok = False
    if not ok:
        print(f"hpcrl: {cxx} does not accept -fopenmp; at::parallel_for in hpcrl._C will run on one thread")
        return []
    return ["-fopenmp"]


cpp_sources = ["csrc/bindings.cpp", "csrc/cpu/multi_tensor_cpu.cpp", "csrc/cpu/replay_cpu.cpp", "csrc/cpu/shm_flags_cpu.cpp"]
omp_flags = openmp_flags()
cxx_flags = ["-O3", *omp_flags, "-g0"]  # -g0 last: the 10 MB debug .so is of no use here
if platform.machine() in ("x86_64", "AMD64"):
    # F16C (every x86-64 CPU since 2012): c10::Half converts with one instruction instead of bit
    # twiddling, which made the fp16 scaled unflatten 5x slower than torch's own ops.
    cxx_flags.append("-mf16c")
if use_cuda:
    # No GPU at build time means no arch to detect; Hopper (H100/H200) is the target we test on.
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0")
    print(f"hpcrl: building CPU+CUDA extension (CUDA_HOME {cuda_home}, arch {os.environ['TORCH_CUDA_ARCH_LIST']}, "
          f"OpenMP: {'on' if omp_flags else 'off'})")
    ext = CUDAExtension(
        "hpcrl._C",
        cpp_sources + ["csrc/cuda/glue.cpp", "csrc/cuda/multi_tensor.cu", "csrc/cuda/replay.cu"],
        define_macros=[("HPCRL_WITH_CUDA", "1")],
        # The .cu files are torch-free (no at::parallel_for): nvcc needs no OpenMP flag.
        extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3", "-std=c++17", "--fmad=false", "-DHPCRL_NVCC_FMAD_OFF"]},
        extra_link_args=omp_flags,
    )
else:
    print(f"hpcrl: building CPU-only extension (OpenMP: {'on' if omp_flags else 'off'})")
    ext = CppExtension("hpcrl._C", cpp_sources, extra_compile_args=cxx_flags, extra_link_args=omp_flags)

setup(
    packages=find_packages(include=["hpcrl", "hpcrl.*"]),
    ext_modules=[ext],
    cmdclass={"build_ext": BuildExtension},
)
