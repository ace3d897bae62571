// Torch glue for the kernels in kernels.h: registers them as torch.ops.app_kernels.* (CUDA).
//
// The only translation unit that includes torch headers. Each op checks device, dtype, layout
// and shape with a message naming the argument, allocates the outputs, and launches on the
// current stream of the input's device. Autograd lives in Python (app/kernels/ops.py).
#include <optional>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "kernels.h"

namespace {

using app_kernels::DType;

DType dtype_of(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return DType::kFloat32;
    case at::kHalf:
      return DType::kFloat16;
    case at::kBFloat16:
      return DType::kBFloat16;
    default:
      TORCH_CHECK(false, name, " must be float32, float16 or bfloat16, got ", t.scalar_type());
  }
}

void check_tensor(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

void check_launch(cudaError_t err, const char* op) {
  TORCH_CHECK(err == cudaSuccess, "app_kernels::", op, " failed: ", cudaGetErrorString(err));
}

void check_same(const at::Tensor& a, const at::Tensor& b, const char* name_a, const char* name_b) {
  TORCH_CHECK(a.sizes() == b.sizes(), name_a, " ", a.sizes(), " and ", name_b, " ", b.sizes(),
              " must have the same shape");
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), name_a, " and ", name_b,
              " must have the same dtype");
}

cudaStream_t stream_of(const at::Tensor& t) {
  return c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
}

// Scores [..., s_q, s_k] (contiguous): returns (rows, s_q, s_k) after checking the kernel limits.
std::tuple<int64_t, int, int> softmax_shape(const at::Tensor& scores) {
  TORCH_CHECK(scores.dim() >= 2, "scores must be [..., s_q, s_k], got ", scores.sizes());
  const int64_t s_q = scores.size(-2), s_k = scores.size(-1);
  TORCH_CHECK(s_k >= 1 && s_k <= app_kernels::kMaxSoftmaxLength, "scores' last dim (", s_k,
              ") must be in [1, ", app_kernels::kMaxSoftmaxLength, "]");
  TORCH_CHECK(s_q >= 1, "scores need at least one query row");
  return {scores.numel() / s_k, static_cast<int>(s_q), static_cast<int>(s_k)};
}

// mask [1 or b, 1, s_q, s_k] bool for scores [b, heads, s_q, s_k]: returns mask_batches.
int check_mask(const at::Tensor& mask, const at::Tensor& scores) {
  check_tensor(mask, "mask");
  TORCH_CHECK(mask.scalar_type() == at::kBool || mask.scalar_type() == at::kByte,
              "mask must be bool, got ", mask.scalar_type());
  TORCH_CHECK(scores.dim() == 4, "scores must be [b, heads, s_q, s_k], got ", scores.sizes());
  TORCH_CHECK(mask.dim() == 4 && mask.size(1) == 1 && mask.size(2) == scores.size(2) &&
                  mask.size(3) == scores.size(3) &&
                  (mask.size(0) == 1 || mask.size(0) == scores.size(0)),
              "mask must be [1 or ", scores.size(0), ", 1, ", scores.size(2), ", ",
              scores.size(3), "], got ", mask.sizes());
  return static_cast<int>(mask.size(0));
}

at::Tensor causal_softmax_forward(const at::Tensor& input, double scale) {
  check_tensor(input, "input");
  const auto [rows, s_q, s_k] = softmax_shape(input);
  TORCH_CHECK(s_q <= s_k, "causal softmax needs s_q (", s_q, ") <= s_k (", s_k, ")");
  const c10::cuda::CUDAGuard guard(input.device());
  at::Tensor output = at::empty_like(input);
  check_launch(app_kernels::causal_softmax_forward(dtype_of(input, "input"), input.data_ptr(),
                                                   output.data_ptr(), static_cast<float>(scale),
                                                   rows, s_q, s_k, stream_of(input)),
               "causal_softmax_forward");
  return output;
}

at::Tensor masked_softmax_forward(const at::Tensor& input, const at::Tensor& mask, double scale) {
  check_tensor(input, "input");
  const auto [rows, s_q, s_k] = softmax_shape(input);
  const int mask_batches = check_mask(mask, input);
  const c10::cuda::CUDAGuard guard(input.device());
  at::Tensor output = at::empty_like(input);
  check_launch(app_kernels::masked_softmax_forward(
                   dtype_of(input, "input"), input.data_ptr(),
                   static_cast<const uint8_t*>(mask.data_ptr()), output.data_ptr(),
                   static_cast<float>(scale), rows, static_cast<int>(input.size(1)), s_q, s_k,
                   mask_batches, stream_of(input)),
               "masked_softmax_forward");
  return output;
}

