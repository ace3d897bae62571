"""Per-rank memory estimate of a training run: model states and activations, from the config alone.

Pure arithmetic (no process group, no model built), used by the preflight check. Ψ is the
number of parameters a rank holds (its tensor-parallel shard of its pipeline stage; the first
and last stages also hold the word embeddings), N_d the data-parallel size.

Model states, bytes per rank (the ZeRO paper's accounting, Rajbhandari et al. 2020):

    fp32 (native, or DeepSpeed without ZeRO):  weights 4Ψ + gradients 4Ψ + Adam 8Ψ   = 16Ψ
    fp16/bf16 (mixed precision, K = 12):       weights 2Ψ + gradients 2Ψ + fp32 master 4Ψ
                                               + Adam 8Ψ                          = 16Ψ
    the optimizer's states: AdamW 8Ψ (two moments); SGD 4Ψ (momentum); Muon 4Ψ_m + 8(Ψ - Ψ_m),
    one momentum buffer per hidden matrix (Ψ_m: the transformer layers' QKV, dense, h->4h and
    4h->h weights the rank holds) and AdamW's two moments for the rest
    native fp16/bf16 steps fp32 main gradients: 4Ψ (accumulated in fp32, or cast from the
    2Ψ half gradients, each freed as it is cast, so the peak stays 4Ψ)
    --use-distributed-optimizer (native): the optimizer states (Adam, fp32 main weights of a
            half run) divided by N_d, as ZeRO-1
    ZeRO-1: optimizer states (and the fp32 master partition DeepSpeed keeps, also in fp32
            runs) divided by N_d;  ZeRO-2: gradients too;  offload_optimizer: optimizer states
            and master weights on the host (0 on the device).  With contiguous_gradients
            (DeepSpeed's default) ZeRO-1/2 also allocate a reduce bucket of reduce_bucket_size
            elements (x2 with overlap_comm) in fp32 (ZeRO-1) or the gradients' dtype (ZeRO-2)
            during every backward, whatever the model's size.
    ZeRO-3: each parameter split on its own into N_d pieces of ceil(numel / N_d), so
            Ψ_p = Σ ceil(numel / N_d) ≈ Ψ/N_d: weights wΨ_p, plus the persistent parameters
            (numel <= stage3_param_persistence_threshold, default 1e5: LayerNorms and biases)
            kept whole as well; gradients gΨ_p (g = w, 4 with data_types.grad_accum_dtype
            fp32); optimizer 4Ψ_p (the fp32 master pieces, a copy in fp32 runs too) + the
            optimizer's states of Ψ_p; offload_param puts the weight pieces on the host,
            offload_optimizer the gradient pieces and the optimizer (0 on the device). A reduce
            bucket of reduce_bucket_size x g bytes, and the parameters gathered whole around
            each module's forward and backward: DeepSpeed keeps a parameter it will reuse within
            stage3_max_reuse_distance elements and prefetches stage3_prefetch_bucket_size
            ahead, so w x min(Ψ - persistent, reuse distance + prefetch + the two largest
            parameters: at a module boundary the tied word embeddings, gathered for the
            output layer, meet a layer's MLP weight); the defaults (1e9 each) keep a model
            under a billion parameters gathered whole between its forward and backward.

Context parallelism (--context-parallel-size C) gives each rank s/C tokens of every sequence:
every per-token term below uses s/C; the p2p ring keeps fp32 scores and probabilities of its
own block and of the half block it computes of each of the C-1 others, and each block's fp32
keys, values and output: (a (s/C)^2 (C+1)/2 8 + 12 s q) b / t with s the whole sequence; a2a
attends a/C heads over the whole s.

Activations, bytes per micro-batch per transformer layer (Korthikanti et al. 2022, eq. 2 with
tensor parallelism t, generalised to an activation width of w bytes and dropout masks of
m = 1 byte, 0 when that dropout is off):

    s b h (w (4 + 12/t) + 2 m)          LayerNorm inputs, QKV, attention output, MLP, masks
    + a s^2 b (2 w + m_attn) / t        probabilities kept on the local attention path (q k^T
                                        + fused softmax + @ v: --attention-backend local or an
                                        explicit mask): the softmax output, the dropout mask
                                        and the dropped copy (w=2, dropout on: the paper's
                                        5 a s / h term); a s^2 b w / t without attention
                                        dropout; SDPA's fused kernels keep none, so plain
                                        causal attention through SDPA drops this term

which is the paper's s b h (34 + 5 a s / h) for w = 2, t = 1, dropout on. The 12 is
(4 q + 2 f) / h for q = heads x kv-channels and MLP width f (GPT-2: q = h, f = 4h); --swiglu
keeps 3 f (gate, up and their product) instead of 2 f. Sequence
parallelism divides the replicated part (the 4 w and the masks, and the embedding output) by
t as well: the paper's s b h / t (34 + 5 a s / h). Full recompute (--recompute-granularity
full; uniform: c layers per chunk) keeps only each chunk's input, w s b h (/t with sequence
parallelism), plus one chunk's activations while it is recomputed; block recomputes only the
first N layers of the stage; selective recompute drops the terms of its --recompute-modules
(core_attn: the attention core; mlp: the dense MLP's 2 f or 3 f; moe: an MoE layer's experts,
router and shared expert; shared_experts: the shared expert's), each kept for one layer at a
time in backward. The first stage adds the embedding output; the
last the output layer, (w + 4) s b V / t (logits and the fp32 softmax the loss keeps). The
1F1B pipeline schedule keeps min(PP - r, micro-batches) micro-batches in flight on stage r, so
with a pipeline both the first stage (most in flight) and the last (the output layer) are
estimated and the larger counts; the micro-batches per iteration, ceil(global batch / (N_d b)),
change with the micro-batch b, so the largest micro-batch that fits is searched for, not
extrapolated. The estimate fits when it is
at most FIT_FRACTION of the device memory; the rest is for the CUDA context, the allocator's
fragmentation and temporary buffers.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from app.config import RunConfig
from app.config.model import EXPLICIT_ATTENTION
from app.pipeline.partition import virtual_stage_layer_ranges

FIT_FRACTION = 0.9
"""Fraction of the device memory the estimate may use."""
DEFAULT_REDUCE_BUCKET = 500_000_000
"""DeepSpeed's default zero_optimization.reduce_bucket_size (elements)."""
DEFAULT_PERSISTENCE = 100_000
"""DeepSpeed's default stage3_param_persistence_threshold (elements)."""
DEFAULT_REUSE_DISTANCE = 1_000_000_000
"""DeepSpeed's default stage3_max_reuse_distance (elements)."""
DEFAULT_PREFETCH_BUCKET = 50_000_000
"""DeepSpeed's default stage3_prefetch_bucket_size (elements)."""


