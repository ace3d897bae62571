// Scaled softmax over attention scores with a causal or an explicit mask, forward and backward.
//
// One row of s_k scores lives in registers: kThreads threads (a warp, or a whole block for rows
// longer than 1024) hold kN values each, loaded kVec at a time (16-byte accesses when s_k is a
// multiple of kVec and the pointers are aligned, single elements otherwise, so any length
// works). Arithmetic is fp32; input and output are the activation dtype. Causal rows skip the
// loads of masked columns and write their zeros directly.
#include <climits>
#include <type_traits>

#include "common.cuh"

namespace app_kernels {
namespace {

using detail::MaxOp;
using detail::SumOp;

// Row `row` of [batch, heads, s_q, s_k] scores: how many leading columns causal masking keeps,
// and where its explicit-mask row starts (null for none).
struct RowView {
  int limit;
  const uint8_t* mask_row;
};

template <bool kCausal>
__device__ __forceinline__ RowView row_view(int64_t row, const uint8_t* mask, int heads, int s_q,
                                            int s_k, int mask_batches) {
  const int q = static_cast<int>(row % s_q);
  RowView view{kCausal ? q + 1 + (s_k - s_q) : s_k, nullptr};
  if (!kCausal && mask != nullptr) {
    const int64_t b = mask_batches == 1 ? 0 : row / (static_cast<int64_t>(heads) * s_q);
    view.mask_row = mask + (b * s_q + q) * static_cast<int64_t>(s_k);
  }
  return view;
}

template <int kVec>
__device__ __forceinline__ void load_mask(const uint8_t* mask_row, int col, bool* masked) {
  if (mask_row == nullptr) {
#pragma unroll
    for (int j = 0; j < kVec; ++j) masked[j] = false;
    return;
  }
  const detail::Pack<uint8_t, kVec> p =
      *reinterpret_cast<const detail::Pack<uint8_t, kVec>*>(mask_row + col);
#pragma unroll
  for (int j = 0; j < kVec; ++j) masked[j] = p.v[j] != 0;
}

template <typename T, int kThreads, int kN, int kVec, bool kCausal>
__global__ void __launch_bounds__(kThreads == 32 ? 128 : kThreads)
softmax_forward_kernel(const T* __restrict__ x, const uint8_t* __restrict__ mask,
                       T* __restrict__ y, float scale, int64_t rows, int heads, int s_q, int s_k,
                       int mask_batches) {
  constexpr int kRowsPerBlock = kThreads == 32 ? 4 : 1;
  constexpr int kChunks = kN / kVec;
  __shared__ float scratch[kThreads / 32];
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kThreads;
  const int t = threadIdx.x % kThreads;
  if (row >= rows) return;  // a whole warp (warp rows) or a whole block (block rows)
  const RowView view = row_view<kCausal>(row, mask, heads, s_q, s_k, mask_batches);
  x += row * s_k;
  y += row * s_k;

  float v[kN];
  float local_max = -INFINITY;
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    const int col = (c * kThreads + t) * kVec;
    float* chunk = v + c * kVec;
    if (col < view.limit) {
      detail::load_floats<T, kVec>(x + col, chunk);
      bool masked[kVec];
      load_mask<kVec>(view.mask_row, col, masked);
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        const bool keep = col + j < view.limit && !masked[j];
        chunk[j] = keep ? chunk[j] * scale : -INFINITY;
        local_max = detail::nan_max(local_max, chunk[j]);  // NaN scores give a NaN row
      }
    } else {
#pragma unroll
      for (int j = 0; j < kVec; ++j) chunk[j] = -INFINITY;
    }
  }
  const float row_max = detail::row_reduce<kThreads>(local_max, MaxOp{}, scratch);

  if (row_max == -INFINITY) {  // every column masked: the uniform row
    float uniform[kVec];
#pragma unroll
    for (int j = 0; j < kVec; ++j) uniform[j] = 1.0f / s_k;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const int col = (c * kThreads + t) * kVec;
      if (col < s_k) detail::store_floats<T, kVec>(y + col, uniform);
    }
    return;
  }
  float local_sum = 0.0f;
