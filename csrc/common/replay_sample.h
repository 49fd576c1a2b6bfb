// Uniform replay indices drawn inside the kernels: Philox4x32-10 (Salmon et al., SC'11; the generator
// behind torch's CUDA RNG) keyed by the sampler's seed, counter = the row's number in the sampler's
// stream. Counter-based, so row b of a call needs no state from row b - 1: the CPU loop, every CUDA
// thread and the NumPy reference (hpcrl/ops/reference.py) draw the same (env, slot) for the same
// (seed, offset + b), and a checkpoint of (seed, offset) resumes the stream exactly. Torch-free.
#pragma once
#include <cstdint>

#include "replay_nstep.h"  // HPCRL_HD

namespace hpcrl {

struct Philox4 {
  uint32_t v[4];
};

HPCRL_HD void mulhilo32(uint32_t a, uint32_t b, uint32_t* hi, uint32_t* lo) {
  const uint64_t p = static_cast<uint64_t>(a) * b;
  *hi = static_cast<uint32_t>(p >> 32);
  *lo = static_cast<uint32_t>(p);
}

// Philox4x32 with 10 rounds of counter c under key k.
HPCRL_HD Philox4 philox4x32_10(Philox4 c, uint32_t k0, uint32_t k1) {
  for (int round = 0; round < 10; ++round) {
    uint32_t hi0, lo0, hi1, lo1;
    mulhilo32(0xD2511F53u, c.v[0], &hi0, &lo0);
    mulhilo32(0xCD9E8D57u, c.v[2], &hi1, &lo1);
    c = Philox4{{hi1 ^ c.v[1] ^ k0, lo1, hi0 ^ c.v[3] ^ k1, lo0}};
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return c;
}

// What every row of one call shares, computed once per call: the number of written (env, slot) pairs
// and the physical slot of the oldest written step.
struct PairRange {
  uint64_t pairs;    // num_envs * filled
  int64_t num_envs;
  int64_t capacity;
  int64_t base;      // (ptr - filled) % capacity
};

HPCRL_HD PairRange pair_range(int64_t num_envs, int64_t capacity, int64_t ptr) {
  const int64_t filled = ptr < capacity ? ptr : capacity;
  return PairRange{static_cast<uint64_t>(num_envs * filled), num_envs, capacity, (ptr - filled) % capacity};
}

// Row `counter` of the stream of `seed`: a pair index in [0, num_envs * filled) (64 random bits
// modulo the range: a bias below range / 2^64), mapped like ReplayShard.sample's torch.randint draw:
// env = i % E, slot = (ptr - filled + i / E) % C, i.e. uniform over the written (env, slot) pairs.
// Two 64-bit divisions per row (the modulo and i / E); the slot's wrap is a compare, since
// base + i / E < 2 C. The same pairs as the per-row formula above, bit for bit.
HPCRL_HD void sample_pair(uint64_t seed, uint64_t counter, const PairRange& range, int64_t* env, int64_t* slot) {
  const Philox4 r = philox4x32_10(
      Philox4{{static_cast<uint32_t>(counter), static_cast<uint32_t>(counter >> 32), 0u, 0u}},
      static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
  const uint64_t bits = (static_cast<uint64_t>(r.v[1]) << 32) | r.v[0];
  const int64_t i = static_cast<int64_t>(bits % range.pairs);
  const int64_t q = i / range.num_envs;
  *env = i - q * range.num_envs;
  const int64_t s = range.base + q;
  *slot = s < range.capacity ? s : s - range.capacity;
}

}  // namespace hpcrl
