// The only translation unit with <torch/extension.h>: Python bindings, input validation and
// device dispatch. Kernels live in cpu/*.cpp (at::parallel_for) and cuda/*.cu (raw pointers).
#include <torch/extension.h>

#include <optional>
#include <string>
#include <vector>

#include "ops.h"

namespace hpcrl {
namespace {

bool is_float_type(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

// Checks shared by flatten and unflatten_; returns the total number of elements.
int64_t check_tensor_list(const std::vector<at::Tensor>& tensors, const at::Tensor& flat, const char* op) {
  TORCH_CHECK(is_float_type(flat.scalar_type()), op, ": dtype ", flat.scalar_type(),
              " is not supported (use float32, float16 or bfloat16)");
  TORCH_CHECK(flat.dim() == 1 && flat.is_contiguous(), op, ": the flat buffer must be a contiguous 1-D tensor, got shape ",
              flat.sizes());
  int64_t total = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    TORCH_CHECK(t.defined(), op, ": tensors[", i, "] is None (use zeros for a missing gradient)");
    TORCH_CHECK(t.scalar_type() == flat.scalar_type(), op, ": mixed dtypes: tensors[", i, "] is ", t.scalar_type(),
                " but expected ", flat.scalar_type(), " (pack each dtype in its own call)");
    TORCH_CHECK(t.device() == flat.device(), op, ": mixed devices: tensors[", i, "] is on ", t.device(),
                " but expected ", flat.device());
    TORCH_CHECK(t.is_contiguous(), op, ": tensors[", i, "] is not contiguous (shape ", t.sizes(), ", strides ",
                t.strides(), "); call .contiguous() first");
    total += t.numel();
  }
  TORCH_CHECK(flat.numel() == total, op, ": size mismatch: the tensors hold ", total,
              " elements but the flat buffer has ", flat.numel());
  return total;
}

at::Tensor flatten(const std::vector<at::Tensor>& tensors, std::optional<at::Tensor> out) {
  at::Tensor flat;
  if (out.has_value()) {
    flat = *out;
  } else {
    TORCH_CHECK(!tensors.empty(), "flatten: empty list and no `out`: cannot infer dtype/device");
    int64_t total = 0;
    for (const auto& t : tensors) total += t.defined() ? t.numel() : 0;
    flat = at::empty({total}, tensors.front().options());
  }
  if (check_tensor_list(tensors, flat, "flatten") == 0) return flat;
  if (flat.is_cuda()) {
#ifdef HPCRL_WITH_CUDA
    flatten_cuda(tensors, flat);
#else
    TORCH_CHECK(false, "flatten: hpcrl._C was built without CUDA; rebuild with HPCRL_CUDA=1");
#endif
  } else {
    TORCH_CHECK(flat.is_cpu(), "flatten: unsupported device ", flat.device());
    flatten_cpu(tensors, flat);
  }
  return flat;
}

void unflatten_(const at::Tensor& flat, const std::vector<at::Tensor>& tensors, double scale) {
  if (check_tensor_list(tensors, flat, "unflatten_") == 0) return;
  if (flat.is_cuda()) {
#ifdef HPCRL_WITH_CUDA
    unflatten_cuda(flat, tensors, scale);
#else
    TORCH_CHECK(false, "unflatten_: hpcrl._C was built without CUDA; rebuild with HPCRL_CUDA=1");
#endif
  } else {
    TORCH_CHECK(flat.is_cpu(), "unflatten_: unsupported device ", flat.device());
    unflatten_cpu(flat, tensors, scale);
  }
}

// strided: any element strides will do (the kernels index through them: reward and flags, which the
// shard stores env-major and interleaved behind [C, E] views).
void check_storage(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t dim, const at::Device& dev,
                   bool strided = false) {
  TORCH_CHECK(t.scalar_type() == dtype, "replay_gather: ", name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.dim() == dim, "replay_gather: ", name, " must have ", dim, " dims, got shape ", t.sizes());
  TORCH_CHECK(strided || t.is_contiguous(), "replay_gather: ", name, " must be contiguous");
  TORCH_CHECK(t.device() == dev, "replay_gather: ", name, " is on ", t.device(), " but the shard is on ", dev);
}

ReplayStorage checked_storage(const at::Tensor& obs, const at::Tensor& action, const at::Tensor& reward,
                              const at::Tensor& flags, const at::Tensor& final_ref, const at::Tensor& final_pool,
                              const at::Tensor& head_next_obs, int64_t ptr, int64_t n_step) {
  const at::Device dev = reward.device();
  check_storage(obs, "obs", at::kFloat, 3, dev);
  check_storage(action, "action", at::kFloat, 3, dev);
  check_storage(reward, "reward", at::kFloat, 2, dev, /*strided=*/true);
  check_storage(flags, "flags", at::kByte, 2, dev, /*strided=*/true);
  check_storage(final_ref, "final_ref", at::kLong, 2, dev);
  check_storage(final_pool, "final_pool", at::kFloat, 2, dev);
  check_storage(head_next_obs, "head_next_obs", at::kFloat, 2, dev);
  const int64_t capacity = reward.size(0), num_envs = reward.size(1), obs_dim = obs.size(2);
  TORCH_CHECK(obs.size(0) == capacity && obs.size(1) == num_envs && action.size(0) == capacity &&
                  action.size(1) == num_envs && flags.sizes() == reward.sizes() &&
                  final_ref.sizes() == reward.sizes(),
              "replay_gather: storage shapes disagree (obs ", obs.sizes(), ", action ", action.sizes(),
              ", reward ", reward.sizes(), ", flags ", flags.sizes(), ", final_ref ", final_ref.sizes(), ")");
  TORCH_CHECK(final_pool.size(1) == obs_dim && head_next_obs.size(0) == num_envs && head_next_obs.size(1) == obs_dim,
              "replay_gather: final_pool ", final_pool.sizes(), " / head_next_obs ", head_next_obs.sizes(),
              " do not match obs_dim=", obs_dim, ", num_envs=", num_envs);
  TORCH_CHECK(ptr >= 1, "replay_gather: the shard is empty (add() at least once before sampling)");
  TORCH_CHECK(n_step >= 1, "replay_gather: n_step must be >= 1, got ", n_step);
  return ReplayStorage{obs, action, reward, flags, final_ref, final_pool, head_next_obs, ptr};
}

// The batch's outputs: the caller's `out` (obs, action, reward, next_obs, discount, n; checked) so a
// sampler reuses one set of buffers, or fresh ones.
ReplayBatch batch_outputs(const ReplayStorage& s, int64_t batch, const std::optional<std::vector<at::Tensor>>& out) {
  const int64_t obs_dim = s.obs.size(2), act_dim = s.action.size(2);
  const auto f32 = s.reward.options();
  if (!out) {
    return ReplayBatch{at::empty({batch, obs_dim}, f32), at::empty({batch, act_dim}, f32), at::empty({batch}, f32),
                       at::empty({batch, obs_dim}, f32), at::empty({batch}, f32),
                       at::empty({batch}, f32.dtype(at::kLong))};
  }
  TORCH_CHECK(out->size() == 6, "replay_gather: out must hold 6 tensors (obs, action, reward, next_obs, discount, n)");
  const auto& o = *out;
  const std::vector<std::vector<int64_t>> shapes{{batch, obs_dim}, {batch, act_dim}, {batch}, {batch, obs_dim},
                                                 {batch}, {batch}};
  const char* names[] = {"obs", "action", "reward", "next_obs", "discount", "n"};
  for (size_t i = 0; i < 6; ++i) {
    check_storage(o[i], names[i], i == 5 ? at::kLong : at::kFloat, static_cast<int64_t>(shapes[i].size()),
                  s.reward.device());
    TORCH_CHECK(o[i].sizes() == at::IntArrayRef(shapes[i]), "replay_gather: out ", names[i], " has shape ",
                o[i].sizes(), ", expected ", at::IntArrayRef(shapes[i]));
  }
  return ReplayBatch{o[0], o[1], o[2], o[3], o[4], o[5]};
}

// The rows' index tensors ([B] int64 on the storage's device, same B) and the prefetch distance.
void check_rows(const at::Tensor& env_idx, const at::Tensor& slot_idx, int64_t prefetch_rows, const at::Device& dev,
                const char* op) {
  check_storage(env_idx, "env_idx", at::kLong, 1, dev);
  check_storage(slot_idx, "slot_idx", at::kLong, 1, dev);
  TORCH_CHECK(env_idx.numel() == slot_idx.numel(), op, ": env_idx has ", env_idx.numel(), " rows but slot_idx has ",
              slot_idx.numel());
  TORCH_CHECK(prefetch_rows >= 0, op, ": prefetch_rows must be >= 0, got ", prefetch_rows);
}

std::vector<at::Tensor> replay_gather(const at::Tensor& obs, const at::Tensor& action, const at::Tensor& reward,
                                      const at::Tensor& flags, const at::Tensor& final_ref,
                                      const at::Tensor& final_pool, const at::Tensor& head_next_obs,
                                      const at::Tensor& env_idx, const at::Tensor& slot_idx, int64_t ptr,
                                      int64_t n_step, double gamma, int64_t prefetch_rows,
                                      std::optional<std::vector<at::Tensor>> out) {
  const ReplayStorage storage =
      checked_storage(obs, action, reward, flags, final_ref, final_pool, head_next_obs, ptr, n_step);
  const at::Device dev = reward.device();
  check_rows(env_idx, slot_idx, prefetch_rows, dev, "replay_gather");
  const ReplayBatch o = batch_outputs(storage, env_idx.numel(), out);
  if (env_idx.numel() > 0) {
    if (dev.is_cuda()) {
#ifdef HPCRL_WITH_CUDA
      replay_gather_cuda(storage, env_idx, slot_idx, n_step, gamma, o);
#else
      TORCH_CHECK(false, "replay_gather: hpcrl._C was built without CUDA; rebuild with HPCRL_CUDA=1");
#endif
    } else {
      TORCH_CHECK(dev.is_cpu(), "replay_gather: unsupported device ", dev);
      replay_gather_cpu(storage, env_idx, slot_idx, n_step, gamma, prefetch_rows, o);
    }
  }
  return {o.obs, o.action, o.reward, o.next_obs, o.discount, o.n};
}

// Draw rows offset .. offset + batch of seed's stream and gather them: one call, no torch ops.
// env_idx / slot_idx [batch] int64 receive the drawn pairs.
std::vector<at::Tensor> replay_sample(const at::Tensor& obs, const at::Tensor& action, const at::Tensor& reward,
                                      const at::Tensor& flags, const at::Tensor& final_ref,
                                      const at::Tensor& final_pool, const at::Tensor& head_next_obs, int64_t ptr,
                                      int64_t n_step, double gamma, uint64_t seed, uint64_t offset,
                                      const at::Tensor& env_idx, const at::Tensor& slot_idx, int64_t prefetch_rows,
                                      std::optional<std::vector<at::Tensor>> out) {
  const ReplayStorage storage =
      checked_storage(obs, action, reward, flags, final_ref, final_pool, head_next_obs, ptr, n_step);
  const at::Device dev = reward.device();
  check_rows(env_idx, slot_idx, prefetch_rows, dev, "replay_sample");
  TORCH_CHECK(env_idx.numel() >= 1, "replay_sample: the batch must have >= 1 rows");
  const ReplayBatch o = batch_outputs(storage, env_idx.numel(), out);
  if (dev.is_cuda()) {
#ifdef HPCRL_WITH_CUDA
    replay_sample_cuda(storage, seed, offset, env_idx, slot_idx, n_step, gamma, o);
#else
    TORCH_CHECK(false, "replay_sample: hpcrl._C was built without CUDA; rebuild with HPCRL_CUDA=1");
#endif
  } else {
    TORCH_CHECK(dev.is_cpu(), "replay_sample: unsupported device ", dev);
    replay_sample_cpu(storage, seed, offset, env_idx, slot_idx, n_step, gamma, prefetch_rows, o);
  }
  return {o.obs, o.action, o.reward, o.next_obs, o.discount, o.n};
}

void check_flags(const at::Tensor& flags, int64_t last, const char* op) {
  TORCH_CHECK(flags.device().is_cpu() && flags.scalar_type() == at::kLong && flags.dim() == 1 && flags.is_contiguous(),
              op, ": flags must be a contiguous 1-D int64 CPU tensor, got ", flags.scalar_type(), " ", flags.sizes(),
              " on ", flags.device());
  TORCH_CHECK(last >= 0 && last < flags.numel(), op, ": flag index ", last, " is outside [0, ", flags.numel(), ")");
}

void shm_publish(const at::Tensor& flags, int64_t index, int64_t value) {
  check_flags(flags, index, "shm_publish");
  shm_publish_cpu(flags, index, value);
}

int64_t shm_wait(const at::Tensor& flags, int64_t stride, int64_t count, int64_t value, double budget_s) {
  TORCH_CHECK(stride >= 1 && count >= 1, "shm_wait: stride and count must be >= 1, got ", stride, " and ", count);
  check_flags(flags, (count - 1) * stride, "shm_wait");
  return shm_wait_cpu(flags, stride, count, value, budget_s);
}

}  // namespace
}  // namespace hpcrl

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "hpcrl fused kernels: multi-tensor flatten/unflatten and per-env replay gather with n-step returns";
#ifdef HPCRL_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
  // True when built with -fopenmp (setup.py): only then does at::parallel_for in cpu/*.cpp use the
  // threads torch.set_num_threads asks for; every translation unit gets the same flags.
