"""Fused ops of the GPT-2 model; each picks its implementation and says which, once, in the log.

    op                 fused implementation (CUDA inputs, flag on)      fallback
    attention          SDPA (causal; auto/flash; ALiBi bias) or          -
                       q k^T + softmax op
    causal softmax     csrc kernel (s_k <= 16384)                        PyTorch, fp32 arithmetic
    masked softmax     csrc kernel (bool mask [b|1, 1, s_q, s_k])        PyTorch, fp32 arithmetic
    layer_norm         csrc kernel, fp32 statistics                      F.layer_norm
    rms_norm           csrc kernel, fp32 statistics                      fp32 PyTorch formula
    cross_entropy      csrc kernel, no fp32 copy of the logits           fp32 logits + PyTorch
    bias_gelu          torch.compile'd gelu(x + b)                       eager
    bias_dropout_add   torch.compile'd r + mask * (x + b) / (1 - p)      eager
    swiglu             torch.compile'd silu(gate) * up                   eager

Every fallback is the reference the kernels are tested against; fused and fallback agree to
rounding. The first call of each op logs "<op>: <implementation> (<why>)" - why the kernel is
not used (flag off, no CUDA, build failed: first error line, shape over the limit) or what runs.
Model code calls only these functions; it never sees CUDA, the kernel library or torch.compile.

Inside code that torch.compile traces (a compiled transformer layer, --compile-layers) every op
takes its PyTorch path and logs nothing: the compiler fuses that path itself, and neither the
csrc/ kernels (no fake-tensor implementation) nor a log call may break the layer's graph.
"""
from __future__ import annotations

import logging
import math
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from app.config import ATTENTION_BACKENDS
from app.config.model import EXPLICIT_ATTENTION
from app.kernels import library as kernel_library
from app.kernels import ops as kernel_ops
from app.mpu import cross_entropy as mpu_ce

logger = logging.getLogger(__name__)

_CHOICES: Dict[str, Tuple[str, str]] = {}


def _tracing() -> bool:
    """True while torch.compile traces the caller (the op then takes its PyTorch path)."""
    return torch.compiler.is_compiling()


def _announce(op: str, implementation: str, why: str) -> None:
    """Log "<op>: <implementation> (<why>)" the first time this choice is made for `op`
    (never while torch.compile traces: a log call would break the graph)."""
    if _tracing():
        return
    if _CHOICES.get(op) != (implementation, why):
        _CHOICES[op] = (implementation, why)
        logger.info("%s: %s (%s)", op, implementation, why)


def selections() -> Dict[str, Tuple[str, str]]:
    """The latest (implementation, why) chosen per op in this process."""
    return dict(_CHOICES)


def reset_selections() -> None:
    """Forget the choices made so far (each op announces again on its next call); for
    benchmarks and tests that compare settings in one process."""
    _CHOICES.clear()
    _SDPA_SEEN.clear()


def _use_kernel(op: str, enabled: bool, flag: str, x: torch.Tensor,
                unsupported: Optional[str]) -> bool:
    """True when the csrc kernel should run for `op`; otherwise announces why PyTorch runs.
    False while torch.compile traces (the compiler fuses the PyTorch path)."""
    if _tracing():
        return False
    if not enabled:
        _announce(op, "PyTorch", f"{flag} off")
        return False
    if not x.is_cuda:
        _announce(op, "PyTorch", "no CUDA" if not torch.cuda.is_available() else "CPU tensors")
        return False
    if unsupported is not None:
        _announce(op, "PyTorch", unsupported)
        return False
    status = kernel_library.status()
    if not status.available:
        _announce(op, "PyTorch", status.reason)
        return False
    _announce(op, "CUDA kernel", "csrc/")
    return True


# ---- torch.compile'd elementwise fusions (CUDA only) -------------------------------------------
_COMPILED: Dict[str, Callable] = {}
_COMPILE_FAILED: Dict[str, str] = {}


