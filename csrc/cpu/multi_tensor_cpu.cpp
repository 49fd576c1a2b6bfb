// Multi-tensor flatten / unflatten(scale) on the CPU: one at::parallel_for over the flat range, so
// a few huge tensors and thousands of tiny ones both split evenly across threads.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#if defined(__F16C__)
#include <immintrin.h>
#endif

#include "../ops.h"

namespace hpcrl {
namespace {

// at::parallel_for forks an OpenMP team only for ranges longer than the grain, and then gives each
// thread an equal share of at least ~grain / 2. Forking costs ~2 us on an idle core but tens of us to
// milliseconds when another process holds the other core, so calls up to 1 MiB of payload (~25 us
// of copy from cache, ~100 us from DRAM) stay on the calling thread; a FastSAC critic's grads
// (3.6 MB) split. In bytes, not elements: every path below moves memory at about the same rate.
constexpr int64_t kGrainBytes = int64_t{1} << 20;

int64_t grain_elems(int64_t elem_size) { return std::max<int64_t>(1, kGrainBytes / elem_size); }

struct Table {
  std::vector<int64_t> offsets;  // offsets[i] = first flat element of tensor i; back() = total
  std::vector<char*> ptrs;
};

Table make_table(const std::vector<at::Tensor>& tensors) {
  Table t;
  t.offsets.reserve(tensors.size() + 1);
  t.ptrs.reserve(tensors.size());
  int64_t off = 0;
  for (const auto& x : tensors) {
    t.offsets.push_back(off);
    t.ptrs.push_back(static_cast<char*>(x.data_ptr()));
    off += x.numel();
  }
  t.offsets.push_back(off);
  return t;
}

// Calls fn(tensor_index, tensor_begin, flat_begin, count) for every run of the flat range
// [begin, end) that lies inside one tensor.
template <typename Fn>
void for_each_run(const Table& t, int64_t begin, int64_t end, Fn&& fn) {
  auto it = std::upper_bound(t.offsets.begin(), t.offsets.end(), begin);
  int64_t i = (it - t.offsets.begin()) - 1;
  int64_t pos = begin;
  while (pos < end) {
    const int64_t stop = std::min(end, t.offsets[i + 1]);
    if (stop > pos) fn(i, pos - t.offsets[i], pos, stop - pos);
    pos = stop;
    ++i;
  }
}

// memcpy in pieces of at most 256 KiB: glibc switches to non-temporal stores for single copies above
// a fraction of the L3 size; those measured up to ~10% slower than torch's copy_ (cached stores) on
// the 10 M-parameter critic, and leave nothing in cache for the optimizer step that reads the grads.
void copy_bytes(char* dst, const char* src, int64_t bytes) {
  constexpr int64_t kPiece = int64_t{1} << 18;
  for (int64_t off = 0; off < bytes; off += kPiece) {
    std::memcpy(dst + off, src + off, static_cast<size_t>(std::min(kPiece, bytes - off)));
  }
}

template <typename T>
void scale_copy(T* dst, const T* src, int64_t n, float scale) {
  for (int64_t k = 0; k < n; ++k) dst[k] = static_cast<T>(static_cast<float>(src[k]) * scale);
}

template <>
void scale_copy<float>(float* dst, const float* src, int64_t n, float scale) {
  for (int64_t k = 0; k < n; ++k) dst[k] = src[k] * scale;  // auto-vectorized at -O3
}

// c10::BFloat16's float -> bf16 (round to nearest even, NaN -> 0x7FC0) written branch-free so that
// -O3 vectorizes the loop; bit-identical to the scalar c10 conversion. The integer half of it needs
// AVX2 for 8 lanes (plain AVX has 4), so on x86-64 Linux an AVX2 clone is picked at load time.
#if defined(__x86_64__) && defined(__linux__) && (defined(__clang__) || defined(__GNUC__))
__attribute__((target_clones("avx2", "default")))
#endif
void bf16_scale_copy(uint16_t* out, const uint16_t* in, int64_t n, float scale) {
  for (int64_t k = 0; k < n; ++k) {
    float f;
    const uint32_t wide = static_cast<uint32_t>(in[k]) << 16;
    std::memcpy(&f, &wide, 4);
    f *= scale;
    uint32_t u;
    std::memcpy(&u, &f, 4);
    const uint16_t rounded = static_cast<uint16_t>((u + ((u >> 16) & 1) + 0x7FFFu) >> 16);
    out[k] = (u & 0x7FFFFFFFu) > 0x7F800000u ? uint16_t{0x7FC0} : rounded;
  }
}

template <>
void scale_copy<c10::BFloat16>(c10::BFloat16* dst, const c10::BFloat16* src, int64_t n, float scale) {
  bf16_scale_copy(reinterpret_cast<uint16_t*>(dst), reinterpret_cast<const uint16_t*>(src), n, scale);
}

#if defined(__F16C__)
// c10::Half converts one value at a time (_cvtss_sh), which made the fp16 scaled unflatten
// compute-bound (~0.65 ns per element); 8 at a time with the same instruction and rounding mode
// (VCVTPS2PH, round to nearest even) gives identical bits at memory speed.
template <>
void scale_copy<c10::Half>(c10::Half* dst, const c10::Half* src, int64_t n, float scale) {
  const __m256 s = _mm256_set1_ps(scale);
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) {
    const __m256 v = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + k)));
    const __m128i h = _mm256_cvtps_ph(_mm256_mul_ps(v, s), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + k), h);
  }
  for (; k < n; ++k) dst[k] = static_cast<c10::Half>(static_cast<float>(src[k]) * scale);
}
#endif

}  // namespace

void flatten_cpu(const std::vector<at::Tensor>& tensors, const at::Tensor& flat) {
  const Table t = make_table(tensors);
  const int64_t elem = flat.element_size();
  char* out = static_cast<char*>(flat.data_ptr());
  at::parallel_for(0, t.offsets.back(), grain_elems(elem), [&](int64_t begin, int64_t end) {
    for_each_run(t, begin, end, [&](int64_t i, int64_t src_off, int64_t dst_off, int64_t n) {
      copy_bytes(out + dst_off * elem, t.ptrs[i] + src_off * elem, n * elem);
    });
  });
}

void unflatten_cpu(const at::Tensor& flat, const std::vector<at::Tensor>& tensors, double scale) {
  const Table t = make_table(tensors);
  const int64_t elem = flat.element_size();
  const char* in = static_cast<const char*>(flat.data_ptr());
  if (scale == 1.0) {
    at::parallel_for(0, t.offsets.back(), grain_elems(elem), [&](int64_t begin, int64_t end) {
      for_each_run(t, begin, end, [&](int64_t i, int64_t dst_off, int64_t src_off, int64_t n) {
        copy_bytes(t.ptrs[i] + dst_off * elem, in + src_off * elem, n * elem);
      });
    });
    return;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, flat.scalar_type(), "hpcrl_unflatten", [&] {
    const float s = static_cast<float>(scale);
    const auto* src = static_cast<const scalar_t*>(flat.data_ptr());
    at::parallel_for(0, t.offsets.back(), grain_elems(elem), [&](int64_t begin, int64_t end) {
      for_each_run(t, begin, end, [&](int64_t i, int64_t dst_off, int64_t src_off, int64_t n) {
        scale_copy(reinterpret_cast<scalar_t*>(t.ptrs[i]) + dst_off, src + src_off, n, s);
      });
    });
  });
}

}  // namespace hpcrl
