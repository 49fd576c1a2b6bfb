// Fused replay gather on the CPU: per sampled row, copy obs/action, run the shared n-step window
// (csrc/common/replay_nstep.h) and copy the bootstrap observation from wherever it is stored.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/Parallel.h>

#include <cstring>

#include "../common/replay_nstep.h"
#include "../ops.h"

namespace hpcrl {

void replay_gather_cpu(const ReplayStorage& s, const at::Tensor& env_idx, const at::Tensor& slot_idx,
                       int64_t n_step, double gamma, const ReplayBatch& out) {
  const int64_t capacity = s.reward.size(0);
  const int64_t num_envs = s.reward.size(1);
  const int64_t obs_dim = s.obs.size(2);
  const int64_t act_dim = s.action.size(2);
  const int64_t batch = env_idx.numel();
  const float* obs = s.obs.data_ptr<float>();
  const float* action = s.action.data_ptr<float>();
  const float* reward = s.reward.data_ptr<float>();
  const uint8_t* flags = s.flags.data_ptr<uint8_t>();
  const int64_t* final_ref = s.final_ref.data_ptr<int64_t>();
  const float* final_pool = s.final_pool.data_ptr<float>();
  const float* head_next = s.head_next_obs.data_ptr<float>();
  const int64_t* envs = env_idx.data_ptr<int64_t>();
  const int64_t* slots = slot_idx.data_ptr<int64_t>();
  float* o_obs = out.obs.data_ptr<float>();
  float* o_act = out.action.data_ptr<float>();
  float* o_rew = out.reward.data_ptr<float>();
  float* o_next = out.next_obs.data_ptr<float>();
  float* o_disc = out.discount.data_ptr<float>();
  int64_t* o_n = out.n.data_ptr<int64_t>();
  const size_t obs_bytes = obs_dim * sizeof(float);
  const size_t act_bytes = act_dim * sizeof(float);
  const float g = static_cast<float>(gamma);
  const int64_t ptr = s.ptr;

  // ~64 rows per task: each row is a few hundred bytes of scattered reads.
  at::parallel_for(0, batch, 64, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t e = envs[b];
      const int64_t slot = slots[b];
      const int64_t row = slot * num_envs + e;
      std::memcpy(o_obs + b * obs_dim, obs + row * obs_dim, obs_bytes);
      std::memcpy(o_act + b * act_dim, action + row * act_dim, act_bytes);
      const NStepWindow w = nstep_window(reward, flags, capacity, num_envs, e, slot, ptr, n_step, g);
      o_rew[b] = w.ret;
      o_disc[b] = w.discount;
      o_n[b] = w.k;
      const float* next;
      if (w.source == kNextFromHead) {
        next = head_next + e * obs_dim;
      } else if (w.source == kNextFromFinal) {
        next = final_pool + final_ref[w.last * num_envs + e] * obs_dim;
      } else {
        next = obs + (((w.last + 1) % capacity) * num_envs + e) * obs_dim;
      }
      std::memcpy(o_next + b * obs_dim, next, obs_bytes);
    }
  });
}

}  // namespace hpcrl
