// Torch-free C++ API of the fused kernels: pointers, sizes and a stream in, a CUDA status out.
//
// The .cu files implement these launchers with <cuda_fp16.h>/<cuda_bf16.h> only, so each one
// compiles with a bare `nvcc -c` in seconds; binding.cpp is the only file that sees torch. Every
// tensor is dense row-major (contiguous); `dtype` names the element type of the activations.
// A launcher returns cudaErrorInvalidValue for sizes it does not handle (the binding checks them
// first, so that is a bug) and otherwise the status of the launch.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace app_kernels {

enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// Longest softmax row (s_k) the softmax kernels take; the Python ops fall back above it.
constexpr int kMaxSoftmaxLength = 16384;

// ---- softmax over the last dim of scores [rows, s_k], rows = batch * heads * s_q --------------
// y = softmax(scale * x) with row r (query q = r % s_q) seeing only columns c <= q + s_k - s_q.
// Requires 1 <= s_q <= s_k <= kMaxSoftmaxLength. Masked columns get y = 0.
cudaError_t causal_softmax_forward(DType dtype, const void* input, void* output, float scale,
                                   int64_t rows, int s_q, int s_k, cudaStream_t stream);

// y = softmax(scale * x masked) with mask [mask_batches, 1, s_q, s_k] (nonzero = masked out);
// rows = batch * heads * s_q, mask_batches is 1 (broadcast) or batch. A fully masked row gives
// the uniform row 1/s_k (what PyTorch's masked_fill(lowest) + softmax gives).
cudaError_t masked_softmax_forward(DType dtype, const void* input, const uint8_t* mask,
                                   void* output, float scale, int64_t rows, int heads, int s_q,
                                   int s_k, int mask_batches, cudaStream_t stream);

// dx = scale * y * (dy - sum_c dy * y), zero at masked positions. `mask` null and causal false:
// no mask; causal true: the causal pattern of causal_softmax_forward; otherwise the explicit mask.
cudaError_t softmax_backward(DType dtype, const void* grad_output, const void* output,
                             const uint8_t* mask, void* grad_input, float scale, int64_t rows,
                             int heads, int s_q, int s_k, int mask_batches, bool causal,
                             cudaStream_t stream);

// ---- LayerNorm over the last dim of x [rows, hidden] with fp32 statistics ---------------------
// y = (x - mean) * rstd * weight + bias, rstd = 1 / sqrt(var + eps) (biased var), y in x's dtype.
// weight/bias are `param_dtype` (x's dtype or fp32). mean/rstd: fp32 [rows], saved for backward.
cudaError_t layer_norm_forward(DType dtype, DType param_dtype, const void* input,
                               const void* weight, const void* bias, void* output, float* mean,
                               float* rstd, int64_t rows, int hidden, float eps,
                               cudaStream_t stream);

// Number of fp32 [hidden] partial rows layer_norm_backward needs in `workspace` (times 2).
int layer_norm_backward_partials(int64_t rows);

// dx (x's dtype), dweight and dbias (param_dtype) of layer_norm_forward. `workspace` holds
// 2 * layer_norm_backward_partials(rows) * hidden floats; the reduction order is fixed, so the
// result is the same from run to run.
cudaError_t layer_norm_backward(DType dtype, DType param_dtype, const void* grad_output,
                                const void* input, const void* weight, const float* mean,
                                const float* rstd, void* grad_input, void* grad_weight,
                                void* grad_bias, float* workspace, int64_t rows, int hidden,
                                cudaStream_t stream);

// ---- RMSNorm over the last dim of x [rows, hidden] with fp32 statistics -----------------------
// y = x * rstd * weight, rstd = 1 / sqrt(mean(x^2) + eps), y in x's dtype; weight is
// `param_dtype` (x's dtype or fp32). rstd: fp32 [rows], saved for backward.
cudaError_t rms_norm_forward(DType dtype, DType param_dtype, const void* input,
                             const void* weight, void* output, float* rstd, int64_t rows,
                             int hidden, float eps, cudaStream_t stream);

// Number of fp32 [hidden] partial rows rms_norm_backward needs in `workspace`.
int rms_norm_backward_partials(int64_t rows);

// dx (x's dtype) and dweight (param_dtype) of rms_norm_forward; `workspace` holds
// rms_norm_backward_partials(rows) * hidden floats; fixed reduction order (same bits each run).
cudaError_t rms_norm_backward(DType dtype, DType param_dtype, const void* grad_output,
                              const void* input, const void* weight, const float* rstd,
                              void* grad_input, void* grad_weight, float* workspace,
                              int64_t rows, int hidden, cudaStream_t stream);

// ---- cross entropy over a vocabulary slice of logits [rows, vocab] ----------------------------
// One pass over the logits in their own dtype (no fp32 copy): per row the slice's max m, the
// sum of exp(z - m), and the target's logit when target - vocab_start lies in [0, vocab)
// (else 0). Targets are global ids (int64). Outputs are fp32 [rows].
cudaError_t cross_entropy_stats(DType dtype, const void* logits, const int64_t* target,
                                float* row_max, float* sum_exp, float* target_logit,
                                int64_t rows, int vocab, int64_t vocab_start,
                                cudaStream_t stream);

// grad = (exp(z - logsumexp) - onehot(target - vocab_start)) * grad_loss, in the logits' dtype.
// logsumexp and grad_loss are fp32 [rows].
cudaError_t cross_entropy_backward(DType dtype, const void* logits, const int64_t* target,
                                   const float* logsumexp, const float* grad_loss,
                                   void* grad_logits, int64_t rows, int vocab,
                                   int64_t vocab_start, cudaStream_t stream);

}  // namespace app_kernels
