// Fused replay gather on the CPU: per sampled row, run the shared n-step window
// (csrc/common/replay_nstep.h), then copy obs/action and the bootstrap observation from wherever it is
// stored, optionally with the reads of later rows prefetched; sampling draws the rows' indices first
// (csrc/common/replay_sample.h).
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstddef>
#include <cstring>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#endif

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

// Philox4x32-10 of many counters at once, with x86 vector multiplies where the CPU has them (picked at
// run time; the build itself targets baseline x86-64): each 64-bit lane holds one counter's 32-bit word
// in its low half, and vpmuludq multiplies exactly those halves into the 64-bit product mulhilo32 takes
// apart. The high halves of the lanes carry garbage that no multiply reads and the output masks off.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define HPCRL_X86_SIMD 1
#define HPCRL_PHILOX_LANES(VEC, SET1, ADD, MUL, SRLI, SLLI, XOR, AND, OR, LOAD, STORE, LANES)          \
  const VEC m0 = SET1(0xD2511F53), m1 = SET1(0xCD9E8D57), low = SET1(0xFFFFFFFF);                   \
  alignas(64) int64_t lane[LANES];                                                                   \
  for (int l = 0; l < LANES; ++l) lane[l] = l;                                                       \
  const VEC lanes = LOAD(reinterpret_cast<const VEC*>(lane));                                        \
  for (int64_t b = 0; b < count; b += LANES) {                                                       \
    const VEC ctr = ADD(SET1(static_cast<int64_t>(first + static_cast<uint64_t>(b))), lanes);          \
    VEC c0 = AND(ctr, low), c1 = SRLI(ctr, 32), c2 = SET1(0), c3 = SET1(0);                            \
    uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);               \
    for (int round = 0; round < 10; ++round) {                                                       \
      const VEC p0 = MUL(c0, m0), p1 = MUL(c2, m1);                                                  \
      c0 = XOR(XOR(SRLI(p1, 32), c1), SET1(k0));                                                     \
      c2 = XOR(XOR(SRLI(p0, 32), c3), SET1(k1));                                                     \
      c1 = p1;                                                                                       \
      c3 = p0;                                                                                       \
      k0 += 0x9E3779B9u;                                                                             \
      k1 += 0xBB67AE85u;                                                                             \
    }                                                                                                \
    STORE(reinterpret_cast<VEC*>(bits + b), OR(SLLI(c1, 32), AND(c0, low)));                          \
  }

// count is a multiple of the lane count (8 / 4); bits is 64-byte aligned. (GCC 12 flags its own
// intrinsics' _mm512_undefined_epi32 placeholders as maybe-uninitialized: a known false positive.)
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
__attribute__((target("avx512f"))) void philox_bits_avx512(uint64_t seed, uint64_t first, int64_t count,
                                                            uint64_t* bits) {
  HPCRL_PHILOX_LANES(__m512i, _mm512_set1_epi64, _mm512_add_epi64, _mm512_mul_epu32, _mm512_srli_epi64,
                     _mm512_slli_epi64, _mm512_xor_si512, _mm512_and_si512, _mm512_or_si512, _mm512_load_si512,
                     _mm512_store_si512, 8)
}

