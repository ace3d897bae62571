"""OptimizerConfig: the optimizer (AdamW, SGD or Muon), its flags' choices and rules, gradient
clipping and Megatron's LR schedule (pure; `app.config` re-exports every name, and RunConfig
calls `check_muon_layout` for the rules that need the parallel layout)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Optional, Tuple

from app.config.options import option
from app.config.rules import positive

OPTIMIZERS = ("adam", "sgd", "muon")
"""--optimizer choices (Megatron's names; adam is AdamW)."""
MUON_TP_MODES = ("blockwise", "duplicated", "distributed")
"""--muon-tp-mode: how Newton-Schulz treats a tensor-parallel shard (app/optim/muon.py)."""
MUON_SCALE_MODES = ("spectral", "unit_rms_norm", "shape_scaling")
MUON_COEFFICIENT_TYPES = ("simple", "quintic", "polar_express")
MUON_MATMUL_PRECISIONS = ("low", "medium", "high")
MUON_SCALAR_OPTIMIZERS = ("adam",)
LR_DECAY_STYLES = ("constant", "linear", "cosine", "exponential")
"""Megatron's LR decay styles (--lr-decay-style)."""


def check_optimizer_choice(config: Any) -> None:
    """--optimizer and the Muon flags of an OptimizerConfig: known names, steps >= 1, momenta
    in [0, 1); the message names the flag."""
    for flag, value, allowed in (
            ("--optimizer", config.optimizer, OPTIMIZERS),
            ("--muon-tp-mode", config.muon_tp_mode, MUON_TP_MODES),
            ("--muon-scale-mode", config.muon_scale_mode, MUON_SCALE_MODES),
            ("--muon-coefficient-type", config.muon_coefficient_type, MUON_COEFFICIENT_TYPES),
            ("--muon-fp32-matmul-prec", config.muon_fp32_matmul_prec, MUON_MATMUL_PRECISIONS),
            ("--muon-scalar-optimizer", config.muon_scalar_optimizer, MUON_SCALAR_OPTIMIZERS)):
        if value not in allowed:
            raise ValueError(f"{flag} must be one of {', '.join(allowed)}, got {value!r}")
    if config.muon_num_ns_steps < 1:
        raise ValueError(f"--muon-num-ns-steps must be >= 1, got {config.muon_num_ns_steps}")
    for flag, value in (("--muon-momentum", config.muon_momentum),
                        ("--sgd-momentum", config.sgd_momentum)):
        if not 0.0 <= value < 1.0:
            raise ValueError(f"{flag} must be in [0, 1), got {value}")


def check_muon_layout(config: Any, num_kv_heads: int, tensor_model_parallel_size: int) -> None:
    """--muon-no-split-qkv orthogonalises the fused QKV matrix whole, which a rank's rows do not
    tile when key/value heads are replicated over TP ranks (groups < TP): refused unless
    blockwise."""
    tp = tensor_model_parallel_size
    if (config.optimizer == "muon" and not config.muon_split_qkv
            and config.muon_tp_mode != "blockwise" and num_kv_heads < tp):
        raise ValueError(
            f"--muon-no-split-qkv with --muon-tp-mode {config.muon_tp_mode}: --num-query-groups "
            f"({num_kv_heads}) < --tensor-model-parallel-size ({tp}) replicates key/value rows "
            "over ranks, so the fused QKV matrix cannot be assembled from the shards; drop "
            "--muon-no-split-qkv (q, k and v are then orthogonalised apart) or use "
            "--muon-tp-mode blockwise")


@dataclass(kw_only=True)
class OptimizerConfig:
    """The optimizer (AdamW, SGD or Muon) and its hyper-parameters, gradient clipping and
    Megatron's LR schedule. lr_decay_iters and lr_warmup_iters hold the values in effect:
    arguments.py fills the first from --train-iters and the second from --lr-warmup-fraction
    when given; the Muon fields are described in app/optim/muon.py and docs/parallelism.md."""

    FLAG_GROUP: ClassVar[Tuple[str, str]] = ("optimizer", "AdamW, clipping and the LR schedule")

    lr: float = option("--lr", default=0.00015)
    min_lr: float = option("--min-lr", default=0.0)
    lr_decay_style: str = option(
        "--lr-decay-style", default="linear", choices=LR_DECAY_STYLES,
        help="LR decay after the warmup, from --lr to --min-lr over --lr-decay-iters")
    lr_decay_iters: Optional[int] = option(
        "--lr-decay-iters", default=None,
        help="default: --train-iters")
    lr_warmup_fraction: Optional[float] = option(
        "--lr-warmup-fraction", "--warmup", default=None,
        help="warmup as a fraction of --lr-decay-iters")
    lr_warmup_iters: int = option("--lr-warmup-iters", default=0)
    lr_decay_samples: Optional[int] = option(
        "--lr-decay-samples", default=None,
        help="LR decay length in samples (with --train-samples or a batch-size schedule; "
             "default: --train-samples, else --lr-decay-iters x --global-batch-size)")
    lr_warmup_samples: int = option(
        "--lr-warmup-samples", default=0,
        help="LR warmup in samples (with --train-samples or a batch-size schedule)")
    lr_in_samples: bool = False
    """The LR schedule counts samples (Megatron's sample-based schedule: --train-samples or a
    batch-size schedule, set by arguments.py), stepping by each iteration's global batch;
    lr_decay_samples and lr_warmup_samples then hold the values in effect."""
    decoupled_lr: Optional[float] = option(
        "--decoupled-lr", default=None,
        help="peak LR of the word embeddings and the output layer (Megatron's "
             "is_embedding_or_output_parameter; the position table keeps --lr), on the same "
             "warm-up and decay as --lr")
    decoupled_min_lr: Optional[float] = option(
        "--decoupled-min-lr", default=None,
        help="with --decoupled-lr: the floor those parameters decay to (default --min-lr)")
    weight_decay: float = option("--weight-decay", default=0.01)
    adam_beta1: float = option("--adam-beta1", default=0.9)
    adam_beta2: float = option("--adam-beta2", default=0.999)
    adam_eps: float = option("--adam-eps", default=1e-08)
    clip_grad: float = option(
        "--clip-grad", default=1.0,
        help="0 disables clipping")
    override_opt_param_scheduler: bool = option(
        "--override-opt_param-scheduler", "--override-opt-param-scheduler", default=False,
        help="on resume, use this run's LR settings, not the checkpoint's")
    use_checkpoint_opt_param_scheduler: bool = option(
        "--use-checkpoint-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler", default=False,
        help="on resume, keep the checkpoint's LR settings")
    use_distributed_optimizer: bool = option(
        "--use-distributed-optimizer", default=False,
        help="native path: shard the fp32 main weights and AdamW states over the data-parallel "
             "ranks (gradients reduce-scattered in buckets, weights all-gathered after the step);"
             " checkpoints stay layout-independent, so a run resumes at another data-parallel "
             "size or without the flag")
    overlap_grad_reduce: bool = option(
        "--overlap-grad-reduce", default=False,
        help="with --use-distributed-optimizer: reduce-scatter each gradient bucket while "
             "backward still runs, once its last micro-batch is in")
    overlap_param_gather: bool = option(
        "--overlap-param-gather", default=False,
        help="with --overlap-grad-reduce: all-gather updated weights in the background; each "
             "module waits for its bucket at its next forward")
    ddp_bucket_size: Optional[int] = option(
        "--ddp-bucket-size", default=None,
        help="elements per gradient bucket of the distributed optimizer (default max(40M, 1M x "
             "data-parallel size))")
    optimizer: str = option(
        "--optimizer", default="adam", choices=OPTIMIZERS,
        help="adam: AdamW; sgd: SGD with --sgd-momentum; muon: Muon for the 2-D weights of the "
             "transformer layers, --muon-scalar-optimizer for the embeddings, output layer, "
             "biases and LayerNorms. With --deepspeed, Muon is DeepSpeed's, set in the JSON "
             "(\"optimizer\": {\"type\": \"Muon\"}), which takes only --muon-momentum, and "
             "--muon-tp-mode blockwise at TP > 1")
    sgd_momentum: float = option(
        "--sgd-momentum", default=0.9,
        help="momentum of --optimizer sgd")
    muon_momentum: float = option(
        "--muon-momentum", default=0.9,
        help="EMA coefficient of Muon's momentum buffer, in [0, 1) (default 0.9)")
    muon_nesterov: bool = option(
        "--muon-nesterov", default=False,
        help="orthogonalise the Nesterov blend of gradient and momentum")
    muon_split_qkv: bool = option(
        "--muon-no-split-qkv", default=True, action="store_false", dest="muon_split_qkv",
        help="orthogonalise the fused QKV weight whole (default: its query, key and value rows as"
             " three matrices); with fewer --num-query-groups than TP ranks it needs "
             "--muon-tp-mode blockwise")
    muon_scale_mode: str = option(
        "--muon-scale-mode", default="spectral", choices=MUON_SCALE_MODES,
        help="update scale of an m x n matrix: spectral sqrt(max(m, n)), unit_rms_norm sqrt(m / "
             "n), shape_scaling sqrt(max(1, m / n))")
    muon_num_ns_steps: int = option(
        "--muon-num-ns-steps", default=5,
        help="Newton-Schulz iterations, >= 1 (default 5)")
    muon_coefficient_type: str = option(
        "--muon-coefficient-type", default="quintic", choices=MUON_COEFFICIENT_TYPES,
        help="Newton-Schulz coefficients: quintic (five tuned steps, cycled), simple (Keller "
             "Jordan's one tuple), polar_express")
    muon_fp32_matmul_prec: str = option(
        "--muon-fp32-matmul-prec", default="medium", choices=MUON_MATMUL_PRECISIONS,
        help="Newton-Schulz precision: medium bf16; high fp32 (TF32 on CUDA); low fp32 at the "
             "process's matmul precision")
    muon_tp_mode: str = option(
        "--muon-tp-mode", default="duplicated", choices=MUON_TP_MODES,
        help="with TP > 1: duplicated all-gathers each matrix and orthogonalises it whole; "
             "distributed runs Newton-Schulz on the shards (an all-reduce per step); both give "
             "the one-process update. blockwise orthogonalises each shard alone (no "
             "communication; the update depends on the TP size)")
    muon_extra_scale_factor: float = option(
        "--muon-extra-scale-factor", default=1.0,
        help="extra factor on Muon's update (0.2 with spectral roughly matches AdamW's update "
             "RMS)")
    muon_scalar_optimizer: str = option(
        "--muon-scalar-optimizer", default="adam", choices=MUON_SCALAR_OPTIMIZERS,
        help="optimizer of the parameters Muon leaves out")


    def _check_sample_schedule(self) -> None:
        """The sample-based LR flags belong to a sample-based schedule, and fit in it."""
        given = [flag for flag, on in (("--lr-decay-samples", self.lr_decay_samples is not None),
                                       ("--lr-warmup-samples", self.lr_warmup_samples != 0))
                 if on]
        if given and not self.lr_in_samples:
            raise ValueError(f"{' and '.join(given)} set a sample-based LR schedule, which "
                             "needs --train-samples or a batch-size schedule "
                             "(--rampup-batch-size, --step-batch-size-schedule); use "
                             "--lr-decay-iters / --lr-warmup-iters instead")
        if self.lr_in_samples:
            decay = self.lr_decay_samples
            if decay is None or decay <= 0 or not 0 <= self.lr_warmup_samples <= decay:
                raise ValueError(f"LR schedule in samples: warmup {self.lr_warmup_samples} and "
                                 f"decay {decay} samples must satisfy 0 <= warmup <= decay, "
                                 "decay > 0 (--lr-warmup-samples, --lr-decay-samples)")

    def _check_decoupled(self) -> None:
        """--decoupled-lr / --decoupled-min-lr form a schedule like --lr / --min-lr."""
        if self.decoupled_lr is None:  # a --decoupled-min-lr alone is unread (app.config.unread)
            return
        floor = self.decoupled_min_lr if self.decoupled_min_lr is not None else self.min_lr
        if self.decoupled_lr < 0 or not 0.0 <= floor <= self.decoupled_lr:
            raise ValueError(f"the decoupled LR floor ({floor}, --decoupled-min-lr or --min-lr) "
                             f"must be between 0 and --decoupled-lr ({self.decoupled_lr})")

    @property
    def decoupled_lr_range(self) -> Optional[Tuple[float, float]]:
        """(max, min) LR of the embedding and output-layer group with --decoupled-lr, else None."""
        if self.decoupled_lr is None:
            return None
        floor = self.decoupled_min_lr if self.decoupled_min_lr is not None else self.min_lr
        return float(self.decoupled_lr), float(floor)

    def __post_init__(self) -> None:
        check_optimizer_choice(self)
        if self.lr_decay_style not in LR_DECAY_STYLES:
            raise ValueError(f"lr_decay_style (--lr-decay-style) must be one of "
                             f"{', '.join(LR_DECAY_STYLES)}, got {self.lr_decay_style!r}")
        if self.lr < 0 or not 0.0 <= self.min_lr <= self.lr:
            raise ValueError(f"--min-lr ({self.min_lr}) must be between 0 and --lr ({self.lr})")
        self._check_decoupled()
        if self.lr_warmup_iters < 0:
            raise ValueError(f"--lr-warmup-iters must be >= 0, got {self.lr_warmup_iters}")
        self._check_sample_schedule()
        if self.lr_decay_iters is not None:
            if self.lr_decay_iters <= 0:
                raise ValueError(f"--lr-decay-iters must be positive, got {self.lr_decay_iters}")
            if self.lr_warmup_iters > self.lr_decay_iters:
                raise ValueError(f"warmup iterations ({self.lr_warmup_iters}) exceed "
                                 f"--lr-decay-iters ({self.lr_decay_iters}); shorten the warmup")
        if self.clip_grad < 0:
            raise ValueError(f"--clip-grad must be >= 0, got {self.clip_grad}")
        positive(self, (("ddp_bucket_size", "--ddp-bucket-size"),), allow_none=True)
        if self.overlap_grad_reduce and not self.use_distributed_optimizer:
            raise ValueError("--overlap-grad-reduce needs --use-distributed-optimizer (the "
                             "distributed optimizer owns the gradient buckets it overlaps); add "
                             "--use-distributed-optimizer or drop --overlap-grad-reduce")
        if self.overlap_param_gather and not self.overlap_grad_reduce:
            raise ValueError("--overlap-param-gather needs --overlap-grad-reduce (and "
                             "--use-distributed-optimizer), as in Megatron-LM; add them or drop "
                             "--overlap-param-gather")
        if self.override_opt_param_scheduler and self.use_checkpoint_opt_param_scheduler:
            raise ValueError("--override-opt_param-scheduler and "
                             "--use-checkpoint-opt_param-scheduler are mutually exclusive")