at::Tensor softmax_backward(const at::Tensor& grad_output, const at::Tensor& output,
                            const std::optional<at::Tensor>& mask, double scale, bool causal) {
  check_tensor(grad_output, "grad_output");
  check_tensor(output, "output");
  check_same(grad_output, output, "grad_output", "output");
  const auto [rows, s_q, s_k] = softmax_shape(output);
  int heads = 1, mask_batches = 1;
  const uint8_t* mask_ptr = nullptr;
  if (mask.has_value()) {
    TORCH_CHECK(!causal, "softmax_backward takes a mask or causal, not both");
    mask_batches = check_mask(*mask, output);
    heads = static_cast<int>(output.size(1));
    mask_ptr = static_cast<const uint8_t*>(mask->data_ptr());
  }
  TORCH_CHECK(!causal || s_q <= s_k, "causal softmax needs s_q (", s_q, ") <= s_k (", s_k, ")");
  const c10::cuda::CUDAGuard guard(output.device());
  at::Tensor grad_input = at::empty_like(output);
  check_launch(app_kernels::softmax_backward(dtype_of(output, "output"), grad_output.data_ptr(),
                                             output.data_ptr(), mask_ptr, grad_input.data_ptr(),
                                             static_cast<float>(scale), rows, heads, s_q, s_k,
                                             mask_batches, causal, stream_of(output)),
               "softmax_backward");
  return grad_input;
}

