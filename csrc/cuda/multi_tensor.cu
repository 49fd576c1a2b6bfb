// Multi-tensor pack (flatten) and unpack-with-scale (unflatten): one kernel launch per call.
// Torch-free on purpose: an nvcc translation unit that includes torch headers takes minutes to
// compile; this one takes a few seconds. See kernels.cuh for the contract.
//
// Work decomposition
//   The flat range [0, total) is cut into fixed chunks of kChunkBytes (16 KiB: 4096 fp32 or 8192
//   fp16/bf16 elements). Blocks walk the chunks grid-stride. A block finds the first tensor that
//   overlaps its chunk by a binary search over the offset table (every thread runs the same search
//   on the same addresses: broadcast loads that hit L1, and no shared memory or __syncthreads()), then
//   walks forward over the tensors that overlap the chunk (many tiny tensors such as biases can share
//   one chunk). Each (tensor, chunk) overlap is a "run" that the whole block copies cooperatively.
//
// Alignment
//   A run is copied with 16-byte vector loads/stores (uint4) when its source and destination have
//   the same address phase modulo 16: a short scalar head brings both to a 16-byte boundary, then
//   vectors, then a scalar tail. When the phases differ (for example a tensor whose flat offset is
//   not a multiple of 4 fp32 elements while its own storage is 16-byte aligned) no common vector
//   alignment exists and the run is copied with scalar (still fully coalesced) accesses.
//   Chunk boundaries are multiples of 16 bytes relative to `flat`, so a run that spans a whole chunk
//   of an aligned tensor is exactly one unrolled pass of vectors.
//
// Indexing
//   Everything that addresses the flat range or a tensor is int64. Only positions inside a run use
//   int, which is safe because a run never exceeds one chunk (<= 8192 elements).
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>

#include <atomic>
#include <cstdint>
#include <cstring>

#include "kernels.cuh"

