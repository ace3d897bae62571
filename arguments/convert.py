"""The parsed namespace -> app.config.RunConfig, once: derived defaults filled here, every rule
checked by the config dataclasses."""
from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any, Dict, Optional, Sequence, Tuple

from app.config import (CheckpointConfig, DataConfig, DeepSpeedConfig, KernelConfig, ModelConfig,
                        OptimizerConfig, ParallelConfig, PrecisionConfig, RollbackConfig,
                        RunConfig, TrainingConfig, default_kernel_build_timeout,
                        resolve_recompute_flags)
from app.config.wandb import WandbConfig
from app.data.tokenizer import pad_vocab_size
from app.launch.distributed import check_backend
from app.training.engines.ds_config import load_ds_json, reconcile_ds_config
from arguments.flags import parse_args


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


def _wandb_config(args: argparse.Namespace) -> WandbConfig:
    save_dir = args.wandb_save_dir
    if save_dir is None and args.wandb_project and args.save:
        save_dir = os.path.join(args.save, "wandb")
    return WandbConfig(project=args.wandb_project, exp_name=args.wandb_exp_name,
                       save_dir=save_dir, entity=args.wandb_entity)


def config_from_argv(argv: Sequence[str], world_size: int, raw_vocab_size: int,
                     padded_vocab_size: Optional[int] = None) -> RunConfig:
    """`build_run_config(parse_args(argv), ...)`: a RunConfig from a command line, for tests,
    benchmarks and tools that build runs in-process."""
    return build_run_config(parse_args(list(argv)), world_size, raw_vocab_size, padded_vocab_size)
