"""Command-line arguments: Megatron-LM flag names (plus DeepSpeed's), converted once into configs.

This is the only module that touches argparse, and nothing under `app/` imports it.
`parse_args` returns the raw namespace; `build_run_config` turns it into an
`app.config.RunConfig` once, filling derived defaults. The rules themselves live in the config
dataclasses (one home each), whose messages name the flags and their values.

Both spellings are accepted where DeepSpeedExamples' Megatron-LM and current Megatron-LM differ;
the pairs share one `dest`, so either spelling sets the same value:

=============================  ==============================
DeepSpeedExamples name          current Megatron-LM name
=============================  ==============================
--model-parallel-size           --tensor-model-parallel-size
--batch-size                    --micro-batch-size
--intermediate-size             --ffn-hidden-size
--warmup (fraction)             --lr-warmup-fraction
--min-scale                     --min-loss-scale
--local_rank                    --local-rank
=============================  ==============================
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Any, Dict, FrozenSet, List, Optional, Sequence, Tuple

from app.config import (ATTENTION_BACKENDS, DISTRIBUTED_BACKENDS, LR_DECAY_STYLES,
                        MUON_COEFFICIENT_TYPES, MUON_MATMUL_PRECISIONS, MUON_SCALAR_OPTIMIZERS,
                        MUON_SCALE_MODES, MUON_TP_MODES, OPTIMIZERS,
                        POSITION_EMBEDDING_TYPES, RECOMPUTE_GRANULARITIES, RECOMPUTE_METHODS,
                        CheckpointConfig, DataConfig, DeepSpeedConfig, KernelConfig, ModelConfig,
                        OptimizerConfig, ParallelConfig, PrecisionConfig, RollbackConfig,
                        RunConfig, TrainingConfig, default_kernel_build_timeout,
                        resolve_recompute_flags)
from app.config.wandb import WandbConfig
from app.data.tokenizer import pad_vocab_size
from app.launch.distributed import check_backend, default_backend
from app.training.engines.ds_config import load_ds_json, reconcile_ds_config


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


def _wandb_config(args: argparse.Namespace) -> WandbConfig:
    save_dir = args.wandb_save_dir
    if save_dir is None and args.wandb_project and args.save:
        save_dir = os.path.join(args.save, "wandb")
    return WandbConfig(project=args.wandb_project, exp_name=args.wandb_exp_name,
                       save_dir=save_dir, entity=args.wandb_entity)


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


# ---------------------------------------------------------------------------- conversion

def _warmup_iters(args: argparse.Namespace, decay_iters: int) -> int:
    """--lr-warmup-fraction (or --warmup) x decay iterations, or --lr-warmup-iters."""
    if args.lr_warmup_fraction is None:
        return args.lr_warmup_iters
    if args.lr_warmup_iters != 0:
        raise ValueError(f"--lr-warmup-fraction/--warmup ({args.lr_warmup_fraction}) and "
                         f"--lr-warmup-iters ({args.lr_warmup_iters}) were both given; use only one")
    if not 0.0 <= args.lr_warmup_fraction <= 1.0:
        raise ValueError(f"--lr-warmup-fraction/--warmup must be in [0, 1], got "
                         f"{args.lr_warmup_fraction}")
    return int(args.lr_warmup_fraction * decay_iters)


def _global_batch_size(args: argparse.Namespace, ds_json: Optional[Dict[str, Any]],
                       data_parallel_size: int) -> int:
    """--global-batch-size; by default the DeepSpeed JSON's train_batch_size (or micro-batch x
    gradient_accumulation_steps x DP) when --deepspeed gives one, else micro-batch x DP."""
    if args.global_batch_size is not None:
        return args.global_batch_size
    default = args.micro_batch_size * data_parallel_size
    if ds_json and "train_batch_size" in ds_json:
        return int(ds_json["train_batch_size"])
    if ds_json and "gradient_accumulation_steps" in ds_json:
        return default * int(ds_json["gradient_accumulation_steps"])
    return default


def _precision_choice(args: argparse.Namespace, ds_json: Optional[Dict[str, Any]],
                      ds_path: Optional[str]) -> Tuple[bool, bool, str]:
    """(fp16, bf16, where it came from): the flags, or with --deepspeed and no precision flag
    the JSON's `fp16.enabled` / `bf16.enabled` (DeepSpeed's convention: the JSON is the source
    of truth). A flag that contradicts the JSON is refused by reconcile_ds_config."""
    if args.fp16 or args.bf16 or not ds_json:
        flag = "--fp16" if args.fp16 else "--bf16" if args.bf16 else "fp32 (no --fp16/--bf16)"
        return args.fp16, args.bf16, flag
    json_fp16 = ds_json.get("fp16", {}).get("enabled") is True
    json_bf16 = ds_json.get("bf16", {}).get("enabled") is True
    if json_fp16 or json_bf16:
        key = "fp16" if json_fp16 else "bf16"
        return json_fp16, json_bf16, f"{ds_path} ({key}.enabled)"
    return False, False, "fp32 (no --fp16/--bf16)"


def _model_config(args: argparse.Namespace, padded_vocab_size: int,
                  precision: PrecisionConfig) -> ModelConfig:
    granularity, method, recompute_layers = resolve_recompute_flags(
        args.checkpoint_activations, args.checkpoint_num_layers, args.recompute_granularity,
        args.recompute_method, args.recompute_num_layers)
    return ModelConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads, seq_length=args.seq_length,
        max_position_embeddings=(args.max_position_embeddings
                                 if args.max_position_embeddings is not None else args.seq_length),
        padded_vocab_size=padded_vocab_size, ffn_hidden_size=args.ffn_hidden_size,
        hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
        layernorm_epsilon=args.layernorm_epsilon, init_method_std=args.init_method_std,
        openai_gelu=args.openai_gelu, recompute_granularity=granularity,
        recompute_method=method, recompute_num_layers=recompute_layers,
        sequence_parallel=args.sequence_parallel,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent, rotary_base=args.rotary_base,
        group_query_attention=args.group_query_attention,
        num_query_groups=args.num_query_groups,
        untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights,
        bias_gelu_fusion=args.bias_gelu_fusion, bias_dropout_fusion=args.bias_dropout_fusion,
        masked_softmax_fusion=args.masked_softmax_fusion, layernorm_fusion=args.layernorm_fusion,
        cross_entropy_loss_fusion=args.cross_entropy_loss_fusion,
        attention_backend=args.attention_backend, use_flash_attn=args.use_flash_attn,
        params_dtype=precision.params_dtype, seed=args.seed,
        attention_softmax_in_fp32=args.attention_softmax_in_fp32,
        apply_query_key_layer_scaling=args.apply_query_key_layer_scaling,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy)


def _training_config(args: argparse.Namespace, global_batch: int) -> TrainingConfig:
    return TrainingConfig(
        micro_batch_size=args.micro_batch_size, global_batch_size=global_batch,
        train_iters=args.train_iters, seed=args.seed, log_interval=args.log_interval,
        eval_interval=args.eval_interval, eval_iters=args.eval_iters,
        exit_interval=args.exit_interval, exit_duration_in_mins=args.exit_duration_in_mins,
        tensorboard_dir=args.tensorboard_dir, metrics_file=args.metrics_file,
        peak_flops=args.peak_flops,
        max_consecutive_skipped_iterations=args.max_consecutive_skipped_iterations,
        check_for_nan_in_loss_and_grad=args.check_for_nan_in_loss_and_grad,
        exit_signal_handler=args.exit_signal_handler, log_straggler=args.log_straggler,
        straggler_margin=args.straggler_margin,
        straggler_minmax_count=args.straggler_minmax_count)


def _optimizer_name(args: argparse.Namespace, ds_json: Optional[Dict[str, Any]]) -> str:
    """--optimizer; with --deepspeed and no --optimizer flag, muon when the JSON's optimizer is
    DeepSpeed's Muon (the JSON is then the source of truth, as for the precision)."""
    json_type = str(((ds_json or {}).get("optimizer") or {}).get("type", "")).lower()
    if json_type == "muon" and "--optimizer" not in getattr(args, "_explicit_flags", ()):
        return "muon"
    return args.optimizer


