// RMSNorm over the last dim with fp32 statistics, forward and backward (weight grad too).
//
// The LayerNorm kernel's structure (layer_norm.cu) without the mean and the bias: a warp owns a
// row and walks it through the cache (a sum of squares, then the output); activations are
// fp32/fp16/bf16 (T), the weight T or fp32 (W). The weight gradient is summed per warp over a
// fixed set of rows into `partials`, then over the warps in a fixed order: no atomics, the
// same bits every run.
#include <climits>

#include "common.cuh"

namespace app_kernels {
namespace {

using detail::SumOp;
using detail::dispatch_types;

constexpr int kWarpsPerBlock = 4;
constexpr int kMaxPartials = 1024;  // warps of the backward: rows are dealt out among them

template <typename T, typename W>
__global__ void __launch_bounds__(32 * kWarpsPerBlock)
rms_norm_forward_kernel(const T* __restrict__ x, const W* __restrict__ weight,
                        T* __restrict__ y, float* __restrict__ rstd_out, int64_t rows,
                        int hidden, float eps) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  x += row * hidden;
  y += row * hidden;
  float sq = 0.0f;
  for (int col = lane; col < hidden; col += 32) {
    const float v = detail::to_float(x[col]);
    sq += v * v;
  }
  const float rstd = rsqrtf(detail::warp_reduce(sq, SumOp{}) / hidden + eps);
  if (lane == 0) rstd_out[row] = rstd;
  for (int col = lane; col < hidden; col += 32) {
    y[col] = detail::from_float<T>(detail::to_float(x[col]) * rstd *
                                   detail::to_float(weight[col]));
  }
}

// dx = rstd (dy w - xhat mean(dy w xhat)) for the rows warp `w` owns (w, w + P, ...), and that
// warp's partial sums of dy * xhat per column in partials[w].
template <typename T, typename W>
__global__ void __launch_bounds__(32 * kWarpsPerBlock)
rms_norm_backward_kernel(const T* __restrict__ dy, const T* __restrict__ x,
                         const W* __restrict__ weight, const float* __restrict__ rstd,
                         T* __restrict__ dx, float* __restrict__ partials, int64_t rows,
                         int hidden, int num_warps) {
  const int warp = blockIdx.x * kWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (warp >= num_warps) return;
  float* acc_w = partials + static_cast<int64_t>(warp) * hidden;
  for (int col = lane; col < hidden; col += 32) acc_w[col] = 0.0f;
  for (int64_t row = warp; row < rows; row += num_warps) {
    const T* dy_row = dy + row * hidden;
    const T* x_row = x + row * hidden;
    const float rs = rstd[row];
    float sum_gx = 0.0f;
    for (int col = lane; col < hidden; col += 32) {
      const float d = detail::to_float(dy_row[col]);
      const float xhat = detail::to_float(x_row[col]) * rs;
      sum_gx += d * detail::to_float(weight[col]) * xhat;
      acc_w[col] += d * xhat;  // this lane's own columns: no other thread touches them
    }
    const float mean_gx = detail::warp_reduce(sum_gx, SumOp{}) / hidden;
    for (int col = lane; col < hidden; col += 32) {
      const float xhat = detail::to_float(x_row[col]) * rs;
      const float g = detail::to_float(dy_row[col]) * detail::to_float(weight[col]);
      dx[row * hidden + col] = detail::from_float<T>(rs * (g - xhat * mean_gx));
    }
  }
}

// dweight[col] = sum over the warps' partials, in warp order (16 slices, then the 16 in order).
template <typename W>
__global__ void __launch_bounds__(512)
rms_norm_reduce_partials(const float* __restrict__ partials, W* __restrict__ grad_weight,
                         int hidden, int num_warps) {
  constexpr int kSlices = 16;
  __shared__ float slice[kSlices][32];
  const int col = blockIdx.x * 32 + threadIdx.x;
  float s = 0.0f;
  if (col < hidden) {
    for (int p = threadIdx.y; p < num_warps; p += kSlices) {
      s += partials[static_cast<int64_t>(p) * hidden + col];
    }
  }
  slice[threadIdx.y][threadIdx.x] = s;
  __syncthreads();
  if (threadIdx.y != 0 || col >= hidden) return;
  for (int i = 1; i < kSlices; ++i) s += slice[i][threadIdx.x];
  grad_weight[col] = detail::from_float<W>(s);
}

}  // namespace

int rms_norm_backward_partials(int64_t rows) {
  return static_cast<int>(rows < kMaxPartials ? (rows > 0 ? rows : 1) : kMaxPartials);
}

cudaError_t rms_norm_forward(DType dtype, DType param_dtype, const void* input,
                             const void* weight, void* output, float* rstd, int64_t rows,
                             int hidden, float eps, cudaStream_t stream) {
  if (rows < 0 || hidden < 1) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  const int64_t blocks = (rows + kWarpsPerBlock - 1) / kWarpsPerBlock;
  if (blocks > INT_MAX) return cudaErrorInvalidValue;
  return dispatch_types(dtype, param_dtype, [&](auto t, auto w) {
    using T = decltype(t);
    using W = decltype(w);
    rms_norm_forward_kernel<T, W><<<static_cast<unsigned>(blocks), 32 * kWarpsPerBlock, 0,
                                    stream>>>(static_cast<const T*>(input),
                                              static_cast<const W*>(weight),
                                              static_cast<T*>(output), rstd, rows, hidden, eps);
    return cudaGetLastError();
  });
}

cudaError_t rms_norm_backward(DType dtype, DType param_dtype, const void* grad_output,
                              const void* input, const void* weight, const float* rstd,
                              void* grad_input, void* grad_weight, float* workspace,
                              int64_t rows, int hidden, cudaStream_t stream) {
  if (rows < 0 || hidden < 1) return cudaErrorInvalidValue;
  return dispatch_types(dtype, param_dtype, [&](auto t, auto w) {
    using T = decltype(t);
    using W = decltype(w);
    if (rows == 0) return cudaMemsetAsync(grad_weight, 0, sizeof(W) * hidden, stream);
    const int warps = rms_norm_backward_partials(rows);
    const dim3 grid((warps + kWarpsPerBlock - 1) / kWarpsPerBlock), block(32 * kWarpsPerBlock);
    rms_norm_backward_kernel<T, W><<<grid, block, 0, stream>>>(
        static_cast<const T*>(grad_output), static_cast<const T*>(input),
        static_cast<const W*>(weight), rstd, static_cast<T*>(grad_input), workspace, rows,
        hidden, warps);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
    const dim3 reduce_grid((hidden + 31) / 32), reduce_block(32, 16);
    rms_norm_reduce_partials<W><<<reduce_grid, reduce_block, 0, stream>>>(
        workspace, static_cast<W*>(grad_weight), hidden, warps);
    return cudaGetLastError();
  });
}

}  // namespace app_kernels
