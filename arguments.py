"""Command-line arguments: the parser generated from the config fields, and the one conversion
of the parsed flags into an `app.config.RunConfig`.

Nothing under `app/` imports this module. Every option is declared once, as a field of a
config dataclass (`app.config.options.option`): its spellings, default, choices and help. This
module only assembles the parser from those fields (with `app.config.cli`, as the tools do),
adds DeepSpeed's own flags (`deepspeed.add_config_arguments`) and the aliases that are not one
field's (the older recompute spelling), and computes the derived values: warm-up iterations
from a fraction, the LR decay length, the global batch, the precision and optimizer taken from
the DeepSpeed JSON, the padded vocabulary (unless --padded-vocab-size gives it), the position
type of --use-rotary-position-embeddings, the kernel build timeout, the W&B folder and
--sequence-parallel (turned off at tensor-parallel size 1, as Megatron-LM does). The
rules live in the config dataclasses, whose messages name the flags.

Both spellings are accepted where DeepSpeedExamples' Megatron-LM and current Megatron-LM differ
(declared on the field, so either sets the same value): --model-parallel-size =
--tensor-model-parallel-size, --batch-size = --micro-batch-size, --intermediate-size =
--ffn-hidden-size, --warmup = --lr-warmup-fraction, --min-scale = --min-loss-scale,
--local_rank = --local-rank; --checkpoint-activations [--checkpoint-num-layers N] =
--recompute-granularity full --recompute-method uniform [--recompute-num-layers N].
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from typing import Any, Dict, FrozenSet, List, Optional, Sequence, Tuple

from app.config import (DataConfig, DeepSpeedConfig, DryRunConfig, ModelConfig, ParallelConfig,
                        RunConfig, default_kernel_build_timeout, resolve_recompute_flags)
from app.config.batch_schedule import parse_step_schedule, schedule_of
from app.config.deepspeed import load_ds_json, reconcile_ds_config
from app.config.cli import add_options, collect_options, group_descriptions
from app.config.options import flag_group, from_flags
from app.data.tokenizer import pad_vocab_size
from app.launch.distributed import check_backend, default_backend
from app.launch.slurm import exit_duration_from_end_time
from app.utils.third_party import prepare_deepspeed_import

ROOTS = (RunConfig, DryRunConfig)
"""The config classes whose option fields make the command line."""


# ---------------------------------------------------------------------------- the parser

def _add_deepspeed_flags(parser: argparse.ArgumentParser, from_deepspeed: bool = True) -> None:
    """DeepSpeed's own flags (--deepspeed, --deepspeed_config, --deepscale*): from deepspeed
    (deepspeed.add_config_arguments) when `from_deepspeed` and it imports; otherwise the same
    spellings with DeepSpeed's defaults. A command line naming none of them parses to the same
    values either way, without importing deepspeed (~0.5 s of every native rank's start)."""
    prepare_deepspeed_import()
    if from_deepspeed:
        try:
            import deepspeed  # by design (deepspeed.add_config_arguments): DeepSpeed's own flags
            deepspeed.add_config_arguments(parser)
            return
        except Exception:  # noqa: BLE001 (not installed, or broken on this machine: same flags)
            pass
    g = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    g.add_argument("--deepspeed", action="store_true", default=False)
    g.add_argument("--deepspeed_config", type=str, default=None)
    g.add_argument("--deepscale", action="store_true", default=False)
    g.add_argument("--deepscale_config", type=str, default=None)


def _names_deepspeed(argv: Sequence[str]) -> bool:
    """Whether a command line needs DeepSpeed's own flag definitions: it names a DeepSpeed flag
    (each spelling starts with --deep) or asks for the help text."""
    return any(a.startswith("--deep") or a in ("-h", "--help") for a in argv)


def _add_recompute_aliases(group: Any) -> None:
    group.add_argument("--checkpoint-activations", action="store_true",
                       help="older spelling of --recompute-granularity full --recompute-method "
                            "uniform")
    group.add_argument("--checkpoint-num-layers", type=int, default=None,
                       help="older spelling of --recompute-num-layers (with "
                            "--checkpoint-activations)")


def build_parser(roots: Sequence[type] = ROOTS,
                 deepspeed_flags_from_deepspeed: bool = True) -> argparse.ArgumentParser:
    """The full parser: one flag per option field of the config classes under `roots`,
    DeepSpeed's flags (its own definitions unless `deepspeed_flags_from_deepspeed` is False)
    and the recompute aliases."""
    parser = argparse.ArgumentParser(
        description="GPT-2 pretraining, Megatron-LM style (native or DeepSpeed)",
        allow_abbrev=False)
    options = collect_options(roots)
    probe = argparse.ArgumentParser(add_help=False)
    # DeepSpeed's own definition of a spelling wins
    _add_deepspeed_flags(probe, deepspeed_flags_from_deepspeed)
    taken = probe._option_string_actions  # noqa: SLF001 (only way to ask "is it defined?")
    groups = add_options(parser, [opt for opt in options
                                  if not any(s in taken for s in opt.flag.spellings)],
                         group_descriptions(options))
    model_title = flag_group(ModelConfig)[0]
    _add_recompute_aliases(groups.get(model_title) or parser.add_argument_group(model_title))
    _add_deepspeed_flags(parser, deepspeed_flags_from_deepspeed)
    return parser


def parse_args(argv: Optional[Sequence[str]] = None,
               roots: Sequence[type] = ROOTS) -> argparse.Namespace:
    """Parse `argv` (default sys.argv[1:]) into a namespace with Megatron's dest names; `roots`
    are the config classes whose options make the command line (a tool adds its own).

    Only parsing happens here (plus defaulting --distributed-backend to nccl when CUDA is
    available, else gloo, and --deepscale* to --deepspeed*); `build_run_config` converts. The
    flags given explicitly are recorded as `_explicit_flags` (each under its first spelling),
    for the DeepSpeed JSON checks that must know what the user asked for.
    """
    given = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(roots, deepspeed_flags_from_deepspeed=_names_deepspeed(given))
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
    """Megatron-style listing, one "  name .... value" line each, sorted, of the arguments whose
    value is not the parser's default (the others are what `--help` says); derived settings are
    in the start-up lines that follow it."""
    # DeepSpeed's four flags have the same defaults in either definition
    defaults = vars(build_parser(deepspeed_flags_from_deepspeed=False).parse_args([]))
    lines = []
    for key in sorted(vars(args)):
        value = getattr(args, key)
        if key.startswith("_") or (key in defaults and defaults[key] == value):
            continue
        dots = "." * max(1, 48 - len(key))
        lines.append(f"  {key} {dots} {value}")
    return lines


# ---------------------------------------------------------------------------- derived values

def _warmup_iters(args: argparse.Namespace, decay_iters: int, in_samples: bool) -> int:
    """--lr-warmup-fraction (or --warmup) x decay iterations, or --lr-warmup-iters (in a
    schedule that counts samples the fraction applies to the samples, see _sample_based)."""
    if args.lr_warmup_fraction is None:
        return args.lr_warmup_iters
    if args.lr_warmup_iters != 0:
        raise ValueError(f"--lr-warmup-fraction/--warmup ({args.lr_warmup_fraction}) and "
                         f"--lr-warmup-iters ({args.lr_warmup_iters}) were both given; use only one")
    if not 0.0 <= args.lr_warmup_fraction <= 1.0:
        raise ValueError(f"--lr-warmup-fraction/--warmup must be in [0, 1], got "
                         f"{args.lr_warmup_fraction}")
    return 0 if in_samples else int(args.lr_warmup_fraction * decay_iters)


def _global_batch_size(args: argparse.Namespace, ds_json: Optional[Dict[str, Any]],
                       data_parallel_size: int) -> int:
    """--global-batch-size; with --step-batch-size-schedule the schedule's last batch (the flag
    is refused, as in Megatron-LM); by default the DeepSpeed JSON's train_batch_size (or
    micro-batch x gradient_accumulation_steps x DP) when --deepspeed gives one, else
    micro-batch x DP."""
    if args.step_batch_size_schedule is not None:
        if args.global_batch_size is not None:
            raise ValueError("--step-batch-size-schedule and --global-batch-size were both "
                             "given; the schedule's last batch is the global batch size: drop "
                             "--global-batch-size")
        return parse_step_schedule(args.step_batch_size_schedule, args.seq_length)[-1][1]
    if args.global_batch_size is not None:
        return args.global_batch_size
    default = args.micro_batch_size * data_parallel_size
    if ds_json and "train_batch_size" in ds_json:
        return int(ds_json["train_batch_size"])
    if ds_json and "gradient_accumulation_steps" in ds_json:
        return default * int(ds_json["gradient_accumulation_steps"])
    return default


def _sample_based(args: argparse.Namespace, global_batch_size: int
                  ) -> Tuple[int, Dict[str, Any]]:
    """(train_iters, LR-schedule overrides): --train-samples gives the iterations by Megatron's
    update_train_iters; with it or a batch-size schedule the LR schedule counts samples
    (Megatron's sample-based schedule: decay over --lr-decay-samples, else --train-samples,
    else --lr-decay-iters x the global batch; warmup --lr-warmup-fraction x the decay, else
    --lr-warmup-samples, else --lr-warmup-iters x the global batch)."""
    schedule = schedule_of(global_batch_size, args.rampup_batch_size,
                           args.step_batch_size_schedule, args.seq_length)
    samples = args.train_samples
    if samples is not None:
        given = [f for f, on in (("--train-iters", args.train_iters is not None),
                                 ("--lr-decay-iters", args.lr_decay_iters is not None),
                                 ("--lr-warmup-iters", args.lr_warmup_iters != 0)) if on]
        if given:
            raise ValueError(f"--train-samples and {', '.join(given)} were both given: "
                             "sample-based training counts in samples (--lr-decay-samples, "
                             "--lr-warmup-samples); give one or the other")
        train_iters = schedule.iterations_for(samples)
    elif args.train_iters is None:
        raise ValueError("--train-iters is required (or --train-samples)")
    else:
        train_iters = args.train_iters
    if samples is None and not schedule.varies:
        return train_iters, {}
    decay_iters = args.lr_decay_iters if args.lr_decay_iters is not None else train_iters
    decay = (args.lr_decay_samples if args.lr_decay_samples is not None else
             samples if samples is not None else decay_iters * global_batch_size)
    if args.lr_warmup_fraction is not None and args.lr_warmup_samples:
        raise ValueError("--lr-warmup-fraction and --lr-warmup-samples were both given; use one")
    warmup = (int(args.lr_warmup_fraction * decay) if args.lr_warmup_fraction is not None else
              args.lr_warmup_samples or args.lr_warmup_iters * global_batch_size)
    return train_iters, dict(lr_in_samples=True, lr_decay_samples=decay,
                             lr_warmup_samples=warmup)


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


def _optimizer_name(args: argparse.Namespace, ds_json: Optional[Dict[str, Any]]) -> str:
    """--optimizer; with --deepspeed and no --optimizer flag, muon when the JSON's optimizer is
    DeepSpeed's Muon (the JSON is then the source of truth, as for the precision)."""
    json_type = str(((ds_json or {}).get("optimizer") or {}).get("type", "")).lower()
    if json_type == "muon" and "--optimizer" not in getattr(args, "_explicit_flags", ()):
        return "muon"
    return args.optimizer


def _model_overrides(args: argparse.Namespace, padded_vocab_size: int,
                     params_dtype: str) -> Dict[str, Any]:
    granularity, method, recompute_layers = resolve_recompute_flags(
        args.checkpoint_activations, args.checkpoint_num_layers, args.recompute_granularity,
        args.recompute_method, args.recompute_num_layers)
    # Megatron's validate_args: the older --use-rotary-position-embeddings means rope
    positions = "rope" if args.use_rotary_position_embeddings else args.position_embedding_type
    return dict(padded_vocab_size=padded_vocab_size, params_dtype=params_dtype, seed=args.seed,
                recompute_granularity=granularity, recompute_method=method,
                recompute_num_layers=recompute_layers, position_embedding_type=positions,
                # Megatron-LM turns --sequence-parallel off at TP 1 (app.config.unread says so)
                sequence_parallel=args.sequence_parallel and args.tensor_model_parallel_size > 1)


def _exit_duration(args: argparse.Namespace) -> Dict[str, Any]:
    """--exit-duration-in-mins, or under Slurm without it the time to the job's end less the
    margin (app.launch.slurm.exit_duration_from_end_time), with where it came from."""
    if args.exit_duration_in_mins is not None:
        return {}
    derived = exit_duration_from_end_time(os.environ, time.time(),
                                          args.exit_duration_margin_mins)
    if derived is None:
        return {}
    return dict(exit_duration_in_mins=derived[0], exit_duration_source=derived[1])


def _wandb_save_dir(args: argparse.Namespace) -> Optional[str]:
    if args.wandb_save_dir is None and args.wandb_project and args.save:
        return os.path.join(args.save, "wandb")  # Megatron-LM's default
    return args.wandb_save_dir


# ---------------------------------------------------------------------------- conversion

def build_run_config(args: argparse.Namespace, world_size: int, raw_vocab_size: int,
                     padded_vocab_size: Optional[int] = None,
                     world_source: str = "") -> RunConfig:
    """Convert the parsed flags once into a validated RunConfig.

    Every option field takes its flag's value; the derived values are computed here (module
    docstring). With --deepspeed the JSON is read here, once, and reconciled with the flags
    (`cfg.deepspeed.config`). `padded_vocab_size` None takes --padded-vocab-size, else pads
    `raw_vocab_size` by Megatron's rule. `world_source` (where the launcher's world came from) goes into the messages about
    the world size. Every rule is checked by the config dataclasses (app.config); a broken one
    raises ValueError naming the flags and values.
    """
    values = vars(args)
    if padded_vocab_size is None and args.padded_vocab_size is not None:
        padded_vocab_size = args.padded_vocab_size  # exact rows, no padding rule (Megatron's)
    if padded_vocab_size is None:
        padded_vocab_size = pad_vocab_size(raw_vocab_size, args.make_vocab_size_divisible_by,
                                           args.tensor_model_parallel_size)
    deepspeed = from_flags(DeepSpeedConfig, values, enabled=args.deepspeed,
                           config_path=args.deepspeed_config)
    ds_json = load_ds_json(deepspeed.config_path) if deepspeed.enabled else None
    fp16, bf16, source = _precision_choice(args, ds_json, deepspeed.config_path)
    params_dtype = "float16" if fp16 else "bfloat16" if bf16 else "float32"
    parallel = from_flags(ParallelConfig, values, world_size=world_size,
                          world_source=world_source,
                          distributed_backend=check_backend(args.distributed_backend))
    global_batch = _global_batch_size(args, ds_json, parallel.data_parallel_size)
    train_iters, lr_samples = _sample_based(args, global_batch)
    decay_iters = args.lr_decay_iters if args.lr_decay_iters is not None else train_iters
    cfg = from_flags(
        RunConfig, values, raw_vocab_size=raw_vocab_size, deepspeed=deepspeed, parallel=parallel,
        model=_model_overrides(args, padded_vocab_size, params_dtype),
        precision=dict(fp16=fp16, bf16=bf16, source=source),
        optimizer=dict(lr_decay_iters=decay_iters,
                       lr_warmup_iters=_warmup_iters(args, decay_iters, bool(lr_samples)),
                       optimizer=_optimizer_name(args, ds_json), **lr_samples),
        training=dict(global_batch_size=global_batch, train_iters=train_iters,
                      **_exit_duration(args)),
        kernels=dict(build_timeout=(
            default_kernel_build_timeout(args.distributed_timeout_minutes)
            if args.kernel_build_timeout is None else args.kernel_build_timeout)),
        wandb=dict(save_dir=_wandb_save_dir(args)),
        explicit_flags=frozenset(getattr(args, "_explicit_flags", ())))
    if ds_json is not None:
        reconciled = reconcile_ds_config(ds_json, cfg, deepspeed.config_path,
                                         getattr(args, "_explicit_flags", ()))
        cfg = dataclasses.replace(cfg, deepspeed=dataclasses.replace(deepspeed, config=reconciled))
    return cfg


def data_config(args: argparse.Namespace) -> Optional[DataConfig]:
    """The DataConfig of the parsed flags alone (None when its own flags are invalid), for
    --dry-run to check the data files when the rest of the configuration fails."""
    try:
        return from_flags(DataConfig, vars(args))
    except ValueError:
        return None


def dry_run_config(args: argparse.Namespace) -> DryRunConfig:
    """The --dry-run options of the parsed flags."""
    return from_flags(DryRunConfig, vars(args))


def config_from_argv(argv: Sequence[str], world_size: int, raw_vocab_size: int,
                     padded_vocab_size: Optional[int] = None) -> RunConfig:
    """`build_run_config(parse_args(argv), ...)`: a RunConfig from a command line, for tests,
    benchmarks and tools that build runs in-process."""
    return build_run_config(parse_args(list(argv)), world_size, raw_vocab_size, padded_vocab_size)
