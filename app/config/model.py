"""The GPT-2 model's configuration (`ModelConfig`) and the activation-recompute flag spellings.

Part of `app.config` (import from there); its rules follow the package's contract: checked
once in `__post_init__`, messages naming the flag and the fix.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from app.config.rules import divisible, positive
from app.utils.dtypes import DTYPE_NAMES

POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "alibi")
RECOMPUTE_GRANULARITIES = (None, "full", "selective")
ATTENTION_BACKENDS = ("auto", "flash", "local")


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
        if self.recompute_granularity not in RECOMPUTE_GRANULARITIES:
            raise ValueError(f"--recompute-granularity must be full or selective, got "
                             f"{self.recompute_granularity!r}")
        if self.recompute_method not in (None, "uniform", "block"):
            raise ValueError(f"--recompute-method must be uniform or block, got "
                             f"{self.recompute_method!r}")
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

    def recomputed_layers(self, pipeline_model_parallel_size: int) -> int:
        """Layers whose forward runs twice under full recompute (all with uniform, the first
        recompute_num_layers of each pipeline stage with block); 0 otherwise."""
        if self.recompute_granularity != "full":
            return 0
        if self.recompute_method == "uniform":
            return self.num_layers
        per_stage = self.num_layers // pipeline_model_parallel_size
        return min(self.recompute_num_layers, per_stage) * pipeline_model_parallel_size

    @property
    def attention_impl(self) -> str:
        """The attention backend in effect: "flash" with --use-flash-attn, else the chosen one."""
        return "flash" if self.use_flash_attn else self.attention_backend

    def num_parameters(self) -> int:
        """Total parameters of the model: 12Lh^2 + 13Lh + Vh + sh + 2h for the default GPT-2
        (4h MLP, learned positions, tied output layer); GQA shrinks the QKV projection, RoPE and
        ALiBi drop the s x h position table, untying adds a V x h output layer."""
        h, L, f = self.hidden_size, self.num_layers, self.ffn_hidden_size
        qkv_rows = (self.num_attention_heads + 2 * self.num_kv_heads) * self.head_dim
        per_layer = (qkv_rows * (h + 1) + h * h + h  # qkv + dense
                     + 2 * h * f + f + h + 4 * h)  # mlp, 2 LayerNorms
        total = L * per_layer + self.padded_vocab_size * h + 2 * h
        if self.position_embedding_type == "learned_absolute":
            total += self.max_position_embeddings * h
        if self.untie_embeddings_and_output_weights:
            total += self.padded_vocab_size * h
        return total


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