#pragma unroll
  for (int i = 0; i < kN; ++i) {
    v[i] = expf(v[i] - row_max);  // masked: exp(-inf) = 0
    local_sum += v[i];
  }
  const float inv_sum = 1.0f / detail::row_reduce<kThreads>(local_sum, SumOp{}, scratch);
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    const int col = (c * kThreads + t) * kVec;
    if (col >= s_k) continue;
    float* chunk = v + c * kVec;
#pragma unroll
    for (int j = 0; j < kVec; ++j) chunk[j] *= inv_sum;
    detail::store_floats<T, kVec>(y + col, chunk);
  }
}

template <typename T, int kThreads, int kN, int kVec, bool kCausal>
__global__ void __launch_bounds__(kThreads == 32 ? 128 : kThreads)
softmax_backward_kernel(const T* __restrict__ dy, const T* __restrict__ y,
                        const uint8_t* __restrict__ mask, T* __restrict__ dx, float scale,
                        int64_t rows, int heads, int s_q, int s_k, int mask_batches) {
  constexpr int kRowsPerBlock = kThreads == 32 ? 4 : 1;
  constexpr int kChunks = kN / kVec;
  __shared__ float scratch[kThreads / 32];
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / kThreads;
  const int t = threadIdx.x % kThreads;
  if (row >= rows) return;
  const RowView view = row_view<kCausal>(row, mask, heads, s_q, s_k, mask_batches);
  dy += row * s_k;
  y += row * s_k;
  dx += row * s_k;

  float g[kN], p[kN];
  float local_dot = 0.0f;
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    const int col = (c * kThreads + t) * kVec;
    if (col < view.limit) {
      detail::load_floats<T, kVec>(dy + col, g + c * kVec);
      detail::load_floats<T, kVec>(y + col, p + c * kVec);
    }
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const int i = c * kVec + j;
      if (col + j >= view.limit) g[i] = p[i] = 0.0f;
      local_dot += g[i] * p[i];
    }
  }
  const float dot = detail::row_reduce<kThreads>(local_dot, SumOp{}, scratch);
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    const int col = (c * kThreads + t) * kVec;
    if (col >= s_k) continue;
    bool masked[kVec];
    load_mask<kVec>(view.mask_row, col, masked);
    float out[kVec];
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const int i = c * kVec + j;
      // masked and causally hidden columns: exactly 0, as the reference's masked_fill gives,
      // also when dot is NaN (a NaN row)
      out[j] = (masked[j] || col + j >= view.limit) ? 0.0f : scale * p[i] * (g[i] - dot);
    }
    detail::store_floats<T, kVec>(dx + col, out);
  }
}

// Shapes of one launch; `launch<kThreads, kN, kVec>()` starts the kernel for one row config.
template <typename T, bool kCausal, bool kBackward>
struct SoftmaxLaunch {
  const T* a;  // forward: x; backward: dy
  const T* b;  // backward: y
  const uint8_t* mask;
  T* out;
  float scale;
  int64_t rows;
  int heads, s_q, s_k, mask_batches;
  cudaStream_t stream;

  template <int kThreads, int kN, int kVec>
  cudaError_t launch() const {
    constexpr int kRowsPerBlock = kThreads == 32 ? 4 : 1;
    const int64_t blocks = (rows + kRowsPerBlock - 1) / kRowsPerBlock;
    if (blocks > INT_MAX) return cudaErrorInvalidValue;
    const dim3 grid(static_cast<unsigned>(blocks)), block(kThreads * kRowsPerBlock);
    if (kBackward) {
      softmax_backward_kernel<T, kThreads, kN, kVec, kCausal><<<grid, block, 0, stream>>>(
          a, b, mask, out, scale, rows, heads, s_q, s_k, mask_batches);
    } else {
      softmax_forward_kernel<T, kThreads, kN, kVec, kCausal><<<grid, block, 0, stream>>>(
          a, mask, out, scale, rows, heads, s_q, s_k, mask_batches);
    }
    return cudaGetLastError();
  }
};

template <int kThreads, int kN, typename Launch, typename T>
cudaError_t launch_with_vec(const Launch& l, bool vec_ok, const T*) {
  constexpr int kVec = 16 / static_cast<int>(sizeof(T));
  if constexpr (kN >= kVec) {
    if (vec_ok) return l.template launch<kThreads, kN, kVec>();
  }
  return l.template launch<kThreads, kN, 1>();
}

