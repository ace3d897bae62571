// LayerNorm over the last dim with fp32 statistics, forward and backward (weight/bias grads too).
//
// A warp owns a row. Rows of up to 2048 values stay in registers (kN per lane, moved kVec at a
// time when the hidden size and pointers allow 16-byte accesses); longer rows take three
// passes through the cache. Activations are fp32/fp16/bf16 (T); weight and bias are T or fp32
// (W): Megatron's mixed-precision LayerNorm. The weight/bias gradients are summed per warp over
// a fixed set of rows, then over the warps in a fixed order: no atomics, same bits every run.
#include <climits>

#include "common.cuh"

namespace app_kernels {
namespace {

using detail::SumOp;
using detail::dispatch_types;

constexpr int kWarpsPerBlock = 4;
constexpr int kMaxPartials = 1024;  // warps of the backward: rows are dealt out among them
constexpr int kMaxCachedPerLane = 64;          // forward: rows up to 2048
constexpr int kMaxCachedPerLaneBackward = 32;  // backward holds four arrays: rows up to 1024

template <typename T, typename W, int kN, int kVec>
__global__ void __launch_bounds__(32 * kWarpsPerBlock)
layer_norm_forward_cached(const T* __restrict__ x, const W* __restrict__ weight,
                          const W* __restrict__ bias, T* __restrict__ y,
                          float* __restrict__ mean_out, float* __restrict__ rstd_out,
                          int64_t rows, int hidden, float eps) {
  constexpr int kChunks = kN / kVec;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  x += row * hidden;
  y += row * hidden;

  float v[kN];
  float sum = 0.0f;
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    const int col = (c * 32 + lane) * kVec;
    if (col < hidden) {
      detail::load_floats<T, kVec>(x + col, v + c * kVec);
    } else {
#pragma unroll
      for (int j = 0; j < kVec; ++j) v[c * kVec + j] = 0.0f;
    }
#pragma unroll
    for (int j = 0; j < kVec; ++j) sum += v[c * kVec + j];
  }
  const float mean = detail::warp_reduce(sum, SumOp{}) / hidden;
  float sq = 0.0f;
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    const int col = (c * 32 + lane) * kVec;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const float d = col < hidden ? v[c * kVec + j] - mean : 0.0f;
      sq += d * d;
    }
  }
  const float rstd = rsqrtf(detail::warp_reduce(sq, SumOp{}) / hidden + eps);
  if (lane == 0) {
    mean_out[row] = mean;
    rstd_out[row] = rstd;
  }
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    const int col = (c * 32 + lane) * kVec;
    if (col >= hidden) continue;
    float w[kVec], b[kVec], out[kVec];
    detail::load_floats<W, kVec>(weight + col, w);
    detail::load_floats<W, kVec>(bias + col, b);
#pragma unroll
    for (int j = 0; j < kVec; ++j) out[j] = (v[c * kVec + j] - mean) * rstd * w[j] + b[j];
    detail::store_floats<T, kVec>(y + col, out);
  }
}

// Any hidden size: three passes over the row (the second and third mostly hit the cache).
template <typename T, typename W>
__global__ void __launch_bounds__(32 * kWarpsPerBlock)
layer_norm_forward_looped(const T* __restrict__ x, const W* __restrict__ weight,
                          const W* __restrict__ bias, T* __restrict__ y,
                          float* __restrict__ mean_out, float* __restrict__ rstd_out,
                          int64_t rows, int hidden, float eps) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  x += row * hidden;
  y += row * hidden;
  float sum = 0.0f;
  for (int col = lane; col < hidden; col += 32) sum += detail::to_float(x[col]);
  const float mean = detail::warp_reduce(sum, SumOp{}) / hidden;
  float sq = 0.0f;
  for (int col = lane; col < hidden; col += 32) {
    const float d = detail::to_float(x[col]) - mean;
    sq += d * d;
  }
  const float rstd = rsqrtf(detail::warp_reduce(sq, SumOp{}) / hidden + eps);
  if (lane == 0) {
    mean_out[row] = mean;
    rstd_out[row] = rstd;
  }
  for (int col = lane; col < hidden; col += 32) {
    const float xhat = (detail::to_float(x[col]) - mean) * rstd;
    y[col] = detail::from_float<T>(xhat * detail::to_float(weight[col]) +
                                   detail::to_float(bias[col]));
  }
}

