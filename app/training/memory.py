"""Per-rank memory estimate of a training run: model states and activations, from the config alone.

Pure arithmetic (no process group, no model built), used by the preflight check. Ψ is the
number of parameters a rank holds (its tensor-parallel shard of its pipeline stage; the first
and last stages also hold the word embeddings), N_d the data-parallel size.

Model states, bytes per rank (the ZeRO paper's accounting, Rajbhandari et al. 2020):

    fp32 (native, or DeepSpeed without ZeRO):  weights 4Ψ + gradients 4Ψ + Adam 8Ψ   = 16Ψ
    fp16/bf16 (mixed precision, K = 12):       weights 2Ψ + gradients 2Ψ + fp32 master 4Ψ
                                               + Adam 8Ψ                          = 16Ψ
    native fp16/bf16 steps fp32 main gradients: 4Ψ, plus the 2Ψ half gradients they are cast
    from unless gradients accumulate in fp32 (bf16, --accumulate-allreduce-grads-in-fp32)
    ZeRO-1: optimizer states (and the fp32 master partition DeepSpeed keeps, also in fp32
            runs) divided by N_d;  ZeRO-2: gradients too;  offload_optimizer: optimizer states
            and master weights on the host (0 on the device).  With contiguous_gradients
            (DeepSpeed's default) ZeRO-1/2 also allocate a reduce bucket of reduce_bucket_size
            elements (x2 with overlap_comm) in fp32 (ZeRO-1) or the gradients' dtype (ZeRO-2)
            during every backward, whatever the model's size.

Activations, bytes per micro-batch per transformer layer (Korthikanti et al. 2022, eq. 2 with
tensor parallelism t, generalised to an activation width of w bytes and dropout masks of
m = 1 byte, 0 when that dropout is off):

    s b h (w (4 + 12/t) + 2 m)          LayerNorm inputs, QKV, attention output, MLP, masks
    + a s^2 b (2 w + m_attn) / t        scores kept by explicit-mask attention (w=2, dropout on:
                                        the paper's 5 a s / h term); SDPA's fused kernels keep
                                        none, so plain causal attention drops this term

which is the paper's s b h (34 + 5 a s / h) for w = 2, t = 1, dropout on. Full recompute
(--checkpoint-activations, c layers per chunk) keeps only each chunk's input, w s b h, plus
one chunk's activations while it is recomputed. The 1F1B pipeline schedule keeps min(PP,
micro-batches) micro-batches in flight on the first stage. The output layer adds
(w + 4) s b V / t (logits and the fp32 softmax the loss keeps). The estimate fits when it is
at most FIT_FRACTION of the device memory; the rest is for the CUDA context, the allocator's
fragmentation and temporary buffers.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from app.config import RunConfig

FIT_FRACTION = 0.9
"""Fraction of the device memory the estimate may use."""
DEFAULT_REDUCE_BUCKET = 500_000_000
"""DeepSpeed's default zero_optimization.reduce_bucket_size (elements)."""


