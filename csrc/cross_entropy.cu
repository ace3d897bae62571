// Cross entropy over a vocabulary slice, reading the logits in their own dtype (no fp32 copy).
//
// Forward: one block per row makes a single pass, keeping per thread a running max and a sum of
// exponentials rescaled to it (the online softmax); the block then agrees on the row max and sums
// the rescaled partial sums. Tensor-parallel ranks combine their (max, sum) pairs the same way
// with two all-reduces in Python. Backward recomputes softmax from the saved logsumexp and writes
// the gradient in the logits' dtype. All arithmetic is fp32.
#include <climits>

#include "common.cuh"

namespace app_kernels {
namespace {

using detail::MaxOp;
using detail::SumOp;

constexpr int kThreads = 256;

template <typename T, int kVec>
__global__ void __launch_bounds__(kThreads)
cross_entropy_stats_kernel(const T* __restrict__ logits, const int64_t* __restrict__ target,
                           float* __restrict__ row_max, float* __restrict__ sum_exp,
                           float* __restrict__ target_logit, int vocab, int64_t vocab_start) {
  __shared__ float scratch[kThreads / 32];
  const int64_t row = blockIdx.x;
  const T* z = logits + row * vocab;
  float m = -INFINITY, s = 0.0f;
  for (int col = threadIdx.x * kVec; col < vocab; col += kThreads * kVec) {
    float v[kVec];
    detail::load_floats<T, kVec>(z + col, v);
    float chunk_max = v[0];
#pragma unroll
    for (int j = 1; j < kVec; ++j) chunk_max = fmaxf(chunk_max, v[j]);
    if (chunk_max > m) {
      s *= expf(m - chunk_max);  // s == 0 while m is -inf
      m = chunk_max;
    }
#pragma unroll
    for (int j = 0; j < kVec; ++j) s += expf(v[j] - m);
  }
  const float block_max = detail::row_reduce<kThreads>(m, MaxOp{}, scratch);
  const float rescaled = s == 0.0f ? 0.0f : s * expf(m - block_max);
  const float block_sum = detail::row_reduce<kThreads>(rescaled, SumOp{}, scratch);
  if (threadIdx.x == 0) {
    const int64_t local = target[row] - vocab_start;
    row_max[row] = block_max;
    sum_exp[row] = block_sum;
    target_logit[row] = (local >= 0 && local < vocab) ? detail::to_float(z[local]) : 0.0f;
  }
}

template <typename T, int kVec>
__global__ void __launch_bounds__(kThreads)
cross_entropy_backward_kernel(const T* __restrict__ logits, const int64_t* __restrict__ target,
                              const float* __restrict__ logsumexp,
                              const float* __restrict__ grad_loss, T* __restrict__ grad,
                              int vocab, int64_t vocab_start) {
  const int64_t row = blockIdx.x;
  const T* z = logits + row * vocab;
  T* dz = grad + row * vocab;
  const float lse = logsumexp[row], g = grad_loss[row];
  const int64_t local = target[row] - vocab_start;
  for (int col = threadIdx.x * kVec; col < vocab; col += kThreads * kVec) {
    float v[kVec];
    detail::load_floats<T, kVec>(z + col, v);
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const float onehot = (col + j == local) ? 1.0f : 0.0f;
      v[j] = (expf(v[j] - lse) - onehot) * g;
    }
    detail::store_floats<T, kVec>(dz + col, v);
  }
}

template <typename T, bool kBackward>
cudaError_t launch(const void* logits, const int64_t* target, float* a, float* b, float* c,
                   const float* lse, const float* grad_loss, void* grad, int64_t rows, int vocab,
                   int64_t vocab_start, cudaStream_t stream) {
  constexpr int kVec = 16 / static_cast<int>(sizeof(T));
  const bool vec = vocab % kVec == 0 && detail::aligned16(logits) &&
                   (grad == nullptr || detail::aligned16(grad));
  const T* z = static_cast<const T*>(logits);
  if (rows > INT_MAX) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(rows)), block(kThreads);
  if constexpr (kBackward) {
    T* dz = static_cast<T*>(grad);
    if (vec) {
      cross_entropy_backward_kernel<T, kVec><<<grid, block, 0, stream>>>(
          z, target, lse, grad_loss, dz, vocab, vocab_start);
    } else {
      cross_entropy_backward_kernel<T, 1><<<grid, block, 0, stream>>>(
          z, target, lse, grad_loss, dz, vocab, vocab_start);
    }
  } else {
    if (vec) {
      cross_entropy_stats_kernel<T, kVec><<<grid, block, 0, stream>>>(z, target, a, b, c, vocab,
                                                                     vocab_start);
    } else {
      cross_entropy_stats_kernel<T, 1><<<grid, block, 0, stream>>>(z, target, a, b, c, vocab,
                                                                 vocab_start);
    }
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t cross_entropy_stats(DType dtype, const void* logits, const int64_t* target,
                                float* row_max, float* sum_exp, float* target_logit,
                                int64_t rows, int vocab, int64_t vocab_start,
                                cudaStream_t stream) {
  if (rows < 0 || vocab < 1) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  return APP_DISPATCH_DTYPE(dtype, scalar_t, [&] {
    return launch<scalar_t, false>(logits, target, row_max, sum_exp, target_logit, nullptr,
                                   nullptr, nullptr, rows, vocab, vocab_start, stream);
  });
}

cudaError_t cross_entropy_backward(DType dtype, const void* logits, const int64_t* target,
                                   const float* logsumexp, const float* grad_loss,
                                   void* grad_logits, int64_t rows, int vocab,
                                   int64_t vocab_start, cudaStream_t stream) {
  if (rows < 0 || vocab < 1) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  return APP_DISPATCH_DTYPE(dtype, scalar_t, [&] {
    return launch<scalar_t, true>(logits, target, nullptr, nullptr, nullptr, logsumexp,
                                  grad_loss, grad_logits, rows, vocab, vocab_start, stream);
  });
}

}  // namespace app_kernels