// dx for the rows warp `w` owns (w, w + P, ...), and that warp's partial sums of dy * xhat and
// dy per column, written to partials[w] and partials[P + w]. The weight is re-read per row
// (from L1) rather than held, to keep four kN arrays in registers.
template <typename T, typename W, int kN, int kVec>
__global__ void __launch_bounds__(32 * kWarpsPerBlock)
layer_norm_backward_cached(const T* __restrict__ dy, const T* __restrict__ x,
                           const W* __restrict__ weight, const float* __restrict__ mean,
                           const float* __restrict__ rstd, T* __restrict__ dx,
                           float* __restrict__ partials, int64_t rows, int hidden, int num_warps) {
  constexpr int kChunks = kN / kVec;
  const int warp = blockIdx.x * kWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (warp >= num_warps) return;
  float acc_w[kN], acc_b[kN];
#pragma unroll
  for (int i = 0; i < kN; ++i) acc_w[i] = acc_b[i] = 0.0f;
  for (int64_t row = warp; row < rows; row += num_warps) {
    const float mu = mean[row], rs = rstd[row];
    float d[kN], xhat[kN];
    float sum_g = 0.0f, sum_gx = 0.0f;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const int col = (c * 32 + lane) * kVec;
      float* dc = d + c * kVec;
      float* xc = xhat + c * kVec;
      float w[kVec];
      if (col < hidden) {
        detail::load_floats<T, kVec>(dy + row * hidden + col, dc);
        detail::load_floats<T, kVec>(x + row * hidden + col, xc);
        detail::load_floats<W, kVec>(weight + col, w);
      } else {
#pragma unroll
        for (int j = 0; j < kVec; ++j) dc[j] = xc[j] = w[j] = 0.0f;
      }
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        xc[j] = col < hidden ? (xc[j] - mu) * rs : 0.0f;
        const float g = dc[j] * w[j];
        sum_g += g;
        sum_gx += g * xc[j];
        acc_w[c * kVec + j] += dc[j] * xc[j];
        acc_b[c * kVec + j] += dc[j];
      }
    }
    const float mean_g = detail::warp_reduce(sum_g, SumOp{}) / hidden;
    const float mean_gx = detail::warp_reduce(sum_gx, SumOp{}) / hidden;
#pragma unroll
    for (int c = 0; c < kChunks; ++c) {
      const int col = (c * 32 + lane) * kVec;
      if (col >= hidden) continue;
      float w[kVec], out[kVec];
      detail::load_floats<W, kVec>(weight + col, w);
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        const int i = c * kVec + j;
        out[j] = rs * (d[i] * w[j] - mean_g - xhat[i] * mean_gx);
      }
      detail::store_floats<T, kVec>(dx + row * hidden + col, out);
    }
  }
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    const int col = (c * 32 + lane) * kVec;
    if (col >= hidden) continue;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      partials[static_cast<int64_t>(warp) * hidden + col + j] = acc_w[c * kVec + j];
      partials[static_cast<int64_t>(num_warps + warp) * hidden + col + j] = acc_b[c * kVec + j];
    }
  }
}

template <typename T, typename W>
__global__ void __launch_bounds__(32 * kWarpsPerBlock)
layer_norm_backward_looped(const T* __restrict__ dy, const T* __restrict__ x,
                           const W* __restrict__ weight, const float* __restrict__ mean,
                           const float* __restrict__ rstd, T* __restrict__ dx,
                           float* __restrict__ partials, int64_t rows, int hidden, int num_warps) {
  const int warp = blockIdx.x * kWarpsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (warp >= num_warps) return;
  float* acc_w = partials + static_cast<int64_t>(warp) * hidden;
  float* acc_b = partials + static_cast<int64_t>(num_warps + warp) * hidden;
  for (int col = lane; col < hidden; col += 32) acc_w[col] = acc_b[col] = 0.0f;
  for (int64_t row = warp; row < rows; row += num_warps) {
    const T* dy_row = dy + row * hidden;
    const T* x_row = x + row * hidden;
    const float mu = mean[row], rs = rstd[row];
    float sum_g = 0.0f, sum_gx = 0.0f;
    for (int col = lane; col < hidden; col += 32) {
      const float d = detail::to_float(dy_row[col]);
      const float xhat = (detail::to_float(x_row[col]) - mu) * rs;
      const float g = d * detail::to_float(weight[col]);
      sum_g += g;
      sum_gx += g * xhat;
      acc_w[col] += d * xhat;  // this lane's own columns: no other thread touches them
      acc_b[col] += d;
    }
    const float mean_g = detail::warp_reduce(sum_g, SumOp{}) / hidden;
    const float mean_gx = detail::warp_reduce(sum_gx, SumOp{}) / hidden;
    for (int col = lane; col < hidden; col += 32) {
      const float xhat = (detail::to_float(x_row[col]) - mu) * rs;
      const float g = detail::to_float(dy_row[col]) * detail::to_float(weight[col]);
      dx[row * hidden + col] = detail::from_float<T>(rs * (g - mean_g - xhat * mean_gx));
    }
  }
}