def _optimizer_config(args: argparse.Namespace,
                      ds_json: Optional[Dict[str, Any]] = None) -> OptimizerConfig:
    decay_iters = args.lr_decay_iters if args.lr_decay_iters is not None else args.train_iters
    return OptimizerConfig(
        lr=args.lr, min_lr=args.min_lr, lr_decay_style=args.lr_decay_style,
        lr_decay_iters=decay_iters, lr_warmup_iters=_warmup_iters(args, decay_iters),
        weight_decay=args.weight_decay, adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps, clip_grad=args.clip_grad,
        override_opt_param_scheduler=args.override_opt_param_scheduler,
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
        use_distributed_optimizer=args.use_distributed_optimizer,
        overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather, ddp_bucket_size=args.ddp_bucket_size,
        optimizer=_optimizer_name(args, ds_json), sgd_momentum=args.sgd_momentum,
        muon_momentum=args.muon_momentum, muon_nesterov=args.muon_nesterov,
        muon_split_qkv=args.muon_split_qkv, muon_scale_mode=args.muon_scale_mode,
        muon_num_ns_steps=args.muon_num_ns_steps,
        muon_coefficient_type=args.muon_coefficient_type,
        muon_fp32_matmul_prec=args.muon_fp32_matmul_prec, muon_tp_mode=args.muon_tp_mode,
        muon_extra_scale_factor=args.muon_extra_scale_factor,
        muon_scalar_optimizer=args.muon_scalar_optimizer)


