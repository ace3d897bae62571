"""The flags: every Megatron-LM flag this project understands plus DeepSpeed's, in groups,
and `parse_args` (parsing only; `arguments.convert` turns the namespace into configs)."""
from __future__ import annotations

import argparse
import sys
from typing import FrozenSet, List, Optional, Sequence

from app.config import (ATTENTION_BACKENDS, DISTRIBUTED_BACKENDS, LR_DECAY_STYLES,
                        MUON_COEFFICIENT_TYPES, MUON_MATMUL_PRECISIONS, MUON_SCALAR_OPTIMIZERS,
                        MUON_SCALE_MODES, MUON_TP_MODES, OPTIMIZERS,
                        POSITION_EMBEDDING_TYPES, RECOMPUTE_GRANULARITIES, RECOMPUTE_METHODS)
from app.launch.distributed import default_backend


# ---------------------------------------------------------------------------- flag groups

def _add_model_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model", "GPT-2 shape and regularisation")
    g.add_argument("--num-layers", type=int, default=24, help="transformer layers")
    g.add_argument("--hidden-size", type=int, default=1024, help="model width h")
    g.add_argument("--num-attention-heads", type=int, default=16)
    g.add_argument("--ffn-hidden-size", "--intermediate-size", dest="ffn_hidden_size", type=int,
                   default=None, help="MLP width (default 4 x hidden size)")
    g.add_argument("--seq-length", type=int, default=1024, help="tokens per training sample")
    g.add_argument("--max-position-embeddings", type=int, default=None,
                   help="rows of the position table (default: --seq-length)")
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--layernorm-epsilon", type=float, default=1e-5)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="pad the vocab to a multiple of this x the tensor-parallel size")
    g.add_argument("--openai-gelu", action="store_true",
                   help="tanh-approximated GeLU instead of the exact erf form")
    g.add_argument("--position-embedding-type", choices=POSITION_EMBEDDING_TYPES,
                   default="learned_absolute",
                   help="learned_absolute: GPT-2's position table (needs --max-position-embeddings "
                        ">= --seq-length); rope: rotary embeddings on queries and keys; alibi: "
                        "linear attention biases (Press et al.). Hugging Face GPT-2 export "
                        "needs learned_absolute")
    g.add_argument("--rotary-percent", type=float, default=1.0,
                   help="fraction of each head's channels RoPE rotates, in (0, 1] (rope only; "
                        "the rotated channel count must be even)")
    g.add_argument("--rotary-base", type=int, default=10000,
                   help="RoPE base of the rotation frequencies (rope only)")
    g.add_argument("--group-query-attention", action="store_true",
                   help="grouped-query attention: --num-query-groups key/value heads shared by "
                        "the query heads")
    g.add_argument("--num-query-groups", type=int, default=None,
                   help="key/value heads with --group-query-attention (default 1: multi-query); "
                        "must divide --num-attention-heads, and be divisible by the TP size or "
                        "divide it (then each group's key/value heads are replicated on "
                        "TP/groups ranks)")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                   help="a separate column-parallel output layer (language_model.output_layer) "
                        "instead of the word embeddings' transpose")
    g.add_argument("--recompute-granularity", choices=RECOMPUTE_GRANULARITIES, default=None,
                   help="activation recompute in backward: full (whole layers, see "
                        "--recompute-method) or selective (the attention core only: QK^T, "
                        "softmax, dropout, AV)")
    g.add_argument("--recompute-method", choices=RECOMPUTE_METHODS, default=None,
                   help="with --recompute-granularity full: uniform recomputes every layer in "
                        "chunks of --recompute-num-layers (default); block recomputes only the "
                        "first --recompute-num-layers layers of each pipeline stage")
    g.add_argument("--recompute-num-layers", type=int, default=None,
                   help="with full recompute: layers per chunk (uniform) or recomputed layers "
                        "per pipeline stage (block, at most --num-layers / PP); default 1")
    g.add_argument("--checkpoint-activations", action="store_true",
                   help="older spelling of --recompute-granularity full --recompute-method "
                        "uniform")
    g.add_argument("--checkpoint-num-layers", type=int, default=None,
                   help="older spelling of --recompute-num-layers (with "
                        "--checkpoint-activations)")