// dweight[col] = sum over the warps' partials, in warp order (16 slices, then the 16 in order).
template <typename W>
__global__ void __launch_bounds__(512)
layer_norm_reduce_partials(const float* __restrict__ partials, W* __restrict__ grad_weight,
                           W* __restrict__ grad_bias, int hidden, int num_warps) {
  constexpr int kSlices = 16;
  __shared__ float slice_w[kSlices][32], slice_b[kSlices][32];
  const int col = blockIdx.x * 32 + threadIdx.x;
  float sw = 0.0f, sb = 0.0f;
  if (col < hidden) {
    for (int p = threadIdx.y; p < num_warps; p += kSlices) {
      sw += partials[static_cast<int64_t>(p) * hidden + col];
      sb += partials[static_cast<int64_t>(num_warps + p) * hidden + col];
    }
  }
  slice_w[threadIdx.y][threadIdx.x] = sw;
  slice_b[threadIdx.y][threadIdx.x] = sb;
  __syncthreads();
  if (threadIdx.y != 0 || col >= hidden) return;
  for (int s = 1; s < kSlices; ++s) {
    sw += slice_w[s][threadIdx.x];
    sb += slice_b[s][threadIdx.x];
  }
  grad_weight[col] = detail::from_float<W>(sw);
  grad_bias[col] = detail::from_float<W>(sb);
}

template <typename T, typename W>
struct LayerNormLaunch {
  const T* x;
  const W* weight;
  const W* bias;
  T* y;
  float* mean;
  float* rstd;
  int64_t rows;
  int hidden;
  float eps;
  // backward only
  const T* dy;
  T* dx;
  W* grad_weight;
  W* grad_bias;
  float* partials;
  cudaStream_t stream;

  template <int kN, int kVec>
  cudaError_t forward() const {
    const int64_t blocks = (rows + kWarpsPerBlock - 1) / kWarpsPerBlock;
    if (blocks > INT_MAX) return cudaErrorInvalidValue;
    const dim3 grid(static_cast<unsigned>(blocks)), block(32 * kWarpsPerBlock);
    if constexpr (kN == 0) {
      layer_norm_forward_looped<T, W><<<grid, block, 0, stream>>>(x, weight, bias, y, mean, rstd,
                                                                  rows, hidden, eps);
    } else {
      layer_norm_forward_cached<T, W, kN, kVec><<<grid, block, 0, stream>>>(
          x, weight, bias, y, mean, rstd, rows, hidden, eps);
    }
    return cudaGetLastError();
  }

  template <int kN, int kVec>
  cudaError_t backward() const {
    const int warps = layer_norm_backward_partials(rows);
    const dim3 grid((warps + kWarpsPerBlock - 1) / kWarpsPerBlock), block(32 * kWarpsPerBlock);
    if constexpr (kN == 0 || kN > kMaxCachedPerLaneBackward) {
      layer_norm_backward_looped<T, W><<<grid, block, 0, stream>>>(dy, x, weight, mean, rstd, dx,
                                                                   partials, rows, hidden, warps);
    } else {
      layer_norm_backward_cached<T, W, kN, kVec><<<grid, block, 0, stream>>>(
          dy, x, weight, mean, rstd, dx, partials, rows, hidden, warps);
    }
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
    const dim3 reduce_grid((hidden + 31) / 32), reduce_block(32, 16);
    layer_norm_reduce_partials<W><<<reduce_grid, reduce_block, 0, stream>>>(
        partials, grad_weight, grad_bias, hidden, warps);
    return cudaGetLastError();
  }

  template <int kN, int kVec>
  cudaError_t run(bool backward_pass) const {
    return backward_pass ? backward<kN, kVec>() : forward<kN, kVec>();
  }
};

