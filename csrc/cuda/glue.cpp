// torch <-> CUDA launcher glue: implements hpcrl::flatten_cuda, unflatten_cuda and replay_gather_cuda
// (csrc/ops.h) on top of the torch-free launchers of csrc/cuda/kernels.cuh.
//
// Compiled by g++ (not nvcc) with -DHPCRL_WITH_CUDA. It uses only device-generic c10 APIs, so it
// also compiles against a CPU-only torch (tools/cuda_compile_check.sh checks exactly that):
//   * c10::DeviceGuard makes the tensors' device current (the launchers query and launch on the
//     current device);
//   * the current CUDA stream comes from c10::impl::VirtualGuardImpl(CUDA).getStream(device), and
//     Stream::native_handle() turns it into the cudaStream_t (CUDAGuardImpl::getStreamNativeHandle
//     returns CUDAStream(s).stream());
//   * no <cuda_runtime.h>: error codes are translated by hpcrl_cuda::error_string().
// Inputs were validated by bindings.cpp; the checks below are cheap internal consistency checks.
#ifndef HPCRL_WITH_CUDA
#error "csrc/cuda/glue.cpp is only part of CUDA builds (compile it with -DHPCRL_WITH_CUDA)"
#endif

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/Device.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>
#include <c10/core/Stream.h>
#include <c10/core/TensorOptions.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <vector>

#include "../ops.h"
#include "kernels.cuh"