def _add_kernel_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("fused kernels", "fusions and the csrc/ kernels "
                                  "(docs/kernels.md); each has a --no- form")
    on = dict(action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--masked-softmax-fusion", **on,
                   help="csrc/ causal and masked softmax kernels (CUDA)")
    g.add_argument("--bias-gelu-fusion", **on, help="torch.compile'd bias+GeLU (CUDA)")
    g.add_argument("--bias-dropout-fusion", **on,
                   help="torch.compile'd bias+dropout+residual add (CUDA)")
    g.add_argument("--layernorm-fusion", **on, help="csrc/ LayerNorm kernel (CUDA)")
    g.add_argument("--cross-entropy-loss-fusion", **on,
                   help="csrc/ cross-entropy kernels, no fp32 copy of the logits (CUDA)")
    g.add_argument("--use-flash-attn", action="store_true",
                   help="causal attention through SDPA's flash/efficient backends only")
    g.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="auto",
                   help="auto: SDPA for causal (measured default); flash: = --use-flash-attn; "
                        "local: q k^T + fused softmax + @ v (Megatron's core attention)")
    g.add_argument("--require-fused-kernels", action="store_true",
                   help="stop if the kernels cannot be built on a CUDA machine "
                        "(default: warn and use PyTorch)")
    g.add_argument("--kernel-build-dir", type=str, default=None,
                   help="kernel build cache (default $APP_KERNELS_BUILD_DIR or "
                        "~/.cache/app_kernels)")
    g.add_argument("--kernel-build-timeout", type=float, default=None,
                   help="seconds a kernel build may take before falling back to PyTorch "
                        "(below the process-group timeout; default 300, or half of "
                        "--distributed-timeout-minutes when that is shorter)")


def _add_parallel_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("parallel", "model parallelism and process launch")
    g.add_argument("--tensor-model-parallel-size", "--model-parallel-size",
                   dest="tensor_model_parallel_size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--sequence-parallel", action="store_true",
                   help="split LayerNorm, dropout and residual activations along the sequence "
                        "over the tensor-parallel ranks (all-gather / reduce-scatter instead of "
                        "all-reduce); needs --tensor-model-parallel-size > 1 and --seq-length "
                        "divisible by it")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                   help="interleaved 1F1B: each pipeline rank holds (num layers / PP) / N model "
                        "chunks of N layers, assigned round-robin (stage r holds virtual stages r, "
                        "r+PP, ...); needs PP > 1, N dividing the layers per stage and the "
                        "micro-batches per iteration a multiple of PP; native path only")
    g.add_argument("--distributed-backend", choices=DISTRIBUTED_BACKENDS, default=None,
                   help="default: nccl when CUDA is available, else gloo")
    g.add_argument("--local_rank", "--local-rank", dest="local_rank", type=int, default=None,
                   help="set by launchers (torch.distributed.launch, deepspeed)")
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0,
                   help="a collective waiting this long for another rank fails, and a rank "
                        "making no progress for this long (plus a margin) is stopped; "
                        "fractions allowed")