#ifdef _OPENMP
  m.attr("openmp") = true;
#else
  m.attr("openmp") = false;
#endif
  m.def("flatten", &hpcrl::flatten, "Pack same-dtype contiguous tensors into one 1-D tensor", py::arg("tensors"),
        py::arg("out") = py::none());
  m.def("unflatten_", &hpcrl::unflatten_, "Scatter a flat tensor back into tensors, times scale", py::arg("flat"),
        py::arg("tensors"), py::arg("scale") = 1.0);
  m.def("replay_gather", &hpcrl::replay_gather, "Gather replay rows with n-step returns", py::arg("obs"),
        py::arg("action"), py::arg("reward"), py::arg("flags"), py::arg("final_ref"), py::arg("final_pool"),
        py::arg("head_next_obs"), py::arg("env_idx"), py::arg("slot_idx"), py::arg("ptr"), py::arg("n_step"),
        py::arg("gamma"), py::arg("prefetch_rows") = 0, py::arg("out") = py::none());
  m.def("replay_sample", &hpcrl::replay_sample, "Draw replay rows (Philox4x32-10) and gather them", py::arg("obs"),
        py::arg("action"), py::arg("reward"), py::arg("flags"), py::arg("final_ref"), py::arg("final_pool"),
        py::arg("head_next_obs"), py::arg("ptr"), py::arg("n_step"), py::arg("gamma"), py::arg("seed"),
        py::arg("offset"), py::arg("env_idx"), py::arg("slot_idx"), py::arg("prefetch_rows") = 0,
        py::arg("out") = py::none());
  // The GIL is released while waiting: a peer watch or a signal handler must run meanwhile.
  m.def("shm_publish", &hpcrl::shm_publish, "Release-store value at flags[index]", py::arg("flags"),
        py::arg("index"), py::arg("value"));
  m.def("shm_wait", &hpcrl::shm_wait, "Wait until flags[i*stride] >= value for i < count; -1 or the first late i",
        py::arg("flags"), py::arg("stride"), py::arg("count"), py::arg("value"), py::arg("budget_s"),
        py::call_guard<py::gil_scoped_release>());
}