def params_per_rank(cfg: RunConfig) -> int:
    """Parameters of the largest pipeline stage's tensor-parallel shard (exact for our GPT-2)."""
    m, p = cfg.model, cfg.parallel
    t, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    h, f, V = m.hidden_size, m.ffn_hidden_size, m.padded_vocab_size
    per_layer = (3 * h * h + 3 * h) // t + h * h // t + h + (h * f + f) // t + f * h // t + h + 4 * h
    layers = (m.num_layers // pp) * per_layer
    embedding = V * h // t
    first = embedding + m.max_position_embeddings * h + layers
    last = layers + 2 * h + (embedding if pp > 1 else 0)
    return max(first + (2 * h if pp == 1 else 0), last)


@dataclass
class MemoryEstimate:
    """Bytes per rank by component, for one micro-batch size."""

    params: int
    """Ψ: parameters held by the rank."""
    weights: float
    gradients: float
    optimizer: float
    buffers: float
    """DeepSpeed's gradient reduce buckets (0 on the native path)."""
    activations: float
    activations_per_sample: float
    """activations / micro_batch_size (the estimate is linear in the micro-batch)."""
    micro_batch_size: int
    notes: List[str] = field(default_factory=list)
    """How each term was computed, for the report."""

    @property
    def model_states(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.buffers

    @property
    def total(self) -> float:
        return self.model_states + self.activations

    def largest_micro_batch(self, device_bytes: float) -> int:
        """Largest micro-batch whose estimate fits FIT_FRACTION of `device_bytes` (0: none)."""
        room = FIT_FRACTION * device_bytes - self.model_states
        if room <= 0 or self.activations_per_sample <= 0:
            return 0
        return int(room // self.activations_per_sample)


def _model_states(cfg: RunConfig, psi: int) -> Dict[str, Any]:
    """weights, gradients, optimizer and DeepSpeed bucket bytes, and how they were counted."""
    half = cfg.precision.fp16 or cfg.precision.bf16
    w = 2 if half else 4
    dp = cfg.parallel.data_parallel_size
    ds = cfg.deepspeed.config if cfg.deepspeed.enabled else None
    zero = (ds or {}).get("zero_optimization", {}) or {}
    stage = int(zero.get("stage", 0)) if ds is not None else 0
    offload = ds is not None and (zero.get("offload_optimizer", {}) or {}).get("device") == "cpu"
    master = 4 if (half or stage >= 1) else 0  # ZeRO keeps an fp32 partition even in fp32 runs
    optim = (master + 8) * psi / (dp if stage >= 1 else 1)
    grads = w * psi / (dp if stage >= 2 else 1)
    grads_text = f"{w}Ψ" + ("/N_d" if stage >= 2 else "")
    if ds is None and half:  # fp32 main gradients, cast from half ones unless accumulated in fp32
        fp32_accumulation = cfg.precision.grads_accumulate_in_fp32
        grads = (4 if fp32_accumulation else 4 + w) * psi
        grads_text = "4Ψ (fp32 main)" + ("" if fp32_accumulation else f" + {w}Ψ")
    buffers = 0.0
    if stage >= 1 and zero.get("contiguous_gradients", True):
        copies = 2 if zero.get("overlap_comm", False) else 1
        width = 4 if stage == 1 else w  # ZeRO-1 stages an fp32 accumulator, ZeRO-2 the grads'
        buffers = float(int(zero.get("reduce_bucket_size", DEFAULT_REDUCE_BUCKET)) * copies * width)
    if offload:
        optim = 0.0
    engine = f"DeepSpeed ZeRO-{stage}" if ds is not None else "native"
    optim_text = ("0 (offloaded to the host)" if offload else
                  f"{master + 8}Ψ" + ("/N_d" if stage >= 1 else ""))
    note = (f"{engine}, {'16-bit' if half else 'fp32'} weights: weights {w}Ψ, gradients "
            f"{grads_text}, optimizer {optim_text} with Ψ = {psi:,} parameters "
            f"per rank, N_d = {dp}"
            + (f"; reduce buckets reduce_bucket_size x {copies} x {width} bytes" if buffers else ""))
    return dict(weights=float(w * psi), gradients=float(grads), optimizer=float(optim),
                buffers=buffers, note=note)


def scores_kept(cfg: RunConfig, device_type: str) -> bool:
    """Whether attention keeps its [b, a/t, s, s] probabilities for backward: with an explicit
    mask (--reset-attention-mask) always; through SDPA only where no fused kernel takes the
    call (on the CPU when attention dropout is on, which sends SDPA to its math path)."""
    if cfg.data.reset_attention_mask:
        return True
    return device_type == "cpu" and cfg.model.attention_dropout > 0


def activation_bytes_per_sample(cfg: RunConfig, device_type: str = "cuda") -> Dict[str, Any]:
    """Activation bytes per sample of the micro-batch on the most loaded rank.

    Returns dict(forward=bytes autograd keeps from the forward pass, recompute=what full
    recompute adds while one chunk is recomputed in backward, transient=the logits alive at
    the loss, note=the formula with its values). Dropout masks are bool on CUDA (m = 1 byte)
    and have the activation's width on the CPU (m = w).
    """
    m, p = cfg.model, cfg.parallel
    t, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    s, h, a, V = m.seq_length, m.hidden_size, m.num_attention_heads, m.padded_vocab_size
    w = 2 if (cfg.precision.fp16 or cfg.precision.bf16) else 4
    mask_width = 1 if device_type == "cuda" else w
    mask = mask_width if m.hidden_dropout > 0 else 0
    attn_mask = mask_width if m.attention_dropout > 0 else 0
    explicit = scores_kept(cfg, device_type)
    per_layer = s * h * (w * (4 + 12 / t) + 2 * mask)
    if explicit:
        per_layer += a * s * s * (2 * w + attn_mask) / t
    layers = m.num_layers // pp
    recompute = 0.0
    if m.checkpoint_activations:
        c = min(m.checkpoint_num_layers, layers)
        stage = -(-layers // c) * w * s * h
        recompute = c * per_layer
        how = f"full recompute: {-(-layers // c)} chunk inputs of w·s·b·h + one chunk of {c} layer(s)"
    else:
        stage = layers * per_layer
        how = f"{layers} layers kept"
    micro = cfg.training.num_micro_batches(p.data_parallel_size)
    in_flight = min(pp, micro) if pp > 1 else 1
    embedding = s * h * (w + mask)
    last = pp == 1  # the output layer lives on the last stage, which has one micro-batch in flight
    forward = in_flight * (stage + embedding) + (4 * s * V / t if last else 0.0)
    transient = w * s * V / t if last else 0.0
    note = (f"per layer s·b·h·(w(4 + 12/t) + 2m){' + a·s²·b(2w + m)/t' if explicit else ''} "
            f"with s = {s}, h = {h}, a = {a}, t = {t}, w = {w}, m = {mask}; {how}; "
            f"{in_flight} micro-batch(es) in flight; output layer (w + 4)·s·b·V/t with V = {V}")
    return dict(forward=float(forward), recompute=float(recompute), transient=float(transient),
                note=note)


def estimate_memory(cfg: RunConfig, micro_batch_size: Optional[int] = None,
                    device_type: str = "cuda") -> MemoryEstimate:
    """The per-rank memory estimate of `cfg` (at its micro-batch size unless one is given) on a
    device of `device_type` ("cuda" or "cpu")."""
    b = micro_batch_size or cfg.training.micro_batch_size
    psi = params_per_rank(cfg)
    states = _model_states(cfg, psi)
    act = activation_bytes_per_sample(cfg, device_type)
    per_sample = act["forward"] + act["recompute"] + act["transient"]
    return MemoryEstimate(params=psi, weights=states["weights"], gradients=states["gradients"],
                          optimizer=states["optimizer"], buffers=states["buffers"],
                          activations=per_sample * b,
                          activations_per_sample=per_sample, micro_batch_size=b,
                          notes=[states["note"], act["note"]])
