#!/usr/bin/env bash
# Compile-check the CUDA half of hpcrl._C on a machine with NO GPU and a CPU-only torch.
#
#   bash tools/cuda_compile_check.sh          # uses `python` (the active venv), else ./.venv/bin/python
#
# 1. nvcc -c every csrc/cuda/*.cu (torch-free kernels, about 2 s each) twice: strict (-Werror
#    all-warnings, C++17) and with the flags torch's CUDAExtension adds (C++20, the
#    __CUDA_NO_HALF*_ macros), so the setup.py build cannot hit an error that this check misses.
# 2. Parity guard: the replay kernel's PTX must contain no fma.rn.f32 (see csrc/cuda/replay.cu).
# 3. g++ compiles csrc/cuda/glue.cpp (-DHPCRL_WITH_CUDA) against the active torch's headers, which
#    works with a CPU-only torch because the glue uses device-generic c10 APIs only; then every
#    hpcrl_cuda:: symbol the glue needs must be defined by the nvcc objects (a link check without
#    libcudart or a CUDA torch).
#
# Environment: NVCC (default: nvcc on PATH, else /usr/local/cuda/bin/nvcc), PYTHON, CXX (default g++),
# HPCRL_CHECK_ARCH (default sm_90). Exits non-zero on the first failure.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

if [[ -z "${NVCC:-}" ]]; then
  if command -v nvcc >/dev/null 2>&1; then
    NVCC=nvcc
  elif [[ -x /usr/local/cuda/bin/nvcc ]]; then
    NVCC=/usr/local/cuda/bin/nvcc
  else
    echo "cuda_compile_check: no nvcc found (set NVCC=/path/to/nvcc)" >&2
    exit 1
  fi
fi

if [[ -z "${PYTHON:-}" ]]; then
  PYTHON=python
  command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
  if ! "$PYTHON" -c 'import torch' >/dev/null 2>&1 && [[ -x "$ROOT/.venv/bin/python" ]]; then
    PYTHON="$ROOT/.venv/bin/python"
  fi
fi
CXX="${CXX:-g++}"
ARCH="${HPCRL_CHECK_ARCH:-sm_90}"

TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT

now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }
T_ALL="$(now)"

# step NAME CMD...: run CMD, print its time, stop the script with its output on failure.
step() {
  local name="$1"
  shift
  local t0
  t0="$(now)"
  if "$@" >"$TMP/step.log" 2>&1; then
    printf '  ok    %-62s %6ss\n' "$name" "$(since "$t0")"
    if [[ -s "$TMP/step.log" ]]; then sed 's/^/        | /' "$TMP/step.log"; fi
  else
    local rc=$?
    printf '  FAIL  %-62s %6ss (exit %d)\n' "$name" "$(since "$t0")" "$rc"
    sed 's/^/        | /' "$TMP/step.log"
    echo "cuda_compile_check: FAILED" >&2
    exit 1
  fi
}

echo "cuda_compile_check: $("$NVCC" --version | tail -n 1 | sed 's/^Build //'), arch $ARCH"

# Flags the real build needs too (setup.py's nvcc args): --fmad=false -DHPCRL_NVCC_FMAD_OFF.
NVCC_COMMON=(-c -O3 "-arch=$ARCH" -Xcompiler -fPIC -I csrc --fmad=false -DHPCRL_NVCC_FMAD_OFF)
NVCC_STRICT=(-std=c++17 -Werror all-warnings -Xptxas -warn-spills)
NVCC_TORCHLIKE=(-std=c++20 -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__
                -D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__ --expt-relaxed-constexpr)