def params_per_rank(cfg: RunConfig) -> int:
    """Parameters of the largest pipeline stage's shard (the first or the last stage, or with
    Mixture of Experts any stage; ModelConfig.parameters_per_rank counts each: tensor-parallel
    shards, and this rank's E / EP experts split over the expert-tensor ranks)."""
    return max(_stage_params(cfg, rank) for rank in _stages(cfg))


def _stages(cfg: RunConfig) -> List[int]:
    pp = cfg.parallel.pipeline_model_parallel_size
    return list(range(pp)) if cfg.model.moe.enabled else sorted({0, pp - 1})


def _stage_params(cfg: RunConfig, stage: int, experts_only: bool = False) -> int:
    """Ψ of one rank of `stage` (or only its expert part Ψ_e)."""
    p = cfg.parallel
    sizes = cfg.model.parameter_numels(p.tensor_model_parallel_size,
                                       p.pipeline_model_parallel_size, stage,
                                       p.expert_model_parallel_size,
                                       p.expert_tensor_parallel_size)
    if not experts_only:
        return sum(sizes)
    moe = cfg.model.moe
    per_layer = sum(moe.expert_numels(cfg.model.hidden_size, cfg.model.swiglu,
                                      p.expert_model_parallel_size,
                                      p.expert_tensor_parallel_size)) if moe.enabled else 0
    per_stage = cfg.model.num_layers // p.pipeline_model_parallel_size
    pattern = moe.layer_pattern(cfg.model.num_layers)[stage * per_stage:(stage + 1) * per_stage]
    return per_layer * sum(pattern)