def _add_precision_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("precision", "mixed precision and loss scaling (docs/precision.md)")
    g.add_argument("--fp16", action="store_true",
                   help="fp16 weights and activations, fp32 main weights, dynamic loss scaling")
    g.add_argument("--bf16", action="store_true",
                   help="bf16 weights and activations, fp32 main weights and gradient accumulation")
    g.add_argument("--loss-scale", type=float, default=None,
                   help="static loss scale (fp16); unset means dynamic scaling")
    g.add_argument("--initial-loss-scale", type=float, default=None,
                   help="initial dynamic loss scale (fp16; default 2^32)")
    g.add_argument("--min-loss-scale", "--min-scale", dest="min_loss_scale", type=float,
                   default=None, help="floor of the dynamic loss scale (fp16; default 1)")
    g.add_argument("--loss-scale-window", type=int, default=None,
                   help="clean steps before the loss scale doubles (fp16; default 1000)")
    g.add_argument("--hysteresis", type=int, default=None,
                   help="overflows tolerated before the loss scale halves (fp16; default 2)")
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true",
                   help="accumulate and all-reduce fp16 gradients in fp32 (always on for bf16)")
    g.add_argument("--attention-softmax-in-fp32", action="store_true",
                   help="attention softmax in fp32 for half-precision scores")
    g.add_argument("--apply-query-key-layer-scaling", action="store_true",
                   help="scale Q K^T by 1/layer number, undone in an fp32 softmax (fp16 guard)")
    g.add_argument("--fp16-lm-cross-entropy", action="store_true",
                   help="LM cross entropy on half-precision logits (default: fp32)")
    g.add_argument("--max-consecutive-skipped-iterations", type=int, default=10,
                   help="stop with an error after this many consecutive non-finite iterations "
                        "(fp16: overflows at the minimum loss scale); 0 disables")
    g.add_argument("--check-for-nan-in-loss-and-grad", action="store_true",
                   help="stop at the first non-finite loss or gradient")


def _add_optimizer_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("optimizer", "AdamW, clipping and the LR schedule")
    g.add_argument("--lr", type=float, default=1.5e-4)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", choices=LR_DECAY_STYLES, default="linear",
                   help="LR decay after the warmup, from --lr to --min-lr over --lr-decay-iters")
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default: --train-iters")
    g.add_argument("--lr-warmup-fraction", "--warmup", dest="lr_warmup_fraction", type=float,
                   default=None, help="warmup as a fraction of --lr-decay-iters")
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--clip-grad", type=float, default=1.0, help="0 disables clipping")
    g.add_argument("--override-opt_param-scheduler", "--override-opt-param-scheduler",
                   dest="override_opt_param_scheduler", action="store_true",
                   help="on resume, use this run's LR settings, not the checkpoint's")
    g.add_argument("--use-checkpoint-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler",
                   dest="use_checkpoint_opt_param_scheduler", action="store_true",
                   help="on resume, keep the checkpoint's LR settings")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="native path: shard the fp32 main weights and AdamW states over the "
                        "data-parallel ranks (gradients reduce-scattered in buckets, weights "
                        "all-gathered after the step); checkpoints stay layout-independent, so "
                        "a run resumes at another data-parallel size or without the flag")
    g.add_argument("--overlap-grad-reduce", action="store_true",
                   help="with --use-distributed-optimizer: reduce-scatter each gradient bucket "
                        "while backward still runs, once its last micro-batch is in")
    g.add_argument("--overlap-param-gather", action="store_true",
                   help="with --overlap-grad-reduce: all-gather updated weights in the "
                        "background; each module waits for its bucket at its next forward")
    g.add_argument("--ddp-bucket-size", type=int, default=None,
                   help="elements per gradient bucket of the distributed optimizer "
                        "(default max(40M, 1M x data-parallel size))")
    _add_muon_args(parser)