def _compiled_call(op: str, fn: Callable, *args):
    """fn(*args) through torch.compile, or None when compiling failed (then never retried)."""
    if op in _COMPILE_FAILED:
        return None
    compiled = _COMPILED.get(op)
    if compiled is None:
        compiled = _COMPILED[op] = torch.compile(fn, fullgraph=True)
    try:
        return compiled(*args)
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception as err:  # noqa: BLE001 - e.g. no working Triton: fall back to eager
        _COMPILE_FAILED[op] = f"torch.compile failed: {str(err).strip().splitlines()[0][:200]}"
        logger.warning("%s: %s; using eager PyTorch", op, _COMPILE_FAILED[op])
        return None


def _use_compiled(op: str, enabled: bool, flag: str, x: torch.Tensor) -> bool:
    """True when `op` should run through its own torch.compile'd function (never inside code
    that is already being compiled: its eager path is traced there)."""
    if _tracing():
        return False
    if not enabled:
        _announce(op, "PyTorch eager", f"{flag} off")
    elif not x.is_cuda:
        _announce(op, "PyTorch eager", "CPU tensors: torch.compile is used on CUDA only")
    elif op in _COMPILE_FAILED:
        _announce(op, "PyTorch eager", _COMPILE_FAILED[op])
    else:
        _announce(op, "torch.compile", "fused elementwise")
        return True
    return False


def gelu(x: torch.Tensor, openai_gelu: bool = False) -> torch.Tensor:
    """GeLU: exact `x * Phi(x)` (erf), or GPT-2's tanh approximation when `openai_gelu`."""
    return F.gelu(x, approximate="tanh" if openai_gelu else "none")


def _bias_gelu_exact(bias: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x + bias)


def _bias_gelu_tanh(bias: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x + bias, approximate="tanh")


def bias_gelu_fusion_applies(fusion: bool) -> bool:
    """Whether a model built now should hand its MLP bias to `bias_gelu` (skip_bias_add).

    Only where the compiled fusion can run (CUDA); on CPU the bias stays inside the GEMM
    (addmm), which is cheaper there than a separate add.
    """
    return fusion and torch.cuda.is_available()


def bias_gelu(bias: Optional[torch.Tensor], x: torch.Tensor, openai_gelu: bool = False,
              fusion: bool = True) -> torch.Tensor:
    """gelu(x + bias), `bias` broadcast over the last dimension (None means no bias). Shape of x.

    `fusion` (--bias-gelu-fusion) compiles it into one kernel for CUDA inputs; backward then
    recomputes x + bias instead of storing it.
    """
    if bias is None:
        _announce("bias_gelu", "PyTorch eager", "--bias-gelu-fusion off" if not fusion
                  else "no CUDA: the bias stays inside the GEMM")
    elif _use_compiled("bias_gelu", fusion, "--bias-gelu-fusion", x):
        out = _compiled_call("bias_gelu", _bias_gelu_tanh if openai_gelu else _bias_gelu_exact,
                             bias, x)
        if out is not None:
            return out
    if bias is not None:
        x = x + bias
    return gelu(x, openai_gelu)


def _bias_dropout_add(x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor,
                      keep: torch.Tensor, inv_keep_prob: float) -> torch.Tensor:
    return residual + (x + bias) * keep * inv_keep_prob


