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

// Multiversioned where the compiler can (GCC/clang on x86-64 Linux: ifunc picks the clone at load time):
// the draw loop's 32x32->64-bit multiplies become AVX2 / AVX-512 vector ones, 8 or 16 rows per
// instruction; the default clone runs on any x86-64.
#if defined(__x86_64__) && defined(__linux__) && (defined(__GNUC__) || defined(__clang__))
#define HPCRL_VECTOR_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define HPCRL_VECTOR_CLONES
#endif

// x / d and x % d for 64-bit x by multiplication (Lemire, Kaser & Kurz, "Faster remainder by direct
// computation", 2019: exact for every 64-bit x with a 128-bit M = floor((2^128 - 1) / d) + 1, d >= 2):
// a 64-bit division costs ~15-40 cycles, this a few multiplies. d = 1 is handled by the callers' masks.
struct FastDivisor {
  __uint128_t m;
  uint64_t d;
  explicit FastDivisor(uint64_t divisor) : m(divisor > 1 ? ~__uint128_t{0} / divisor + 1 : 0), d(divisor) {}
  static uint64_t mul128_u64(__uint128_t a, uint64_t b) {  // (a * b) >> 128
    const __uint128_t low = static_cast<__uint128_t>(static_cast<uint64_t>(a)) * b;
    const __uint128_t high = static_cast<__uint128_t>(static_cast<uint64_t>(a >> 64)) * b;
    return static_cast<uint64_t>((high + (low >> 64)) >> 64);
  }
  uint64_t div(uint64_t x) const { return d == 1 ? x : mul128_u64(m, x); }
  uint64_t mod(uint64_t x) const { return d == 1 ? 0 : mul128_u64(m * x, d); }
};

// Rows first .. first + count of seed's stream into env / slot: the pairs of sample_pair
// (csrc/common/replay_sample.h) bit for bit. Philox runs on kLanes counters at once, its rounds written
// as loops over the lanes so that they vectorise; the modulo and the division by E are multiplications.
HPCRL_VECTOR_CLONES
void draw_pairs(uint64_t seed, uint64_t first, int64_t count, const PairRange& range, int64_t* env, int64_t* slot) {
  constexpr int kLanes = 16;
  const FastDivisor pairs(range.pairs), envs(static_cast<uint64_t>(range.num_envs));
  for (int64_t b0 = 0; b0 < count; b0 += kLanes) {
    uint32_t c0[kLanes], c1[kLanes], c2[kLanes], c3[kLanes];
    for (int l = 0; l < kLanes; ++l) {
      const uint64_t c = first + static_cast<uint64_t>(b0 + l);
      c0[l] = static_cast<uint32_t>(c);
      c1[l] = static_cast<uint32_t>(c >> 32);
      c2[l] = 0;
      c3[l] = 0;
    }
    uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
    for (int round = 0; round < 10; ++round) {  // philox4x32_10, lane by lane
      for (int l = 0; l < kLanes; ++l) {
        const uint64_t p0 = static_cast<uint64_t>(0xD2511F53u) * c0[l];
        const uint64_t p1 = static_cast<uint64_t>(0xCD9E8D57u) * c2[l];
        const uint32_t n0 = static_cast<uint32_t>(p1 >> 32) ^ c1[l] ^ k0;
        const uint32_t n2 = static_cast<uint32_t>(p0 >> 32) ^ c3[l] ^ k1;
        c1[l] = static_cast<uint32_t>(p1);
        c3[l] = static_cast<uint32_t>(p0);
        c0[l] = n0;
        c2[l] = n2;
      }
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    const int lanes = count - b0 < kLanes ? static_cast<int>(count - b0) : kLanes;
    for (int l = 0; l < lanes; ++l) {
      const uint64_t i = pairs.mod((static_cast<uint64_t>(c1[l]) << 32) | c0[l]);
      const uint64_t q = envs.div(i);
      env[b0 + l] = static_cast<int64_t>(i - q * envs.d);
      const int64_t sl = range.base + static_cast<int64_t>(q);
      slot[b0 + l] = sl < range.capacity ? sl : sl - range.capacity;
    }
  }
}

// dst[0, n) = src[0, n): a loop the compiler vectorises inline; rows are a few dozen floats, for which a
// call to memcpy (size known only at run time) costs about as much as the copy.
inline void copy_floats(float* __restrict__ dst, const float* __restrict__ src, int64_t n) {
  for (int64_t k = 0; k < n; ++k) dst[k] = src[k];
}

// Sampling mode of the gather: row b's pair is drawn from (seed, offset + b) and written to env / slot.
struct Draw {
  uint64_t seed, offset;
  int64_t* env;
  int64_t* slot;
};

void gather_rows(const ReplayStorage& s, const at::Tensor& env_idx, const at::Tensor& slot_idx, const Draw* draw,
                 int64_t n_step, double gamma, int64_t prefetch_rows, const ReplayBatch& out) {
  const StepLayout steps{s.reward.stride(0), s.reward.stride(1), s.flags.stride(0), s.flags.stride(1)};
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
  // action at (slot, env), reward and flags at the full window's first and last step (the whole
  // window when they are stored env-major, as the shard stores them), and the bootstrap obs of a window
  // that runs its full n steps (the common case; a shorter window merely wastes the hint).
  auto prefetch_row = [&](int64_t b) {
    const int64_t e = envs[b];
    const int64_t slot = slots[b];
    const int64_t row = slot * num_envs + e;
    prefetch_span(obs + row * obs_dim, obs_bytes);
    prefetch_span(action + row * act_dim, act_bytes);
    const int64_t last = slot + n_step - 1 < capacity ? slot + n_step - 1 : slot + n_step - 1 - capacity;
    for (const int64_t t : {slot, last}) {
      prefetch_span(reward + t * steps.reward_slot + e * steps.reward_env, sizeof(float));
      prefetch_span(flags + t * steps.flags_slot + e * steps.flags_env, 1);
    }
    const int64_t next = last + 1 == capacity ? 0 : last + 1;
    prefetch_span(obs + (next * num_envs + e) * obs_dim, obs_bytes);
  };
  const PairRange range = pair_range(num_envs, capacity, ptr);
  const Newest newest = newest_of(ptr, capacity);
  at::parallel_for(0, batch, kGrainRows, [&](int64_t begin, int64_t end) {
    // The chunk's pairs first, in a tight loop of their own: drawing each row inline, next to its
    // cache misses, measured 1.5-1.6x slower (benchmarks/ops/replay_sampler.py); the prefetch window needs
    // the pairs ahead of time anyway.
    if (draw != nullptr) {
      draw_pairs(draw->seed, draw->offset + static_cast<uint64_t>(begin), end - begin, range, draw->env + begin,
                 draw->slot + begin);
    }
    for (int64_t b = begin; b < std::min(end, begin + prefetch_rows); ++b) prefetch_row(b);
    for (int64_t b = begin; b < end; ++b) {
      if (prefetch_rows > 0 && b + prefetch_rows < end) prefetch_row(b + prefetch_rows);
      const int64_t e = envs[b];
      const int64_t slot = slots[b];
      const int64_t row = slot * num_envs + e;
      copy_floats(o_obs + b * obs_dim, obs + row * obs_dim, obs_dim);
      copy_floats(o_act + b * act_dim, action + row * act_dim, act_dim);
      const NStepWindow w = nstep_window(reward, flags, steps, capacity, e, slot, newest, n_step, g);
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
      copy_floats(o_next + b * obs_dim, next, obs_dim);
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