def _add_muon_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "optimizer choice", "--optimizer and Muon's settings (Megatron-LM's names and defaults; "
        "docs/parallelism.md)")
    g.add_argument("--optimizer", choices=OPTIMIZERS, default="adam",
                   help="adam: AdamW; sgd: SGD with --sgd-momentum; muon: Muon for the 2-D "
                        "weights of the transformer layers, --muon-scalar-optimizer for the "
                        "embeddings, output layer, biases and LayerNorms. With --deepspeed, Muon "
                        "is DeepSpeed's, set in the JSON (\"optimizer\": {\"type\": \"Muon\"}), "
                        "which takes only --muon-momentum, and --muon-tp-mode blockwise at TP > 1")
    g.add_argument("--sgd-momentum", type=float, default=0.9, help="momentum of --optimizer sgd")
    g.add_argument("--muon-momentum", type=float, default=0.9,
                   help="EMA coefficient of Muon's momentum buffer, in [0, 1) (default 0.9)")
    g.add_argument("--muon-nesterov", action="store_true",
                   help="orthogonalise the Nesterov blend of gradient and momentum")
    g.add_argument("--muon-no-split-qkv", dest="muon_split_qkv", action="store_false",
                   help="orthogonalise the fused QKV weight whole (default: its query, key and "
                        "value rows as three matrices); with fewer --num-query-groups than TP "
                        "ranks it needs --muon-tp-mode blockwise")
    g.add_argument("--muon-scale-mode", choices=MUON_SCALE_MODES, default="spectral",
                   help="update scale of an m x n matrix: spectral sqrt(max(m, n)), "
                        "unit_rms_norm sqrt(m / n), shape_scaling sqrt(max(1, m / n))")
    g.add_argument("--muon-num-ns-steps", type=int, default=5,
                   help="Newton-Schulz iterations, >= 1 (default 5)")
    g.add_argument("--muon-coefficient-type", choices=MUON_COEFFICIENT_TYPES, default="quintic",
                   help="Newton-Schulz coefficients: quintic (five tuned steps, cycled), simple "
                        "(Keller Jordan's one tuple), polar_express")
    g.add_argument("--muon-fp32-matmul-prec", choices=MUON_MATMUL_PRECISIONS, default="medium",
                   help="Newton-Schulz precision: medium bf16; high fp32 (TF32 on CUDA); low "
                        "fp32 at the process's matmul precision")
    g.add_argument("--muon-tp-mode", choices=MUON_TP_MODES, default="duplicated",
                   help="with TP > 1: duplicated all-gathers each matrix and orthogonalises it "
                        "whole; distributed runs Newton-Schulz on the shards (an all-reduce per "
                        "step); both give the one-process update. blockwise orthogonalises each "
                        "shard alone (no communication; the update depends on the TP size)")
    g.add_argument("--muon-extra-scale-factor", type=float, default=1.0,
                   help="extra factor on Muon's update (0.2 with spectral roughly matches "
                        "AdamW's update RMS)")
    g.add_argument("--muon-scalar-optimizer", choices=MUON_SCALAR_OPTIMIZERS, default="adam",
                   help="optimizer of the parameters Muon leaves out")


def _add_training_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("training", "batches, iterations, logging, evaluation, exits")
    g.add_argument("--micro-batch-size", "--batch-size", dest="micro_batch_size", type=int,
                   default=4, help="samples per rank per micro-batch")
    g.add_argument("--global-batch-size", type=int, default=None,
                   help="samples per iteration (default: micro batch x data-parallel size)")
    g.add_argument("--train-iters", type=int, default=None)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=100)
    g.add_argument("--tensorboard-dir", type=str, default=None)
    g.add_argument("--metrics-file", type=str, default=None,
                   help="append one JSON object per log line to this file")
    g.add_argument("--peak-flops", type=float, default=None,
                   help="peak FLOP/s per rank for MFU (default: looked up or measured)")
    g.add_argument("--exit-interval", type=int, default=None,
                   help="save and exit when the iteration is a multiple of this")
    g.add_argument("--exit-duration-in-mins", type=float, default=None)
    g.add_argument("--exit-signal-handler", action=argparse.BooleanOptionalAction, default=None,
                   help="on SIGTERM/SIGINT/SIGUSR1 save a checkpoint at the end of the "
                        "iteration and exit 0 (default: on when --save is given)")
    g.add_argument("--log-straggler", action="store_true",
                   help="every --log-interval, name (with their hosts) the ranks whose forward "
                        "+ data-wait time per iteration exceeds the median by more than "
                        "--straggler-margin (one all-gather per interval)")
    g.add_argument("--straggler-margin", type=float, default=0.1,
                   help="fraction above the median at which --log-straggler names a rank "
                        "(0.1: more than 10%% slower)")
    g.add_argument("--straggler-minmax-count", type=int, default=1,
                   help="how many slowest and fastest ranks the straggler line lists")


