"""`RunConfig`: everything one training run needs, and the rules that span several configs.
Part of `app.config`."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import FrozenSet, Tuple

from app.config.batch_schedule import BatchSchedule, schedule_of
from app.config.checkpoint import CheckpointConfig
from app.config.data import DataConfig
from app.config.deepspeed import DeepSpeedConfig, zero_stage
from app.config.fp8 import Fp8Config
from app.config.kernels import KernelConfig
from app.config.logs import LogConfig
from app.config.model import ModelConfig
from app.config.moe import check_moe_run
from app.config.optimizer import OptimizerConfig, check_muon_layout
from app.config.options import option
from app.config.parallel import ParallelConfig, PrecisionConfig
from app.config.recompute import RecomputePlan, recompute_plan
from app.config.runtime import RuntimeConfig
from app.config.rules import divisible
from app.config.training import InProcessRestartConfig, RollbackConfig, TrainingConfig
from app.config.wandb import WandbConfig


@dataclass(kw_only=True)
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
    make_vocab_size_divisible_by: int = option(
        "--make-vocab-size-divisible-by", default=128, group="model",
        help="pad the vocab to a multiple of this x the tensor-parallel size")
    rollback: RollbackConfig = field(default_factory=RollbackConfig)
    inprocess: InProcessRestartConfig = field(default_factory=InProcessRestartConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    log: LogConfig = field(default_factory=LogConfig)
    fp8: Fp8Config = field(default_factory=Fp8Config)
    explicit_flags: FrozenSet[str] = frozenset()
    """The flags given on the command line, each by its first spelling (arguments.py); the
    ones the run's path does not read, or that change nothing in it, are named by
    app.config.unread."""
    batch_schedule: BatchSchedule = field(init=False)
    """The global batch of each iteration (app.config.batch_schedule), from --global-batch-size
    and --rampup-batch-size or --step-batch-size-schedule."""

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
        self.batch_schedule = self._build_batch_schedule()
        self._check_virtual_pipeline()
        self._check_deepspeed_pipeline()
        self._check_context_parallel()
        self._check_inprocess_restart()
        if self.rollback.enabled and not (self.checkpoint.save and self.checkpoint.save_interval):
            raise ValueError("--rollback-on-spike reloads the latest checkpoint: give --save and "
                             "--save-interval (a rollback skips the data read since that "
                             "checkpoint)")
        half = self.precision.fp16 or self.precision.bf16
        if m.fp16_lm_cross_entropy and not half:
            raise ValueError("--fp16-lm-cross-entropy needs --fp16 or --bf16 (the logits are "
                             "fp32 otherwise); drop it or pick a half precision")
        if self.deepspeed.enabled and self.checkpoint.ckpt_format != "torch":
            raise ValueError(f"--ckpt-format {self.checkpoint.ckpt_format} is written by the "
                             "native path; with --deepspeed DeepSpeed saves its own files: drop "
                             "--ckpt-format, or convert afterwards with "
                             "tools/convert_checkpoint.py --input-format deepspeed "
                             "--output-format torch_dist")
        if (not self.deepspeed.enabled and self.checkpoint.ckpt_format == "torch"
                and self.checkpoint.save and m.moe.enabled
                and p.expert_tensor_parallel_size != tp):
            raise ValueError(
                f"--save with --ckpt-format torch, --expert-tensor-parallel-size "
                f"{p.expert_tensor_parallel_size} and --tensor-model-parallel-size {tp}: "
                "Megatron's legacy files name a rank by its tensor and expert-parallel ranks, so "
                "they hold experts split over the tensor-parallel ranks only; use --ckpt-format "
                "torch_dist (any layout), or the same expert and dense tensor-parallel sizes")
        if self.deepspeed.enabled and self.optimizer.use_distributed_optimizer:
            raise ValueError("--use-distributed-optimizer is for the native path; with --deepspeed "
                             "shard the optimizer with ZeRO (zero_optimization.stage 1, 2 or 3 in "
                             "the JSON, e.g. ds_configs/zero1.json) and drop the flag")
        if self.deepspeed.enabled and self.kernels.compile_layers:
            raise ValueError("--compile-layers is for the native path (DeepSpeed wraps the model "
                             "in its own engine, whose compile this project does not use): drop "
                             "--compile-layers or --deepspeed")
        if self.deepspeed.enabled and self.precision.accumulate_allreduce_grads_in_fp32:
            raise ValueError("--accumulate-allreduce-grads-in-fp32 is for the native path; with "
                             "--deepspeed set the gradient accumulation dtype in the JSON "
                             "(data_types.grad_accum_dtype) and drop the flag")
        if m.params_dtype != self.precision.params_dtype:
            raise ValueError(f"params_dtype {m.params_dtype} does not match the precision flags "
                             f"(which imply {self.precision.params_dtype})")
        self._check_model_options_against_layout()
        if self.fp8.fp8_param_gather and not self.optimizer.use_distributed_optimizer:
            raise ValueError("--fp8-param-gather only supported with distributed optimizer "
                             "(Megatron-LM's rule): add --use-distributed-optimizer or drop "
                             "--fp8-param-gather")
        check_moe_run(m.moe, m, p, self.deepspeed, self.optimizer)
        check_muon_layout(self.optimizer, m.num_kv_heads, tp)
        self._check_kernel_build_timeout()
        self._check_local_checkpoints()

    def _check_local_checkpoints(self) -> None:
        """Local checkpoints with replication need whole groups of J x K ranks; ZeRO-3's
        partitioned weights have no local-checkpoint path."""
        c, world = self.checkpoint, self.parallel.world_size
        if c.replication and world % (c.replication_jump * c.replication_factor):
            raise ValueError(
                f"--replication: the world size ({world}) is not divisible by --replication-jump "
                f"({c.replication_jump}) x --replication-factor ({c.replication_factor}); pick "
                "a jump and factor whose product divides the number of ranks")
        if c.local_checkpoints and self.deepspeed.enabled and zero_stage(self.deepspeed.config) == 3:
            raise ValueError("--non-persistent-ckpt-type local is not implemented for ZeRO-3 "
                             "(its weights are partitioned); use ZeRO-1/2 or the native path, or "
                             "--non-persistent-ckpt-type global (a ZeRO-3 checkpoint), or rely "
                             "on --save")

    def _build_batch_schedule(self) -> BatchSchedule:
        """The batch-size schedule of the flags, checked against the layout and the engine."""
        t = self.training
        schedule = schedule_of(t.global_batch_size, t.rampup_batch_size,
                               t.step_batch_size_schedule, self.model.seq_length)
        rampup = schedule.rampup
        if schedule.steps is not None and schedule.steps[-1][1] != t.global_batch_size:
            raise ValueError(f"--step-batch-size-schedule ends at batch {schedule.steps[-1][1]} "
                             f"but the global batch size is {t.global_batch_size}: the "
                             "schedule's last batch is the global batch size; drop "
                             "--global-batch-size")
        if schedule.varies and self.deepspeed.enabled:
            flag = "--rampup-batch-size" if rampup else "--step-batch-size-schedule"
            raise ValueError(
                f"{flag} is not supported with --deepspeed: DeepSpeed fixes train_batch_size and "
                "gradient_accumulation_steps at deepspeed.initialize (its ZeRO optimizer keeps "
                "the accumulation count it was built with), so the batch cannot change per "
                f"iteration; train with a batch-size schedule on the native path (optimizer "
                f"states sharded with --use-distributed-optimizer) or drop {flag}")
        if (schedule.varies or t.train_samples is not None) and not self.optimizer.lr_in_samples:
            raise ValueError("a batch-size schedule or --train-samples counts the LR schedule "
                             "in samples: OptimizerConfig.lr_in_samples must be set (arguments.py "
                             "does it)")
        return schedule

    def _check_inprocess_restart(self) -> None:
        """--inprocess-restart rebuilds what the native engine holds; refuse what it cannot."""
        if not self.inprocess.enabled:
            return
        if self.deepspeed.enabled:
            raise ValueError("--inprocess-restart is implemented for the native engine: "
                             "DeepSpeed keeps process groups and engine state of its own that it "
                             "does not rebuild; drop --inprocess-restart (a launcher restart "
                             "resumes DeepSpeed runs from --save) or drop --deepspeed")
        if self.optimizer.use_distributed_optimizer:
            raise ValueError("--inprocess-restart with --use-distributed-optimizer is not "
                             "supported: that optimizer gathers its state over the ranks to "
                             "copy it, which an in-memory snapshot every iteration cannot "
                             "afford; drop one of the two flags")
        if self.inprocess.snapshot_interval == 0 and not self.checkpoint.load:
            raise ValueError("--inprocess-snapshot-interval 0 keeps no state in memory, so an "
                             "in-process restart reloads the newest checkpoint: give --load "
                             "(the --save directory), or a positive snapshot interval")

    def _check_context_parallel(self) -> None:
        """--context-parallel-size C: the sequence in 2C equal chunks (each split again over TP
        with sequence parallelism) and only the options the ring attention supports."""
        m, p, cp = self.model, self.parallel, self.parallel.context_parallel_size
        if cp == 1:
            return
        divisible("--seq-length", m.seq_length, "2 x --context-parallel-size", 2 * cp)
        if m.sequence_parallel:
            divisible("--seq-length / --context-parallel-size", m.seq_length // cp,
                      "--tensor-model-parallel-size", p.tensor_model_parallel_size)
        if p.cp_comm_type == "a2a":
            tp = p.tensor_model_parallel_size
            for flag, heads in (("--num-attention-heads", m.num_attention_heads),
                                ("--num-query-groups", m.num_kv_heads)):
                if heads % tp or (heads // tp) % cp:
                    raise ValueError(
                        f"--cp-comm-type a2a splits each tensor-parallel rank's heads over the "
                        f"context ranks: {flag} ({heads}) / --tensor-model-parallel-size ({tp}) "
                        f"is not divisible by --context-parallel-size ({cp}); use p2p or "
                        "change the sizes")
        refused = [
            (m.position_embedding_type == "alibi", "--position-embedding-type", "alibi"),
            (self.data.attention_mask_resets, "--reset-attention-mask", True),
        ]
        for bad, flag, value in refused:
            if bad:
                raise ValueError(
                    f"--context-parallel-size {cp} does not support {flag} {value} yet "
                    "(docs/parallelism.md, context parallelism); drop one of them")

    def _check_model_options_against_layout(self) -> None:
        """Sequence parallelism, query groups and recompute against TP / PP / DeepSpeed."""
        m, p = self.model, self.parallel
        tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
        if m.sequence_parallel:
            if tp == 1:  # arguments.py turns the flag off at TP 1, as Megatron-LM does
                raise ValueError("sequence_parallel needs --tensor-model-parallel-size > 1 "
                                 "(got 1): it splits the sequence over the tensor-parallel "
                                 "ranks")
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
            why = ("ZeRO-3 partitions the weights themselves and gathers them module by module "
                   "during forward and backward, which DeepSpeed's pipeline engine does not "
                   "support (it refuses ZeRO-2 and ZeRO-3); to fit a larger model, shard it "
                   "with --tensor-model-parallel-size and ZeRO-3, or use ZeRO-1 with the pipeline"
                   if stage == 3 else
                   "ZeRO-2 reduce-scatters gradients during backward, before the tied "
                   "word-embedding gradient is summed across the first and last stage"
                   if stage == 2 else
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
    """Samples the (train, valid, test) datasets must hold: every iteration's global batch (as
    the batch-size schedule gives it),
    eval_iters global batches per evaluation (`TrainingConfig.evaluations`) and eval_iters global
    batches of test. With --rollback-on-spike the training split also holds the samples the
    rollbacks may skip: --save-interval + --max-consecutive-skipped-iterations iterations per
    rollback, since no checkpoint is saved while a run of non-finite iterations lasts (one
    streak can hide a save point and then reach the limit). Longer skips are possible (several
    streaks over several save points, or the limit off); the rollback then checks the data left
    and stops if it is short."""
    t, r = cfg.training, cfg.rollback
    train = cfg.batch_schedule.samples_in(t.train_iters)
    if r.enabled:
        window = cfg.checkpoint.save_interval + t.max_consecutive_skipped_iterations
        train += r.max_rollbacks * window * t.global_batch_size
    valid = t.evaluations() * t.eval_iters * t.global_batch_size
    return train, valid, t.eval_iters * t.global_batch_size
