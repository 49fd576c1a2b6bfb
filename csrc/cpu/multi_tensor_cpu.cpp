// Multi-tensor flatten / unflatten(scale) on the CPU: one at::parallel_for over the flat range, so
// a few huge tensors and thousands of tiny ones both split evenly across threads.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstring>

#include "../ops.h"

namespace hpcrl {
namespace {

constexpr int64_t kGrain = 1 << 15;  // elements per task: ~128 KiB of fp32, well above dispatch cost

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

template <typename T>
void scale_copy(T* dst, const T* src, int64_t n, float scale) {
  for (int64_t k = 0; k < n; ++k) dst[k] = static_cast<T>(static_cast<float>(src[k]) * scale);
}

template <>
void scale_copy<float>(float* dst, const float* src, int64_t n, float scale) {
  for (int64_t k = 0; k < n; ++k) dst[k] = src[k] * scale;  // auto-vectorized at -O3
}

}  // namespace

void flatten_cpu(const std::vector<at::Tensor>& tensors, const at::Tensor& flat) {
  const Table t = make_table(tensors);
  const int64_t elem = flat.element_size();
  char* out = static_cast<char*>(flat.data_ptr());
  at::parallel_for(0, t.offsets.back(), kGrain, [&](int64_t begin, int64_t end) {
    for_each_run(t, begin, end, [&](int64_t i, int64_t src_off, int64_t dst_off, int64_t n) {
      std::memcpy(out + dst_off * elem, t.ptrs[i] + src_off * elem, n * elem);
    });
  });
}

void unflatten_cpu(const at::Tensor& flat, const std::vector<at::Tensor>& tensors, double scale) {
  const Table t = make_table(tensors);
  const int64_t elem = flat.element_size();
  const char* in = static_cast<const char*>(flat.data_ptr());
  if (scale == 1.0) {
    at::parallel_for(0, t.offsets.back(), kGrain, [&](int64_t begin, int64_t end) {
      for_each_run(t, begin, end, [&](int64_t i, int64_t dst_off, int64_t src_off, int64_t n) {
        std::memcpy(t.ptrs[i] + dst_off * elem, in + src_off * elem, n * elem);
      });
    });
    return;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, flat.scalar_type(), "hpcrl_unflatten", [&] {
    const float s = static_cast<float>(scale);
    const auto* src = static_cast<const scalar_t*>(flat.data_ptr());
    at::parallel_for(0, t.offsets.back(), kGrain, [&](int64_t begin, int64_t end) {
      for_each_run(t, begin, end, [&](int64_t i, int64_t dst_off, int64_t src_off, int64_t n) {
        scale_copy(reinterpret_cast<scalar_t*>(t.ptrs[i]) + dst_off, src + src_off, n, s);
      });
    });
  });
}

}  // namespace hpcrl