def _add_data_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("data", "dataset and tokenizer")
    g.add_argument("--data-path", nargs="*", default=[],
                   help="a dataset prefix, or weight prefix pairs: 0.7 a 0.3 b")
    g.add_argument("--split", type=str, default="969,30,1")
    g.add_argument("--data-cache-path", type=str, default=None)
    g.add_argument("--vocab-file", type=str, default=None)
    g.add_argument("--merge-file", type=str, default=None)
    g.add_argument("--tokenizer-type", type=str, default="GPT2BPETokenizer")
    g.add_argument("--reset-position-ids", action="store_true")
    g.add_argument("--reset-attention-mask", action="store_true")
    g.add_argument("--eod-mask-loss", action="store_true")
    g.add_argument("--num-workers", type=int, default=2)


def _add_checkpoint_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("checkpointing", "Megatron-layout checkpoints")
    g.add_argument("--save", type=str, default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--load", type=str, default=None)
    g.add_argument("--no-save-optim", action="store_true")
    g.add_argument("--no-save-rng", action="store_true")
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--finetune", action="store_true",
                   help="load weights only and start at iteration 0")
    g.add_argument("--keep-last-n-checkpoints", type=int, default=None,
                   help="after each save, delete all but the newest N iter_ directories")
    g.add_argument("--overwrite-checkpoints", action="store_true",
                   help="allow training from scratch (or from another --load) into a --save "
                        "directory that already holds checkpoints")
    g.add_argument("--async-save", action="store_true",
                   help="write checkpoint files in the background while training goes on; "
                        "the checkpoint becomes the latest once every rank's files are durable "
                        "(docs/reliability.md)")


def _add_rollback_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "self-healing", "roll back to the last checkpoint on a loss spike (docs/reliability.md)")
    g.add_argument("--rollback-on-spike", action="store_true",
                   help="on a loss spike, or when --max-consecutive-skipped-iterations is reached, "
                        "reload the last checkpoint, skip the data since it and continue (needs "
                        "--save and --save-interval)")
    g.add_argument("--spike-window", type=int, default=50,
                   help="iterations of loss history for the running mean and deviation")
    g.add_argument("--spike-zscore", type=float, default=5.0,
                   help="a spike is a loss above mean + this x the standard deviation ...")
    g.add_argument("--spike-min-increase", type=float, default=0.2,
                   help="... and above mean x (1 + this)")
    g.add_argument("--max-rollbacks", type=int, default=3,
                   help="rollbacks allowed; the next trigger stops the run (exit code 3)")


def _add_preflight_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("preflight", "check a run without training (docs/reliability.md)")
    g.add_argument("--dry-run", action="store_true",
                   help="check the flags, DeepSpeed JSON, data, checkpoint and memory; print one "
                        "report and exit (non-zero on any error) without training")
    g.add_argument("--dry-run-world-size", type=int, default=None,
                   help="plan for this many ranks (default: the launcher's WORLD_SIZE, else 1)")
    g.add_argument("--dry-run-device-memory", type=float, default=None, metavar="GiB",
                   help="memory per device to check the estimate against (default: the first "
                        "CUDA device's)")