namespace hpcrl_cuda {

namespace {

constexpr int kThreads = 256;     // threads per block (the kernels hard-code this stride)
constexpr int kVecBytes = 16;     // one uint4
constexpr int kUnroll = 4;        // independent 16-byte loads in flight per thread
constexpr int kChunkBytes = kThreads * kVecBytes * kUnroll;  // 16 KiB
constexpr int kMinBlocksPerSm = 4;  // __launch_bounds__: at most 64 registers (the kernels need 32-54)
constexpr int kBlocksPerSm = 8;     // grid = 8 blocks per SM, 2048 threads = a full SM on sm_80/sm_90

// ---- element operations -------------------------------------------------------------------------
// The copy ops move raw bits (uint32_t for fp32, uint16_t for fp16/bf16), so flatten and the
// scale == 1 unflatten are bit-exact for every value, NaN payloads included. The scale ops convert
// with explicit intrinsics only, so this file also compiles under the -D__CUDA_NO_HALF_CONVERSIONS__
// -D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF_OPERATORS__ flags that torch's CUDAExtension adds.

template <typename T>
struct CopyOp {
  static constexpr bool kIdentity = true;
  __device__ __forceinline__ T operator()(T x) const { return x; }
};

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_f32(float x);
template <>
__device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_f32<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// y = T(float(x) * scale): the fp32 multiply (round to nearest) then round-to-nearest-even to T,
// the same arithmetic as the reference `(chunk.float() * scale).to(dtype)`.
template <typename T>
struct ScaleOp {
  static constexpr bool kIdentity = false;
  float scale;
  __device__ __forceinline__ T operator()(T x) const { return from_f32<T>(to_f32(x) * scale); }
};

template <typename T, typename Op>
__device__ __forceinline__ uint4 apply_vec(uint4 v, const Op& op) {
  if constexpr (Op::kIdentity) {
    return v;
  } else {
    constexpr int kVec = kVecBytes / static_cast<int>(sizeof(T));
    T e[kVec];
    memcpy(e, &v, sizeof(v));  // register moves after optimization
#pragma unroll
    for (int k = 0; k < kVec; ++k) e[k] = op(e[k]);
    memcpy(&v, e, sizeof(v));
    return v;
  }
}

// The whole block copies dst[0, len) = op(src[0, len)).
template <typename T, typename Op>
__device__ __forceinline__ void copy_run(T* __restrict__ dst, const T* __restrict__ src, int len, const Op& op) {
  constexpr int kVec = kVecBytes / static_cast<int>(sizeof(T));
  const uintptr_t da = reinterpret_cast<uintptr_t>(dst);
  const uintptr_t sa = reinterpret_cast<uintptr_t>(src);
  const int tid = static_cast<int>(threadIdx.x);
  int head = 0;  // scalar elements before the first common 16-byte boundary (< kVec)
  int nvec = 0;  // 16-byte vectors after the head
  if (((da ^ sa) % kVecBytes) == 0 && (da % sizeof(T)) == 0) {
    // Same phase modulo 16 (and element-aligned, which torch tensors always are): after `head`
    // scalar elements both pointers sit on a 16-byte boundary.
    const int head_bytes = static_cast<int>((kVecBytes - da % kVecBytes) % kVecBytes);
    head = min(len, head_bytes / static_cast<int>(sizeof(T)));
    nvec = (len - head) / kVec;
    if (tid < head) dst[tid] = op(src[tid]);  // head < kVec <= kThreads
  }
  // Otherwise no common alignment exists: head = nvec = 0 and the (unrolled) tail loop below
  // copies the whole run with scalar, coalesced accesses.

  if (nvec > 0) {
    const uint4* __restrict__ sv = reinterpret_cast<const uint4*>(src + head);
    uint4* __restrict__ dv = reinterpret_cast<uint4*>(dst + head);
    for (int base = 0; base < nvec; base += kUnroll * kThreads) {
      uint4 r[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int j = base + u * kThreads + tid;
        if (j < nvec) r[u] = sv[j];
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int j = base + u * kThreads + tid;
        if (j < nvec) dv[j] = apply_vec<T>(r[u], op);
      }
    }
  }

  // Tail (< kVec elements), or the whole run when no common alignment exists. Unrolled so that
  // several independent loads are in flight per thread.
  const int tail = head + nvec * kVec;
#pragma unroll 4
  for (int j = tail + tid; j < len; j += kThreads) dst[j] = op(src[j]);
}

// kToFlat: flat <- tensors (flatten); otherwise tensors <- flat (unflatten).
// With __launch_bounds__(kThreads) alone, nvcc 13.0 caps these kernels at 48 registers and spills;
// minBlocks = 4 allows 64 (no spills, at least 32 warps per SM).
template <typename T, typename Op, bool kToFlat>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm)
    multi_tensor_kernel(const int64_t* __restrict__ table, int64_t n, int64_t total, T* flat, Op op) {
  constexpr int64_t kChunk = kChunkBytes / static_cast<int64_t>(sizeof(T));
  const int64_t* __restrict__ addrs = table;
  const int64_t* __restrict__ offs = table + n;
  const int64_t num_chunks = (total + kChunk - 1) / kChunk;

  for (int64_t c = blockIdx.x; c < num_chunks; c += gridDim.x) {
    const int64_t begin = c * kChunk;
    const int64_t end = min(begin + kChunk, total);

    // Largest i in [0, n) with offs[i] <= begin. Because it is the largest, offs[i + 1] > begin,
    // so tensor i is non-empty and contains `begin` (empty tensors are skipped automatically).
    int64_t lo = 0;
    int64_t hi = n - 1;
    while (lo < hi) {
      const int64_t mid = lo + (hi - lo + 1) / 2;
      if (offs[mid] <= begin) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }

    for (int64_t i = lo; i < n; ++i) {
      const int64_t t0 = offs[i];
      if (t0 >= end) break;
      const int64_t t1 = offs[i + 1];
      const int64_t a = max(begin, t0);
      const int64_t b = min(end, t1);
      if (a >= b) continue;  // empty tensor
      T* tensor = reinterpret_cast<T*>(static_cast<uintptr_t>(addrs[i])) + (a - t0);
      const int len = static_cast<int>(b - a);  // <= kChunk
      if constexpr (kToFlat) {
        copy_run<T>(flat + a, tensor, len, op);
      } else {
        copy_run<T>(tensor, flat + a, len, op);
      }
    }
  }
}

// Number of SMs of the current device, cached per device (cudaDeviceGetAttribute is cheap, but this
// runs on every optimizer step).
cudaError_t sm_count(int* out) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cache[kMaxDevices] = {};
  int dev = 0;
  cudaError_t err = cudaGetDevice(&dev);
  if (err != cudaSuccess) return err;
  if (dev >= 0 && dev < kMaxDevices) {
    const int cached = cache[dev].load(std::memory_order_relaxed);
    if (cached > 0) {
      *out = cached;
      return cudaSuccess;
    }
  }
  int sms = 0;
  err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
  if (err != cudaSuccess) return err;
  if (sms <= 0) sms = 1;
  if (dev >= 0 && dev < kMaxDevices) cache[dev].store(sms, std::memory_order_relaxed);
  *out = sms;
  return cudaSuccess;
}

