"""The GPT-2 model's configuration (`ModelConfig`), its parameter count, the activation-recompute
plan (`recompute_plan`) and the recompute flag spellings.

Part of `app.config` (import from there); its rules follow the package's contract: checked
once in `__post_init__`, messages naming the flag and the fix.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from app.config.rules import divisible, positive
from app.utils.dtypes import DTYPE_NAMES

POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "alibi")
"""--position-embedding-type values."""
RECOMPUTE_GRANULARITIES = ("full", "selective")
"""--recompute-granularity values (unset: no recompute)."""
RECOMPUTE_METHODS = ("uniform", "block")
"""--recompute-method values (with full recompute)."""
ATTENTION_BACKENDS = ("auto", "flash", "local")
"""--attention-backend values."""


@dataclass
class ModelConfig:
    """Shape and regularisation of the GPT-2 model (Megatron-LM semantics)."""

    num_layers: int
    """Number of transformer layers (all pipeline stages together)."""
    hidden_size: int
    """Model width h."""
    num_attention_heads: int
    """Attention heads; must divide hidden_size and be divisible by the tensor-parallel size."""
    seq_length: int
    """Training sequence length s (tokens per sample, not counting the shifted label)."""
    max_position_embeddings: int
    """Rows of the learned position table; must be >= seq_length."""
    padded_vocab_size: int
    """Vocabulary rows of the embedding and logits, padded (see app.data.tokenizer.pad_vocab_size)."""
    ffn_hidden_size: Optional[int] = None
    """MLP width; None means 4 * hidden_size."""
    hidden_dropout: float = 0.1
    """Dropout on embeddings and on the output of attention and MLP."""
    attention_dropout: float = 0.1
    """Dropout on the attention probabilities."""
    layernorm_epsilon: float = 1e-5
    init_method_std: float = 0.02
    """Std of the normal init; the two output projections of a layer use std / sqrt(2 L)."""
    openai_gelu: bool = False
    """tanh-approximated GeLU (GPT-2's) instead of the exact erf form."""
    recompute_granularity: Optional[str] = None
    """Activation recompute: None (keep every activation), "full" (recompute whole layers in
    backward) or "selective" (only the attention core: QK^T, softmax, dropout, AV)."""
    recompute_method: Optional[str] = None
    """With full recompute: "uniform" (every layer, in chunks of recompute_num_layers) or
    "block" (only the first recompute_num_layers layers of each pipeline stage). Filled with
    "uniform" when full recompute is asked for without a method."""
    recompute_num_layers: Optional[int] = None
    """Layers per recomputed chunk (uniform) or recomputed layers per stage (block); filled
    with 1 for full recompute."""
    sequence_parallel: bool = False
    """Megatron's sequence parallelism (needs TP > 1): LayerNorm, dropout and residual run on
    a 1/TP slice of the sequence; all-gather / reduce-scatter replace the TP all-reduces."""
    position_embedding_type: str = "learned_absolute"
    """learned_absolute (GPT-2's table), rope (rotary, Su et al.) or alibi (Press et al.)."""
    rotary_percent: float = 1.0
    """Fraction of each head's channels that RoPE rotates (the rest pass through)."""
    rotary_base: int = 10000
    """RoPE's base: channel pair i turns at position p by p * base^(-2i / rotary_dim)."""
    group_query_attention: bool = False
    """Grouped-query attention: num_query_groups key/value heads shared by the query heads."""
    num_query_groups: Optional[int] = None
    """Key/value heads with group_query_attention (1 = multi-query attention); filled with 1
    (Megatron's default) when group_query_attention is on and it is not given."""
    untie_embeddings_and_output_weights: bool = False
    """A separate (column-parallel) output layer instead of the word embeddings' transpose."""
    bias_gelu_fusion: bool = True
    """--bias-gelu-fusion: gelu(x + b) as one torch.compile'd kernel on CUDA (docs/kernels.md)."""
    bias_dropout_fusion: bool = True
    """--bias-dropout-fusion: residual + dropout(x + b) as one torch.compile'd kernel on CUDA."""
    masked_softmax_fusion: bool = True
    """--masked-softmax-fusion: the csrc/ causal and masked softmax kernels where they apply."""
    layernorm_fusion: bool = True
    """--layernorm-fusion: the csrc/ LayerNorm kernel (fp32 statistics) on CUDA."""
    cross_entropy_loss_fusion: bool = True
    """--cross-entropy-loss-fusion: the csrc/ cross-entropy kernels (no fp32 logits) on CUDA."""
    attention_backend: str = "auto"
    """--attention-backend: auto (SDPA for causal), flash (SDPA flash/efficient only) or local
    (q k^T + fused softmax + @ v, Megatron's core attention); explicit masks always go local."""
    use_flash_attn: bool = False
    """--use-flash-attn: Megatron's spelling of attention_backend "flash"."""
    params_dtype: str = "float32"
    """dtype of the module parameters: float32, float16 or bfloat16."""
    attention_softmax_in_fp32: bool = False
    """Compute the attention softmax in fp32 for half-precision scores (explicit-mask path)."""
    apply_query_key_layer_scaling: bool = False
    """Scale Q K^T by 1/layer_number before the softmax and back inside it, in fp32 (fp16
    overflow guard); implies attention_softmax_in_fp32."""
    fp16_lm_cross_entropy: bool = False
    """Compute the LM cross entropy on half-precision logits (default: upcast to fp32)."""
    seed: int = 1234
    """Seed from which every parameter's initial value is derived (independent of TP/PP)."""

    def __post_init__(self) -> None:
        if self.ffn_hidden_size is None:  # a construction default, not a rewrite
            self.ffn_hidden_size = 4 * self.hidden_size
        positive(self, (("num_layers", "--num-layers"), ("hidden_size", "--hidden-size"),
                         ("num_attention_heads", "--num-attention-heads"),
                         ("seq_length", "--seq-length"),
                         ("max_position_embeddings", "--max-position-embeddings"),
                         ("padded_vocab_size", "padded vocab size"),
                         ("ffn_hidden_size", "--ffn-hidden-size")))
        divisible("--hidden-size", self.hidden_size, "--num-attention-heads",
                   self.num_attention_heads)
        if (self.position_embedding_type == "learned_absolute"
                and self.seq_length > self.max_position_embeddings):
            raise ValueError(
                f"--seq-length ({self.seq_length}) is larger than --max-position-embeddings "
                f"({self.max_position_embeddings}); raise --max-position-embeddings or lower "
                "--seq-length")
        self._check_recompute()
        self._check_positions()
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
        if self.use_flash_attn and self.attention_backend == "local":
            raise ValueError("--use-flash-attn asks for SDPA flash attention but "
                             "--attention-backend local asks for the fused-softmax path; "
                             "drop one of the two")

    def _check_recompute(self) -> None:
        """--recompute-granularity / --recompute-method / --recompute-num-layers agree."""
        if self.recompute_granularity not in (None,) + RECOMPUTE_GRANULARITIES:
            raise ValueError(f"--recompute-granularity must be one of "
                             f"{', '.join(RECOMPUTE_GRANULARITIES)}, got "
                             f"{self.recompute_granularity!r}")
        if self.recompute_method not in (None,) + RECOMPUTE_METHODS:
            raise ValueError(f"--recompute-method must be one of {', '.join(RECOMPUTE_METHODS)}, "
                             f"got {self.recompute_method!r}")
        if self.recompute_granularity == "full":  # construction defaults, as ffn_hidden_size
            self.recompute_method = self.recompute_method or "uniform"
            self.recompute_num_layers = self.recompute_num_layers or 1
            positive(self, (("recompute_num_layers", "--recompute-num-layers"),))
            return
        given = [flag for flag, value in (("--recompute-method", self.recompute_method),
                                          ("--recompute-num-layers", self.recompute_num_layers))
                 if value is not None]
        if given:
            raise ValueError(
                f"{' and '.join(given)} apply to --recompute-granularity full only (got "
                f"{self.recompute_granularity or 'no recompute'}); selective recompute always "
                "recomputes the attention core of every layer: drop "
                f"{' and '.join(given)} or use --recompute-granularity full")

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
                "which flash attention and the fused softmax kernels do not take; use "
                "--attention-backend auto (SDPA with the bias)")
        if kind != "rope":
            for flag, value, default in (("--rotary-percent", self.rotary_percent, 1.0),
                                         ("--rotary-base", self.rotary_base, 10000)):
                if value != default:
                    raise ValueError(f"{flag} ({value}) applies to --position-embedding-type "
                                     f"rope only, but the type is {kind}; drop {flag} or use "
                                     "--position-embedding-type rope")
            return
        if not 0.0 < self.rotary_percent <= 1.0:
            raise ValueError(f"--rotary-percent must be in (0, 1], got {self.rotary_percent}")
        if self.rotary_base <= 0:
            raise ValueError(f"--rotary-base must be positive, got {self.rotary_base}")
        if self.rotary_dim < 2 or self.rotary_dim % 2:
            raise ValueError(
                f"--rotary-percent ({self.rotary_percent}) x head dimension ({self.head_dim} = "
                f"--hidden-size / --num-attention-heads) gives {self.rotary_dim} rotated "
                "channels; RoPE needs an even number >= 2: change --rotary-percent")

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
        return self.hidden_size // self.num_attention_heads

    @property
    def num_kv_heads(self) -> int:
        """Key/value heads: num_query_groups with grouped-query attention, else one per head."""
        return self.num_query_groups if self.group_query_attention else self.num_attention_heads

    @property
    def rotary_dim(self) -> int:
        """Channels of each head that RoPE rotates: int(head_dim x rotary_percent)."""
        return int(self.head_dim * self.rotary_percent)

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
                            pipeline_model_parallel_size: int = 1, pipeline_rank: int = 0) -> int:
        """Parameters one rank of pipeline stage `pipeline_rank` holds (the whole model with the
        defaults): its tensor-parallel shard of the stage's layers, plus the word embeddings
        (and the learned position table, replicated over TP) on the first stage, and the final
        LayerNorm and the output layer (untied, or the last stage's copy of the tied word
        embeddings) on the last. GQA shrinks the QKV projection (key/value heads replicated
        when there are fewer groups than TP ranks); RoPE and ALiBi have no position table."""
        t, pp = tensor_model_parallel_size, pipeline_model_parallel_size
        h, f, V = self.hidden_size, self.ffn_hidden_size, self.padded_vocab_size
        kv_heads = max(1, self.num_kv_heads // t)  # fewer groups than TP: one group per rank
        qkv_rows = (self.num_attention_heads // t + 2 * kv_heads) * self.head_dim
        per_layer = (qkv_rows * (h + 1) + h * h // t + h  # QKV (column), dense (row: whole bias)
                     + (h * f + f) // t + f * h // t + h  # MLP h->f (column), f->h (row)
                     + 4 * h)  # two LayerNorms
        total = self.num_layers // pp * per_layer
        first, last = pipeline_rank == 0, pipeline_rank == pp - 1
        embedding = V * h // t
        if first:
            total += embedding
            if self.position_embedding_type == "learned_absolute":
                total += self.max_position_embeddings * h
        if last:
            total += 2 * h  # final LayerNorm
            if self.untie_embeddings_and_output_weights or not first:
                total += embedding
        return total


@dataclass(frozen=True)
class RecomputePlan:
    """What one model chunk's forward (its consecutive layers) recomputes in backward."""

    granularity: str
    """none, selective (every layer's attention core) or full (the chunks marked below)."""
    chunks: Tuple[Tuple[int, bool], ...]
    """The chunk's layers in order, as (consecutive layers, run through one checkpoint?)."""

    @property
    def recomputed_layers(self) -> int:
        """Layers whose whole forward runs twice (full recompute)."""
        return sum(n for n, recomputed in self.chunks if recomputed)

    @property
    def largest_recomputed_chunk(self) -> int:
        """Layers rerun at once in backward (their activations live together); 0 without."""
        return max((n for n, recomputed in self.chunks if recomputed), default=0)

    @property
    def checkpointed_regions(self) -> int:
        """Checkpoint calls in one forward: one attention core per layer (selective), one per
        recomputed chunk (full), 0 without recompute."""
        if self.granularity == "selective":
            return sum(n for n, _ in self.chunks)
        return sum(1 for _, recomputed in self.chunks if recomputed)


def recompute_plan(config: ModelConfig, layers: int) -> RecomputePlan:
    """The recompute of a model chunk of `layers` consecutive layers (a pipeline stage, or one
    virtual stage with interleaving), as Megatron-LM does it: full uniform checkpoints chunks
    of recompute_num_layers layers (the last may be shorter); full block checkpoints the first
    recompute_num_layers layers one by one and keeps the others; selective recomputes every
    layer's attention core and checkpoints no whole layer."""
    if config.recompute_granularity != "full":
        return RecomputePlan(config.recompute, ((layers, False),) if layers else ())
    n = config.recompute_num_layers
    if config.recompute_method == "uniform":
        chunks = tuple((min(n, layers - i), True) for i in range(0, layers, n))
    else:
        block = min(n, layers)
        chunks = ((1, True),) * block + (((layers - block, False),) if layers > block else ())
    return RecomputePlan("full", chunks)


def resolve_recompute_flags(checkpoint_activations: bool, checkpoint_num_layers: Optional[int],
                            granularity: Optional[str], method: Optional[str],
                            num_layers: Optional[int]
                            ) -> Tuple[Optional[str], Optional[str], Optional[int]]:
    """(granularity, method, num_layers) from Megatron's two spellings of activation recompute.

    `--checkpoint-activations [--checkpoint-num-layers N]` (the older spelling) means
    `--recompute-granularity full --recompute-method uniform --recompute-num-layers N`; mixing
    the spellings is accepted only where they agree. `--checkpoint-num-layers` alone does
    nothing, as in Megatron-LM.
    """
    if not checkpoint_activations:
        return granularity, method, num_layers
    for flag, value, legacy in (("--recompute-granularity", granularity, "full"),
                                ("--recompute-method", method, "uniform"),
                                ("--recompute-num-layers", num_layers, checkpoint_num_layers)):
        if value is not None and legacy is not None and value != legacy:
            raise ValueError(
                f"--checkpoint-activations means --recompute-granularity full "
                f"--recompute-method uniform --recompute-num-layers <--checkpoint-num-layers>, "
                f"which contradicts {flag} {value}; use one spelling")
    return "full", "uniform", num_layers or checkpoint_num_layers or 1