def _bias_add(x: torch.Tensor, bias: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    return residual + (x + bias)


def bias_dropout_add(x: torch.Tensor, bias: Optional[torch.Tensor], residual: torch.Tensor,
                     p: float, training: bool, fusion: bool = True) -> torch.Tensor:
    """residual + dropout(x + bias, p) (no dropout when not training or p == 0). Shape of x.

    With `fusion` (--bias-dropout-fusion) on CUDA the arithmetic is one compiled kernel and the
    keep-mask is drawn with `bernoulli_` from the default generator, outside the compiled code,
    so activation checkpointing (which restores the generator) recomputes the same mask.
    """
    dropout = training and p > 0.0
    if bias is not None and _use_compiled("bias_dropout_add", fusion, "--bias-dropout-fusion", x):
        if dropout:
            keep = torch.empty_like(x, dtype=torch.bool).bernoulli_(1.0 - p)  # [*x.shape]
            out = _compiled_call("bias_dropout_add", _bias_dropout_add, x, bias, residual, keep,
                                 1.0 / (1.0 - p))
        else:
            out = _compiled_call("bias_add", _bias_add, x, bias, residual)
        if out is not None:
            return out
    if bias is not None:
        x = x + bias
    return residual + (F.dropout(x, p, True) if dropout else x)


# ---- softmax and attention ---------------------------------------------------------------------
def _softmax_reference(scores: torch.Tensor, mask: Optional[torch.Tensor], scale: float,
                       softmax_in_fp32: bool) -> torch.Tensor:
    out_dtype = scores.dtype
    if softmax_in_fp32 and scores.dtype in (torch.float16, torch.bfloat16):
        scores = scores.float()
    scores = scores * scale
    if mask is not None:
        scores = scores.masked_fill(mask, torch.finfo(scores.dtype).min)
    return torch.softmax(scores, dim=-1).to(out_dtype)


def causal_mask(s_q: int, s_k: int, device: torch.device) -> torch.Tensor:
    """bool [s_q, s_k], True where key c is after query r (c > r + s_k - s_q): masked out."""
    return torch.ones(s_q, s_k, dtype=torch.bool, device=device).triu(s_k - s_q + 1)


def scale_mask_softmax(scores: torch.Tensor, mask: Optional[torch.Tensor], scale: float,
                       softmax_in_fp32: bool = True, use_kernel: bool = True) -> torch.Tensor:
    """softmax(scale * scores with masked positions removed) over the last dim; dtype of scores.

    scores: [b, heads, s_q, s_k]; mask: bool, broadcastable to scores, True = masked out (Megatron's
    convention), or None for no mask. Masked positions get the dtype's lowest value before the
    softmax, so they receive probability 0 exactly and a fully masked row gives a uniform row
    instead of NaN. With `softmax_in_fp32` half-precision scores are upcast for the softmax.
    `use_kernel` (--masked-softmax-fusion) allows the CUDA kernel (always fp32 arithmetic) when
    the mask is [b|1, 1, s_q, s_k].
    """
    if mask is not None and _use_kernel(
            "masked_softmax", use_kernel, "--masked-softmax-fusion", scores,
            kernel_ops.masked_softmax_unsupported(scores, mask)):
        return kernel_ops.masked_softmax(scores, mask, scale)
    return _softmax_reference(scores, mask, scale, softmax_in_fp32)


def scale_causal_softmax(scores: torch.Tensor, scale: float, softmax_in_fp32: bool = True,
                         use_kernel: bool = True) -> torch.Tensor:
    """softmax(scale * scores) over keys c <= r + s_k - s_q; [..., s_q, s_k], dtype of scores.

    `softmax_in_fp32`: half inputs are upcast for the PyTorch softmax (the kernel always works
    in fp32). `use_kernel` (--masked-softmax-fusion) allows the CUDA kernel up to s_k = 16384;
    above that, and elsewhere, PyTorch.
    """
    if _use_kernel("causal_softmax", use_kernel, "--masked-softmax-fusion", scores,
                   kernel_ops.causal_softmax_unsupported(scores)):
        return kernel_ops.causal_softmax(scores, scale)
    mask = causal_mask(scores.shape[-2], scores.shape[-1], scores.device)
    return _softmax_reference(scores, mask, scale, softmax_in_fp32)


def _sdpa_backend_name(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       dropout_p: float) -> str:
    """Which SDPA backend PyTorch picks for these inputs ("flash", "efficient", ...)."""
    try:
        choice = torch._fused_sdp_choice(q, k, v, None, dropout_p, True)  # private but stable
        return torch.nn.attention.SDPBackend(choice).name.lower()
    except Exception:  # noqa: BLE001 - only for the log line
        return "picked by PyTorch"


_SDPA_SEEN: set = set()


_SDPA_WHY = {"auto": "auto: faster than the fused softmax for causal attention",
             "flash": "--attention-backend flash / --use-flash-attn",
             "fused": "--attention-backend fused"}


def _announce_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float,
                   backend: str) -> None:
    """Announce SDPA with the backend PyTorch picks; computed once per kind of input."""
    if _tracing():
        return
    key = (backend, q.device.type, q.dtype, q.shape[-1], dropout_p > 0.0)
    if key in _SDPA_SEEN:
        return
    _SDPA_SEEN.add(key)
    if not q.is_cuda:
        _announce("attention", "SDPA", f"CPU tensors ({_SDPA_WHY[backend]})")
        return
    _announce("attention", "SDPA", f"{_SDPA_WHY[backend]}; backend "
              f"{_sdpa_backend_name(q, k, v, dropout_p)}")


