"""Batches, iterations, logging, evaluation and exits (`TrainingConfig`), the loss-spike
rollback (`RollbackConfig`) and in-process restart (`InProcessRestartConfig`). Part of
`app.config`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, List, Optional, Tuple

from app.config.options import option
from app.config.rules import positive


@dataclass(kw_only=True)
class TrainingConfig:
    """Batch sizes, iteration counts, evaluation, logging and exit conditions. global_batch_size
    and train_iters are required: arguments.py derives the first (micro batch x data-parallel
    size, or the DeepSpeed JSON's) and refuses a run without the second."""

    FLAG_GROUP: ClassVar[Tuple[str, str]] = ("training",
                                             "batches, iterations, logging, evaluation, exits")

    micro_batch_size: int = option(
        "--micro-batch-size", "--batch-size", default=4,
        help="samples per rank per micro-batch")
    global_batch_size: int = option(
        "--global-batch-size",
        help="samples per iteration (default: micro batch x data-parallel size)")
    train_iters: int = option(
        "--train-iters",
        help="iterations to train (or give --train-samples)")
    train_samples: Optional[int] = option(
        "--train-samples", default=None,
        help="samples to train, instead of --train-iters (Megatron's sample-based training: "
             "the iterations follow from the batch-size schedule, the LR schedule counts "
             "samples)")
    rampup_batch_size: List[int] = option(
        "--rampup-batch-size", default_factory=list, nargs=3,
        metavar=("START", "INCREMENT", "SAMPLES"),
        help="grow the global batch from START by INCREMENT up to --global-batch-size over "
             "SAMPLES consumed samples (Megatron's classic ramp-up)")
    step_batch_size_schedule: Optional[str] = option(
        "--step-batch-size-schedule", default=None,
        help="'THRESHOLD:BATCH ...': the global batch from each threshold of consumed tokens "
             "on (K/M/B/T suffixes), e.g. '0:256 10B:512 20B:1024'; the first threshold is 0 "
             "and the last batch is the global batch size (today's Megatron-LM)")
    seed: int = option("--seed", default=1234)
    log_interval: int = option("--log-interval", default=100)
    eval_interval: int = option("--eval-interval", default=1000)
    eval_iters: int = option("--eval-iters", default=100)
    exit_interval: Optional[int] = option(
        "--exit-interval", default=None,
        help="save and exit when the iteration is a multiple of this")
    exit_duration_in_mins: Optional[float] = option(
        "--exit-duration-in-mins", default=None,
        help="save and exit after this many minutes of training (default under Slurm: the "
             "time left before the job's end, SLURM_JOB_END_TIME, less "
             "--exit-duration-margin-mins)")
    exit_duration_margin_mins: float = option(
        "--exit-duration-margin-mins", default=10.0,
        help="under Slurm without --exit-duration-in-mins: stop this many minutes before the "
             "job's end time (at most 20%% of the time left) to save the final checkpoint")
    exit_duration_source: Optional[str] = None
    """How --exit-duration-in-mins was derived when the flag was not given (logged at start);
    None when it was given or not derived."""
    tensorboard_dir: Optional[str] = option("--tensorboard-dir", default=None)
    metrics_file: Optional[str] = option(
        "--metrics-file", default=None,
        help="append one JSON object per log line to this file")
    peak_flops: Optional[float] = option(
        "--peak-flops", default=None,
        help="peak FLOP/s per rank for MFU (default: looked up or measured)")
    exit_signal_handler: Optional[bool] = option(
        "--exit-signal-handler", default=None,
        help="on SIGTERM/SIGINT/SIGUSR1 save a checkpoint at the end of the iteration and exit 0 "
             "(default: on when --save is given)")
    max_consecutive_skipped_iterations: int = option(
        "--max-consecutive-skipped-iterations", default=10, group="precision",
        help="stop with an error after this many consecutive non-finite iterations (fp16: "
             "overflows at the minimum loss scale); 0 disables")
    check_for_nan_in_loss_and_grad: bool = option(
        "--check-for-nan-in-loss-and-grad", default=False, action="boolean_optional",
        group="precision",
        help="stop at the first non-finite loss or gradient")
    """Off by default here, on in Megatron-LM (docs/precision.md); --no-... is Megatron's
    spelling of off."""
    log_straggler: bool = option(
        "--log-straggler", default=False,
        help="every --log-interval, name (with their hosts) the ranks whose forward + data-wait "
             "time per iteration exceeds the median by more than --straggler-margin (one "
             "all-gather per interval)")
    straggler_margin: float = option(
        "--straggler-margin", default=0.1,
        help="fraction above the median at which --log-straggler names a rank (0.1: more than "
             "10%% slower)")
    straggler_minmax_count: int = option(
        "--straggler-minmax-count", default=1,
        help="how many slowest and fastest ranks the straggler line lists")

    def __post_init__(self) -> None:
        positive(self, (("micro_batch_size", "--micro-batch-size"),
                         ("global_batch_size", "--global-batch-size"),
                         ("train_iters", "--train-iters"), ("log_interval", "--log-interval"),
                         ("eval_interval", "--eval-interval")))
        positive(self, (("exit_interval", "--exit-interval"),
                         ("exit_duration_in_mins", "--exit-duration-in-mins"),
                         ("exit_duration_margin_mins", "--exit-duration-margin-mins"),
                         ("peak_flops", "--peak-flops")), allow_none=True)
        positive(self, (("straggler_margin", "--straggler-margin"),
                        ("straggler_minmax_count", "--straggler-minmax-count")))
        if self.rampup_batch_size and self.step_batch_size_schedule is not None:
            raise ValueError("--rampup-batch-size and --step-batch-size-schedule were both "
                             "given; use one batch-size schedule")
        positive(self, (("train_samples", "--train-samples"),), allow_none=True)
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



@dataclass(kw_only=True)
class RollbackConfig:
    """Self-healing from loss spikes (docs/reliability.md): reload the last checkpoint, skip the
    data that led to the spike, continue; at most max_rollbacks times. No spike is called
    before the window of loss history is full."""

    FLAG_GROUP: ClassVar[Tuple[str, str]] = (
        "self-healing", "roll back to the last checkpoint on a loss spike (docs/reliability.md)")

    enabled: bool = option(
        "--rollback-on-spike", default=False,
        help="on a loss spike, or when --max-consecutive-skipped-iterations is reached, reload "
             "the last checkpoint, skip the data since it and continue (needs --save and "
             "--save-interval)")
    window: int = option(
        "--spike-window", default=50,
        help="iterations of loss history for the running mean and deviation")
    zscore: float = option(
        "--spike-zscore", default=5.0,
        help="a spike is a loss above mean + this x the standard deviation ...")
    min_increase: float = option(
        "--spike-min-increase", default=0.2,
        help="... and above mean x (1 + this)")
    max_rollbacks: int = option(
        "--max-rollbacks", default=3,
        help="rollbacks allowed; the next trigger stops the run (exit code 3)")

    def __post_init__(self) -> None:
        positive(self, (("window", "--spike-window"), ("zscore", "--spike-zscore")))
        if self.min_increase < 0:
            raise ValueError(f"--spike-min-increase must be >= 0, got {self.min_increase}")
        if self.max_rollbacks < 0:
            raise ValueError(f"--max-rollbacks must be >= 0, got {self.max_rollbacks}")



@dataclass(kw_only=True)
class InProcessRestartConfig:
    """In-process restart (Megatron-LM's --inprocess-restart; docs/reliability.md): when a rank
    raises while training, every rank abandons the iteration, the process group is rebuilt in
    the same processes and training goes on from the newest state all ranks hold (an in-memory
    snapshot, else the newest checkpoint). Our own implementation: Megatron's monitoring
    options of nvidia-resiliency-ext are not offered."""

    FLAG_GROUP: ClassVar[Tuple[str, str]] = (
        "in-process restart", "recover from a rank's error without relaunching a process "
        "(docs/reliability.md)")

    enabled: bool = option(
        "--inprocess-restart", default=False,
        help="when a rank raises while training (an error, a non-finite check, a lost peer "
             "connection), rebuild the process group inside the same processes and continue "
             "from the newest state every rank holds; a dead process still needs the "
             "launcher's restart")
    max_iterations: int = option(
        "--inprocess-max-iterations", default=3,
        help="in-process restarts allowed in one process; the next failure ends the run as "
             "without --inprocess-restart (Megatron's default is no limit; ours stops an error "
             "that repeats at every attempt)")
    barrier_timeout: float = option(
        "--inprocess-barrier-timeout", default=120.0,
        help="seconds every rank has to rejoin after a failure; a rank that does not (a dead "
             "process) ends the run with exit code 4, for the launcher to restart")
    snapshot_interval: int = option(
        "--inprocess-snapshot-interval", default=1,
        help="keep an in-memory copy of the training state every this many iterations (host "
             "memory: twice the weights and optimizer states); 0 keeps none and a restart "
             "reloads the newest checkpoint")

    def __post_init__(self) -> None:
        positive(self, (("max_iterations", "--inprocess-max-iterations"),
                        ("barrier_timeout", "--inprocess-barrier-timeout")))
        if self.snapshot_interval < 0:
            raise ValueError(f"--inprocess-snapshot-interval must be >= 0, got "
                             f"{self.snapshot_interval}")