def _other_configs(args: argparse.Namespace) -> Dict[str, Any]:
    return dict(
        data=DataConfig(
            data_path=list(args.data_path), split=args.split,
            data_cache_path=args.data_cache_path, tokenizer_type=args.tokenizer_type,
            vocab_file=args.vocab_file, merge_file=args.merge_file,
            reset_position_ids=args.reset_position_ids,
            reset_attention_mask=args.reset_attention_mask, eod_mask_loss=args.eod_mask_loss,
            num_workers=args.num_workers),
        checkpoint=CheckpointConfig(
            save=args.save, save_interval=args.save_interval, load=args.load,
            no_save_optim=args.no_save_optim, no_save_rng=args.no_save_rng,
            no_load_optim=args.no_load_optim, no_load_rng=args.no_load_rng,
            finetune=args.finetune, keep_last_n_checkpoints=args.keep_last_n_checkpoints,
            overwrite_checkpoints=args.overwrite_checkpoints, async_save=args.async_save),
        rollback=RollbackConfig(
            enabled=args.rollback_on_spike, window=args.spike_window, zscore=args.spike_zscore,
            min_increase=args.spike_min_increase, max_rollbacks=args.max_rollbacks),
        kernels=KernelConfig(
            require_fused_kernels=args.require_fused_kernels, build_dir=args.kernel_build_dir,
            build_timeout=(default_kernel_build_timeout(args.distributed_timeout_minutes)
                           if args.kernel_build_timeout is None else args.kernel_build_timeout)),
        wandb=_wandb_config(args),
    )


def build_run_config(args: argparse.Namespace, world_size: int, raw_vocab_size: int,
                     padded_vocab_size: Optional[int] = None) -> RunConfig:
    """Convert the parsed flags once into a validated RunConfig.

    Fills the derived defaults (ffn = 4h, max positions = seq length, lr_decay_iters =
    train_iters, warmup iterations = fraction x decay iterations, global batch = micro batch x
    data-parallel size or the DeepSpeed JSON's). With --deepspeed the JSON is read here, once,
    and reconciled with the flags (`cfg.deepspeed.config`). `padded_vocab_size` None pads
    `raw_vocab_size` by Megatron's rule. Every rule is checked by the config dataclasses
    (app.config); a broken one raises ValueError naming the flags and values.
    """
    if args.train_iters is None:
        raise ValueError("--train-iters is required")
    if padded_vocab_size is None:
        padded_vocab_size = pad_vocab_size(raw_vocab_size, args.make_vocab_size_divisible_by,
                                           args.tensor_model_parallel_size)
    deepspeed = DeepSpeedConfig(
        enabled=args.deepspeed, config_path=args.deepspeed_config,
        activation_checkpointing=args.deepspeed_activation_checkpointing,
        mpi=args.deepspeed_mpi, universal_checkpoint=args.universal_checkpoint)
    parallel = ParallelConfig(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size, world_size=world_size,
        distributed_backend=check_backend(args.distributed_backend), local_rank=args.local_rank,
        distributed_timeout_minutes=args.distributed_timeout_minutes,
        num_layers_per_virtual_pipeline_stage=args.num_layers_per_virtual_pipeline_stage)
    ds_json = load_ds_json(deepspeed.config_path) if deepspeed.enabled else None
    fp16, bf16, source = _precision_choice(args, ds_json, deepspeed.config_path)
    precision = PrecisionConfig(
        fp16=fp16, bf16=bf16, loss_scale=args.loss_scale,
        initial_loss_scale=args.initial_loss_scale, min_loss_scale=args.min_loss_scale,
        loss_scale_window=args.loss_scale_window, hysteresis=args.hysteresis,
        accumulate_allreduce_grads_in_fp32=args.accumulate_allreduce_grads_in_fp32,
        source=source)
    cfg = RunConfig(
        model=_model_config(args, padded_vocab_size, precision), parallel=parallel,
        optimizer=_optimizer_config(args, ds_json), precision=precision,
        training=_training_config(args, _global_batch_size(args, ds_json,
                                                           parallel.data_parallel_size)),
        deepspeed=deepspeed, raw_vocab_size=raw_vocab_size,
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by, **_other_configs(args))
    if ds_json is not None:
        reconciled = reconcile_ds_config(ds_json, cfg, deepspeed.config_path,
                                         getattr(args, "_explicit_flags", ()))
        cfg = dataclasses.replace(cfg, deepspeed=dataclasses.replace(deepspeed, config=reconciled))
    return cfg


# ---------------------------------------------------------------------------- helpers

def format_args(args: argparse.Namespace) -> List[str]:
    """Megatron-style listing of every argument, one "  name .... value" line each, sorted."""
    lines = []
    for key in sorted(vars(args)):
        if key.startswith("_"):
            continue
        dots = "." * max(1, 48 - len(key))
        lines.append(f"  {key} {dots} {getattr(args, key)}")
    return lines


def config_from_argv(argv: Sequence[str], world_size: int, raw_vocab_size: int,
                     padded_vocab_size: Optional[int] = None) -> RunConfig:
    """`build_run_config(parse_args(argv), ...)`: a RunConfig from a command line, for tests,
    benchmarks and tools that build runs in-process."""
    return build_run_config(parse_args(list(argv)), world_size, raw_vocab_size, padded_vocab_size)