shopt -s nullglob
CU_FILES=(csrc/cuda/*.cu)
shopt -u nullglob
if [[ ${#CU_FILES[@]} -eq 0 ]]; then
  echo "cuda_compile_check: no csrc/cuda/*.cu files" >&2
  exit 1
fi

echo "[1/3] nvcc: torch-free kernels"
OBJS=()
for cu in "${CU_FILES[@]}"; do
  obj="$TMP/$(basename "$cu" .cu).o"
  step "$cu (c++17, -Werror all-warnings)" "$NVCC" "${NVCC_COMMON[@]}" "${NVCC_STRICT[@]}" "$cu" -o "$obj"
  step "$cu (torch CUDAExtension flags, c++20)" "$NVCC" "${NVCC_COMMON[@]}" "${NVCC_TORCHLIKE[@]}" "$cu" \
    -o "$TMP/$(basename "$cu" .cu).torchlike.o"
  OBJS+=("$obj")
done

echo "[2/3] parity guard: no FMA contraction in the replay kernel"
no_fma() {
  "$NVCC" -ptx -O3 "-arch=$ARCH" -std=c++17 -I csrc --fmad=false -DHPCRL_NVCC_FMAD_OFF \
    csrc/cuda/replay.cu -o "$TMP/replay.ptx"
  local n
  n="$(grep -c 'fma\.rn\.f32' "$TMP/replay.ptx" || true)"
  if [[ "$n" != "0" ]]; then
    echo "replay.cu PTX has $n fma.rn.f32 instructions: CPU/GPU n-step returns would differ"
    return 1
  fi
  # Negative control: with nvcc's default --fmad=true the same source must show the contraction,
  # otherwise this grep proves nothing (informative only).
  "$NVCC" -ptx -O3 "-arch=$ARCH" -std=c++17 -I csrc -DHPCRL_NVCC_FMAD_OFF csrc/cuda/replay.cu -o "$TMP/replay_fmad.ptx"
  n="$(grep -c 'fma\.rn\.f32' "$TMP/replay_fmad.ptx" || true)"
  echo "control: with the default --fmad=true the replay PTX has $n fma.rn.f32 (expected >= 1)"
}
step "csrc/cuda/replay.cu PTX has no fma.rn.f32 (--fmad=false)" no_fma

echo "[3/3] g++: glue against $("$PYTHON" -c 'import torch; print("torch " + torch.__version__)')"
mapfile -t TORCH_INC < <("$PYTHON" -c 'from torch.utils.cpp_extension import include_paths
print("\n".join(include_paths()))')
PY_INC="$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
GLUE_FLAGS=(-std=c++20 -DHPCRL_WITH_CUDA -Wall -Wextra -Werror -I csrc)
for d in "${TORCH_INC[@]}" "$PY_INC"; do GLUE_FLAGS+=(-isystem "$d"); done
# -c -O0 costs about the same as -fsyntax-only (the time is in parsing the headers) and yields an
# object whose undefined symbols can be checked against the nvcc objects.
step "csrc/cuda/glue.cpp (g++ -c -O0, -Wall -Wextra -Werror)" "$CXX" "${GLUE_FLAGS[@]}" -O0 -g0 -fPIC -c \
  csrc/cuda/glue.cpp -o "$TMP/glue.o"

link_check() {
  # Function names (the last "hpcrl_cuda::NAME(" of each demangled line; parameters may name types).
  local names='s/.*\(hpcrl_cuda::[A-Za-z0-9_]*\)(.*/\1/p'
  nm -C --undefined-only "$TMP/glue.o" | sed -n "$names" | sort -u >"$TMP/needed.txt"
  nm -C --defined-only "${OBJS[@]}" | grep ' T ' | sed -n "$names" | sort -u >"$TMP/defined.txt"
  if [[ ! -s "$TMP/needed.txt" ]]; then
    echo "glue.o references no hpcrl_cuda:: launcher"
    return 1
  fi
  local missing
  missing="$(comm -23 "$TMP/needed.txt" "$TMP/defined.txt")"
  if [[ -n "$missing" ]]; then
    echo "undefined in the nvcc objects: $missing"
    return 1
  fi
  # Same check with full signatures (mangled names), so a parameter-type drift is caught too.
  nm --undefined-only "$TMP/glue.o" | awk '{print $NF}' | grep '_ZN10hpcrl_cuda' | sort -u >"$TMP/needed_m.txt"
  nm --defined-only "${OBJS[@]}" | awk '$2 == "T" {print $3}' | grep '_ZN10hpcrl_cuda' | sort -u >"$TMP/defined_m.txt"
  missing="$(comm -23 "$TMP/needed_m.txt" "$TMP/defined_m.txt")"
  if [[ -n "$missing" ]]; then
    echo "signature mismatch, undefined: $missing"
    return 1
  fi
  echo "resolved: $(tr '\n' ' ' <"$TMP/needed.txt")"
}
step "glue.o's hpcrl_cuda:: symbols are defined by the .cu objects" link_check

echo "cuda_compile_check: OK in $(since "$T_ALL")s"