def _add_deepspeed_args(parser: argparse.ArgumentParser) -> None:
    """DeepSpeed's own flags (from deepspeed when it imports) plus ours for the DeepSpeed path."""
    try:
        import deepspeed  # by design (deepspeed.add_config_arguments): DeepSpeed's own flags
        deepspeed.add_config_arguments(parser)
    except Exception:  # noqa: BLE001 (not installed, or broken on this machine: same flags)
        g = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
        g.add_argument("--deepspeed", action="store_true", default=False)
        g.add_argument("--deepspeed_config", type=str, default=None)
        g.add_argument("--deepscale", action="store_true", default=False)
        g.add_argument("--deepscale_config", type=str, default=None)
    known = parser._option_string_actions  # noqa: SLF001 (only way to ask "is it defined?")
    if "--deepspeed_mpi" not in known:
        parser.add_argument("--deepspeed_mpi", action="store_true", default=False,
                            help="discover ranks through mpi4py")
    parser.add_argument("--deepspeed-activation-checkpointing", action="store_true",
                        help="run the recompute chosen by --recompute-granularity (or "
                             "--checkpoint-activations) through deepspeed.checkpointing, with "
                             "the JSON's activation_checkpointing settings; needs --deepspeed")
    parser.add_argument("--universal-checkpoint", action="store_true",
                        help="load a DeepSpeed universal checkpoint (ds_to_universal.py output, "
                             "named by --load's latest_universal) at any DP/TP size")


def _add_wandb_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("Weights & Biases", "log the training scalars and the run "
                                  "configuration from the last rank (pip install wandb; "
                                  "docs/metrics.md)")
    g.add_argument("--wandb-project", type=str, default=None,
                   help="the W&B project; W&B is off without it")
    g.add_argument("--wandb-exp-name", type=str, default=None, help="the run's name in W&B")
    g.add_argument("--wandb-save-dir", type=str, default=None,
                   help="the run's local W&B files (default: {--save}/wandb)")
    g.add_argument("--wandb-entity", type=str, default=None,
                   help="the W&B user or team (default: the account's)")


def build_parser() -> argparse.ArgumentParser:
    """The full parser: every Megatron-LM flag this project understands plus DeepSpeed's."""
    parser = argparse.ArgumentParser(
        description="GPT-2 pretraining, Megatron-LM style (native or DeepSpeed)",
        allow_abbrev=False)
    for add in (_add_model_args, _add_kernel_args, _add_parallel_args, _add_precision_args,
                _add_optimizer_args, _add_training_args, _add_data_args, _add_checkpoint_args,
                _add_rollback_args, _add_preflight_args,
                _add_deepspeed_args, _add_wandb_args):
        add(parser)
    return parser


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parse `argv` (default sys.argv[1:]) into a namespace with Megatron's dest names.

    Only parsing happens here (plus defaulting --distributed-backend to nccl when CUDA is
    available, else gloo, and --deepscale* to --deepspeed*); `build_run_config` converts. The
    flags given explicitly are recorded as `_explicit_flags` (each under its first spelling),
    for the DeepSpeed JSON checks that must know what the user asked for.
    """
    parser = build_parser()
    given = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(given)
    if args.distributed_backend is None:  # resolved here so init code can use it before configs
        args.distributed_backend = default_backend()
    args.deepspeed = bool(args.deepspeed or getattr(args, "deepscale", False))
    if args.deepspeed_config is None and getattr(args, "deepscale_config", None):
        args.deepspeed_config = args.deepscale_config
    args._explicit_flags = _explicit_flags(parser, given)
    return args


def _explicit_flags(parser: argparse.ArgumentParser, argv: Sequence[str]) -> FrozenSet[str]:
    """Flags present in `argv`, each named by the first spelling of its option."""
    actions = parser._option_string_actions  # noqa: SLF001 (the only map of spellings)
    found = set()
    for token in argv:
        if token.startswith("--"):
            action = actions.get(token.split("=", 1)[0])
            if action is not None:
                found.add(action.option_strings[0])
    return frozenset(found)


def format_args(args: argparse.Namespace) -> List[str]:
    """Megatron-style listing of every argument, one "  name .... value" line each, sorted."""
    lines = []
    for key in sorted(vars(args)):
        if key.startswith("_"):
            continue
        dots = "." * max(1, 48 - len(key))
        lines.append(f"  {key} {dots} {getattr(args, key)}")
    return lines
