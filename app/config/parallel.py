"""The parallel layout (`ParallelConfig`) and the numeric precision (`PrecisionConfig`).
Part of `app.config`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, List, Optional, Tuple

from app.config.options import option
from app.config.rules import positive

CP_COMM_TYPES = ("p2p", "a2a")
"""Context-parallel attention schemes (--cp-comm-type; app.mpu.context_parallel)."""
DISTRIBUTED_BACKENDS = ("gloo", "nccl")
"""torch.distributed backends a run may use (--distributed-backend)."""


@dataclass(kw_only=True)
class ParallelConfig:
    """Parallel layout: world = tensor x context x data x pipeline (Megatron Core's rank order)."""

    FLAG_GROUP: ClassVar[Tuple[str, str]] = ("parallel", "model parallelism and process launch")

    tensor_model_parallel_size: int = option(
        "--tensor-model-parallel-size", "--model-parallel-size", default=1)
    pipeline_model_parallel_size: int = option("--pipeline-model-parallel-size", default=1)
    num_layers_per_virtual_pipeline_stage: Optional[int] = option(
        "--num-layers-per-virtual-pipeline-stage", default=None,
        help="interleaved 1F1B: each pipeline rank holds (num layers / PP) / N model chunks of N "
             "layers, assigned round-robin (stage r holds virtual stages r, r+PP, ...); needs PP "
             "> 1, N dividing the layers per stage and the micro-batches per iteration a multiple"
             " of PP; native path only")
    context_parallel_size: int = option(
        "--context-parallel-size", default=1,
        help="ranks sharing each sequence: it is cut into 2C chunks, rank i holding chunks i and "
             "2C-1-i; attention passes keys/values around the context group "
             "(docs/parallelism.md); gradients are averaged over data x context ranks")
    cp_comm_type: str = option(
        "--cp-comm-type", default="p2p", choices=CP_COMM_TYPES,
        help="context-parallel attention: p2p = ring of key/value blocks merged by log-sum-exp; "
             "a2a = all-to-all over heads (Ulysses; heads per TP rank divisible by C)")
    distributed_backend: str = option(
        "--distributed-backend", default="gloo", flag_default=None, choices=DISTRIBUTED_BACKENDS,
        help="default: nccl when CUDA is available, else gloo")
    local_rank: Optional[int] = option(
        "--local_rank", "--local-rank", default=None,
        help="set by launchers (torch.distributed.launch, deepspeed)")
    distributed_timeout_minutes: float = option(
        "--distributed-timeout-minutes", default=10.0,
        help="a collective waiting this long for another rank fails, and a rank making no "
             "progress for this long (plus a margin) is stopped; fractions allowed")
    expert_model_parallel_size: int = option(
        "--expert-model-parallel-size", default=1,
        help="EP: ranks that split each MoE layer's experts (Megatron's expert grid: expert "
             "tensor x expert x expert data x pipeline; docs/moe.md)")
    expert_tensor_parallel_size: Optional[int] = option(
        "--expert-tensor-parallel-size", default=None,
        help="ETP: ranks that split each expert's FFN (default: --tensor-model-parallel-size)")
    world_size: int = 1
    """Ranks in the job (from the launcher; not a flag)."""
    world_source: str = ""
    """Where world_size came from (app.launch.distributed.WorldInfo.source), for messages."""

    def __post_init__(self) -> None:
        if self.expert_tensor_parallel_size is None:  # Megatron's default, set at construction
            self.expert_tensor_parallel_size = self.tensor_model_parallel_size
        positive(self, (("expert_model_parallel_size", "--expert-model-parallel-size"),
                         ("expert_tensor_parallel_size", "--expert-tensor-parallel-size")))
        positive(self, (("tensor_model_parallel_size", "--tensor-model-parallel-size"),
                         ("pipeline_model_parallel_size", "--pipeline-model-parallel-size"),
                         ("context_parallel_size", "--context-parallel-size"),
                         ("world_size", "world size"),
                         ("distributed_timeout_minutes", "--distributed-timeout-minutes")))
        positive(self, (("num_layers_per_virtual_pipeline_stage",
                          "--num-layers-per-virtual-pipeline-stage"),), allow_none=True)
        mp = (self.tensor_model_parallel_size * self.pipeline_model_parallel_size
              * self.context_parallel_size)
        if self.world_size % mp:
            raise ValueError(
                f"world size ({self.world_size}) is not divisible by --tensor-model-parallel-size "
                f"({self.tensor_model_parallel_size}) x --pipeline-model-parallel-size "
                f"({self.pipeline_model_parallel_size}) x --context-parallel-size "
                f"({self.context_parallel_size}); launch a multiple of their product"
                + (f" (the world size came from {self.world_source})"
                   if self.world_source else ""))
        if self.cp_comm_type not in CP_COMM_TYPES:
            raise ValueError(f"--cp-comm-type must be one of {', '.join(CP_COMM_TYPES)}, got "
                             f"{self.cp_comm_type!r}")
        if self.distributed_backend not in DISTRIBUTED_BACKENDS:
            raise ValueError(f"--distributed-backend must be one of "
                             f"{', '.join(DISTRIBUTED_BACKENDS)}, got {self.distributed_backend!r}")

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // (self.tensor_model_parallel_size
                                   * self.pipeline_model_parallel_size * self.context_parallel_size)

    def megatron_layout(self) -> str:
        """The layout as Megatron-LM's validate_args prints it first: "using world size: W,
        data-parallel size: D, context-parallel size: C, hierarchical context-parallel sizes:
        None, tensor-model-parallel size: T, pipeline-model-parallel size: P"."""
        return (f"using world size: {self.world_size}, data-parallel size: "
                f"{self.data_parallel_size}, context-parallel size: {self.context_parallel_size}, "
                "hierarchical context-parallel sizes: None, tensor-model-parallel size: "
                f"{self.tensor_model_parallel_size}, pipeline-model-parallel size: "
                f"{self.pipeline_model_parallel_size}")

    @property
    def expert_data_parallel_size(self) -> int:
        """EDP = world / (ETP x EP x PP): ranks holding the same experts (Megatron Core)."""
        return self.world_size // (self.expert_tensor_parallel_size
                                   * self.expert_model_parallel_size
                                   * self.pipeline_model_parallel_size)