// input [..., hidden]; weight and bias [hidden] in input's dtype or float32.
DType check_layer_norm_params(const at::Tensor& input, const at::Tensor& weight,
                              const at::Tensor& bias) {
  check_tensor(weight, "weight");
  check_tensor(bias, "bias");
  TORCH_CHECK(input.dim() >= 1 && weight.dim() == 1 && weight.size(0) == input.size(-1),
              "weight ", weight.sizes(), " must be [hidden] for input ", input.sizes());
  check_same(weight, bias, "weight", "bias");
  TORCH_CHECK(weight.scalar_type() == input.scalar_type() || weight.scalar_type() == at::kFloat,
              "weight must be float32 or the input's dtype (", input.scalar_type(), "), got ",
              weight.scalar_type());
  return dtype_of(weight, "weight");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_forward(const at::Tensor& input,
                                                                  const at::Tensor& weight,
                                                                  const at::Tensor& bias,
                                                                  double eps) {
  check_tensor(input, "input");
  const DType param_dtype = check_layer_norm_params(input, weight, bias);
  const int64_t hidden = input.size(-1), rows = input.numel() / std::max<int64_t>(hidden, 1);
  const c10::cuda::CUDAGuard guard(input.device());
  at::Tensor output = at::empty_like(input);
  const auto stats_options = input.options().dtype(at::kFloat);
  at::Tensor mean = at::empty({rows}, stats_options), rstd = at::empty({rows}, stats_options);
  check_launch(app_kernels::layer_norm_forward(
                   dtype_of(input, "input"), param_dtype, input.data_ptr(), weight.data_ptr(),
                   bias.data_ptr(), output.data_ptr(), mean.data_ptr<float>(),
                   rstd.data_ptr<float>(), rows, static_cast<int>(hidden),
                   static_cast<float>(eps), stream_of(input)),
               "layer_norm_forward");
  return {output, mean, rstd};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_backward(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight,
    const at::Tensor& mean, const at::Tensor& rstd) {
  check_tensor(grad_output, "grad_output");
  check_tensor(input, "input");
  check_same(grad_output, input, "grad_output", "input");
  const DType param_dtype = check_layer_norm_params(input, weight, weight);
  const int64_t hidden = input.size(-1), rows = input.numel() / std::max<int64_t>(hidden, 1);
  for (const at::Tensor* stat : {&mean, &rstd}) {
    check_tensor(*stat, "mean/rstd");
    TORCH_CHECK(stat->scalar_type() == at::kFloat && stat->numel() == rows,
                "mean/rstd must be float32 [", rows, "]");
  }
  const c10::cuda::CUDAGuard guard(input.device());
  at::Tensor grad_input = at::empty_like(input);
  at::Tensor grad_weight = at::empty_like(weight), grad_bias = at::empty_like(weight);
  const int partials = app_kernels::layer_norm_backward_partials(rows);
  at::Tensor workspace = at::empty({2 * partials, hidden}, input.options().dtype(at::kFloat));
  check_launch(app_kernels::layer_norm_backward(
                   dtype_of(input, "input"), param_dtype, grad_output.data_ptr(),
                   input.data_ptr(), weight.data_ptr(), mean.data_ptr<float>(),
                   rstd.data_ptr<float>(), grad_input.data_ptr(), grad_weight.data_ptr(),
                   grad_bias.data_ptr(), workspace.data_ptr<float>(), rows,
                   static_cast<int>(hidden), stream_of(input)),
               "layer_norm_backward");
  return {grad_input, grad_weight, grad_bias};
}

// input [..., hidden]; weight [hidden] in input's dtype or float32.
DType check_rms_norm_weight(const at::Tensor& input, const at::Tensor& weight) {
  check_tensor(weight, "weight");
  TORCH_CHECK(input.dim() >= 1 && weight.dim() == 1 && weight.size(0) == input.size(-1),
              "weight ", weight.sizes(), " must be [hidden] for input ", input.sizes());
  TORCH_CHECK(weight.scalar_type() == input.scalar_type() || weight.scalar_type() == at::kFloat,
              "weight must be float32 or the input's dtype (", input.scalar_type(), "), got ",
              weight.scalar_type());
  return dtype_of(weight, "weight");
}

std::tuple<at::Tensor, at::Tensor> rms_norm_forward(const at::Tensor& input,
                                                    const at::Tensor& weight, double eps) {
  check_tensor(input, "input");
  const DType param_dtype = check_rms_norm_weight(input, weight);
  const int64_t hidden = input.size(-1), rows = input.numel() / std::max<int64_t>(hidden, 1);
  const c10::cuda::CUDAGuard guard(input.device());
  at::Tensor output = at::empty_like(input);
  at::Tensor rstd = at::empty({rows}, input.options().dtype(at::kFloat));
  check_launch(app_kernels::rms_norm_forward(dtype_of(input, "input"), param_dtype,
                                             input.data_ptr(), weight.data_ptr(),
                                             output.data_ptr(), rstd.data_ptr<float>(), rows,
                                             static_cast<int>(hidden), static_cast<float>(eps),
                                             stream_of(input)),
               "rms_norm_forward");
  return {output, rstd};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward(const at::Tensor& grad_output,
                                                     const at::Tensor& input,
                                                     const at::Tensor& weight,
                                                     const at::Tensor& rstd) {
  check_tensor(grad_output, "grad_output");
  check_tensor(input, "input");
  check_same(grad_output, input, "grad_output", "input");
  const DType param_dtype = check_rms_norm_weight(input, weight);
  const int64_t hidden = input.size(-1), rows = input.numel() / std::max<int64_t>(hidden, 1);
  check_tensor(rstd, "rstd");
  TORCH_CHECK(rstd.scalar_type() == at::kFloat && rstd.numel() == rows,
              "rstd must be float32 [", rows, "]");
  const c10::cuda::CUDAGuard guard(input.device());
  at::Tensor grad_input = at::empty_like(input), grad_weight = at::empty_like(weight);
  const int partials = app_kernels::rms_norm_backward_partials(rows);
  at::Tensor workspace = at::empty({partials, hidden}, input.options().dtype(at::kFloat));
  check_launch(app_kernels::rms_norm_backward(
                   dtype_of(input, "input"), param_dtype, grad_output.data_ptr(),
                   input.data_ptr(), weight.data_ptr(), rstd.data_ptr<float>(),
                   grad_input.data_ptr(), grad_weight.data_ptr(), workspace.data_ptr<float>(),
                   rows, static_cast<int>(hidden), stream_of(input)),
               "rms_norm_backward");
  return {grad_input, grad_weight};
}

// logits [..., vocab] and target [...] int64: returns (rows, vocab).
std::pair<int64_t, int> check_cross_entropy(const at::Tensor& logits, const at::Tensor& target) {
  check_tensor(logits, "logits");
  check_tensor(target, "target");
  TORCH_CHECK(target.scalar_type() == at::kLong, "target must be int64, got ",
              target.scalar_type());
  TORCH_CHECK(logits.dim() == target.dim() + 1 &&
                  logits.sizes().slice(0, target.dim()) == target.sizes(),
              "logits ", logits.sizes(), " must be target's shape ", target.sizes(),
              " plus a vocab dim");
  const int64_t vocab = logits.size(-1);
  TORCH_CHECK(vocab >= 1 && vocab <= INT32_MAX, "vocab dim ", vocab, " out of range");
  return {target.numel(), static_cast<int>(vocab)};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> cross_entropy_stats(const at::Tensor& logits,
                                                                   const at::Tensor& target,
                                                                   int64_t vocab_start) {
  const auto [rows, vocab] = check_cross_entropy(logits, target);
  const c10::cuda::CUDAGuard guard(logits.device());
  const auto options = logits.options().dtype(at::kFloat);
  at::Tensor row_max = at::empty(target.sizes(), options);
  at::Tensor sum_exp = at::empty(target.sizes(), options);
  at::Tensor target_logit = at::empty(target.sizes(), options);
  check_launch(app_kernels::cross_entropy_stats(
                   dtype_of(logits, "logits"), logits.data_ptr(), target.data_ptr<int64_t>(),
                   row_max.data_ptr<float>(), sum_exp.data_ptr<float>(),
                   target_logit.data_ptr<float>(), rows, vocab, vocab_start, stream_of(logits)),
               "cross_entropy_stats");
  return {row_max, sum_exp, target_logit};
}

at::Tensor cross_entropy_backward(const at::Tensor& grad_loss, const at::Tensor& logits,
                                  const at::Tensor& target, const at::Tensor& logsumexp,
                                  int64_t vocab_start) {
  const auto [rows, vocab] = check_cross_entropy(logits, target);
  for (const at::Tensor* t : {&grad_loss, &logsumexp}) {
    check_tensor(*t, "grad_loss/logsumexp");
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->sizes() == target.sizes(),
                "grad_loss and logsumexp must be float32 of target's shape ", target.sizes());
  }
  const c10::cuda::CUDAGuard guard(logits.device());
  at::Tensor grad = at::empty_like(logits);
  check_launch(app_kernels::cross_entropy_backward(
                   dtype_of(logits, "logits"), logits.data_ptr(), target.data_ptr<int64_t>(),
                   logsumexp.data_ptr<float>(), grad_loss.data_ptr<float>(), grad.data_ptr(),
                   rows, vocab, vocab_start, stream_of(logits)),
               "cross_entropy_backward");
  return grad;
}

}  // namespace

TORCH_LIBRARY(app_kernels, m) {
  m.def("causal_softmax_forward(Tensor input, float scale) -> Tensor");
  m.def("masked_softmax_forward(Tensor input, Tensor mask, float scale) -> Tensor");
  m.def(
      "softmax_backward(Tensor grad_output, Tensor output, Tensor? mask, float scale, "
      "bool causal) -> Tensor");
  m.def(
      "layer_norm_forward(Tensor input, Tensor weight, Tensor bias, float eps) "
      "-> (Tensor, Tensor, Tensor)");
  m.def(
      "layer_norm_backward(Tensor grad_output, Tensor input, Tensor weight, Tensor mean, "
      "Tensor rstd) -> (Tensor, Tensor, Tensor)");
  m.def("rms_norm_forward(Tensor input, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def(
      "rms_norm_backward(Tensor grad_output, Tensor input, Tensor weight, Tensor rstd) "
      "-> (Tensor, Tensor)");
  m.def(
      "cross_entropy_stats(Tensor logits, Tensor target, int vocab_start) "
      "-> (Tensor, Tensor, Tensor)");
  m.def(
      "cross_entropy_backward(Tensor grad_loss, Tensor logits, Tensor target, "
      "Tensor logsumexp, int vocab_start) -> Tensor");
}

TORCH_LIBRARY_IMPL(app_kernels, CUDA, m) {
  m.impl("causal_softmax_forward", &causal_softmax_forward);
  m.impl("masked_softmax_forward", &masked_softmax_forward);
  m.impl("softmax_backward", &softmax_backward);
  m.impl("layer_norm_forward", &layer_norm_forward);
  m.impl("layer_norm_backward", &layer_norm_backward);
  m.impl("rms_norm_forward", &rms_norm_forward);
  m.impl("rms_norm_backward", &rms_norm_backward);
  m.impl("cross_entropy_stats", &cross_entropy_stats);
  m.impl("cross_entropy_backward", &cross_entropy_backward);
}