__attribute__((target("avx2"))) void philox_bits_avx2(uint64_t seed, uint64_t first, int64_t count, uint64_t* bits) {
  HPCRL_PHILOX_LANES(__m256i, _mm256_set1_epi64x, _mm256_add_epi64, _mm256_mul_epu32, _mm256_srli_epi64,
                     _mm256_slli_epi64, _mm256_xor_si256, _mm256_and_si256, _mm256_or_si256, _mm256_load_si256,
                     _mm256_store_si256, 4)
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#undef HPCRL_PHILOX_LANES
#endif

// The 64 bits sample_pair takes from Philox (words 1:0) for counters first .. first + count.
void philox_bits(uint64_t seed, uint64_t first, int64_t count, uint64_t* bits) {
#ifdef HPCRL_X86_SIMD
  static const int simd = __builtin_cpu_supports("avx512f") ? 8 : __builtin_cpu_supports("avx2") ? 4 : 0;
  if (simd != 0 && count % simd == 0) {
    (simd == 8 ? philox_bits_avx512 : philox_bits_avx2)(seed, first, count, bits);
    return;
  }
#endif
  for (int64_t b = 0; b < count; ++b) {
    const uint64_t c = first + static_cast<uint64_t>(b);
    const Philox4 r = philox4x32_10(Philox4{{static_cast<uint32_t>(c), static_cast<uint32_t>(c >> 32), 0u, 0u}},
                                    static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
    bits[b] = (static_cast<uint64_t>(r.v[1]) << 32) | r.v[0];
  }
}

// x / d and x % d for 64-bit x by multiplication (Lemire, Kaser & Kurz, "Faster remainder by direct
// computation", 2019: exact for every 64-bit x with a 128-bit M = floor((2^128 - 1) / d) + 1, d >= 2):
// a 64-bit division costs ~15-40 cycles, this a few multiplies. d = 1 takes its own branch (M would be 2^128).
// Compilers without 128-bit integers divide.
#ifdef __SIZEOF_INT128__
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
#else
struct FastDivisor {
  uint64_t d;
  explicit FastDivisor(uint64_t divisor) : d(divisor) {}
  uint64_t div(uint64_t x) const { return x / d; }
  uint64_t mod(uint64_t x) const { return x % d; }
};
#endif

// Rows first .. first + count of seed's stream into env / slot: the pairs of sample_pair
// (csrc/common/replay_sample.h) bit for bit, kBlock rows of Philox at a time (vectorised), then the
// modulo and the division by E as multiplications.
void draw_pairs(uint64_t seed, uint64_t first, int64_t count, const PairRange& range, int64_t* env, int64_t* slot) {
  constexpr int64_t kBlock = 256;
  alignas(64) uint64_t bits[kBlock];
  const FastDivisor pairs(range.pairs), envs(static_cast<uint64_t>(range.num_envs));
  for (int64_t b0 = 0; b0 < count; b0 += kBlock) {
    const int64_t n = std::min(kBlock, count - b0);
    const int64_t whole = n - n % 8;  // the vector paths take multiples of their lanes; the rest is scalar
    philox_bits(seed, first + static_cast<uint64_t>(b0), whole, bits);
    philox_bits(seed, first + static_cast<uint64_t>(b0 + whole), n - whole, bits + whole);
    for (int64_t l = 0; l < n; ++l) {
      const uint64_t i = pairs.mod(bits[l]);
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
  // Rows go in blocks, in two passes (below). What each pass reads, requested ``prefetch_rows`` rows ahead:
  // the window's reward and flags at its first and last step (the whole window, as the shard stores them
  // env-major), then the row's obs, action and bootstrap obs.
  auto prefetch_window = [&](int64_t b) {
    const int64_t e = envs[b];
    const int64_t slot = slots[b];
    const int64_t last = slot + n_step - 1 < capacity ? slot + n_step - 1 : slot + n_step - 1 - capacity;
    for (const int64_t t : {slot, last}) {
      prefetch_span(reward + t * steps.reward_slot + e * steps.reward_env, sizeof(float));
      prefetch_span(flags + t * steps.flags_slot + e * steps.flags_env, 1);
    }
  };
  auto prefetch_copies = [&](int64_t b, const float* next) {
    const int64_t row = slots[b] * num_envs + envs[b];
    prefetch_span(obs + row * obs_dim, obs_bytes);
    prefetch_span(action + row * act_dim, act_bytes);
    prefetch_span(next, obs_bytes);
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
    for (int64_t b = begin; b < std::min(end, begin + prefetch_rows); ++b) prefetch_window(b);
    // Pass 1, the n-step windows: the one data-dependent part (a window's flags decide where its bootstrap
    // obs lies). Pass 2, the copies: loads that depend on nothing, which the CPU keeps many of in flight, as
    // in index_select. Done row by row, each bootstrap read waited on its window: 1.7-1.8x the cold
    // index_select floor at batch 8,192 against 1.4-1.55x in two passes (benchmarks/ops/replay_build_ab.py).
    constexpr int64_t kBlockRows = 128;  // its bootstrap pointers stay in L1; its rows' lines in L2
    const float* next_rows[kBlockRows];
    for (int64_t b0 = begin; b0 < end; b0 += kBlockRows) {
      const int64_t b1 = std::min(end, b0 + kBlockRows);
      for (int64_t b = b0; b < b1; ++b) {
        if (prefetch_rows > 0 && b + prefetch_rows < end) prefetch_window(b + prefetch_rows);
        const int64_t e = envs[b];
        const NStepWindow w = nstep_window(reward, flags, steps, capacity, e, slots[b], newest, n_step, g);
        o_rew[b] = w.ret;
        o_disc[b] = w.discount;
        o_n[b] = w.k;
        if (w.source == kNextFromHead) {
          next_rows[b - b0] = head_next + e * obs_dim;
        } else if (w.source == kNextFromFinal) {
          next_rows[b - b0] = final_pool + final_ref[w.last * num_envs + e] * obs_dim;
        } else {
          next_rows[b - b0] = obs + ((w.last + 1 == capacity ? 0 : w.last + 1) * num_envs + e) * obs_dim;
        }
      }
      for (int64_t b = b0; b < b1; ++b) {
        if (prefetch_rows > 0 && b + prefetch_rows < b1) prefetch_copies(b + prefetch_rows, next_rows[b + prefetch_rows - b0]);
        const int64_t row = slots[b] * num_envs + envs[b];
        copy_floats(o_obs + b * obs_dim, obs + row * obs_dim, obs_dim);
        copy_floats(o_act + b * act_dim, action + row * act_dim, act_dim);
        copy_floats(o_next + b * obs_dim, next_rows[b - b0], obs_dim);
      }
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
