"""Configuration dataclasses: the only way configuration reaches library code.

`arguments.py` parses the command line (Megatron-LM flag names plus DeepSpeed's) and converts
the namespace once into these dataclasses. Nothing under `app/` reads argparse or a global
args object. Each dataclass validates its own fields in `__post_init__`; cross-config rules
(for example the global batch against the data-parallel size) are checked by
`validate_configs`, which names every value involved in its messages.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import List, Optional, Tuple


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
    checkpoint_activations: bool = False
    """Recompute transformer layers in backward."""
    checkpoint_num_layers: int = 1
    """Layers per recomputed chunk when checkpoint_activations is on."""
    bias_gelu_fusion: bool = True
    """Use the fused bias+GeLU op (CUDA kernel or torch.jit fallback); numerics are identical."""
    masked_softmax_fusion: bool = True
    """Use the fused scale+mask+softmax op for the explicit-mask attention path."""
    params_dtype: str = "float32"
    """dtype of the module parameters: float32, float16 or bfloat16."""
    seed: int = 1234
    """Seed from which every parameter's initial value is derived (independent of TP/PP)."""

    def __post_init__(self) -> None:
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                     "max_position_embeddings", "padded_vocab_size", "ffn_hidden_size",
                     "checkpoint_num_layers"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) is not divisible by "
                f"num_attention_heads ({self.num_attention_heads})")
        if self.seq_length > self.max_position_embeddings:
            raise ValueError(
                f"seq_length ({self.seq_length}) exceeds max_position_embeddings "
                f"({self.max_position_embeddings}); raise --max-position-embeddings")
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if self.params_dtype not in ("float32", "float16", "bfloat16"):
            raise ValueError(f"params_dtype must be float32, float16 or bfloat16, got {self.params_dtype}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def num_parameters(self) -> int:
        """Total parameters of the (tied-embedding) model: 12Lh^2 + 13Lh + Vh + sh + 2h for 4h MLP."""
        h, L, f = self.hidden_size, self.num_layers, self.ffn_hidden_size
        per_layer = 4 * h * h + 4 * h + 2 * h * f + f + h + 4 * h  # qkv+dense, mlp, 2 LayerNorms
        return L * per_layer + self.padded_vocab_size * h + self.max_position_embeddings * h + 2 * h


@dataclass
class ParallelConfig:
    """Parallel layout: world = tensor x pipeline x data (Megatron's rank order)."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    world_size: int = 1
    distributed_backend: str = "gloo"
    """torch.distributed backend: gloo (CPU) or nccl (CUDA); arguments.py defaults it by device."""
    local_rank: Optional[int] = None
    """--local_rank from a launcher; None means read LOCAL_RANK from the environment."""

    def __post_init__(self) -> None:
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "world_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        mp = self.tensor_model_parallel_size * self.pipeline_model_parallel_size
        if self.world_size % mp:
            raise ValueError(
                f"world size ({self.world_size}) is not divisible by tensor_model_parallel_size "
                f"({self.tensor_model_parallel_size}) x pipeline_model_parallel_size "
                f"({self.pipeline_model_parallel_size})")

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // (self.tensor_model_parallel_size * self.pipeline_model_parallel_size)


@dataclass
class OptimizerConfig:
    """AdamW hyper-parameters, gradient clipping and Megatron's LR schedule."""

    lr: float = 1.5e-4
    min_lr: float = 0.0
    lr_decay_style: str = "cosine"
    """constant | linear | cosine | exponential."""
    lr_decay_iters: Optional[int] = None
    """Iterations over which the LR decays to min_lr; None means train_iters (filled by arguments.py)."""
    lr_warmup_iters: int = 0
    """Linear-warmup iterations (arguments.py turns --lr-warmup-fraction/--warmup into this)."""
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    """Max global gradient norm; 0 disables clipping."""
    override_opt_param_scheduler: bool = False
    """On resume, use this run's LR settings instead of the checkpoint's."""
    use_checkpoint_opt_param_scheduler: bool = False
    """On resume, adopt the checkpoint's LR settings, ignoring this run's."""

    def __post_init__(self) -> None:
        if self.lr_decay_style not in ("constant", "linear", "cosine", "exponential"):
            raise ValueError(f"lr_decay_style must be constant, linear, cosine or exponential, "
                             f"got {self.lr_decay_style!r}")
        if self.lr < 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ValueError(f"need 0 <= min_lr ({self.min_lr}) <= lr ({self.lr})")
        if self.lr_warmup_iters < 0:
            raise ValueError(f"lr_warmup_iters must be >= 0, got {self.lr_warmup_iters}")
        if self.clip_grad < 0:
            raise ValueError(f"clip_grad must be >= 0, got {self.clip_grad}")
        if self.override_opt_param_scheduler and self.use_checkpoint_opt_param_scheduler:
            raise ValueError("--override-opt_param-scheduler and "
                             "--use-checkpoint-opt_param-scheduler are mutually exclusive")


@dataclass
class PrecisionConfig:
    """Numeric precision. fp16/bf16 run through DeepSpeed for now (the native path is fp32);
    the loss-scale fields, when given on the command line, fill the DeepSpeed JSON's fp16 block."""

    fp16: bool = False
    bf16: bool = False
    loss_scale: Optional[float] = None
    """Static loss scale; None means dynamic scaling."""
    initial_loss_scale: float = 2.0 ** 32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2

    def __post_init__(self) -> None:
        if self.fp16 and self.bf16:
            raise ValueError("--fp16 and --bf16 are mutually exclusive; pick one")


@dataclass
class DataConfig:
    """Where the training data lives and how batches are built from it."""

    data_path: List[str] = field(default_factory=list)
    """One prefix, or a weighted list [w1, p1, w2, p2, ...] as strings (Megatron's --data-path)."""
    split: str = "969,30,1"
    data_cache_path: Optional[str] = None
    tokenizer_type: str = "GPT2BPETokenizer"
    vocab_file: Optional[str] = None
    merge_file: Optional[str] = None
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False
    num_workers: int = 2
    """torch DataLoader worker processes."""


@dataclass
class TrainingConfig:
    """Batch sizes, iteration counts, evaluation, logging and exit conditions."""

    micro_batch_size: int
    global_batch_size: int
    train_iters: int
    seed: int = 1234
    log_interval: int = 100
    eval_interval: int = 1000
    eval_iters: int = 100
    exit_interval: Optional[int] = None
    exit_duration_in_mins: Optional[float] = None
    tensorboard_dir: Optional[str] = None
    metrics_file: Optional[str] = None
    peak_flops: Optional[float] = None
    """Peak FLOP/s per rank used for MFU; None means measured/looked up at start."""

    def __post_init__(self) -> None:
        for name in ("micro_batch_size", "global_batch_size", "train_iters", "log_interval",
                     "eval_interval"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.eval_iters < 0:
            raise ValueError(f"eval_iters must be >= 0, got {self.eval_iters}")

    def num_micro_batches(self, data_parallel_size: int) -> int:
        """Micro-batches per rank per iteration: global / (micro x DP), validated exactly."""
        per_step = self.micro_batch_size * data_parallel_size
        if self.global_batch_size % per_step:
            raise ValueError(
                f"global_batch_size ({self.global_batch_size}) is not divisible by "
                f"micro_batch_size ({self.micro_batch_size}) x data-parallel size "
                f"({data_parallel_size})")
        return self.global_batch_size // per_step


@dataclass
class CheckpointConfig:
    """Megatron-layout (or DeepSpeed) checkpoint saving and loading."""

    save: Optional[str] = None
    save_interval: Optional[int] = None
    load: Optional[str] = None
    no_save_optim: bool = False
    no_save_rng: bool = False
    no_load_optim: bool = False
    no_load_rng: bool = False
    finetune: bool = False
    keep_last_n_checkpoints: Optional[int] = None
    """After each committed save, delete all but the newest N iter_ directories; None keeps all."""

    def __post_init__(self) -> None:
        if self.keep_last_n_checkpoints is not None and self.keep_last_n_checkpoints < 1:
            raise ValueError(f"--keep-last-n-checkpoints must be at least 1, got "
                             f"{self.keep_last_n_checkpoints} (leave it out to keep every checkpoint)")


@dataclass
class DeepSpeedConfig:
    """The DeepSpeed path: enabled by --deepspeed with --deepspeed_config <json>."""

    enabled: bool = False
    config_path: Optional[str] = None
    activation_checkpointing: bool = False
    """--deepspeed-activation-checkpointing: use deepspeed.checkpointing instead of ours."""
    mpi: bool = False
    """--deepspeed_mpi: discover ranks through mpi4py."""


@dataclass
class LaunchConfig:
    """What start-up needs before the world size and the tokenizer are known."""

    distributed_backend: Optional[str]
    """gloo | nccl; None picks nccl with CUDA, else gloo."""
    deepspeed_mpi: bool
    tokenizer_type: str
    vocab_file: Optional[str]
    merge_file: Optional[str]
    make_vocab_size_divisible_by: int
    tensor_model_parallel_size: int


@dataclass
class RunConfig:
    """Everything one training run needs; built once by arguments.build_run_config."""

    model: ModelConfig
    parallel: ParallelConfig
    optimizer: OptimizerConfig
    precision: PrecisionConfig
    data: DataConfig
    training: TrainingConfig
    checkpoint: CheckpointConfig
    deepspeed: DeepSpeedConfig
    raw_vocab_size: int = 0
    """Tokenizer vocabulary before padding (recorded in checkpoints)."""
    make_vocab_size_divisible_by: int = 128


def validate_configs(cfg: RunConfig) -> None:
    """Check every rule that spans two configs; each message names the values involved."""
    m, p, t = cfg.model, cfg.parallel, cfg.training
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    divisibility = (("num_attention_heads", m.num_attention_heads, "tensor_model_parallel_size", tp),
                    ("ffn_hidden_size", m.ffn_hidden_size, "tensor_model_parallel_size", tp),
                    ("padded vocab size", m.padded_vocab_size, "tensor_model_parallel_size", tp),
                    ("num_layers", m.num_layers, "pipeline_model_parallel_size", pp))
    for name, value, divisor_name, divisor in divisibility:
        if value % divisor:
            raise ValueError(f"{name} ({value}) is not divisible by {divisor_name} ({divisor})")
    t.num_micro_batches(p.data_parallel_size)
    if cfg.deepspeed.enabled and pp > 1:
        raise ValueError(f"pipeline_model_parallel_size ({pp}) > 1 is not supported with "
                         "--deepspeed yet; use the native path or --pipeline-model-parallel-size 1")
    if cfg.deepspeed.enabled and not cfg.deepspeed.config_path:
        raise ValueError("--deepspeed needs --deepspeed_config <path to JSON>")
    if cfg.precision.fp16 and m.params_dtype != "float16":
        m.params_dtype = "float16"
    if cfg.precision.bf16 and m.params_dtype != "bfloat16":
        m.params_dtype = "bfloat16"
    ck = cfg.checkpoint
    if ck.save_interval is not None and ck.save_interval <= 0:
        raise ValueError(f"--save-interval must be positive, got {ck.save_interval}")


def model_flops_per_token(m: ModelConfig) -> float:
    """Megatron model FLOPs per token (fwd+bwd, no recompute): 72 L h^2 (1 + s/(6h) + V/(12 L h)).

    This is the formula of Narayanan et al. 2021 divided by B*s; it assumes ffn = 4h.
    """
    L, h, s, V = m.num_layers, m.hidden_size, m.seq_length, m.padded_vocab_size
    return 72.0 * L * h * h * (1.0 + s / (6.0 * h) + V / (12.0 * L * h))


def split_weights(splits: str) -> Tuple[float, float, float]:
    """'969,30,1' -> normalised (train, valid, test) fractions; '90/5/5' also accepted."""
    sep = "," if "," in splits else "/"
    parts = [float(x) for x in splits.split(sep) if x.strip()]
    if not parts or len(parts) > 3 or any(x < 0 for x in parts) or not math.isfinite(sum(parts)):
        raise ValueError(f"--split {splits!r} must be up to three non-negative numbers, e.g. 969,30,1")
    while len(parts) < 3:
        parts.append(0.0)
    total = sum(parts)
    if total <= 0:
        raise ValueError(f"--split {splits!r} sums to zero")
    return tuple(x / total for x in parts)  # type: ignore[return-value]