@dataclass(kw_only=True)
class PrecisionConfig:
    """Numeric precision: fp32, bf16 or fp16 weights (native path or DeepSpeed).

    The loss-scale fields apply to fp16 only (given with bf16 or fp32 they are not read, and a
    warning says so) and default (None) to Megatron's values: initial scale 2^32, minimum 1,
    window 1000, hysteresis 2; `loss_scale` set means a static scale.
    On the DeepSpeed path, the ones given fill the JSON's fp16 block; without --fp16/--bf16 the
    precision comes from the JSON (arguments.py).
    """

    FLAG_GROUP: ClassVar[Tuple[str, str]] = ("precision",
                                             "mixed precision and loss scaling (docs/precision.md)")

    fp16: bool = option(
        "--fp16", default=False,
        help="fp16 weights and activations, fp32 main weights, dynamic loss scaling")
    bf16: bool = option(
        "--bf16", default=False,
        help="bf16 weights and activations, fp32 main weights and gradient accumulation")
    loss_scale: Optional[float] = option(
        "--loss-scale", default=None,
        help="static loss scale (fp16); unset means dynamic scaling")
    initial_loss_scale: Optional[float] = option(
        "--initial-loss-scale", default=None,
        help="initial dynamic loss scale (fp16; default 2^32)")
    min_loss_scale: Optional[float] = option(
        "--min-loss-scale", "--min-scale", default=None,
        help="floor of the dynamic loss scale (fp16; default 1)")
    loss_scale_window: Optional[int] = option(
        "--loss-scale-window", default=None,
        help="clean steps before the loss scale doubles (fp16; default 1000)")
    hysteresis: Optional[int] = option(
        "--hysteresis", default=None,
        help="overflows tolerated before the loss scale halves (fp16; default 2)")
    accumulate_allreduce_grads_in_fp32: bool = option(
        "--accumulate-allreduce-grads-in-fp32", default=False,
        help="accumulate and all-reduce fp16 gradients in fp32 (always on for bf16)")
    source: str = "command line"
    """Where the precision came from: the flags, or the DeepSpeed JSON (logged at start)."""

    def __post_init__(self) -> None:
        if self.fp16 and self.bf16:
            raise ValueError("--fp16 and --bf16 are mutually exclusive; pick one")
        positive(self, (("loss_scale", "--loss-scale"),
                         ("initial_loss_scale", "--initial-loss-scale"),
                         ("min_loss_scale", "--min-loss-scale"),
                         ("loss_scale_window", "--loss-scale-window"),
                         ("hysteresis", "--hysteresis")), allow_none=True)
        initial, minimum, _, _ = self.dynamic_scaler_settings()
        if minimum > initial:
            raise ValueError(f"--min-loss-scale ({minimum}) exceeds --initial-loss-scale "
                             f"({initial})")

    @property
    def params_dtype(self) -> str:
        """Model weight dtype this precision implies: float16, bfloat16 or float32."""
        return "float16" if self.fp16 else "bfloat16" if self.bf16 else "float32"

    @property
    def grads_accumulate_in_fp32(self) -> bool:
        """Whether half-precision gradients accumulate in fp32 buffers (bf16: always)."""
        return self.bf16 or (self.fp16 and self.accumulate_allreduce_grads_in_fp32)

    @property
    def loss_scale_flags(self) -> List[str]:
        """The loss-scale flags given (read with --fp16 only; app.config.unread warns about
        them otherwise, as Megatron-LM accepts and ignores them)."""
        return [flag for flag, value in (("--loss-scale", self.loss_scale),
                                         ("--initial-loss-scale", self.initial_loss_scale),
                                         ("--min-loss-scale", self.min_loss_scale),
                                         ("--loss-scale-window", self.loss_scale_window),
                                         ("--hysteresis", self.hysteresis)) if value is not None]

    def dynamic_scaler_settings(self) -> Tuple[float, float, int, int]:
        """(initial scale, minimum scale, growth window, hysteresis) with Megatron's defaults."""
        return (2.0 ** 32 if self.initial_loss_scale is None else float(self.initial_loss_scale),
                1.0 if self.min_loss_scale is None else float(self.min_loss_scale),
                1000 if self.loss_scale_window is None else int(self.loss_scale_window),
                2 if self.hysteresis is None else int(self.hysteresis))