def _sdpa_kernels(backend: str) -> list:
    """The SDPA kernels a backend restricts SDPA to on CUDA: flash = flash and memory-efficient
    (--use-flash-attn's meaning); fused = every fused kernel (flash, memory-efficient, cuDNN:
    Megatron's "fused" is Transformer Engine's cuDNN fused attention)."""
    from torch.nn.attention import SDPBackend
    kernels = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
    return kernels + ([SDPBackend.CUDNN_ATTENTION] if backend == "fused" else [])


def _sdpa_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float,
                 backend: str) -> torch.Tensor:
    _announce_sdpa(q, k, v, dropout_p, backend)
    grouped = k.shape[1] != q.shape[1]  # grouped-query attention: fewer key/value heads
    if backend in ("flash", "fused") and q.is_cuda:
        from torch.nn.attention import sdpa_kernel

        try:
            with sdpa_kernel(_sdpa_kernels(backend)):
                return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p,
                                                      is_causal=True, enable_gqa=grouped)
        except RuntimeError as err:  # e.g. a head size no fused kernel takes
            _announce("attention", "SDPA (any backend)", f"{_SDPA_WHY[backend]}, but its fused "
                      f"kernels refused these inputs: {str(err).splitlines()[0][:160]}")
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True,
                                          enable_gqa=grouped)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
              dropout_p: float, backend: str = "auto", softmax_fusion: bool = True,
              qk_coeff: float = 1.0, softmax_in_fp32: bool = True) -> torch.Tensor:
    """softmax(q k^T / sqrt(d), masked) v with dropout on the probabilities. [b, n, s, d] each.

    mask None is causal attention; otherwise bool [b|1, 1, s_q, s_k], True = masked out, or a
    float additive bias [b|1, n, s_q, s_k] (ALiBi, the masked positions already at the dtype's
    minimum), which always runs through SDPA's attn_mask (the softmax kernels take bool masks;
    app.config refuses ALiBi with the flash and local backends). k and v may have fewer heads
    than q (grouped-query attention: query head i reads key/value head i // (n_q / n_kv)).
    backend (--attention-backend, Megatron's names; --use-flash-attn means "flash"):
      auto    - causal through SDPA (the measured default; see docs/kernels.md), masks "local";
      flash   - causal through SDPA restricted to its flash/efficient kernels, masks "local";
      fused   - causal through SDPA restricted to its fused kernels (flash, efficient, cuDNN),
                masks "local";
      unfused - scores = q k^T, PyTorch's softmax (fp32 arithmetic), dropout, probs @ v;
      local   - Megatron's core attention: as unfused, with the fused (causal or masked)
                softmax kernel when `softmax_fusion` (--masked-softmax-fusion).
    On the local path `qk_coeff` n != 1 (--apply-query-key-layer-scaling) divides the scores
    by sqrt(d) * n and the softmax multiplies them back by n, in fp32; `softmax_in_fp32`
    (--attention-softmax-in-fp32) upcasts half scores for the PyTorch softmax.
    Dropout uses the current default generator (the caller forks the model-parallel stream).
    """
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend must be one of {ATTENTION_BACKENDS}, "
                         f"got {backend!r}")
    if mask is not None and mask.is_floating_point():
        _announce("attention", "SDPA with an additive bias", "ALiBi")
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                              enable_gqa=k.shape[1] != q.shape[1])
    if mask is None and backend not in EXPLICIT_ATTENTION:
        return _sdpa_causal(q, k, v, dropout_p, backend)
    if k.shape[1] != q.shape[1]:  # each key/value head serves n_q / n_kv consecutive queries
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    softmax_fusion = softmax_fusion and backend != "unfused"
    if mask is None:
        _announce("attention", "q k^T + causal softmax + @ v", f"--attention-backend {backend}")
    scores = torch.matmul(q, k.transpose(-2, -1))  # [b, n, s_q, s_k]
    if qk_coeff != 1.0:
        scores = scores / (math.sqrt(q.shape[-1]) * qk_coeff)
        scale, softmax_in_fp32 = qk_coeff, True
    else:
        scale = 1.0 / math.sqrt(q.shape[-1])
    if mask is None:
        probs = scale_causal_softmax(scores, scale, softmax_in_fp32,
                                     use_kernel=softmax_fusion)  # [b, n, s_q, s_k]
    else:
        probs = scale_mask_softmax(scores, mask, scale, softmax_in_fp32,
                                   use_kernel=softmax_fusion)
    if dropout_p > 0.0:
        probs = F.dropout(probs, dropout_p, True)
    return torch.matmul(probs, v)  # [b, n, s_q, d]


