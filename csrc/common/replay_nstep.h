// n-step window of one sampled transition, shared verbatim by the CPU and CUDA kernels so both
// compute bit-for-bit the same arithmetic. Torch-free on purpose (nvcc compiles it without torch).
//
// obs, action and final_ref are time-major: element (slot s, env e) lives at s * num_envs + e. reward and
// flags are addressed through strides (StepLayout): the shard stores them env-major and interleaved, so
// the n steps of a window sit side by side (hpcrl/replay/shard.py).
// `ptr` counts every add() ever made; the newest transition has logical time ptr - 1.
#pragma once
#include <cstdint>

#if defined(__CUDACC__)
#define HPCRL_HD __host__ __device__ __forceinline__
#else
#define HPCRL_HD inline
#endif

namespace hpcrl {

constexpr uint8_t kTerminated = 1;  // flags bit 0: episode ended, no bootstrap
constexpr uint8_t kTruncated = 2;   // flags bit 1: episode cut by a time limit, bootstrap from final obs

// Where the bootstrap observation of a window comes from.
enum NextObsSource : int32_t {
  kNextFromHead = 0,   // newest transition: the shard's `head_next_obs[env]`
  kNextFromFinal = 1,  // episode ended at the last step: `final_pool[final_ref[last, env]]`
  kNextFromRing = 2,   // ordinary step: `obs[last + 1, env]`
};

struct NStepWindow {
  float ret;        // sum_j gamma^j * r_{t+j} over the k included steps
  float discount;   // gamma^k, or 0 when the last included step terminated
  int64_t k;        // effective n (1 <= k <= n_step)
  int64_t last;     // physical slot of the last included step
  int32_t source;   // NextObsSource
};

// Where the newest write landed: logical time ptr - 1 = lap * capacity + slot. Computed once per call,
// so a row finds its slot's logical time with a compare instead of a 64-bit division.
struct Newest {
  int64_t ptr;
  int64_t lap;
  int64_t slot;
};

HPCRL_HD Newest newest_of(int64_t ptr, int64_t capacity) {
  return Newest{ptr, (ptr - 1) / capacity, (ptr - 1) % capacity};
}

// Element strides of reward and flags (slot s, env e at s * slot + e * env of each array).
struct StepLayout {
  int64_t reward_slot, reward_env, flags_slot, flags_env;
};

// Window starting at physical slot `slot` of env `env`. Included steps stop after the first
// terminated/truncated step (rewards of the next episode never leak in) and never reach the write
// head (logical time >= ptr does not exist yet), so a window cannot read across the ring's seam.
// Preconditions (checked by the callers): 0 <= slot < min(ptr, capacity), 0 <= env < num_envs.
HPCRL_HD NStepWindow nstep_window(const float* reward, const uint8_t* flags, const StepLayout& at,
                                  int64_t capacity, int64_t env, int64_t slot, const Newest& newest,
                                  int64_t n_step, float gamma) {
  // Logical time of the slot: the newest write that landed on it, slot + capacity * ((ptr - 1 - slot) /
  // capacity) = the newest write's lap, or the lap before for a slot past the newest write's.
  const int64_t ptr = newest.ptr;
  const int64_t t = slot + capacity * (slot > newest.slot ? newest.lap - 1 : newest.lap);
  const int64_t available = ptr - t;  // steps from t up to (excluding) the write head, >= 1
  const int64_t n = n_step < available ? n_step : available;
  NStepWindow w{0.0f, 1.0f, 0, slot, kNextFromRing};
  uint8_t f = 0;
  int64_t s = slot;  // (slot + j) % capacity, wrapped by a compare instead of a 64-bit division per step
  for (int64_t j = 0; j < n; ++j, s = s + 1 == capacity ? 0 : s + 1) {
    w.ret += w.discount * reward[s * at.reward_slot + env * at.reward_env];
    w.discount *= gamma;
    w.k = j + 1;
    w.last = s;
    f = flags[s * at.flags_slot + env * at.flags_env];
    if (f != 0) break;
  }
  if (f & kTerminated) w.discount = 0.0f;
  if (t + w.k == ptr) {
    w.source = kNextFromHead;
  } else if (f != 0) {
    w.source = kNextFromFinal;
  } else {
    w.source = kNextFromRing;
  }
  return w;
}

}  // namespace hpcrl
