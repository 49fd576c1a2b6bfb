// Torch-free launchers of the hpcrl CUDA kernels (csrc/cuda/multi_tensor.cu, csrc/cuda/replay.cu).
//
// This header is included by nvcc (the .cu files) and by g++ (csrc/cuda/glue.cpp, which cannot rely
// on <cuda_runtime.h> being on its include path), so it uses nothing but <cstdint>:
//   * streams travel as `void*` (a cudaStream_t),
//   * every launcher returns an `int` that is a cudaError_t (0 == cudaSuccess); the glue turns a
//     non-zero value into a TORCH_CHECK failure with the text of error_string(),
//   * all sizes and indices are int64_t (tensors with more than 2^31 elements are supported).
// A launcher only enqueues work on `stream`: it never synchronizes and never allocates.
#pragma once

#include <cstdint>

namespace hpcrl_cuda {

// Element types of the multi-tensor ops (the glue maps at::ScalarType onto these).
enum DType : int {
  kFloat32 = 0,
  kFloat16 = 1,
  kBFloat16 = 2,
};

// cudaGetErrorString() of a launcher's return value.
const char* error_string(int code);

// ---------------------------------------------------------------------------------------------
// Multi-tensor pack / unpack: ONE kernel launch for the whole list of tensors.
//
// `table` is a DEVICE pointer to 2 * num_tensors + 1 int64 values:
//   table[0 .. n)        the data address of tensor i (reinterpret_cast<int64_t>(ptr)),
//   table[n .. 2n + 1)   element offsets of tensor i inside `flat`: off[0] = 0, off[i + 1] =
//                        off[i] + numel(i), off[n] = total. Empty tensors (numel 0) are allowed.
// Every tensor is contiguous, of element type `dtype`, and lives on the current device; `flat` holds
// `total` elements of that type. num_tensors <= 0 or total <= 0 launches nothing and returns 0.
// An unknown dtype returns cudaErrorInvalidValue without launching.

// flat[off[i] + j] = tensor_i[j]  (a pure copy, bit-exact).
int multi_tensor_flatten(const int64_t* table, int64_t num_tensors, int64_t total, void* flat, int dtype,
                         void* stream);

// tensor_i[j] = T(float(flat[off[i] + j]) * scale), computed in fp32 and rounded to nearest even;
// scale == 1.0f exactly makes it a pure (bit-exact) copy.
int multi_tensor_unflatten(const int64_t* table, int64_t num_tensors, int64_t total, const void* flat, int dtype,
                           float scale, void* stream);

// ---------------------------------------------------------------------------------------------
// Replay gather with n-step returns (see csrc/ops.h and csrc/common/replay_nstep.h).
//
// Storage is time-major: element (slot s, env e) of an [C, E, ...] array is row s * E + e; reward and
// flags are read through their element strides (the shard stores them env-major, interleaved).
// Row b of the batch reads env = env_idx[b], slot = slot_idx[b] (already validated by the caller:
// 0 <= env < E, 0 <= slot < min(ptr, C)), runs hpcrl::nstep_window and writes
//   out_obs[b, :]      = obs[slot, env, :]
//   out_action[b, :]   = action[slot, env, :]
//   out_reward[b]      = w.ret
//   out_discount[b]    = w.discount
//   out_n[b]           = w.k
//   out_next_obs[b, :] = head_next_obs[env, :]                         if w.source == head
//                        final_pool[max(final_ref[w.last, env], 0), :] if w.source == final, P > 0
//                        obs[(w.last + 1) % C, env, :]                 otherwise
// (the same rules as hpcrl.ops.reference.replay_gather, including its clamp(min=0) of final_ref and
// its fallback to the ring when the pool is empty; a ref >= P, which the shard never stores, is
// clamped to P - 1 instead of reading out of bounds).
struct ReplayGatherArgs {
  // Storage (device pointers).
  const float* obs;            // [C, E, D]
  const float* action;         // [C, E, A]
  const float* reward;         // [C, E], element (s, e) at s * reward_slot_stride + e * reward_env_stride
  const uint8_t* flags;        // [C, E], element (s, e) at s * flags_slot_stride + e * flags_env_stride
  int64_t reward_slot_stride, reward_env_stride, flags_slot_stride, flags_env_stride;
  const int64_t* final_ref;    // [C, E]
  const float* final_pool;     // [P, D] (may be null when P == 0)
  const float* head_next_obs;  // [E, D]
  int64_t capacity;            // C
  int64_t num_envs;            // E
  int64_t obs_dim;             // D
  int64_t act_dim;             // A
  int64_t pool_size;           // P
  int64_t ptr;                 // number of add() calls so far
  // Sampled rows (device pointers).
  const int64_t* env_idx;      // [B]
  const int64_t* slot_idx;     // [B]
  int64_t batch;               // B; <= 0 launches nothing
  int64_t n_step;              // >= 1
  float gamma;                 // the caller converts the double gamma with static_cast<float>, like the CPU path
  // Outputs (device pointers, preallocated, contiguous).
  float* out_obs;              // [B, D]
  float* out_action;           // [B, A]
  float* out_reward;           // [B]
  float* out_next_obs;         // [B, D]
  float* out_discount;         // [B]
  int64_t* out_n;              // [B]
  // Sampling (csrc/common/replay_sample.h): when `sampling` is set, row b draws its pair from
  // (seed, offset + b), writes it to out_env[b] / out_slot[b] and ignores env_idx / slot_idx.
  int sampling;
  uint64_t seed;
  uint64_t offset;
  int64_t* out_env;            // [B]
  int64_t* out_slot;           // [B]
};

int replay_gather(const ReplayGatherArgs& args, void* stream);

}  // namespace hpcrl_cuda