// Values per lane: the smallest class holding the row, or 0 (looped) above 2048 (backward:
// the classes above kMaxCachedPerLaneBackward run looped too).
template <typename Launch, int kVec>
cudaError_t dispatch_hidden(const Launch& l, bool backward_pass) {
  const int per_lane = (l.hidden + 31) / 32;
  if constexpr (kVec <= 4) {
    if (per_lane <= 4) return l.template run<4, kVec>(backward_pass);
  }
  if (per_lane <= 8) return l.template run<8, kVec>(backward_pass);
  if (per_lane <= 16) return l.template run<16, kVec>(backward_pass);
  if (per_lane <= 32) return l.template run<32, kVec>(backward_pass);
  if (per_lane <= kMaxCachedPerLane) return l.template run<kMaxCachedPerLane, kVec>(backward_pass);
  return l.template run<0, 1>(backward_pass);
}

template <typename T, typename W>
cudaError_t run_layer_norm(const LayerNormLaunch<T, W>& l, bool vec, bool backward_pass) {
  constexpr int kVec = 16 / (sizeof(T) > sizeof(W) ? sizeof(T) : sizeof(W));
  if (vec && l.hidden % kVec == 0) {
    return dispatch_hidden<LayerNormLaunch<T, W>, kVec>(l, backward_pass);
  }
  return dispatch_hidden<LayerNormLaunch<T, W>, 1>(l, backward_pass);
}

}  // namespace

int layer_norm_backward_partials(int64_t rows) {
  return static_cast<int>(rows < kMaxPartials ? (rows > 0 ? rows : 1) : kMaxPartials);
}

cudaError_t layer_norm_forward(DType dtype, DType param_dtype, const void* input,
                               const void* weight, const void* bias, void* output, float* mean,
                               float* rstd, int64_t rows, int hidden, float eps,
                               cudaStream_t stream) {
  if (rows < 0 || hidden < 1) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  const bool vec = detail::aligned16(input) && detail::aligned16(output) &&
                   detail::aligned16(weight) && detail::aligned16(bias);
  return dispatch_types(dtype, param_dtype, [&](auto t, auto w) {
    using T = decltype(t);
    using W = decltype(w);
    LayerNormLaunch<T, W> l{};
    l.x = static_cast<const T*>(input);
    l.weight = static_cast<const W*>(weight);
    l.bias = static_cast<const W*>(bias);
    l.y = static_cast<T*>(output);
    l.mean = mean;
    l.rstd = rstd;
    l.rows = rows;
    l.hidden = hidden;
    l.eps = eps;
    l.stream = stream;
    return run_layer_norm(l, vec, false);
  });
}

cudaError_t layer_norm_backward(DType dtype, DType param_dtype, const void* grad_output,
                                const void* input, const void* weight, const float* mean,
                                const float* rstd, void* grad_input, void* grad_weight,
                                void* grad_bias, float* workspace, int64_t rows, int hidden,
                                cudaStream_t stream) {
  if (rows < 0 || hidden < 1) return cudaErrorInvalidValue;
  const bool vec = detail::aligned16(grad_output) && detail::aligned16(input) &&
                   detail::aligned16(weight) && detail::aligned16(grad_input);
  return dispatch_types(dtype, param_dtype, [&](auto t, auto w) {
    using T = decltype(t);
    using W = decltype(w);
    if (rows == 0) {  // no rows: zero weight/bias grads
      cudaError_t err = cudaMemsetAsync(grad_weight, 0, sizeof(W) * hidden, stream);
      return err != cudaSuccess ? err : cudaMemsetAsync(grad_bias, 0, sizeof(W) * hidden, stream);
    }
    LayerNormLaunch<T, W> l{};
    l.x = static_cast<const T*>(input);
    l.weight = static_cast<const W*>(weight);
    l.mean = const_cast<float*>(mean);
    l.rstd = const_cast<float*>(rstd);
    l.rows = rows;
    l.hidden = hidden;
    l.dy = static_cast<const T*>(grad_output);
    l.dx = static_cast<T*>(grad_input);
    l.grad_weight = static_cast<W*>(grad_weight);
    l.grad_bias = static_cast<W*>(grad_bias);
    l.partials = workspace;
    l.stream = stream;
    return run_layer_norm(l, vec, true);
  });
}

}  // namespace app_kernels