// Row configurations: a warp with 1..32 values per lane up to 1024 columns, then whole blocks.
template <typename T, typename Launch>
cudaError_t dispatch_rows(const Launch& l, bool vec_ok) {
  const T* tag = nullptr;
  const int s_k = l.s_k;
  if (s_k <= 32) return launch_with_vec<32, 1>(l, vec_ok, tag);
  if (s_k <= 64) return launch_with_vec<32, 2>(l, vec_ok, tag);
  if (s_k <= 128) return launch_with_vec<32, 4>(l, vec_ok, tag);
  if (s_k <= 256) return launch_with_vec<32, 8>(l, vec_ok, tag);
  if (s_k <= 512) return launch_with_vec<32, 16>(l, vec_ok, tag);
  if (s_k <= 1024) return launch_with_vec<32, 32>(l, vec_ok, tag);
  if (s_k <= 2048) return launch_with_vec<256, 8>(l, vec_ok, tag);
  if (s_k <= 4096) return launch_with_vec<256, 16>(l, vec_ok, tag);
  if (s_k <= 8192) return launch_with_vec<512, 16>(l, vec_ok, tag);
  return launch_with_vec<1024, 16>(l, vec_ok, tag);
}

bool valid_shape(int64_t rows, int s_q, int s_k) {
  return rows >= 0 && s_q >= 1 && s_k >= 1 && s_k <= kMaxSoftmaxLength && rows % s_q == 0;
}

// 16-byte accesses need every row (and mask row) to start on a 16-byte boundary.
bool vec_ok(DType dtype, int s_k, std::initializer_list<const void*> pointers) {
  const int vec = 16 / detail::element_bytes(dtype);
  if (s_k % vec != 0) return false;
  for (const void* p : pointers)
    if (p != nullptr && !detail::aligned16(p)) return false;
  return true;
}

template <bool kCausal, bool kBackward>
cudaError_t run_softmax(DType dtype, const void* a, const void* b, const uint8_t* mask, void* out,
                        float scale, int64_t rows, int heads, int s_q, int s_k,
                        int mask_batches, cudaStream_t stream) {
  if (!valid_shape(rows, s_q, s_k) || heads < 1 || mask_batches < 1) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  const bool vec = vec_ok(dtype, s_k, {a, b, out, mask});
  return APP_DISPATCH_DTYPE(dtype, scalar_t, [&] {
    const SoftmaxLaunch<scalar_t, kCausal, kBackward> l{
        static_cast<const scalar_t*>(a), static_cast<const scalar_t*>(b), mask,
        static_cast<scalar_t*>(out), scale, rows, heads, s_q, s_k, mask_batches, stream};
    return dispatch_rows<scalar_t>(l, vec);
  });
}

}  // namespace

cudaError_t causal_softmax_forward(DType dtype, const void* input, void* output, float scale,
                                   int64_t rows, int s_q, int s_k, cudaStream_t stream) {
  if (s_q > s_k) return cudaErrorInvalidValue;
  return run_softmax<true, false>(dtype, input, nullptr, nullptr, output, scale, rows, 1, s_q,
                                  s_k, 1, stream);
}

cudaError_t masked_softmax_forward(DType dtype, const void* input, const uint8_t* mask,
                                   void* output, float scale, int64_t rows, int heads, int s_q,
                                   int s_k, int mask_batches, cudaStream_t stream) {
  if (rows % (static_cast<int64_t>(heads) * s_q) != 0) return cudaErrorInvalidValue;
  return run_softmax<false, false>(dtype, input, nullptr, mask, output, scale, rows, heads, s_q,
                                   s_k, mask_batches, stream);
}

cudaError_t softmax_backward(DType dtype, const void* grad_output, const void* output,
                             const uint8_t* mask, void* grad_input, float scale, int64_t rows,
                             int heads, int s_q, int s_k, int mask_batches, bool causal,
                             cudaStream_t stream) {
  if (causal) {
    if (s_q > s_k) return cudaErrorInvalidValue;
    return run_softmax<true, true>(dtype, grad_output, output, nullptr, grad_input, scale, rows,
                                   1, s_q, s_k, 1, stream);
  }
  if (rows % (static_cast<int64_t>(heads) * s_q) != 0) return cudaErrorInvalidValue;
  return run_softmax<false, true>(dtype, grad_output, output, mask, grad_input, scale, rows,
                                  heads, s_q, s_k, mask_batches, stream);
}

}  // namespace app_kernels
