// Sequence flags of the shared-memory all-reduce (hpcrl/comm/shm.py): one int64 per rank in a segment
// every rank of a host maps. A rank stores its flag with release order after writing its slot, a peer
// loads it with acquire order before reading that slot: the C++ memory model's guarantee that the slot's
// bytes are visible, on x86 and on weaker-ordered CPUs (aarch64) alike. Plain Python reads give none.
#include <ATen/core/Tensor.h>

#include <sched.h>
#include <time.h>

#include <chrono>
#include <cstdint>

#include "../ops.h"

namespace hpcrl {
namespace {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

}  // namespace

void shm_publish_cpu(const at::Tensor& flags, int64_t index, int64_t value) {
  __atomic_store_n(flags.data_ptr<int64_t>() + index, value, __ATOMIC_RELEASE);
}

int64_t shm_wait_cpu(const at::Tensor& flags, int64_t stride, int64_t count, int64_t value, double budget_s) {
  const int64_t* base = flags.data_ptr<int64_t>();
  const auto start = std::chrono::steady_clock::now();
  int64_t first = 0;  // flags below `first` have arrived: never read again
  for (uint64_t spin = 0;; ++spin) {
    while (first < count && __atomic_load_n(base + first * stride, __ATOMIC_ACQUIRE) >= value) ++first;
    if (first == count) return -1;
    if ((spin & 63) != 0) {
      cpu_relax();
      continue;
    }
    // Spin while a peer is likely microseconds away; then give the core away: ranks may outnumber
    // cores (a laptop, a loaded CI box), where spinning would delay the very peer being waited for.
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (waited >= budget_s) return first;
    if (waited < 50e-6) {
      cpu_relax();
    } else if (waited < 2e-3) {
      sched_yield();
    } else {
      const timespec nap{0, 50 * 1000};  // 50 us: far below a collective's timeout, far above a spin
      nanosleep(&nap, nullptr);
    }
  }
}

}  // namespace hpcrl