template <typename T, bool kToFlat, typename Op>
int launch(const int64_t* table, int64_t n, int64_t total, const void* flat, Op op, void* stream) {
  constexpr int64_t kChunk = kChunkBytes / static_cast<int64_t>(sizeof(T));
  const int64_t num_chunks = (total + kChunk - 1) / kChunk;
  int sms = 0;
  const cudaError_t err = sm_count(&sms);
  if (err != cudaSuccess) return static_cast<int>(err);
  const int64_t cap = static_cast<int64_t>(sms) * kBlocksPerSm;
  const unsigned blocks = static_cast<unsigned>(num_chunks < cap ? num_chunks : cap);
  // `flat` is only read when !kToFlat; the kernel takes one pointer type for both directions.
  T* flat_t = static_cast<T*>(const_cast<void*>(flat));
  multi_tensor_kernel<T, Op, kToFlat>
      <<<blocks, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(table, n, total, flat_t, op);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace
}  // namespace hpcrl_cuda

// The exported launchers are defined with qualified names, so a signature that drifts from
// kernels.cuh is a compile error here instead of a new overload and a link error later.
const char* hpcrl_cuda::error_string(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }

int hpcrl_cuda::multi_tensor_flatten(const int64_t* table, int64_t num_tensors, int64_t total, void* flat, int dtype,
                                     void* stream) {
  switch (dtype) {
    case kFloat32:
    case kFloat16:
    case kBFloat16:
      break;
    default:
      return static_cast<int>(cudaErrorInvalidValue);
  }
  if (num_tensors <= 0 || total <= 0) return static_cast<int>(cudaSuccess);
  if (dtype == kFloat32) return launch<uint32_t, true>(table, num_tensors, total, flat, CopyOp<uint32_t>{}, stream);
  return launch<uint16_t, true>(table, num_tensors, total, flat, CopyOp<uint16_t>{}, stream);
}

int hpcrl_cuda::multi_tensor_unflatten(const int64_t* table, int64_t num_tensors, int64_t total, const void* flat,
                                       int dtype, float scale, void* stream) {
  switch (dtype) {
    case kFloat32:
    case kFloat16:
    case kBFloat16:
      break;
    default:
      return static_cast<int>(cudaErrorInvalidValue);
  }
  if (num_tensors <= 0 || total <= 0) return static_cast<int>(cudaSuccess);
  if (scale == 1.0f) {  // x * 1.0f == x for every non-NaN x: copy the bits instead
    if (dtype == kFloat32) {
      return launch<uint32_t, false>(table, num_tensors, total, flat, CopyOp<uint32_t>{}, stream);
    }
    return launch<uint16_t, false>(table, num_tensors, total, flat, CopyOp<uint16_t>{}, stream);
  }
  switch (dtype) {
    case kFloat32:
      return launch<float, false>(table, num_tensors, total, flat, ScaleOp<float>{scale}, stream);
    case kFloat16:
      return launch<__half, false>(table, num_tensors, total, flat, ScaleOp<__half>{scale}, stream);
    default:
      return launch<__nv_bfloat16, false>(table, num_tensors, total, flat, ScaleOp<__nv_bfloat16>{scale}, stream);
  }
}