namespace hpcrl {
namespace {

// The current CUDA stream of `device` as a cudaStream_t (type-erased).
void* current_stream(const c10::Device& device) {
  const c10::impl::VirtualGuardImpl impl(c10::DeviceType::CUDA);
  return impl.getStream(device).native_handle();
}

void check_launch(int err, const char* name) {
  TORCH_CHECK(err == 0, "hpcrl CUDA kernel ", name, " failed: ", hpcrl_cuda::error_string(err));
}

int dtype_code(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return hpcrl_cuda::kFloat32;
    case at::kHalf:
      return hpcrl_cuda::kFloat16;
    case at::kBFloat16:
      return hpcrl_cuda::kBFloat16;
    default:
      TORCH_CHECK(false, "hpcrl CUDA multi-tensor ops support float32, float16 and bfloat16, got ", t);
  }
  return -1;  // unreachable
}

int64_t total_numel(const std::vector<at::Tensor>& tensors) {
  int64_t total = 0;
  for (const at::Tensor& t : tensors) total += t.numel();
  return total;
}

// Device copy of the table [n addresses | n + 1 element offsets] that the multi-tensor kernel reads.
// `mutable_ptrs`: the kernel writes the tensors (unflatten), so take their mutable data pointers.
//
// Lifetime and ordering (this is the part that must be right, not fast):
//   * The host table is a pinned tensor from torch's caching host allocator, copied with
//     non_blocking=true on the current stream of `device` (the stream the kernel is launched on, so
//     the kernel sees the finished copy). For a non-blocking copy from pinned memory, torch's
//     copy_ (Copy.cu) records an event on the pinned block with the caching host allocator, and the
//     block is not handed out again until that event completes: dropping `host` at the end of this
//     function is safe even though the copy is still in flight. (Had the pinned allocation been
//     pageable instead, cudaMemcpyAsync from pageable memory returns only after the source has been
//     staged, which is also safe.) This avoids a device synchronization per call, which a plain
//     blocking .to(device) from pageable memory would cost.
//   * The device table comes from the CUDA caching allocator on that same current stream. It is freed
//     when the returned tensor dies, after the kernel was enqueued; the allocator only reuses the
//     block for work later on that stream, which is ordered after the kernel.
at::Tensor device_table(const std::vector<at::Tensor>& tensors, const c10::Device& device, bool mutable_ptrs) {
  const int64_t n = static_cast<int64_t>(tensors.size());
  at::Tensor host = at::empty({2 * n + 1}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  int64_t* addrs = host.mutable_data_ptr<int64_t>();
  int64_t* offs = addrs + n;
  offs[0] = 0;
  for (int64_t i = 0; i < n; ++i) {
    const at::Tensor& t = tensors[static_cast<size_t>(i)];
    const void* p = mutable_ptrs ? t.mutable_data_ptr() : t.const_data_ptr();
    addrs[i] = static_cast<int64_t>(reinterpret_cast<uintptr_t>(p));
    offs[i + 1] = offs[i] + t.numel();
  }
  return host.to(at::TensorOptions().device(device).dtype(at::kLong), /*non_blocking=*/true, /*copy=*/false);
}

void check_list(const std::vector<at::Tensor>& tensors, const at::Tensor& flat) {
  for (const at::Tensor& t : tensors) {
    TORCH_CHECK(t.device() == flat.device() && t.scalar_type() == flat.scalar_type() && t.is_contiguous(),
                "hpcrl CUDA multi-tensor op: every tensor must be contiguous, on ", flat.device(), " and of dtype ",
                flat.scalar_type());
  }
  TORCH_CHECK(flat.is_contiguous(), "hpcrl CUDA multi-tensor op: flat must be contiguous");
}

}  // namespace

void flatten_cuda(const std::vector<at::Tensor>& tensors, const at::Tensor& flat) {
  const int64_t total = total_numel(tensors);
  TORCH_CHECK(total == flat.numel(), "hpcrl flatten_cuda: tensors hold ", total, " elements, flat holds ",
              flat.numel());
  if (tensors.empty() || total == 0) return;  // nothing to copy: no launch
  check_list(tensors, flat);
  const int dtype = dtype_code(flat.scalar_type());
  const c10::DeviceGuard guard(flat.device());
  const at::Tensor table = device_table(tensors, flat.device(), /*mutable_ptrs=*/false);
  check_launch(hpcrl_cuda::multi_tensor_flatten(table.const_data_ptr<int64_t>(), static_cast<int64_t>(tensors.size()),
                                                total, flat.mutable_data_ptr(), dtype, current_stream(flat.device())),
               "multi_tensor_flatten");
}

void unflatten_cuda(const at::Tensor& flat, const std::vector<at::Tensor>& tensors, double scale) {
  const int64_t total = total_numel(tensors);
  TORCH_CHECK(total == flat.numel(), "hpcrl unflatten_cuda: tensors hold ", total, " elements, flat holds ",
              flat.numel());
  if (tensors.empty() || total == 0) return;
  check_list(tensors, flat);
  const int dtype = dtype_code(flat.scalar_type());
  const c10::DeviceGuard guard(flat.device());
  const at::Tensor table = device_table(tensors, flat.device(), /*mutable_ptrs=*/true);
  // The multiply runs in fp32 with the scale rounded to fp32, like the CPU kernel and the reference.
  check_launch(hpcrl_cuda::multi_tensor_unflatten(table.const_data_ptr<int64_t>(),
                                                  static_cast<int64_t>(tensors.size()), total, flat.const_data_ptr(),
                                                  dtype, static_cast<float>(scale), current_stream(flat.device())),
               "multi_tensor_unflatten");
}

namespace {

hpcrl_cuda::ReplayGatherArgs gather_args(const ReplayStorage& s, const at::Tensor& env_idx, const at::Tensor& slot_idx,
                                         int64_t n_step, double gamma, const ReplayBatch& out) {
  const int64_t batch = env_idx.numel();
  TORCH_CHECK(s.obs.dim() == 3 && s.action.dim() == 3 && s.final_pool.dim() == 2,
              "hpcrl replay_gather_cuda: unexpected storage ranks");
  hpcrl_cuda::ReplayGatherArgs a{};
  a.obs = s.obs.const_data_ptr<float>();
  a.action = s.action.const_data_ptr<float>();
  a.reward = s.reward.const_data_ptr<float>();
  a.flags = s.flags.const_data_ptr<uint8_t>();
  a.reward_slot_stride = s.reward.stride(0);
  a.reward_env_stride = s.reward.stride(1);
  a.flags_slot_stride = s.flags.stride(0);
  a.flags_env_stride = s.flags.stride(1);
  a.final_ref = s.final_ref.const_data_ptr<int64_t>();
  a.pool_size = s.final_pool.size(0);
  a.final_pool = a.pool_size > 0 ? s.final_pool.const_data_ptr<float>() : nullptr;
  a.head_next_obs = s.head_next_obs.const_data_ptr<float>();
  a.capacity = s.obs.size(0);
  a.num_envs = s.obs.size(1);
  a.obs_dim = s.obs.size(2);
  a.act_dim = s.action.size(2);
  a.ptr = s.ptr;
  a.env_idx = env_idx.const_data_ptr<int64_t>();
  a.slot_idx = slot_idx.const_data_ptr<int64_t>();
  a.batch = batch;
  a.n_step = n_step;
  a.gamma = static_cast<float>(gamma);  // same rounding of gamma as the CPU kernel
  a.out_obs = out.obs.mutable_data_ptr<float>();
  a.out_action = out.action.mutable_data_ptr<float>();
  a.out_reward = out.reward.mutable_data_ptr<float>();
  a.out_next_obs = out.next_obs.mutable_data_ptr<float>();
  a.out_discount = out.discount.mutable_data_ptr<float>();
  a.out_n = out.n.mutable_data_ptr<int64_t>();
  return a;
}

}  // namespace

void replay_gather_cuda(const ReplayStorage& s, const at::Tensor& env_idx, const at::Tensor& slot_idx,
                        int64_t n_step, double gamma, const ReplayBatch& out) {
  if (env_idx.numel() == 0) return;
  const c10::Device device = s.obs.device();
  const c10::DeviceGuard guard(device);
  const hpcrl_cuda::ReplayGatherArgs a = gather_args(s, env_idx, slot_idx, n_step, gamma, out);
  check_launch(hpcrl_cuda::replay_gather(a, current_stream(device)), "replay_gather");
}

void replay_sample_cuda(const ReplayStorage& s, uint64_t seed, uint64_t offset, const at::Tensor& env_idx,
                        const at::Tensor& slot_idx, int64_t n_step, double gamma, const ReplayBatch& out) {
  const c10::Device device = s.obs.device();
  const c10::DeviceGuard guard(device);
  hpcrl_cuda::ReplayGatherArgs a = gather_args(s, env_idx, slot_idx, n_step, gamma, out);
  a.sampling = 1;
  a.seed = seed;
  a.offset = offset;
  a.out_env = env_idx.mutable_data_ptr<int64_t>();
  a.out_slot = slot_idx.mutable_data_ptr<int64_t>();
  check_launch(hpcrl_cuda::replay_gather(a, current_stream(device)), "replay_sample");
}

}  // namespace hpcrl
