// Fused replay gather with n-step returns: one kernel launch per call. Torch-free (see kernels.cuh).
//
// Thread mapping: a GROUP of threads per sampled row (a warp, or 2/4/8 warps for wide rows).
//   * The copies dominate: out_obs, out_next_obs (D floats each) and out_action (A floats). With one
//     thread per row, consecutive threads would read rows that are D * 4 bytes apart, so every load
//     would be its own memory transaction. With a group per row, the lanes read consecutive floats
//     (float4 when the row is 16-byte aligned): fully coalesced.
//   * The n-step window is computed redundantly by every lane of the group. All lanes load the same
//     reward/flag addresses (one broadcast transaction each) and take the same branches, so there is
//     no divergence, and no shuffles or shared memory are needed. The window walks at most n_step
//     elements, which is small next to the 2 * D + A floats that the row copies.
//   * Group size: 32 threads up to D = 512 (at most 4 float4 per lane and row), doubling up to 256
//     threads (a whole block) for image-sized observations, so wide rows still spread over many SMs.
//     group >= 32 and divides the block, so a warp never serves two rows: every branch (including
//     inside nstep_window) is uniform across the warp.
//
// Bit-for-bit parity with the CPU kernel: hpcrl::nstep_window computes `ret += discount * reward`.
// nvcc contracts that into an FMA by default (one rounding instead of two), which the CPU build
// (x86-64 SSE, no FMA) and the reference (separate torch ops) do not do. This file must therefore be
// compiled with `--fmad=false`. There is no predefined macro that reveals the flag, so the build must
// also define HPCRL_NVCC_FMAD_OFF, and this file refuses to compile without it: a forgotten flag is a
// build error here instead of a parity failure that only a GPU test run would find.
// tools/cuda_compile_check.sh also checks the PTX for fma.rn.f32.
#ifndef HPCRL_NVCC_FMAD_OFF
#error "csrc/cuda/replay.cu must be compiled with: nvcc --fmad=false -DHPCRL_NVCC_FMAD_OFF (bit-exact CPU/GPU n-step returns)"
#endif

#include <cuda_runtime.h>

#include <cstdint>

#include "../common/replay_nstep.h"
#include "../common/replay_sample.h"
#include "kernels.cuh"

namespace hpcrl_cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = int64_t{1} << 20;  // grid-stride beyond this

// The `group` threads with lane = 0 .. group - 1 copy dst[0, len) = src[0, len).
__device__ __forceinline__ void copy_row(float* __restrict__ dst, const float* __restrict__ src, int64_t len,
                                         int lane, int group, bool vec4) {
  if (vec4) {  // len % 4 == 0 and both rows 16-byte aligned (checked by the launcher)
    const float4* __restrict__ s4 = reinterpret_cast<const float4*>(src);
    float4* __restrict__ d4 = reinterpret_cast<float4*>(dst);
    const int64_t n4 = len / 4;
#pragma unroll 4
    for (int64_t j = lane; j < n4; j += group) d4[j] = s4[j];
  } else {
#pragma unroll 4
    for (int64_t j = lane; j < len; j += group) dst[j] = src[j];
  }
}

// minBlocks 3: ptxas then allows up to 85 registers (it uses 80 with nvcc 13.0, no spills) and keeps
// at least 24 warps per SM. With __launch_bounds__(kThreads) alone, nvcc 13.0 caps the kernel at 64
// registers and spills; without launch bounds it uses 72.
__global__ void __launch_bounds__(kThreads, 3)
    replay_gather_kernel(const ReplayGatherArgs a, int group, bool vec4_obs, bool vec4_act) {
  const int64_t gtid = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int lane = static_cast<int>(threadIdx.x) & (group - 1);
  const int64_t row_stride = static_cast<int64_t>(gridDim.x) * (kThreads / group);
  const int64_t E = a.num_envs;
  const int64_t D = a.obs_dim;
  const int64_t A = a.act_dim;

  const hpcrl::PairRange range = hpcrl::pair_range(E, a.capacity, a.ptr);
  const hpcrl::Newest newest = hpcrl::newest_of(a.ptr, a.capacity);
  const hpcrl::StepLayout steps{a.reward_slot_stride, a.reward_env_stride, a.flags_slot_stride, a.flags_env_stride};
  for (int64_t b = gtid / group; b < a.batch; b += row_stride) {
    int64_t env, slot;
    if (a.sampling) {  // every lane of the group draws the same pair (counter-based: no shared state)
      hpcrl::sample_pair(a.seed, a.offset + static_cast<uint64_t>(b), range, &env, &slot);
      if (lane == 0) {
        a.out_env[b] = env;
        a.out_slot[b] = slot;
      }
    } else {
      env = a.env_idx[b];
      slot = a.slot_idx[b];
    }
    const hpcrl::NStepWindow w =
        hpcrl::nstep_window(a.reward, a.flags, steps, a.capacity, env, slot, newest, a.n_step, a.gamma);

    if (lane == 0) {
      a.out_reward[b] = w.ret;
      a.out_discount[b] = w.discount;
      a.out_n[b] = w.k;
    }

    const int64_t row = slot * E + env;
    copy_row(a.out_obs + b * D, a.obs + row * D, D, lane, group, vec4_obs);
    copy_row(a.out_action + b * A, a.action + row * A, A, lane, group, vec4_act);

    const float* next;
    if (w.source == hpcrl::kNextFromHead) {
      next = a.head_next_obs + env * D;
    } else if (w.source == hpcrl::kNextFromFinal && a.pool_size > 0) {
      int64_t ref = a.final_ref[w.last * E + env];
      ref = ref < 0 ? 0 : (ref >= a.pool_size ? a.pool_size - 1 : ref);
      next = a.final_pool + ref * D;
    } else {
      next = a.obs + ((w.last + 1 == a.capacity ? 0 : w.last + 1) * E + env) * D;
    }
    copy_row(a.out_next_obs + b * D, next, D, lane, group, vec4_obs);
  }
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) % 16) == 0; }

}  // namespace
}  // namespace hpcrl_cuda

// Qualified definition: must match the declaration in kernels.cuh exactly.
int hpcrl_cuda::replay_gather(const ReplayGatherArgs& a, void* stream) {
  if (a.batch <= 0) return static_cast<int>(cudaSuccess);
  if (a.capacity <= 0 || a.num_envs <= 0 || a.n_step < 1 || a.obs_dim < 0 || a.act_dim < 0 || a.pool_size < 0) {
    return static_cast<int>(cudaErrorInvalidValue);
  }

  // Rows are D (or A) floats starting at multiples of D (A) floats from 16-byte aligned bases, so
  // float4 is valid when the dimension is a multiple of 4 and every base pointer is 16-byte aligned
  // (torch's caching allocator returns 512-byte aligned blocks; views with offsets may not be).
  const bool vec4_obs = a.obs_dim % 4 == 0 && aligned16(a.obs) && aligned16(a.head_next_obs) &&
                        (a.pool_size == 0 || aligned16(a.final_pool)) && aligned16(a.out_obs) &&
                        aligned16(a.out_next_obs);
  const bool vec4_act = a.act_dim % 4 == 0 && aligned16(a.action) && aligned16(a.out_action);

  int group = 32;
  while (group < kThreads && a.obs_dim > static_cast<int64_t>(group) * 16) group *= 2;

  const int64_t rows_per_block = kThreads / group;
  int64_t blocks = (a.batch + rows_per_block - 1) / rows_per_block;
  if (blocks > kMaxBlocks) blocks = kMaxBlocks;

  replay_gather_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      a, group, vec4_obs, vec4_act);
  return static_cast<int>(cudaGetLastError());
}