# ---- LayerNorm ---------------------------------------------------------------------------------
def layer_norm(x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor],
               eps: float, use_kernel: bool = True) -> torch.Tensor:
    """LayerNorm over the last dim with fp32 statistics; output in x's dtype.

    weight/bias may be fp32 while x is fp16/bf16 (Megatron's mixed-precision LayerNorm).
    `use_kernel` (--layernorm-fusion) allows the CUDA kernel; the fallback is F.layer_norm, on
    fp32 copies of x, weight and bias unless all are fp32 (Megatron's MixedFusedLayerNorm
    numerics: statistics and affine transform in fp32, one rounding of the output).
    """
    if _use_kernel("layer_norm", use_kernel, "--layernorm-fusion", x,
                   kernel_ops.layer_norm_unsupported(x, weight, bias)):
        return kernel_ops.layer_norm(x, weight, bias, eps)
    shape = (x.shape[-1],)
    if x.dtype == torch.float32 and all(t is None or t.dtype == torch.float32
                                        for t in (weight, bias)):
        return F.layer_norm(x, shape, weight, bias, eps)
    weight32 = weight.float() if weight is not None else None
    bias32 = bias.float() if bias is not None else None
    return F.layer_norm(x.float(), shape, weight32, bias32, eps).to(x.dtype)


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm (same parameters and names) whose forward is `layer_norm` above."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, dtype: Optional[torch.dtype] = None,
                 use_kernel: bool = True) -> None:
        super().__init__(hidden_size, eps=eps, dtype=dtype)
        self.use_kernel = use_kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.weight, self.bias, self.eps, self.use_kernel)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             use_kernel: bool = True) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) * weight over the last dim, fp32 arithmetic, x's dtype out.

    `weight` may be fp32 while x is fp16/bf16. `use_kernel` (--layernorm-fusion) allows the
    CUDA kernel; the fallback is the formula on fp32 copies (one rounding of the output).
    """
    if _use_kernel("rms_norm", use_kernel, "--layernorm-fusion", x,
                   kernel_ops.rms_norm_unsupported(x, weight)):
        return kernel_ops.rms_norm(x, weight, eps)
    if _tracing():  # the compiler fuses the formula and picks what to keep for backward
        x32 = x.to(_acc(x))
        return (x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
                * weight.to(_acc(x))).to(x.dtype)
    return _RMSNormFunction.apply(x, weight, eps)


def _acc(x: torch.Tensor) -> torch.dtype:
    """The arithmetic dtype for x: fp32, or fp64 for fp64 inputs."""
    return torch.promote_types(x.dtype, torch.float32)


class _RMSNormFunction(torch.autograd.Function):
    """The PyTorch RMSNorm in fp32 keeping only x and 1/rms [..., 1] for backward (what the
    kernel keeps; autograd through the formula would keep two [..., h] fp32 copies)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x32 = x.to(_acc(x))
        rstd = torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)  # [..., 1]
        ctx.save_for_backward(x, weight, rstd)
        return (x32 * rstd * weight.to(_acc(x))).to(x.dtype)

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        xhat = x.to(_acc(x)) * rstd  # [..., h]
        gw = grad_y.to(_acc(x)) * weight.to(_acc(x))
        # d/dx of w x r, r = (mean(x^2) + eps)^-1/2: r (g w - xhat mean(g w xhat))
        grad_x = rstd * (gw - xhat * (gw * xhat).mean(dim=-1, keepdim=True))
        grad_w = (grad_y.to(_acc(x)) * xhat).reshape(-1, x.shape[-1]).sum(dim=0)
        return grad_x.to(x.dtype), grad_w.to(weight.dtype), None


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm (one `weight`, Megatron's RMSNorm) whose forward is `rms_norm` above."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, dtype: Optional[torch.dtype] = None,
                 use_kernel: bool = True) -> None:
        super().__init__(hidden_size, eps=eps, dtype=dtype)
        self.use_kernel = use_kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.use_kernel)


