"""Configuration dataclasses: the only way configuration reaches library code.

`arguments/` parses the command line (Megatron-LM flag names plus DeepSpeed's) and converts
the namespace once into these dataclasses. Nothing under `app/` reads argparse or a global
args object.

Every rule is checked here, once, when a config is built: each dataclass checks its own fields
in `__post_init__`, and `RunConfig.__post_init__` checks the rules that span several (the
global batch against the data-parallel size, heads against the tensor-parallel size, ...).
Messages name the command-line flag, the values and the fix. Nothing rewrites a config after
it is built; derived values are properties or are computed where they are used.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

# the model half and the shared rules live in submodules; `app.config` names them all
from app.config.model import (ATTENTION_BACKENDS, POSITION_EMBEDDING_TYPES,
                              RECOMPUTE_GRANULARITIES, RECOMPUTE_METHODS, ModelConfig,
                              RecomputePlan, recompute_plan, resolve_recompute_flags)
from app.config.optimizer import (LR_DECAY_STYLES, MUON_COEFFICIENT_TYPES,
                                  MUON_MATMUL_PRECISIONS, MUON_SCALAR_OPTIMIZERS, MUON_SCALE_MODES,
                                  MUON_TP_MODES, OPTIMIZERS, OptimizerConfig, check_muon_layout)
from app.config.rules import divisible, positive, split_weights
from app.config.wandb import WandbConfig

__all__ = [
    "ATTENTION_BACKENDS", "DISTRIBUTED_BACKENDS", "LR_DECAY_STYLES", "POSITION_EMBEDDING_TYPES",
    "RECOMPUTE_GRANULARITIES", "RECOMPUTE_METHODS", "CheckpointConfig", "DataConfig",
    "DeepSpeedConfig", "KernelConfig", "MUON_COEFFICIENT_TYPES", "MUON_MATMUL_PRECISIONS",
    "MUON_SCALAR_OPTIMIZERS", "MUON_SCALE_MODES", "MUON_TP_MODES", "ModelConfig", "OPTIMIZERS",
    "OptimizerConfig", "ParallelConfig",
    "PrecisionConfig", "RecomputePlan", "RollbackConfig", "RunConfig", "TrainingConfig",
    "WandbConfig",
    "default_kernel_build_timeout", "divisible", "positive", "recompute_plan",
    "resolve_recompute_flags", "samples_per_split", "split_weights"]

DISTRIBUTED_BACKENDS = ("gloo", "nccl")
"""torch.distributed backends a run may use (--distributed-backend)."""


@dataclass
class ParallelConfig:
    """Parallel layout: world = tensor x pipeline x data (Megatron's rank order)."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    world_size: int = 1
    distributed_backend: str = "gloo"
    """torch.distributed backend: gloo (CPU) or nccl (CUDA); arguments/ defaults it by device."""
    local_rank: Optional[int] = None
    """--local_rank from a launcher; None means read LOCAL_RANK from the environment."""
    distributed_timeout_minutes: float = 10.0
    """Timeout of every process group: a collective waiting longer for a peer fails, and the
    training watchdog stops a rank that makes no progress for this long (plus a margin)."""
    num_layers_per_virtual_pipeline_stage: Optional[int] = None
    """Layers per model chunk for the interleaved 1F1B schedule; None means one chunk per stage
    (RunConfig checks it against the layer count, the pipeline size and the micro-batches)."""

    def __post_init__(self) -> None:
        positive(self, (("tensor_model_parallel_size", "--tensor-model-parallel-size"),
                         ("pipeline_model_parallel_size", "--pipeline-model-parallel-size"),
                         ("world_size", "world size"),
                         ("distributed_timeout_minutes", "--distributed-timeout-minutes")))
        positive(self, (("num_layers_per_virtual_pipeline_stage",
                          "--num-layers-per-virtual-pipeline-stage"),), allow_none=True)
        mp = self.tensor_model_parallel_size * self.pipeline_model_parallel_size
        if self.world_size % mp:
            raise ValueError(
                f"world size ({self.world_size}) is not divisible by --tensor-model-parallel-size "
                f"({self.tensor_model_parallel_size}) x --pipeline-model-parallel-size "
                f"({self.pipeline_model_parallel_size}); launch a multiple of their product")
        if self.distributed_backend not in DISTRIBUTED_BACKENDS:
            raise ValueError(f"--distributed-backend must be one of "
                             f"{', '.join(DISTRIBUTED_BACKENDS)}, got {self.distributed_backend!r}")

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // (self.tensor_model_parallel_size * self.pipeline_model_parallel_size)


@dataclass
class PrecisionConfig:
    """Numeric precision: fp32, bf16 or fp16 weights (native path or DeepSpeed).

    The loss-scale fields apply to fp16 only and default (None) to Megatron's values: initial
    scale 2^32, minimum 1, window 1000, hysteresis 2; `loss_scale` set means a static scale.
    On the DeepSpeed path, the ones given fill the JSON's fp16 block.
    """

    fp16: bool = False
    bf16: bool = False
    loss_scale: Optional[float] = None
    """Static loss scale; None means dynamic scaling."""
    initial_loss_scale: Optional[float] = None
    min_loss_scale: Optional[float] = None
    loss_scale_window: Optional[int] = None
    hysteresis: Optional[int] = None
    accumulate_allreduce_grads_in_fp32: bool = False
    """Accumulate and all-reduce gradients in fp32 buffers (always on for bf16)."""
    source: str = "command line"
    """Where the precision came from: the flags, or the DeepSpeed JSON (logged at start)."""

    def __post_init__(self) -> None:
        if self.fp16 and self.bf16:
            raise ValueError("--fp16 and --bf16 are mutually exclusive; pick one")
        given = [flag for flag, value in (("--loss-scale", self.loss_scale),
                                          ("--initial-loss-scale", self.initial_loss_scale),
                                          ("--min-loss-scale", self.min_loss_scale),
                                          ("--loss-scale-window", self.loss_scale_window),
                                          ("--hysteresis", self.hysteresis)) if value is not None]
        if given and not self.fp16:
            raise ValueError(f"{', '.join(given)} only apply with --fp16 (bf16 and fp32 need no "
                             "loss scaling); drop them or add --fp16")
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

    def dynamic_scaler_settings(self) -> Tuple[float, float, int, int]:
        """(initial scale, minimum scale, growth window, hysteresis) with Megatron's defaults."""
        return (2.0 ** 32 if self.initial_loss_scale is None else float(self.initial_loss_scale),
                1.0 if self.min_loss_scale is None else float(self.min_loss_scale),
                1000 if self.loss_scale_window is None else int(self.loss_scale_window),
                2 if self.hysteresis is None else int(self.hysteresis))


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

    def __post_init__(self) -> None:
        split_weights(self.split)
        if self.num_workers < 0:
            raise ValueError(f"--num-workers must be >= 0, got {self.num_workers}")


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
    exit_signal_handler: Optional[bool] = None
    """SIGTERM/SIGINT/SIGUSR1 save a checkpoint at the end of the iteration and exit 0;
    None: on when --save is given (app.training.resilience.signals.handler_enabled)."""
    max_consecutive_skipped_iterations: int = 10
    """Stop (non-zero exit, no checkpoint) after this many consecutive non-finite iterations
    (fp16: overflows at the minimum loss scale); 0 disables."""
    check_for_nan_in_loss_and_grad: bool = False
    """Stop at the first non-finite loss or gradient (Megatron's flag)."""
    log_straggler: bool = False
    """Every log interval, compare the ranks' forward + data-wait time per iteration and name
    those slower than the median by more than straggler_margin, with their hosts
    (app.training.telemetry.stragglers; one all-gather per interval)."""
    straggler_margin: float = 0.1
    """How much slower than the median a rank must be to be named: 0.1 = more than 10%."""
    straggler_minmax_count: int = 1
    """How many slowest and fastest ranks the straggler line lists (Megatron's flag)."""

    def __post_init__(self) -> None:
        positive(self, (("micro_batch_size", "--micro-batch-size"),
                         ("global_batch_size", "--global-batch-size"),
                         ("train_iters", "--train-iters"), ("log_interval", "--log-interval"),
                         ("eval_interval", "--eval-interval")))
        positive(self, (("exit_interval", "--exit-interval"),
                         ("exit_duration_in_mins", "--exit-duration-in-mins"),
                         ("peak_flops", "--peak-flops")), allow_none=True)
        positive(self, (("straggler_margin", "--straggler-margin"),
                        ("straggler_minmax_count", "--straggler-minmax-count")))
        if self.eval_iters < 0:
            raise ValueError(f"--eval-iters must be >= 0, got {self.eval_iters}")
        if self.max_consecutive_skipped_iterations < 0:
            raise ValueError(f"--max-consecutive-skipped-iterations must be >= 0 (0 disables), "
                             f"got {self.max_consecutive_skipped_iterations}")

    def evaluations(self, from_iteration: int = 0) -> int:
        """Validation evaluations the trainer runs after iteration `from_iteration` until
        train_iters: one at every multiple of eval_interval, and one at the end when train_iters
        is not a multiple (the last iteration has not just evaluated); 0 with eval_iters 0."""
        if not self.eval_iters:
            return 0
        final = 1 if self.train_iters % self.eval_interval else 0
        return max(0, self.train_iters // self.eval_interval
                   - from_iteration // self.eval_interval + final)

    def num_micro_batches(self, data_parallel_size: int) -> int:
        """Micro-batches per rank per iteration: global / (micro x DP), validated exactly."""
        per_step = self.micro_batch_size * data_parallel_size
        if self.global_batch_size % per_step:
            raise ValueError(
                f"--global-batch-size ({self.global_batch_size}) is not divisible by "
                f"--micro-batch-size ({self.micro_batch_size}) x data-parallel size "
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
    overwrite_checkpoints: bool = False
    """Allow training from scratch (or from another --load) into a --save that already holds
    checkpoints; without it such a run is refused (app.training.resilience.resume.decide_start)."""
    async_save: bool = False
    """Copy the state to host memory and write the files in a background thread; the tracker
    moves once every rank's files are durable (app.checkpointing.commit)."""

    def __post_init__(self) -> None:
        positive(self, (("save_interval", "--save-interval"),), allow_none=True)
        if self.finetune and not self.load:
            raise ValueError("--finetune needs --load <checkpoint dir>")
        if self.keep_last_n_checkpoints is not None and self.keep_last_n_checkpoints < 1:
            raise ValueError(f"--keep-last-n-checkpoints must be at least 1, got "
                             f"{self.keep_last_n_checkpoints} (leave it out to keep every checkpoint)")


@dataclass
class DeepSpeedConfig:
    """The DeepSpeed path: enabled by --deepspeed with --deepspeed_config <json>."""

    enabled: bool = False
    config_path: Optional[str] = None
    config: Optional[Dict[str, Any]] = None
    """The JSON at config_path, read once and reconciled with the command line
    (app.training.engines.ds_config.reconcile_ds_config); what deepspeed.initialize receives."""
    activation_checkpointing: bool = False
    """--deepspeed-activation-checkpointing: use deepspeed.checkpointing instead of ours."""
    mpi: bool = False
    """--deepspeed_mpi: discover ranks through mpi4py."""
    universal_checkpoint: bool = False
    """--universal-checkpoint: --load names a DeepSpeed universal checkpoint (any DP/TP size)."""

    def __post_init__(self) -> None:
        if self.enabled and not self.config_path:
            raise ValueError("--deepspeed needs --deepspeed_config <path to JSON> (see ds_configs/)")
        if self.activation_checkpointing and not self.enabled:
            raise ValueError("--deepspeed-activation-checkpointing needs --deepspeed (without it "
                             "the recompute runs through our own checkpoint function; drop the "
                             "flag)")
        if self.universal_checkpoint and not self.enabled:
            raise ValueError("--universal-checkpoint needs --deepspeed (a DeepSpeed universal "
                             "checkpoint); for Megatron checkpoints use tools/convert_checkpoint.py")


@dataclass
class RollbackConfig:
    """Self-healing from loss spikes (docs/reliability.md): reload the last checkpoint, skip the
    data that led to the spike, continue; at most max_rollbacks times."""

    enabled: bool = False
    """--rollback-on-spike."""
    window: int = 50
    """--spike-window: iterations of loss history the running mean and deviation cover; no
    spike is called before the window is full."""
    zscore: float = 5.0
    """--spike-zscore: a spike is a loss above mean + zscore x standard deviation ..."""
    min_increase: float = 0.2
    """--spike-min-increase: ... and above mean x (1 + min_increase)."""
    max_rollbacks: int = 3
    """--max-rollbacks: rollbacks allowed in one run; the next trigger stops it (exit 3)."""

    def __post_init__(self) -> None:
        positive(self, (("window", "--spike-window"), ("zscore", "--spike-zscore")))
        if self.min_increase < 0:
            raise ValueError(f"--spike-min-increase must be >= 0, got {self.min_increase}")
        if self.max_rollbacks < 0:
            raise ValueError(f"--max-rollbacks must be >= 0, got {self.max_rollbacks}")


def default_kernel_build_timeout(distributed_timeout_minutes: float) -> float:
    """Seconds a kernel build may take when --kernel-build-timeout is not given: 300, or half
    the process-group timeout when that is shorter (the other ranks wait for the build)."""
    return min(300.0, distributed_timeout_minutes * 30.0)


@dataclass
class KernelConfig:
    """How the csrc/ fused kernels are obtained (built on first use; see docs/kernels.md)."""

    require_fused_kernels: bool = False
    """--require-fused-kernels: a failed kernel build on a CUDA machine stops the run instead of
    falling back to PyTorch with a warning."""
    build_dir: Optional[str] = None
    """--kernel-build-dir: cache of built kernels; None means $APP_KERNELS_BUILD_DIR or
    ~/.cache/app_kernels."""
    build_timeout: float = 300.0
    """--kernel-build-timeout: seconds local rank 0 may spend on the build (waiting for another
    node's build included) before the run falls back to PyTorch; must stay below the
    process-group timeout, since the other ranks wait for it in the first collective. Without
    the flag: `default_kernel_build_timeout` of --distributed-timeout-minutes."""

    def __post_init__(self) -> None:
        positive(self, (("build_timeout", "--kernel-build-timeout"),))


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
    kernels: KernelConfig = field(default_factory=KernelConfig)
    raw_vocab_size: int = 0
    """Tokenizer vocabulary before padding (recorded in checkpoints)."""
    make_vocab_size_divisible_by: int = 128
    rollback: RollbackConfig = field(default_factory=RollbackConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)

    def __post_init__(self) -> None:
        m, p, t = self.model, self.parallel, self.training
        tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
        if self.make_vocab_size_divisible_by <= 0:
            raise ValueError(f"--make-vocab-size-divisible-by must be positive, got "
                             f"{self.make_vocab_size_divisible_by}")
        if self.raw_vocab_size > m.padded_vocab_size:
            raise ValueError(f"need vocab size ({self.raw_vocab_size}) <= padded vocab size "
                             f"({m.padded_vocab_size})")
        for what, value in (("--num-attention-heads", m.num_attention_heads),
                            ("--ffn-hidden-size", m.ffn_hidden_size),
                            ("padded vocab size", m.padded_vocab_size)):
            divisible(what, value, "--tensor-model-parallel-size", tp)
        divisible("--num-layers", m.num_layers, "--pipeline-model-parallel-size", pp)
        t.num_micro_batches(p.data_parallel_size)
        self._check_virtual_pipeline()
        self._check_deepspeed_pipeline()
        if self.rollback.enabled and not (self.checkpoint.save and self.checkpoint.save_interval):
            raise ValueError("--rollback-on-spike reloads the latest checkpoint: give --save and "
                             "--save-interval (a rollback skips the data read since that "
                             "checkpoint)")
        half = self.precision.fp16 or self.precision.bf16
        if m.fp16_lm_cross_entropy and not half:
            raise ValueError("--fp16-lm-cross-entropy needs --fp16 or --bf16 (the logits are "
                             "fp32 otherwise); drop it or pick a half precision")
        if self.deepspeed.enabled and self.optimizer.use_distributed_optimizer:
            raise ValueError("--use-distributed-optimizer is for the native path; with --deepspeed "
                             "shard the optimizer with ZeRO (zero_optimization.stage 1 or 2 in "
                             "the JSON, e.g. ds_configs/zero1.json) and drop the flag")
        if self.deepspeed.enabled and self.precision.accumulate_allreduce_grads_in_fp32:
            raise ValueError("--accumulate-allreduce-grads-in-fp32 is for the native path; with "
                             "--deepspeed set the gradient accumulation dtype in the JSON "
                             "(data_types.grad_accum_dtype) and drop the flag")
        if m.params_dtype != self.precision.params_dtype:
            raise ValueError(f"params_dtype {m.params_dtype} does not match the precision flags "
                             f"(which imply {self.precision.params_dtype})")
        self._check_model_options_against_layout()
        check_muon_layout(self.optimizer, m.num_kv_heads, tp)
        self._check_kernel_build_timeout()

    def _check_model_options_against_layout(self) -> None:
        """Sequence parallelism, query groups and recompute against TP / PP / DeepSpeed."""
        m, p = self.model, self.parallel
        tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
        if m.sequence_parallel:
            if tp == 1:
                raise ValueError("--sequence-parallel needs --tensor-model-parallel-size > 1 "
                                 "(got 1): it splits the sequence over the tensor-parallel "
                                 "ranks; drop --sequence-parallel or raise the TP size")
            divisible("--seq-length", m.seq_length, "--tensor-model-parallel-size", tp)
        groups = m.num_kv_heads
        if m.group_query_attention and groups % tp and tp % groups:
            raise ValueError(
                f"--num-query-groups ({groups}) and --tensor-model-parallel-size ({tp}): "
                "each rank needs whole key/value groups (groups divisible by TP) or one group "
                "shared by TP/groups ranks (TP divisible by groups); change one of them")
        if groups < tp and self.deepspeed.enabled:
            raise ValueError(
                f"--num-query-groups ({groups}) < --tensor-model-parallel-size ({tp}) replicates "
                "key/value heads over ranks, which DeepSpeed's gradient norm would count once per "
                "rank; with --deepspeed use --num-query-groups divisible by the TP size, or "
                "train on the native path")
        if m.recompute_method == "block" and m.recompute_num_layers > m.num_layers // pp:
            raise ValueError(
                f"--recompute-num-layers ({m.recompute_num_layers}) with --recompute-method block "
                f"exceeds the layers per pipeline stage ({m.num_layers // pp} = --num-layers "
                f"{m.num_layers} / --pipeline-model-parallel-size {pp}); lower it")
        if self.deepspeed.activation_checkpointing and m.recompute_granularity is None:
            raise ValueError(
                "--deepspeed-activation-checkpointing only chooses DeepSpeed's checkpoint "
                "function; say what to recompute with --recompute-granularity full|selective "
                "(or --checkpoint-activations)")

    def _check_kernel_build_timeout(self) -> None:
        """Ranks that do not build wait for the builder in the first collective after the build
        (app.kernels.agree_across_ranks), so the build must end within the process-group
        timeout. Checked when several ranks run (one rank has no one waiting for it)."""
        minutes = self.parallel.distributed_timeout_minutes
        build_s = self.kernels.build_timeout
        if self.parallel.world_size > 1 and build_s >= minutes * 60:
            raise ValueError(f"--kernel-build-timeout ({build_s:g} s) must be below "
                             f"--distributed-timeout-minutes ({minutes:g} min = "
                             f"{minutes * 60:g} s): the other ranks wait for the kernel build in "
                             "a collective; lower the first or raise the second")

    def recompute_plan(self) -> RecomputePlan:
        """What each model chunk recomputes (`app.config.recompute_plan`): a chunk is a pipeline
        stage's num_layers / PP layers, or a virtual stage's with interleaving."""
        chunks = (self.parallel.pipeline_model_parallel_size
                  * self.virtual_pipeline_model_parallel_size)
        return recompute_plan(self.model, self.model.num_layers // chunks)

    @property
    def virtual_pipeline_model_parallel_size(self) -> int:
        """Model chunks per pipeline rank: (layers / PP) / --num-layers-per-virtual-pipeline-stage,
        1 without interleaving."""
        per_chunk = self.parallel.num_layers_per_virtual_pipeline_stage
        if per_chunk is None:
            return 1
        return self.model.num_layers // self.parallel.pipeline_model_parallel_size // per_chunk

    def _check_deepspeed_pipeline(self) -> None:
        """--deepspeed with PP > 1 needs ZeRO stage 1 (checked once the JSON is read)."""
        pp = self.parallel.pipeline_model_parallel_size
        if not self.deepspeed.enabled or pp == 1 or self.deepspeed.config is None:
            return
        stage = self.deepspeed.config.get("zero_optimization", {}).get("stage", 0)
        if stage != 1:
            why = ("ZeRO-2 reduce-scatters gradients during backward, before the tied "
                   "word-embedding gradient is summed across the first and last stage"
                   if stage >= 2 else
                   "without ZeRO DeepSpeed's gradient norm counts the replicated weights "
                   "(LayerNorms, biases) of the first stage only")
            raise ValueError(
                f"{self.deepspeed.config_path}: zero_optimization.stage {stage} cannot be "
                f"combined with --pipeline-model-parallel-size ({pp}) under --deepspeed ({why}); "
                "pipeline parallelism under DeepSpeed needs ZeRO stage 1, as DeepSpeed's own "
                "pipeline engine: use ds_configs/zero1.json, or "
                "--pipeline-model-parallel-size 1")

    def _check_virtual_pipeline(self) -> None:
        """Megatron's rules for the interleaved schedule (--num-layers-per-virtual-pipeline-stage)."""
        per_chunk = self.parallel.num_layers_per_virtual_pipeline_stage
        if per_chunk is None:
            return
        flag = "--num-layers-per-virtual-pipeline-stage"
        pp = self.parallel.pipeline_model_parallel_size
        if pp == 1:
            raise ValueError(f"{flag} ({per_chunk}) needs --pipeline-model-parallel-size > 1 (got "
                             "1): interleaving splits each pipeline stage into chunks; raise "
                             f"--pipeline-model-parallel-size or drop {flag}")
        per_stage = self.model.num_layers // pp
        if per_stage % per_chunk:
            raise ValueError(f"--num-layers ({self.model.num_layers}) / "
                             f"--pipeline-model-parallel-size ({pp}) = {per_stage} layers per "
                             f"stage is not divisible by {flag} ({per_chunk}); pick a {flag} that "
                             f"divides {per_stage}")
        if self.deepspeed.enabled:
            raise ValueError(f"{flag} is not supported with --deepspeed (the DeepSpeed path runs "
                             f"plain 1F1B); drop {flag} or use the native path")
        micro = self.training.num_micro_batches(self.parallel.data_parallel_size)
        if self.virtual_pipeline_model_parallel_size > 1 and micro % pp:
            t = self.training
            raise ValueError(
                f"{flag} needs the micro-batches per iteration to be a multiple of "
                f"--pipeline-model-parallel-size ({pp}), but --global-batch-size "
                f"({t.global_batch_size}) / (--micro-batch-size ({t.micro_batch_size}) x "
                f"data-parallel size ({self.parallel.data_parallel_size})) = {micro}; raise "
                f"--global-batch-size to a multiple of {t.micro_batch_size * pp * self.parallel.data_parallel_size}")


def samples_per_split(cfg: "RunConfig") -> Tuple[int, int, int]:
    """Samples the (train, valid, test) datasets must hold: every iteration's global batch,
    eval_iters global batches per evaluation (`TrainingConfig.evaluations`) and eval_iters global
    batches of test. With --rollback-on-spike the training split also holds the samples the
    rollbacks may skip: --save-interval + --max-consecutive-skipped-iterations iterations per
    rollback, since no checkpoint is saved while a run of non-finite iterations lasts (one
    streak can hide a save point and then reach the limit). Longer skips are possible (several
    streaks over several save points, or the limit off); the rollback then checks the data left
    and stops if it is short."""
    t, r = cfg.training, cfg.rollback
    train = t.train_iters * t.global_batch_size
    if r.enabled:
        window = cfg.checkpoint.save_interval + t.max_consecutive_skipped_iterations
        train += r.max_rollbacks * window * t.global_batch_size
    valid = t.evaluations() * t.eval_iters * t.global_batch_size
    return train, valid, t.eval_iters * t.global_batch_size
