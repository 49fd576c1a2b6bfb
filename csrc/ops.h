// Backend entry points of hpcrl._C. bindings.cpp validates every input (device, dtype,
// contiguity, shapes) and allocates outputs; the functions here only compute.
// Slim ATen headers only: <torch/extension.h> costs ~60 s of g++ per translation unit.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace hpcrl {

// Every tensor of `tensors` is contiguous, has flat's dtype and device; sum of numels == flat.numel().
void flatten_cpu(const std::vector<at::Tensor>& tensors, const at::Tensor& flat);
void unflatten_cpu(const at::Tensor& flat, const std::vector<at::Tensor>& tensors, double scale);

// Replay shard storage (time-major, see csrc/common/replay_nstep.h and hpcrl/replay/shard.py):
//   obs [C, E, D] f32, action [C, E, A] f32, reward [C, E] f32, flags [C, E] u8 (these two with any strides),
//   final_ref [C, E] i64, final_pool [P, D] f32, head_next_obs [E, D] f32.
// Rows: env_idx [B] i64, slot_idx [B] i64 (physical slots, already validated).
// Outputs (preallocated): out_obs [B, D], out_action [B, A], out_reward [B], out_next_obs [B, D],
//   out_discount [B] f32, out_n [B] i64.
struct ReplayStorage {
  at::Tensor obs, action, reward, flags, final_ref, final_pool, head_next_obs;
  int64_t ptr;  // number of add() calls so far
};
struct ReplayBatch {
  at::Tensor obs, action, reward, next_obs, discount, n;
};
// prefetch_rows: how many rows ahead the CPU loop requests its cache lines (0: none).
void replay_gather_cpu(const ReplayStorage& s, const at::Tensor& env_idx, const at::Tensor& slot_idx,
                       int64_t n_step, double gamma, int64_t prefetch_rows, const ReplayBatch& out);
// Sampling: env_idx / slot_idx are OUTPUTS here, filled with the pairs drawn for rows offset .. offset + B
// of seed's stream (csrc/common/replay_sample.h), then gathered as above.
void replay_sample_cpu(const ReplayStorage& s, uint64_t seed, uint64_t offset, const at::Tensor& env_idx,
                       const at::Tensor& slot_idx, int64_t n_step, double gamma, int64_t prefetch_rows,
                       const ReplayBatch& out);

// Shared-memory all-reduce flags (hpcrl/comm/shm.py): flags is a contiguous int64 CPU tensor mapped by
// every rank of a host. publish: a release store of value at flags[index]. wait: acquire loads until
// flags[i * stride] >= value for every i < count, or budget_s seconds passed; returns -1, or the first
// i still below (the peer to name). Called without the GIL.
void shm_publish_cpu(const at::Tensor& flags, int64_t index, int64_t value);
int64_t shm_wait_cpu(const at::Tensor& flags, int64_t stride, int64_t count, int64_t value, double budget_s);

#ifdef HPCRL_WITH_CUDA
// Same contracts on CUDA tensors (csrc/cuda/glue.cpp); each is one kernel launch on the current stream.
void flatten_cuda(const std::vector<at::Tensor>& tensors, const at::Tensor& flat);
void unflatten_cuda(const at::Tensor& flat, const std::vector<at::Tensor>& tensors, double scale);
void replay_gather_cuda(const ReplayStorage& s, const at::Tensor& env_idx, const at::Tensor& slot_idx,
                        int64_t n_step, double gamma, const ReplayBatch& out);
void replay_sample_cuda(const ReplayStorage& s, uint64_t seed, uint64_t offset, const at::Tensor& env_idx,
                        const at::Tensor& slot_idx, int64_t n_step, double gamma, const ReplayBatch& out);
#endif

}  // namespace hpcrl