def norm(normalization: str, width: int, eps: float, dtype: Optional[torch.dtype] = None,
         use_kernel: bool = True) -> nn.Module:
    """A `LayerNorm` or `RMSNorm` (--normalization) over `width` channels, weight 1 (bias 0)."""
    if normalization == "RMSNorm":
        return RMSNorm(width, eps=eps, dtype=dtype, use_kernel=use_kernel)
    if normalization == "LayerNorm":
        return LayerNorm(width, eps=eps, dtype=dtype, use_kernel=use_kernel)
    raise ValueError(f"normalization must be LayerNorm or RMSNorm, got {normalization!r}")


# ---- SwiGLU ------------------------------------------------------------------------------------
def _swiglu(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)  # [..., f] each
    return F.silu(gate) * up


class _SwiGLUFunction(torch.autograd.Function):
    """silu(gate) * up keeping only its input for backward (Megatron's SwiGLUFunction): the
    [..., f] silu(gate) is recomputed instead of stored."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return _swiglu(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (x,) = ctx.saved_tensors
        gate, up = x.chunk(2, dim=-1)
        sig = torch.sigmoid(gate)
        silu = gate * sig
        d_gate = grad * up * sig * (1 + gate * (1 - sig))  # silu'(g) = s (1 + g (1 - s))
        return torch.cat((d_gate, grad * silu), dim=-1)


def swiglu(x: torch.Tensor, fusion: bool = True) -> torch.Tensor:
    """silu(gate) * up for x = [gate, up] along the last dim ([..., 2f] -> [..., f]).

    `fusion` (--bias-swiglu-fusion) compiles it into one kernel for CUDA inputs (no [..., f]
    intermediates kept for backward beyond x).
    """
    if _use_compiled("swiglu", fusion, "--bias-swiglu-fusion", x):
        out = _compiled_call("swiglu", _swiglu, x)
        if out is not None:
            return out
    return _swiglu(x) if _tracing() else _SwiGLUFunction.apply(x)


# ---- cross entropy -----------------------------------------------------------------------------
def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, parallel_state,
                  use_kernel: bool = True, in_fp32: bool = True) -> torch.Tensor:
    """Per-token fp32 cross-entropy of vocab-split logits [b, s, V/tp] against labels [b, s].

    Kernel (--cross-entropy-loss-fusion, CUDA): one pass over the logits in their own dtype per
    direction, the same two all-reduces across tensor-parallel ranks as the fallback (max
    [b, s], then [2, b, s]), no fp32 [b, s, V/tp] copy.
    Fallback: the logits in fp32 (their own dtype when not `in_fp32`: --fp16-lm-cross-entropy),
    then PyTorch's row-fused F.cross_entropy at one tensor-parallel rank, else
    `vocab_parallel_cross_entropy`; the loss is fp32 either way.
    """
    if _use_kernel("cross_entropy", use_kernel, "--cross-entropy-loss-fusion", logits,
                   kernel_ops.cross_entropy_unsupported(logits)):
        return mpu_ce.fused_vocab_parallel_cross_entropy(logits, labels, parallel_state,
                                                         kernel_ops.cross_entropy_stats,
                                                         kernel_ops.cross_entropy_grad)
    if in_fp32:
        logits = logits.float()
    if parallel_state.tensor_model_parallel_size == 1:
        b, s, vocab = logits.shape
        return F.cross_entropy(logits.view(b * s, vocab), labels.reshape(b * s),
                               reduction="none").view(b, s).float()
    return mpu_ce.vocab_parallel_cross_entropy(logits, labels, parallel_state).float()
