// Device helpers shared by the kernels: dtype conversion, packed loads, warp/block reductions.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "kernels.h"

namespace app_kernels {
namespace detail {

constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// kVec consecutive elements moved as one aligned access (16 bytes at most).
template <typename T, int kVec>
struct alignas(sizeof(T) * kVec) Pack {
  T v[kVec];
};

template <typename T, int kVec>
__device__ __forceinline__ void load_floats(const T* src, float* dst) {
  const Pack<T, kVec> p = *reinterpret_cast<const Pack<T, kVec>*>(src);
#pragma unroll
  for (int j = 0; j < kVec; ++j) dst[j] = to_float(p.v[j]);
}

template <typename T, int kVec>
__device__ __forceinline__ void store_floats(T* dst, const float* src) {
  Pack<T, kVec> p;
#pragma unroll
  for (int j = 0; j < kVec; ++j) p.v[j] = from_float<T>(src[j]);
  *reinterpret_cast<Pack<T, kVec>*>(dst) = p;
}

// max(a, b) that propagates NaN, like torch.max; fmaxf would return the other operand, so an
// all-NaN softmax row would look fully masked (uniform) instead of NaN as in PyTorch.
__device__ __forceinline__ float nan_max(float a, float b) { return (isnan(a) || a > b) ? a : b; }

struct MaxOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return nan_max(a, b); }
};
struct SumOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return a + b; }
};

template <typename Op>
__device__ __forceinline__ float warp_reduce(float v, Op op) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v = op(v, __shfl_xor_sync(kFullMask, v, offset));
  return v;
}

// Reduce over the kThreads threads that share one row: a warp (shuffles only) or a whole
// block of kThreads threads (shuffles, then `scratch` of kThreads / 32 floats). Every thread of
// the row gets the result; the combination order is fixed, so results are reproducible.
template <int kThreads, typename Op>
__device__ __forceinline__ float row_reduce(float v, Op op, float* scratch) {
  v = warp_reduce(v, op);
  if (kThreads == 32) return v;
  constexpr int kWarps = kThreads / 32;
  const int warp = threadIdx.x / 32;
  __syncthreads();  // the previous reduction's readers are done with scratch
  if (threadIdx.x % 32 == 0) scratch[warp] = v;
  __syncthreads();
  float r = scratch[0];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) r = op(r, scratch[w]);
  return r;
}

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

inline int element_bytes(DType dtype) { return dtype == DType::kFloat32 ? 4 : 2; }

}  // namespace detail
}  // namespace app_kernels

// Runs the statement with `scalar_t` bound to the CUDA type of `dtype`.
#define APP_DISPATCH_DTYPE(dtype, scalar_t, ...)                         \
  [&]() -> cudaError_t {                                                 \
    switch (dtype) {                                                     \
      case ::app_kernels::DType::kFloat32: {                             \
        using scalar_t = float;                                          \
        return __VA_ARGS__();                                            \
      }                                                                  \
      case ::app_kernels::DType::kFloat16: {                             \
        using scalar_t = __half;                                         \
        return __VA_ARGS__();                                            \
      }                                                                  \
      case ::app_kernels::DType::kBFloat16: {                            \
        using scalar_t = __nv_bfloat16;                                  \
        return __VA_ARGS__();                                            \
      }                                                                  \
    }                                                                    \
    return cudaErrorInvalidValue;                                        \
  }()

namespace app_kernels {
namespace detail {

// Calls f(T{}, W{}) with T the CUDA type of `dtype` and W that of `param_dtype` (T itself, or
// float for fp32 parameters); cudaErrorInvalidValue for any other pairing. The norms use it.
template <typename F>
cudaError_t dispatch_types(DType dtype, DType param_dtype, F&& f) {
  if (param_dtype != DType::kFloat32 && param_dtype != dtype) return cudaErrorInvalidValue;
  const bool fp32_params = param_dtype == DType::kFloat32;
  return APP_DISPATCH_DTYPE(dtype, scalar_t, [&] {
    if (fp32_params) return f(scalar_t{}, float{});
    return f(scalar_t{}, scalar_t{});
  });
}

}  // namespace detail
}  // namespace app_kernels
