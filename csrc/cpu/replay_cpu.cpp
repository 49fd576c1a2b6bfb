// Fused replay gather on the CPU: per sampled row, copy obs/action, run the shared n-step window
// (csrc/common/replay_nstep.h) and copy the bootstrap observation from wherever it is stored,
// optionally with the reads of a later row prefetched; sampling draws the rows' indices first
// (csrc/common/replay_sample.h).
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstddef>
#include <cstring>

#include "../common/replay_nstep.h"
#include "../common/replay_sample.h"
#include "../ops.h"

namespace hpcrl {
namespace {

// Requests every cache line of [p, p + bytes) (a hint: never faults, no effect on results).
inline void prefetch_span(const void* p, size_t bytes) {
#if defined(__GNUC__) || defined(__clang__)
  if (bytes == 0) return;
  const char* c = static_cast<const char*>(p);
  const char* last = c + bytes - 1;
  for (; c <= last; c += 64) __builtin_prefetch(c);
  __builtin_prefetch(last);
#else
  (void)p;
  (void)bytes;
#endif
}

// Sampling mode of the gather: row b's pair is drawn from (seed, offset + b) and written to env / slot.
struct Draw {
  uint64_t seed, offset;
  int64_t* env;
  int64_t* slot;
};

void gather_rows(const ReplayStorage& s, const at::Tensor& env_idx, const at::Tensor& slot_idx, const Draw* draw,
                 int64_t n_step, double gamma, int64_t prefetch_rows, const ReplayBatch& out) {
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

  // A row is ~600 B of scattered reads plus the n-step window: 70-300 ns (cache-miss bound). Forking
  // the OpenMP team costs ~2 us on an idle core but tens of us to milliseconds when another process
  // holds the other core, so batches up to 1024 rows (SAC's 256 included) stay on the calling
  // thread; larger ones split into shares of >= 512 rows (>= ~50 us each).
  constexpr int64_t kGrainRows = 1024;
  // What row b will read, as far as it is known before its n-step window is computed: obs and
  // action at (slot, env), reward and flags over the full window, and the bootstrap obs of a window
  // that runs its full n steps (the common case; a shorter window merely wastes the hint).
  auto prefetch_row = [&](int64_t b) {
    const int64_t e = envs[b];
    int64_t slot = slots[b];
    const int64_t row = slot * num_envs + e;
    prefetch_span(obs + row * obs_dim, obs_bytes);
    prefetch_span(action + row * act_dim, act_bytes);
    for (int64_t j = 0; j < n_step; ++j) {
      prefetch_span(reward + slot * num_envs + e, sizeof(float));
      prefetch_span(flags + slot * num_envs + e, 1);
      slot = slot + 1 == capacity ? 0 : slot + 1;
    }
    prefetch_span(obs + (slot * num_envs + e) * obs_dim, obs_bytes);
  };
  const PairRange range = pair_range(num_envs, capacity, ptr);
  const Newest newest = newest_of(ptr, capacity);
  auto draw_row = [&](int64_t b) {
    sample_pair(draw->seed, draw->offset + static_cast<uint64_t>(b), range, draw->env + b, draw->slot + b);
  };
  at::parallel_for(0, batch, kGrainRows, [&](int64_t begin, int64_t end) {
    // The chunk's pairs first, in a tight loop of their own: drawing each row inline, next to its
    // cache misses, measured 1.5-1.6x slower (benchmarks/replay_sampler.py); the prefetch window needs
    // the pairs ahead of time anyway.
    if (draw != nullptr) {
      for (int64_t b = begin; b < end; ++b) draw_row(b);
    }
    for (int64_t b = begin; b < std::min(end, begin + prefetch_rows); ++b) prefetch_row(b);
    for (int64_t b = begin; b < end; ++b) {
      if (prefetch_rows > 0 && b + prefetch_rows < end) prefetch_row(b + prefetch_rows);
      const int64_t e = envs[b];
      const int64_t slot = slots[b];
      const int64_t row = slot * num_envs + e;
      std::memcpy(o_obs + b * obs_dim, obs + row * obs_dim, obs_bytes);
      std::memcpy(o_act + b * act_dim, action + row * act_dim, act_bytes);
      const NStepWindow w = nstep_window(reward, flags, capacity, num_envs, e, slot, newest, n_step, g);
      o_rew[b] = w.ret;
      o_disc[b] = w.discount;
      o_n[b] = w.k;
      const float* next;
      if (w.source == kNextFromHead) {
        next = head_next + e * obs_dim;
      } else if (w.source == kNextFromFinal) {
        next = final_pool + final_ref[w.last * num_envs + e] * obs_dim;
      } else {
        next = obs + ((w.last + 1 == capacity ? 0 : w.last + 1) * num_envs + e) * obs_dim;
      }
      std::memcpy(o_next + b * obs_dim, next, obs_bytes);
    }
  });
}

}  // namespace

void replay_gather_cpu(const ReplayStorage& s, const at::Tensor& env_idx, const at::Tensor& slot_idx,
                       int64_t n_step, double gamma, int64_t prefetch_rows, const ReplayBatch& out) {
  gather_rows(s, env_idx, slot_idx, nullptr, n_step, gamma, prefetch_rows, out);
}

void replay_sample_cpu(const ReplayStorage& s, uint64_t seed, uint64_t offset, const at::Tensor& env_idx,
                       const at::Tensor& slot_idx, int64_t n_step, double gamma, int64_t prefetch_rows,
                       const ReplayBatch& out) {
  const Draw draw{seed, offset, env_idx.data_ptr<int64_t>(), slot_idx.data_ptr<int64_t>()};
  gather_rows(s, env_idx, slot_idx, &draw, n_step, gamma, prefetch_rows, out);
}

}  // namespace hpcrl