def expert_params_per_rank(cfg: RunConfig) -> int:
    """Ψ_e: the routed experts' parameters on the rank of the stage with the most (0 for a
    dense model): sum over its MoE layers of 2 h F_moe E g / (ETP x EP), g = 3/2 with SwiGLU."""
    return max(_stage_params(cfg, rank, experts_only=True) for rank in _stages(cfg))


@dataclass(frozen=True)
class StageActivations:
    """Activation bytes per sample of the micro-batch on one pipeline stage's ranks."""

    pipeline_rank: int
    max_in_flight: int
    """Micro-batches the 1F1B schedule keeps in flight there at most (PP - rank; 1 without PP)."""
    forward: float
    """Kept by autograd from the forward pass of one micro-batch."""
    recompute: float
    """Added by full recompute while one chunk is recomputed in backward."""
    transient: float
    """The logits alive at the loss (last stage)."""
    note: str

    def bytes(self, micro_batch_size: int, micro_batches: int) -> float:
        """Peak activation bytes at `micro_batch_size` with `micro_batches` per iteration."""
        in_flight = min(self.max_in_flight, micro_batches)
        return micro_batch_size * (in_flight * self.forward + self.recompute + self.transient)


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
    gathered: float
    """ZeRO-3: parameters gathered whole at the peak of forward and backward (0 otherwise)."""
    activations: float
    """Activations of the most loaded pipeline stage (the first or the last)."""
    micro_batch_size: int
    stages: List[StageActivations] = field(default_factory=list)
    """The stages estimated: the first and, with a pipeline, the last."""
    samples_per_rank: int = 1
    """Samples per data-parallel rank per iteration (global batch / N_d)."""
    notes: List[str] = field(default_factory=list)
    """How each term was computed, for the report."""

    @property
    def model_states(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.buffers + self.gathered

    @property
    def total(self) -> float:
        return self.model_states + self.activations

    def activations_at(self, micro_batch_size: int) -> float:
        """Activation bytes of the most loaded stage at `micro_batch_size`; the micro-batches
        per iteration (which bound those in flight) follow from it, ceil(samples_per_rank / b)."""
        micro_batches = -(-self.samples_per_rank // micro_batch_size)
        return max(st.bytes(micro_batch_size, micro_batches) for st in self.stages)

    def largest_micro_batch(self, device_bytes: float) -> int:
        """Largest micro-batch whose estimate fits FIT_FRACTION of `device_bytes` (0: none).

        Exact search: with a pipeline, the micro-batches in flight, min(PP, micro-batches),
        shrink as the micro-batch grows, so activations are not linear in it. Every micro-batch
        b keeps at least b x (one in flight) bytes, which bounds the search; from
        samples_per_rank on, one is in flight and the first candidate fits."""
        room = FIT_FRACTION * device_bytes - self.model_states
        one_in_flight = max(st.bytes(1, 1) for st in self.stages)
        if room <= 0 or one_in_flight <= 0:
            return 0
        for b in range(int(room // one_in_flight), 0, -1):
            if self.activations_at(b) <= room:
                return b
        return 0


def _model_states(cfg: RunConfig, psi: int) -> Dict[str, Any]:
    """weights, gradients, optimizer and DeepSpeed bucket bytes, and how they were counted."""
    half = cfg.precision.fp16 or cfg.precision.bf16
    w = 2 if half else 4
    # the distributed optimizer shards over every rank holding the same weights: data x context
    dp = cfg.parallel.data_parallel_size * cfg.parallel.context_parallel_size
    ds = cfg.deepspeed.config if cfg.deepspeed.enabled else None
    zero = (ds or {}).get("zero_optimization", {}) or {}
    stage = int(zero.get("stage", 0)) if ds is not None else 0
    offload = ds is not None and (zero.get("offload_optimizer", {}) or {}).get("device") == "cpu"
    master = 4 if (half or stage >= 1) else 0  # ZeRO keeps an fp32 partition even in fp32 runs
    sharded = stage >= 1 or (ds is None and cfg.optimizer.use_distributed_optimizer)
    state_bytes, state_text = optimizer_state_bytes(cfg, psi)
    # Mixture of Experts: the experts' states are sharded over their own replicas (EDP)
    psi_e = expert_params_per_rank(cfg)
    edp = cfg.parallel.expert_data_parallel_size
    shards = ((psi - psi_e) / dp + psi_e / edp) / psi if psi else 1.0
    optim = (master * psi + state_bytes) * (shards if sharded else 1)
    grads = w * psi * (shards if stage >= 2 else 1)
    grads_text = f"{w}Ψ" + ("/N_d" if stage >= 2 else "")
    if ds is None and half:  # fp32 main gradients (MixedPrecisionOptimizer._main_grads)
        grads = 4 * psi
        grads_text = ("4Ψ (fp32 main)" if cfg.precision.grads_accumulate_in_fp32 else
                      f"4Ψ (fp32 main, cast from {w}Ψ half ones, each freed as it is cast)")
    if stage == 3:
        return _zero3_states(cfg, zero, psi, dp)
    buffers = 0.0
    if stage >= 1 and zero.get("contiguous_gradients", True):
        copies = 2 if zero.get("overlap_comm", False) else 1
        width = 4 if stage == 1 else w  # ZeRO-1 stages an fp32 accumulator, ZeRO-2 the grads'
        buffers = float(int(zero.get("reduce_bucket_size", DEFAULT_REDUCE_BUCKET)) * copies * width)
    if offload:
        optim = 0.0
    engine = (f"DeepSpeed ZeRO-{stage}" if ds is not None else
              "native, distributed optimizer" if sharded else "native")
    states = f"{master}Ψ + {state_text}" if master else state_text
    optim_text = ("0 (offloaded to the host)" if offload else
                  (f"({states})/N_d" if sharded else states))
    experts = (f"; of Ψ, the routed experts' Ψ_e = {psi_e:,} are sharded over the "
               f"expert-data-parallel size {edp} instead of N_d" if psi_e else "")
    note = (f"{engine}, {'16-bit' if half else 'fp32'} weights: weights {w}Ψ, gradients "
            f"{grads_text}, optimizer {optim_text} with Ψ = {psi:,} parameters "
            f"per rank, N_d = {dp}{experts}"
            + (f"; reduce buckets reduce_bucket_size x {copies} x {width} bytes" if buffers else ""))
    return dict(weights=float(w * psi), gradients=float(grads), optimizer=float(optim),
                buffers=buffers, gathered=0.0, note=note)


def zero3_pieces(cfg: RunConfig, zero: Dict[str, Any], dp: int) -> Tuple[int, int, int, int]:
    """(pieces, persistent, two largest, whole) elements at ZeRO-3 on one rank: the sum over its
    parameters of ceil(numel / N_d), the persistent ones (numel <= the persistence threshold,
    kept whole, in model order until stage3_model_persistence_threshold), the two largest
    parameters together and the rank's whole shard Ψ."""
    p = cfg.parallel
    sizes = cfg.model.parameter_numels(p.tensor_model_parallel_size)
    threshold = int(zero.get("stage3_param_persistence_threshold", DEFAULT_PERSISTENCE))
    model_cap = int(zero.get("stage3_model_persistence_threshold", sys.maxsize))
    persistent = 0
    for n in sizes:
        if n <= threshold and persistent + n <= model_cap:
            persistent += n
    two_largest = sum(sorted(sizes)[-2:])
    return sum(-(-n // dp) for n in sizes), persistent, two_largest, sum(sizes)


def _zero3_states(cfg: RunConfig, zero: Dict[str, Any], psi: int, dp: int) -> Dict[str, Any]:
    """`_model_states` at ZeRO-3 (module docstring): every state split per parameter into
    N_d pieces of ceil(numel / N_d); the persistent parameters also whole; the gradients in
    the weights' dtype; fp32 master pieces (a copy in fp32 runs too); offloads move pieces to
    the host; a reduce bucket, and the parameters gathered whole around forward and backward."""
    half = cfg.precision.fp16 or cfg.precision.bf16
    w = 2 if half else 4
    ds = cfg.deepspeed.config or {}
    g = 4 if (ds.get("data_types") or {}).get("grad_accum_dtype") == "fp32" else w
    pieces, persistent, two_largest, whole = zero3_pieces(cfg, zero, dp)
    off_param = (zero.get("offload_param") or {}).get("device") == "cpu"
    off_optim = (zero.get("offload_optimizer") or {}).get("device") == "cpu"
    state, state_text = optimizer_state_bytes(cfg, psi)
    optim = 0.0 if off_optim else 4 * pieces + state * pieces / psi
    bucket = (int(zero.get("reduce_bucket_size", DEFAULT_REDUCE_BUCKET)) * g
              if zero.get("contiguous_gradients", True) else 0)
    reuse = int(zero.get("stage3_max_reuse_distance", DEFAULT_REUSE_DISTANCE))
    prefetch = int(zero.get("stage3_prefetch_bucket_size", DEFAULT_PREFETCH_BUCKET))
    gathered = w * min(whole - persistent, reuse + prefetch + two_largest)
    host = "0 (offloaded to the host)"
    note = (f"DeepSpeed ZeRO-3, {'16-bit' if half else 'fp32'} weights: weights "
            f"{host if off_param else f'{w}Ψ_p'} + {w}·{persistent:,} persistent, gradients "
            f"{host if off_optim else f'{g}Ψ_p'}, optimizer "
            f"{host if off_optim else '4Ψ_p + ' + state_text + '/N_d'}"
            f" with Ψ_p = Σ ceil(numel/N_d) = {pieces:,} (Ψ = {psi:,}, N_d = {dp}); reduce "
            f"bucket reduce_bucket_size x {g} bytes; gathered {w} x min(Ψ - persistent, "
            "max_reuse_distance + prefetch_bucket_size + the two largest parameters)")
    return dict(weights=float((0 if off_param else w * pieces) + w * persistent),
                gradients=float(0 if off_optim else g * pieces), optimizer=float(optim),
                buffers=float(bucket), gathered=float(gathered), note=note)


def muon_matrix_params_per_rank(cfg: RunConfig) -> int:
    """Ψ_m: elements of the Muon matrices (QKV, attention dense, h->4h, 4h->h weights, routed
    experts) one rank holds: its tensor-parallel shards of its stage's layers."""
    m, p = cfg.model, cfg.parallel
    t, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    h, f, q = m.hidden_size, m.ffn_hidden_size, m.num_attention_heads * m.head_dim
    qkv_rows = (m.num_attention_heads // t + 2 * max(1, m.num_kv_heads // t)) * m.head_dim
    fc1 = 2 * f if m.swiglu else f  # --swiglu: gate and up halves
    attention = qkv_rows * h + h * q // t
    # MoE layers: their routed experts (a matrix per expert) instead of the MLP
    return (m.num_layers // pp * (attention + (fc1 + f) * h // t) + expert_params_per_rank(cfg)
            - _moe_layers_per_stage(cfg) * (fc1 + f) * h // t)


def _moe_layers_per_stage(cfg: RunConfig) -> int:
    m, pp = cfg.model, cfg.parallel.pipeline_model_parallel_size
    per_stage = m.num_layers // pp
    return max(sum(m.moe.layer_pattern(m.num_layers)[r * per_stage:(r + 1) * per_stage])
               for r in range(pp))


def optimizer_state_bytes(cfg: RunConfig, psi: int) -> Tuple[float, str]:
    """(bytes, formula) of the optimizer's own states for Ψ = `psi` parameters: AdamW 8Ψ, SGD
    4Ψ, Muon 4Ψ_m + 8(Ψ - Ψ_m) (see the module docstring)."""
    name = cfg.optimizer.optimizer
    if name == "sgd":
        return 4.0 * psi, "SGD momentum 4Ψ"
    if name == "muon":
        muon = muon_matrix_params_per_rank(cfg)
        return (4.0 * muon + 8.0 * (psi - muon),
                f"Muon momentum 4Ψ_m + AdamW 8(Ψ - Ψ_m), Ψ_m = {muon:,}")
    return 8.0 * psi, "AdamW 8Ψ"


def scores_kept(cfg: RunConfig, device_type: str) -> bool:
    """Whether attention keeps its [b, a/t, s, s] probabilities for backward: on the local path
    (q k^T + fused softmax + @ v: --attention-backend local, or an explicit mask from
    --reset-attention-mask) always; through SDPA only where no fused kernel takes the call (on
    the CPU when attention dropout is on, which sends SDPA to its math path)."""
    if cfg.data.attention_mask_resets or cfg.model.attention_impl in EXPLICIT_ATTENTION:
        return True
    return device_type == "cpu" and cfg.model.attention_dropout > 0


def stage_activations(cfg: RunConfig, device_type: str = "cuda",
                      pipeline_rank: int = 0) -> StageActivations:
    """Activation bytes per sample of the micro-batch on pipeline stage `pipeline_rank`.

    Dropout masks are bool on CUDA (m = 1 byte) and have the activation's width on the CPU
    (m = w). The first stage adds the embedding output; the last the output layer and the loss.
    """
    m, p = cfg.model, cfg.parallel
    t, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    c = p.context_parallel_size  # each rank holds s / c tokens of every sequence
    s, h, a, V = m.seq_length // c, m.hidden_size, m.num_attention_heads, m.padded_vocab_size
    w = 2 if (cfg.precision.fp16 or cfg.precision.bf16) else 4
    mask_width = 1 if device_type == "cuda" else w
    mask = mask_width if m.hidden_dropout > 0 else 0
    sp = t if m.sequence_parallel else 1  # sequence parallelism splits the replicated part
    # inside the tensor-parallel region: QKV output and context (4 q), the MLP's hidden
    # activations (2 f: fc1 output and activation; 3 f with --swiglu: gate, up and product);
    # 4 q + 2 f = 12 h for GPT-2
    q, f = a * m.head_dim, m.ffn_hidden_size
    inner = (4 * q + (3 if m.swiglu else 2) * f) / h
    per_layer = s * h * (w * (4 / sp + inner / t) + 2 * mask / sp)
    per_layer, moe_text = _moe_layer_average(cfg, pipeline_rank, per_layer, s // sp, w, mask, sp)
    core, scores = 0.0, ""
    if c > 1 and p.cp_comm_type == "p2p":
        # the ring keeps q, k, v (views of the QKV output, counted above), its fp32 output
        # [s/c, q] and log-sum-exp [a, s/c]; every score block is recomputed in backward
        core = 4 * s * (q + a) / t
        scores = f" + 4·s·(q + a)·b/t (ring output and log-sum-exp, C = {c})"
    elif c > 1 and scores_kept(cfg, device_type):  # a2a: a/C heads over the whole sequence
        width = 2 * w + mask_width if m.attention_dropout > 0 else w
        core = (a / c) * (s * c) ** 2 * width / t
        scores = f" + (a/C)·s²·b·{'(2w + m)' if m.attention_dropout > 0 else 'w'}/t (C = {c})"
    elif scores_kept(cfg, device_type):
        # the softmax output; with attention dropout also its mask and the dropped copy @ v keeps
        width = 2 * w + mask_width if m.attention_dropout > 0 else w
        core = a * s * s * width / t
        scores = " + a·s²·b(2w + m)/t" if m.attention_dropout > 0 else " + a·s²·b·w/t"
    selective = _selective(cfg, pipeline_rank, core, s // sp, w, sp)
    stage, recompute, how = _kept_and_recomputed(cfg, per_layer, core, w * s * h / sp, selective)
    first, last = pipeline_rank == 0, pipeline_rank == pp - 1
    forward = (stage + (s * h * (w + mask) / sp if first else 0.0)
               + (4 * s * V / t if last else 0.0))
    transient = w * s * V / t if last else 0.0
    in_flight = pp - pipeline_rank
    where = ("" if pp == 1 else
             f"stage {pipeline_rank} of {pp}, up to {in_flight} micro-batch(es) in flight: ")
    split = "/t" if sp > 1 else ""
    tokens = f"s/C = {s}" if c > 1 else f"s = {s}"
    note = (f"{where}per layer s·b·h·(w(4{split} + {inner:g}/t) + 2m{split}){scores} with {tokens}, "
            f"h = {h}, a = {a}, t = {t}, w = {w}, m = {mask}{moe_text}; {how}"
            + (f"; output layer (w + 4)·s·b·V/t with V = {V}" if last else ""))
    return StageActivations(pipeline_rank=pipeline_rank, max_in_flight=in_flight,
                            forward=float(forward), recompute=float(recompute),
                            transient=float(transient), note=note)


def _stage_layers(cfg: RunConfig, pipeline_rank: int) -> Tuple[int, int]:
    """(layers, MoE layers) of pipeline stage `pipeline_rank`, all its model chunks."""
    m, p = cfg.model, cfg.parallel
    layers = [i for r in virtual_stage_layer_ranges(
        m.num_layers, p.pipeline_model_parallel_size, cfg.virtual_pipeline_model_parallel_size,
        pipeline_rank) for i in r]
    pattern = m.moe.layer_pattern(m.num_layers)
    return len(layers), sum(pattern[i] for i in layers)


def _mlp_terms(cfg: RunConfig, tokens: int, w: int, sp: int) -> Tuple[float, float, float]:
    """Bytes per sample that (the dense MLP, an MoE layer's shared expert, its routed experts and
    router) keep for backward; see `_moe_layer_average`."""
    m, p = cfg.model, cfg.parallel
    c, t = (3 if m.swiglu else 2), p.tensor_model_parallel_size
    mlp = tokens * sp * w * c * m.ffn_hidden_size / t
    if not m.moe.enabled:
        return mlp, 0.0, 0.0
    h, etp, k = m.hidden_size, p.expert_tensor_parallel_size, m.moe.moe_router_topk
    shared = tokens * sp * w * c * m.moe.shared_expert_size / t
    experts = (k * tokens * w * (etp * h + (c + 1) * m.moe.moe_ffn_hidden_size)
               + 12 * tokens * m.moe.num_experts)
    return mlp, shared, experts


def _moe_layer_average(cfg: RunConfig, pipeline_rank: int, dense: float, tokens: int, w: int,
                       mask: int, sp: int) -> Tuple[float, str]:
    """The mean per-layer activation bytes per sample over the stage's layers when some are MoE
    layers, and the note's words. An MoE layer keeps, instead of the MLP's, its shared expert's
    and, under balanced routing, k x ETP rows per local token (T = s/sp of them) of the experts'
    input, fc1 output, activation and probability-weighted product, w (ETP h + 4 F_moe) with
    SwiGLU (3 F_moe without), plus the router's fp32 logits and probabilities (12 E bytes per
    token)."""
    m, p = cfg.model, cfg.parallel
    if not m.moe.enabled:
        return dense, ""
    layers, moe_layers = _stage_layers(cfg, pipeline_rank)
    if not moe_layers:
        return dense, ""
    c, k = (3 if m.swiglu else 2), m.moe.moe_router_topk
    mlp, shared, experts = _mlp_terms(cfg, tokens, w, sp)
    moe = dense - mlp + shared + experts
    mean = (dense * (layers - moe_layers) + moe * moe_layers) / layers
    return mean, (f"; {moe_layers} of the stage's {layers} layers MoE: their MLP term "
                  f"replaced by the shared expert's + k·T·w·(ETP·h + {c + 1}·F_moe) + "
                  f"12·T·E with T = s/sp tokens, k = {k}, "
                  f"ETP = {p.expert_tensor_parallel_size} (balanced routing)")


def _selective(cfg: RunConfig, pipeline_rank: int, core: float, tokens: int, w: int,
               sp: int) -> Tuple[float, float, str]:
    """(bytes per sample and layer, averaged over the stage, that selective recompute does not
    keep; the largest module it reruns at once in backward; the note's words) for the
    --recompute-modules: core_attn the attention `core`, mlp the dense MLP's term, moe an MoE
    layer's experts, router and shared expert, shared_experts the shared expert's."""
    modules = cfg.recompute_plan().modules
    layers, moe_layers = _stage_layers(cfg, pipeline_rank)
    mlp, shared, experts = _mlp_terms(cfg, tokens, w, sp)
    dense_part = mlp if "mlp" in modules and layers > moe_layers else 0.0
    moe_part = (shared + experts if "moe" in modules
                else shared if "shared_experts" in modules else 0.0) if moe_layers else 0.0
    core_part = core if "core_attn" in modules else 0.0
    dropped = core_part + (dense_part * (layers - moe_layers) + moe_part * moe_layers) / layers
    return dropped, max(core_part, dense_part, moe_part), ", ".join(modules) or "nothing"


def _kept_and_recomputed(cfg: RunConfig, per_layer: float, core: float, layer_input: float,
                         selective: Tuple[float, float, str]) -> Tuple[float, float, str]:
    """(bytes a pipeline stage's layers keep after forward, bytes a recompute adds in backward,
    how) under `cfg.recompute_plan()` for each of the stage's model chunks; per layer:
    `per_layer` + the attention `core`. A checkpointed chunk keeps its input only and, in
    backward, the activations of its layers while they are recomputed; selective recompute
    keeps each layer without what `_selective` drops and reruns one module at a time."""
    plan, chunks = cfg.recompute_plan(), cfg.virtual_pipeline_model_parallel_size
    layers = sum(n for n, _ in plan.chunks)
    if plan.granularity == "selective":
        dropped, rerun, modules = selective
        return (chunks * layers * (per_layer + core - dropped), rerun,
                f"{chunks * layers} layers kept without what selective recompute reruns "
                f"({modules})")
    checkpointed = plan.checkpointed_regions  # chunks that keep their input only
    whole = layers - plan.recomputed_layers
    kept = chunks * (checkpointed * layer_input + whole * (per_layer + core))
    rerun = plan.largest_recomputed_chunk * (per_layer + core)
    if plan.granularity == "none":
        return kept, rerun, f"{chunks * layers} layers kept"
    return (kept, rerun, f"{cfg.model.recompute_method} recompute: {chunks * checkpointed} "
                         f"chunk input(s) + {chunks * whole} layers kept + one chunk of "
                         f"{plan.largest_recomputed_chunk} layer(s) rerun")


def fp8_weight_bytes(cfg: RunConfig) -> Tuple[float, str]:
    """(extra bytes, how counted) of FP8 through Transformer Engine (--fp8-format) for the
    linear weights Ψ_lin of the transformer layers (QKV, attention output, both MLP GEMMs):
    their FP8 copy and its transpose, 2Ψ_lin, beside the bf16 weights; with
    --fp8-param-gather the weights themselves are FP8 (Ψ_lin) with their transpose (Ψ_lin)
    instead of bf16 (2Ψ_lin): no change. Activations are counted at the bf16 width (FP8
    GEMM inputs saved in FP8 would take less): an estimate until a GPU run measures it."""
    linear = muon_matrix_params_per_rank(cfg)
    if cfg.fp8.fp8_param_gather:
        return 0.0, (f"FP8 (--fp8-param-gather): linear weights Ψ_lin = {linear:,} held in FP8 "
                     "with their transpose, as many bytes as bf16 (estimate)")
    return 2.0 * linear, (f"FP8: + 2Ψ_lin for the FP8 copy and transpose of the linear weights, "
                          f"Ψ_lin = {linear:,} (estimate; activations at the bf16 width)")


def estimate_memory(cfg: RunConfig, micro_batch_size: Optional[int] = None,
                    device_type: str = "cuda") -> MemoryEstimate:
    """The per-rank memory estimate of `cfg` (at its micro-batch size unless one is given) on a
    device of `device_type` ("cuda" or "cpu"); with a pipeline, of the first or the last stage,
    whichever needs more."""
    b = micro_batch_size or cfg.training.micro_batch_size
    psi = params_per_rank(cfg)
    states = _model_states(cfg, psi)
    if cfg.fp8.enabled:
        states["weights"] += fp8_weight_bytes(cfg)[0]
        states["note"] += "; " + fp8_weight_bytes(cfg)[1]
    stages = [stage_activations(cfg, device_type, r) for r in _stages(cfg)]
    est = MemoryEstimate(params=psi, weights=states["weights"], gradients=states["gradients"],
                         optimizer=states["optimizer"], buffers=states["buffers"],
                         gathered=states["gathered"],
                         activations=0.0, micro_batch_size=b, stages=stages,
                         samples_per_rank=max(1, cfg.training.global_batch_size
                                              // cfg.parallel.data_parallel_size),
                         notes=[states["note"]] + [st.note for st in stages])
    est.activations = est.activations_at(b)
    return est
