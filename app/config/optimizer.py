"""OptimizerConfig: the optimizer (AdamW, SGD or Muon), its flags' choices and rules, gradient
clipping and Megatron's LR schedule (pure; `app.config` re-exports every name, and RunConfig
calls `check_muon_layout` for the rules that need the parallel layout)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

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


@dataclass
class OptimizerConfig:
    """The optimizer (AdamW, SGD or Muon) and its hyper-parameters, gradient clipping and
    Megatron's LR schedule."""

    lr: float = 1.5e-4
    min_lr: float = 0.0
    lr_decay_style: str = "linear"
    """One of LR_DECAY_STYLES; linear is Megatron-LM's default."""
    lr_decay_iters: Optional[int] = None
    """Iterations over which the LR decays to min_lr; None means train_iters (filled by arguments/)."""
    lr_warmup_iters: int = 0
    """Linear-warmup iterations (arguments/ turns --lr-warmup-fraction/--warmup into this)."""
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
    use_distributed_optimizer: bool = False
    """Shard the fp32 main weights and AdamW states over data parallel (native path; ZeRO-1 as
    Megatron's distributed optimizer: reduce-scatter of gradients, all-gather of weights)."""
    overlap_grad_reduce: bool = False
    """Start each gradient bucket's reduce-scatter during backward, once its last micro-batch
    gradients are in (needs use_distributed_optimizer)."""
    overlap_param_gather: bool = False
    """All-gather the updated weights in the background; each module waits for its bucket at
    its next forward (needs overlap_grad_reduce)."""
    ddp_bucket_size: Optional[int] = None
    """Elements per gradient bucket of the distributed optimizer; None: max(40M, 1M x DP)."""
    optimizer: str = "adam"
    """adam (AdamW), sgd or muon (OPTIMIZERS); the fields below (Megatron's defaults) are
    described in app/optim/muon.py and docs/parallelism.md ("Muon")."""
    sgd_momentum: float = 0.9
    muon_momentum: float = 0.9
    muon_nesterov: bool = False
    muon_split_qkv: bool = True
    muon_scale_mode: str = "spectral"
    muon_num_ns_steps: int = 5
    muon_coefficient_type: str = "quintic"
    muon_fp32_matmul_prec: str = "medium"
    """Newton-Schulz precision: medium bf16; high fp32 (TF32 on CUDA); low fp32 as set."""
    muon_tp_mode: str = "duplicated"
    """blockwise (layout-dependent), duplicated or distributed (both layout-independent)."""
    muon_extra_scale_factor: float = 1.0
    muon_scalar_optimizer: str = "adam"

    def __post_init__(self) -> None:
        check_optimizer_choice(self)
        if self.lr_decay_style not in LR_DECAY_STYLES:
            raise ValueError(f"lr_decay_style (--lr-decay-style) must be one of "
                             f"{', '.join(LR_DECAY_STYLES)}, got {self.lr_decay_style!r}")
        if self.lr < 0 or not 0.0 <= self.min_lr <= self.lr:
            raise ValueError(f"--min-lr ({self.min_lr}) must be between 0 and --lr ({self.lr})")
        if self.lr_warmup_iters < 0:
            raise ValueError(f"--lr-warmup-iters must be >= 0, got {self.lr_warmup_iters}")
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
