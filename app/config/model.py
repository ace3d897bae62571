"""The GPT-2 model's configuration (`ModelConfig`: its options, rules and parameter count).

Part of `app.config` (import from there); its rules follow the package's contract: checked
once in `__post_init__`, messages naming the flag and the fix.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, List, Optional, Tuple

from app.config.moe import MoEConfig
from app.config.options import option
from app.config.recompute import (RECOMPUTE_GRANULARITIES, RECOMPUTE_METHODS, check_recompute,
                                  recompute_plan, selective_modules)
from app.config.rules import divisible, positive
from app.utils.dtypes import DTYPE_NAMES

POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "alibi")
"""--position-embedding-type values."""
ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused", "local")
"""--attention-backend values (Megatron's AttnBackend names; what each runs here:
app.model.fused.attention)."""
EXPLICIT_ATTENTION = ("unfused", "local")
"""Backends that compute q k^T, softmax and @ v as three ops (the probabilities are kept)."""
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
"""--normalization values."""


@dataclass(kw_only=True)
class ModelConfig:
    """Shape and regularisation of the GPT-2 model (Megatron-LM semantics)."""

    FLAG_GROUP: ClassVar[Tuple[str, str]] = ("model", "GPT-2 shape and regularisation")

    num_layers: int = option("--num-layers", default=24, help="transformer layers")
    hidden_size: int = option("--hidden-size", default=1024, help="model width h")
    num_attention_heads: int = option("--num-attention-heads", default=16)
    """Must divide hidden_size and be divisible by the tensor-parallel size."""
    ffn_hidden_size: Optional[int] = option("--ffn-hidden-size", "--intermediate-size",
                                            default=None,
                                            help="MLP width (default 4 x hidden size)")
    """With --swiglu the width of each of the gate and up halves, by default
    int(8h/3 / 64) x 64 (Megatron's)."""
    kv_channels: Optional[int] = option(
        "--kv-channels", default=None,
        help="channels of each attention head (default --hidden-size / "
             "--num-attention-heads); the attention output projection is "
             "heads x kv-channels -> hidden size")
    swiglu: bool = option("--swiglu", default=False,
                          help="gated MLP: silu(x W_gate) * (x W_up) instead of GeLU (Megatron's "
                               "gated_linear_unit with SiLU)")
    normalization: str = option(
        "--normalization", default="LayerNorm", choices=NORMALIZATIONS,
        help="LayerNorm (weight and bias) or RMSNorm (weight only) for every norm of the model")
    add_bias_linear: bool = option(
        "--disable-bias-linear", default=True, action="store_false", dest="add_bias_linear",
        help="no bias in any linear layer (QKV, attention output, both MLP projections)")
    qk_layernorm: bool = option(
        "--qk-layernorm", default=False,
        help="--normalization over each query and key head (head channels) before RoPE, "
             "as Megatron Core")
    add_qkv_bias: bool = option(
        "--add-qkv-bias", default=False,
        help="a bias on the QKV projection even with --disable-bias-linear (Qwen2); always on "
             "while the linears have biases (Megatron's rule)")
    squared_relu: bool = option(
        "--squared-relu", default=False,
        help="MLP activation relu(x)^2 instead of GeLU (Nemotron); not with --swiglu")
    layernorm_zero_centered_gamma: bool = option(
        "--apply-layernorm-1p", default=False, dest="layernorm_zero_centered_gamma",
        help="every norm's weight is stored zero-centred and applied as 1 + weight (initialised "
             "to 0; LayerNorm and RMSNorm), Megatron's layernorm_zero_centered_gamma")
    seq_length: int = option("--seq-length", default=1024, help="tokens per training sample")
    max_position_embeddings: Optional[int] = option(
        "--max-position-embeddings", default=None,
        help="rows of the position table (default: --seq-length)")
    padded_vocab_size: int = option(
        "--padded-vocab-size",
        help="exact rows of the word embeddings and the output layer (at least the tokenizer's "
             "vocabulary, divisible by the TP size); default: the tokenizer's vocabulary padded "
             "to --make-vocab-size-divisible-by x TP")
    """Vocabulary rows of the embedding and logits: --padded-vocab-size, else derived from the
    tokenizer and --make-vocab-size-divisible-by (app.data.tokenizer.pad_vocab_size)."""
    hidden_dropout: float = option("--hidden-dropout", default=0.1)
    """Dropout on embeddings and on the output of attention and MLP."""
    attention_dropout: float = option("--attention-dropout", default=0.1)
    """Dropout on the attention probabilities."""
    layernorm_epsilon: float = option("--norm-epsilon", "--layernorm-epsilon", default=1e-5,
                                      dest="layernorm_epsilon",
                                      help="epsilon of every LayerNorm / RMSNorm")
    init_method_std: float = option("--init-method-std", default=0.02)
    """Std of the normal init; the two output projections of a layer use std / sqrt(2 L)."""
    openai_gelu: bool = option("--openai-gelu", default=False,
                               help="tanh-approximated GeLU instead of the exact erf form")
    position_embedding_type: str = option(
        "--position-embedding-type", default="learned_absolute", choices=POSITION_EMBEDDING_TYPES,
        help="learned_absolute: GPT-2's position table (needs --max-position-embeddings "
             ">= --seq-length); rope: rotary embeddings on queries and keys; alibi: "
             "linear attention biases (Press et al.). Hugging Face GPT-2 export "
             "needs learned_absolute")
    rotary_percent: float = option(
        "--rotary-percent", default=1.0,
        help="fraction of each head's channels RoPE rotates, in (0, 1] (rope only; "
             "the rotated channel count must be even)")
    rotary_base: int = option("--rotary-base", default=10000,
                              help="RoPE base of the rotation frequencies (rope only)")
    use_rope_scaling: bool = option(
        "--use-rope-scaling", default=False,
        help="Llama 3.x RoPE frequency scaling (rope only): wavelengths above 8192 positions "
             "divided by --rope-scaling-factor, below 2048 kept, smoothly blended between "
             "(low/high frequency factors 1 and 4, original context 8192, as Megatron Core)")
    rope_scaling_factor: float = option(
        "--rope-scaling-factor", default=8.0,
        help="the factor of --use-rope-scaling (Megatron's default 8; honoured here, where "
             "Megatron's own GPT builder always uses 8)")
    rotary_seq_len_interpolation_factor: Optional[int] = option(
        "--rotary-seq-len-interpolation-factor", default=None,
        help="RoPE positions multiplied by 1/N before the rotation (linear position "
             "interpolation; rope only)")
    use_rotary_position_embeddings: bool = option(
        "--use-rotary-position-embeddings", default=False,
        help="older spelling of --position-embedding-type rope (it wins over that flag, as in "
             "Megatron)")
    add_position_embedding: bool = option(
        "--no-position-embedding", default=True, action="store_false",
        dest="add_position_embedding",
        help="no learned position table: accepted with --position-embedding-type rope (which "
             "has none), refused otherwise (Megatron's deprecated flag)")
    deprecated_use_mcore_models: bool = option(
        "--use-mcore-models", default=False, dest="deprecated_use_mcore_models",
        help="accepted and ignored, as in Megatron (deprecated; our model is the one model)")
    group_query_attention: bool = option(
        "--group-query-attention", default=False,
        help="grouped-query attention: --num-query-groups key/value heads shared by "
             "the query heads")
    num_query_groups: Optional[int] = option(
        "--num-query-groups", default=None,
        help="key/value heads with --group-query-attention (default 1: multi-query); "
             "must divide --num-attention-heads, and be divisible by the TP size or "
             "divide it (then each group's key/value heads are replicated on "
             "TP/groups ranks)")
    untie_embeddings_and_output_weights: bool = option(
        "--untie-embeddings-and-output-weights", default=False,
        help="a separate column-parallel output layer (language_model.output_layer) "
             "instead of the word embeddings' transpose")
    recompute_granularity: Optional[str] = option(
        "--recompute-granularity", default=None, choices=RECOMPUTE_GRANULARITIES,
        help="activation recompute in backward: full (whole layers, see "
             "--recompute-method) or selective (the attention core only: QK^T, "
             "softmax, dropout, AV) by default; --recompute-modules names what selective "
             "recomputes (also mlp, moe, shared_experts)")
    recompute_method: Optional[str] = option(
        "--recompute-method", default=None, choices=RECOMPUTE_METHODS,
        help="with --recompute-granularity full: uniform recomputes every layer in "
             "chunks of --recompute-num-layers (default); block recomputes only the "
             "first --recompute-num-layers layers of each pipeline stage")
    recompute_num_layers: Optional[int] = option(
        "--recompute-num-layers", default=None,
        help="with full recompute: layers per chunk (uniform) or recomputed layers "
             "per pipeline stage (block, at most --num-layers / PP); default 1")
    recompute_modules: List[str] = option(
        "--recompute-modules", default_factory=lambda: ["core_attn"], nargs="*",
        help="with --recompute-granularity selective, what every layer recomputes: core_attn "
             "(QK^T, softmax, dropout, AV), mlp (a dense layer's MLP), moe (a whole MoE "
             "layer), shared_experts (an MoE layer's shared expert); default core_attn")
    moe_layer_recompute: bool = option(
        "--moe-layer-recompute", default=False, group="mixture of experts",
        help="deprecated in Megatron-LM: --recompute-granularity selective with moe added to "
             "--recompute-modules (refused with full recompute)")
    sequence_parallel: bool = option(
        "--sequence-parallel", default=False, group="parallel",
        help="split LayerNorm, dropout and residual activations along the sequence "
             "over the tensor-parallel ranks (all-gather / reduce-scatter instead of "
             "all-reduce); needs --tensor-model-parallel-size > 1 and --seq-length "
             "divisible by it")
    masked_softmax_fusion: bool = option("--masked-softmax-fusion", default=True,
                                         group="fused kernels",
                                         help="csrc/ causal and masked softmax kernels (CUDA)")
    bias_gelu_fusion: bool = option("--bias-gelu-fusion", default=True, group="fused kernels",
                                    help="torch.compile'd bias+GeLU (CUDA)")
    bias_dropout_fusion: bool = option("--bias-dropout-fusion", default=True,
                                       group="fused kernels",
                                       help="torch.compile'd bias+dropout+residual add (CUDA)")
    layernorm_fusion: bool = option("--layernorm-fusion", default=True, group="fused kernels",
                                    help="csrc/ LayerNorm kernel (CUDA)")
    """Also the csrc/ RMSNorm kernel (--normalization RMSNorm)."""
    bias_swiglu_fusion: bool = option("--bias-swiglu-fusion", default=True,
                                      group="fused kernels",
                                      help="torch.compile'd silu(gate) * up (CUDA, --swiglu)")
    cross_entropy_loss_fusion: bool = option(
        "--cross-entropy-loss-fusion", default=True, group="fused kernels",
        help="csrc/ cross-entropy kernels, no fp32 copy of the logits (CUDA)")
    use_flash_attn: bool = option(
        "--use-flash-attn", default=False, group="fused kernels",
        help="causal attention through SDPA's flash/efficient backends only")
    attention_backend: str = option(
        "--attention-backend", default="auto", choices=ATTENTION_BACKENDS, group="fused kernels",
        help="auto: SDPA for causal (measured default); flash: = --use-flash-attn; "
             "local: q k^T + fused softmax + @ v (Megatron's core attention); fused: SDPA "
             "restricted to its fused kernels (flash, memory-efficient, cuDNN); unfused: "
             "q k^T + PyTorch softmax + @ v")
    apply_rope_fusion: bool = option(
        "--no-rope-fusion", default=True, action="store_false", dest="apply_rope_fusion",
        group="fused kernels",
        help="Megatron's switch for its fused RoPE kernel; this project has none, so RoPE runs "
             "in PyTorch either way")
    params_dtype: str = "float32"
    """dtype of the module parameters: float32, float16 or bfloat16 (from the precision)."""
    attention_softmax_in_fp32: bool = option(
        "--attention-softmax-in-fp32", default=False, group="precision",
        help="attention softmax in fp32 for half-precision scores")
    apply_query_key_layer_scaling: bool = option(
        "--apply-query-key-layer-scaling", default=False, group="precision",
        help="scale Q K^T by 1/layer number, undone in an fp32 softmax (fp16 guard)")
    fp16_lm_cross_entropy: bool = option(
        "--fp16-lm-cross-entropy", default=False, group="precision",
        help="LM cross entropy on half-precision logits (default: fp32)")
    seed: int = 1234
    """Seed from which every parameter's initial value is derived (independent of TP/PP);
    the run's --seed (TrainingConfig.seed)."""
    moe: MoEConfig = field(default_factory=MoEConfig)
    """Mixture of Experts (--num-experts and the --moe-* flags); dense by default."""

    def __post_init__(self) -> None:
        if self.ffn_hidden_size is None:  # construction defaults, not rewrites (Megatron's)
            self.ffn_hidden_size = (int(4 * self.hidden_size * 2 / 3 / 64) * 64 if self.swiglu
                                    else 4 * self.hidden_size)
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        positive(self, (("num_layers", "--num-layers"), ("hidden_size", "--hidden-size"),
                         ("num_attention_heads", "--num-attention-heads"),
                         ("seq_length", "--seq-length"),
                         ("max_position_embeddings", "--max-position-embeddings"),
                         ("padded_vocab_size", "padded vocab size"),
                         ("ffn_hidden_size", "--ffn-hidden-size")))
        if self.kv_channels is None:  # Megatron's default; without it heads must divide h
            divisible("--hidden-size", self.hidden_size, "--num-attention-heads",
                       self.num_attention_heads)
            self.kv_channels = self.hidden_size // self.num_attention_heads
        positive(self, (("kv_channels", "--kv-channels"),))
        if self.normalization not in NORMALIZATIONS:
            raise ValueError(f"--normalization must be one of {', '.join(NORMALIZATIONS)}, got "
                             f"{self.normalization!r}")
        if (self.position_embedding_type == "learned_absolute"
                and self.seq_length > self.max_position_embeddings):
            raise ValueError(
                f"--seq-length ({self.seq_length}) is larger than --max-position-embeddings "
                f"({self.max_position_embeddings}); raise --max-position-embeddings or lower "
                "--seq-length")
        self.moe.check_against_model(self.num_layers, self.ffn_hidden_size, self.add_bias_linear)
        check_recompute(self)
        self._check_positions()
        self._check_block()
        self._check_query_groups()
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"--{name.replace('_', '-')} must be in [0, 1), got "
                                 f"{getattr(self, name)}")
        if self.params_dtype not in DTYPE_NAMES:
            raise ValueError(f"params_dtype must be one of {', '.join(DTYPE_NAMES)}, got "
                             f"{self.params_dtype!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"--attention-backend must be one of "
                             f"{', '.join(ATTENTION_BACKENDS)}, got {self.attention_backend!r}")
        if self.use_flash_attn and self.attention_backend not in ("auto", "flash"):
            raise ValueError(f"--use-flash-attn asks for SDPA flash attention but "
                             f"--attention-backend {self.attention_backend} asks for another "
                             "path; drop one of the two")

    def _check_positions(self) -> None:
        """--position-embedding-type and the RoPE settings agree."""
        kind = self.position_embedding_type
        if kind not in POSITION_EMBEDDING_TYPES:
            raise ValueError(f"--position-embedding-type must be one of "
                             f"{', '.join(POSITION_EMBEDDING_TYPES)}, got {kind!r}")
        if kind == "alibi" and self.attention_impl != "auto":
            flag = ("--use-flash-attn" if self.use_flash_attn
                    else f"--attention-backend {self.attention_backend}")
            raise ValueError(
                f"--position-embedding-type alibi with {flag}: ALiBi adds a bias to every score, "
                "which runs through SDPA's attention bias only; use --attention-backend auto")
        if self.use_rotary_position_embeddings and kind != "rope":
            raise ValueError(f"--use-rotary-position-embeddings means --position-embedding-type "
                             f"rope, but the type is {kind}; drop one of the two")
        if not self.add_position_embedding and kind != "rope":
            raise ValueError(f"--no-position-embedding with --position-embedding-type {kind}: "
                             "the flag is deprecated and valid with rope only (Megatron's rule); "
                             "drop it (--position-embedding-type says which positions are used)")
        if kind != "rope":
            for flag, value, default in (
                    ("--rotary-percent", self.rotary_percent, 1.0),
                    ("--rotary-base", self.rotary_base, 10000),
                    ("--use-rope-scaling", self.use_rope_scaling, False),
                    ("--rotary-seq-len-interpolation-factor",
                     self.rotary_seq_len_interpolation_factor, None)):
                if value != default:
                    raise ValueError(f"{flag} ({value}) applies to --position-embedding-type "
                                     f"rope only, but the type is {kind}; drop {flag} or use "
                                     "--position-embedding-type rope")
            return
        if self.rope_scaling_factor <= 0:
            raise ValueError(f"--rope-scaling-factor must be positive, got "
                             f"{self.rope_scaling_factor}")
        if (self.rotary_seq_len_interpolation_factor is not None
                and self.rotary_seq_len_interpolation_factor <= 0):
            raise ValueError(f"--rotary-seq-len-interpolation-factor must be positive, got "
                             f"{self.rotary_seq_len_interpolation_factor}")
        if not 0.0 < self.rotary_percent <= 1.0:
            raise ValueError(f"--rotary-percent must be in (0, 1], got {self.rotary_percent}")
        if self.rotary_base <= 0:
            raise ValueError(f"--rotary-base must be positive, got {self.rotary_base}")
        if self.rotary_dim < 2 or self.rotary_dim % 2:
            raise ValueError(
                f"--rotary-percent ({self.rotary_percent}) x head dimension ({self.head_dim} = "
                f"--hidden-size / --num-attention-heads) gives {self.rotary_dim} rotated "
                "channels; RoPE needs an even number >= 2: change --rotary-percent")

    def _check_block(self) -> None:
        """--squared-relu agrees with the other MLP flags."""
        if self.squared_relu and (self.swiglu or self.openai_gelu):
            other = "--swiglu" if self.swiglu else "--openai-gelu"
            raise ValueError(f"--squared-relu and {other} both choose the MLP activation; "
                             "drop one of them")

    def _check_query_groups(self) -> None:
        """--group-query-attention / --num-query-groups agree with the heads."""
        if not self.group_query_attention:
            if self.num_query_groups is not None:
                raise ValueError(f"--num-query-groups ({self.num_query_groups}) needs "
                                 "--group-query-attention; add it, or drop --num-query-groups")
            return
        if self.num_query_groups is None:  # Megatron's default: one group (multi-query)
            self.num_query_groups = 1
        positive(self, (("num_query_groups", "--num-query-groups"),))
        divisible("--num-attention-heads", self.num_attention_heads, "--num-query-groups",
                   self.num_query_groups)

    @property
    def head_dim(self) -> int:
        """Channels of each attention head: --kv-channels (default hidden / heads)."""
        return self.kv_channels

    @property
    def llama_features(self) -> List[str]:
        """The flags in use that change GPT-2's block (what paths written for GPT-2 only, such
        as the Hugging Face GPT-2 export, must refuse)."""
        used = [("--swiglu", self.swiglu), ("--normalization RMSNorm",
                                            self.normalization == "RMSNorm"),
                ("--disable-bias-linear", not self.add_bias_linear),
                ("--qk-layernorm", self.qk_layernorm),
                ("--squared-relu", self.squared_relu),
                ("--kv-channels", self.kv_channels * self.num_attention_heads
                 != self.hidden_size)]
        return [flag for flag, on in used if on]

    def require_gpt2_block(self, what: str) -> None:
        """Raise a ValueError naming `what` when this model uses `llama_features`."""
        if self.llama_features:
            raise ValueError(f"{what} does not support {', '.join(self.llama_features)} yet "
                             "(GPT-2's block only); train or convert this model without them, "
                             "or use the legacy checkpoint format")

    @property
    def qkv_bias(self) -> bool:
        """The QKV projection has a bias: --add-qkv-bias, or linear biases everywhere."""
        return self.add_bias_linear or self.add_qkv_bias

    @property
    def num_kv_heads(self) -> int:
        """Key/value heads: num_query_groups with grouped-query attention, else one per head."""
        return self.num_query_groups if self.group_query_attention else self.num_attention_heads

    @property
    def rotary_dim(self) -> int:
        """Channels of each head that RoPE rotates: int(head_dim x rotary_percent)."""
        return int(self.head_dim * self.rotary_percent)

    def recomputes(self, module: str) -> bool:
        """Selective recompute reruns `module` (a --recompute-modules name) in backward."""
        return module in selective_modules(self)

    @property
    def recompute(self) -> str:
        """The recompute mode as app.training.telemetry.flops names it: none, selective or full."""
        return self.recompute_granularity or "none"

    def recomputed_layers(self, pipeline_model_parallel_size: int,
                          virtual_pipeline_model_parallel_size: int = 1) -> int:
        """Layers of the whole model whose forward runs twice under full recompute (0 otherwise):
        `recompute_plan` of each model chunk (a pipeline stage, or a virtual stage with
        interleaving), times the chunks."""
        chunks = pipeline_model_parallel_size * virtual_pipeline_model_parallel_size
        return recompute_plan(self, self.num_layers // chunks).recomputed_layers * chunks

    @property
    def attention_impl(self) -> str:
        """The attention backend in effect: "flash" with --use-flash-attn, else the chosen one."""
        return "flash" if self.use_flash_attn else self.attention_backend

    def num_parameters(self) -> int:
        """Parameters of the whole model: 12Lh^2 + 13Lh + Vh + sh + 2h for the default GPT-2
        (4h MLP, learned positions, tied output layer); see `parameters_per_rank`."""
        return self.parameters_per_rank()

    def parameters_per_rank(self, tensor_model_parallel_size: int = 1,
                            pipeline_model_parallel_size: int = 1, pipeline_rank: int = 0,
                            expert_model_parallel_size: int = 1,
                            expert_tensor_parallel_size: Optional[int] = None) -> int:
        """Parameters one rank of pipeline stage `pipeline_rank` holds (the whole model with the
        defaults): the sum of `parameter_numels`."""
        return sum(self.parameter_numels(tensor_model_parallel_size, pipeline_model_parallel_size,
                                         pipeline_rank, expert_model_parallel_size,
                                         expert_tensor_parallel_size))

    def norm_numels(self, width: int) -> List[int]:
        """Parameter sizes of one norm over `width` channels: weight and bias (LayerNorm) or
        weight only (RMSNorm)."""
        return [width] * (1 if self.normalization == "RMSNorm" else 2)

    def parameter_numels(self, tensor_model_parallel_size: int = 1,
                         pipeline_model_parallel_size: int = 1,
                         pipeline_rank: int = 0, expert_model_parallel_size: int = 1,
                         expert_tensor_parallel_size: Optional[int] = None) -> List[int]:
        """The size of every parameter tensor one rank of pipeline stage `pipeline_rank` holds:
        its tensor-parallel shard of the stage's layers, plus the word embeddings (and the
        learned position table, replicated over TP) on the first stage, and the final LayerNorm
        and the output layer (untied, or the last stage's copy of the tied word embeddings) on
        the last. GQA shrinks the QKV projection (key/value heads replicated when there are
        fewer groups than TP ranks); RoPE and ALiBi have no position table; --swiglu doubles
        the first MLP projection, --disable-bias-linear drops the linears' biases (but QKV's with
        --add-qkv-bias), RMSNorm has no bias, --qk-layernorm adds two head-wide norms per layer.
        An MoE layer (--num-experts, --moe-layer-freq) holds the router [E, h], this rank's
        experts (E / EP of them, each FFN split over ETP, default TP) and the shared expert
        (split over TP) instead of the MLP."""
        t, pp = tensor_model_parallel_size, pipeline_model_parallel_size
        h, V = self.hidden_size, self.padded_vocab_size
        fc1 = self.ffn_hidden_size * (2 if self.swiglu else 1)  # gate and up halves (swiglu)
        kv_heads = max(1, self.num_kv_heads // t)  # fewer groups than TP: one group per rank
        qkv_rows = (self.num_attention_heads // t + 2 * kv_heads) * self.head_dim
        attn_width = self.num_attention_heads * self.head_dim // t
        norm = self.norm_numels(h)

        def linear(rows: int, cols: int, bias_rows: int, bias: bool = self.add_bias_linear
                   ) -> List[int]:
            return [rows * cols] + ([bias_rows] if bias else [])
        attention = (norm  # input norm
                     + linear(qkv_rows, h, qkv_rows, self.qkv_bias)  # QKV (column)
                     + (self.norm_numels(self.head_dim) * 2 if self.qk_layernorm else [])
                     + linear(h, attn_width, h)  # dense (row: whole bias)
                     + norm)  # post-attention norm
        mlp = linear(fc1 // t, h, fc1 // t) + linear(h, self.ffn_hidden_size // t, h)
        moe, etp = self.moe, expert_tensor_parallel_size or t
        experts: List[int] = []
        if moe.enabled:
            shared = moe.shared_expert_size * (2 if self.swiglu else 1)
            experts = ([moe.num_experts * h]  # router
                       + ([h] if moe.moe_shared_expert_gate else [])  # the shared expert's own
                       + ([shared // t * h, h * moe.shared_expert_size // t] if shared else [])
                       + moe.expert_numels(h, self.swiglu, expert_model_parallel_size, etp))
        first, last = pipeline_rank == 0, pipeline_rank == pp - 1
        sizes: List[int] = []
        if first:
            sizes.append(V * h // t)
            if self.position_embedding_type == "learned_absolute":
                sizes.append(self.max_position_embeddings * h)
        per_stage = self.num_layers // pp
        pattern = moe.layer_pattern(self.num_layers)[pipeline_rank * per_stage:
                                                     (pipeline_rank + 1) * per_stage]
        for is_moe in pattern:
            sizes += attention + (experts if is_moe else mlp)
        if last:
            sizes += norm  # final norm
            if self.untie_embeddings_and_output_weights or not first:
                sizes.append(V * h // t)
        return sizes
