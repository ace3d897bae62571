"""A checkpoint's `args` both ways: the Namespace we store (Megatron's names, so Megatron's tools
read it) from a RunConfig, the ModelConfig read back from one, and the check that a run may load it.

`checkpoint_args_namespace` writes the model shape, the parallel layout, the data position and
a few fields Megatron tools read; `model_config_from_args` is its inverse on the model's
fields (for inference and conversion; older checkpoints' missing fields take ModelConfig's
defaults). Three ModelConfig fields have no Megatron arg and are not stored (NOT_SAVED).
`check_checkpoint_args` compares the fields that must agree (MODEL_SHAPE_FIELDS) and the layout,
naming the flag that would load the checkpoint; the tokenizer is compared by what it does
(app.data.tokenizer_identity: a GPT-2 BPE given as vocab.json + merges.txt is the same
tokenizer as the same vocabulary and merges in a tokenizer.json), not by its type's name.
`writer_record` is what the args say of the code that wrote them (`writer`: project and
version); `checkpoint_writer` reads it back, or recognises this trainer's args of releases that
recorded none.

Args written by Megatron-LM itself (core_v0.16.1 to today's main; tests/data/megatron_args holds
what its parse_args makes) are read with Megatron's meaning (`_meaning`): e.g. num_query_groups is
its argparse default 1 unless --group-query-attention. The args that change the arithmetic in
ways this code does not build (the FIXED_ARCHITECTURE fields that ModelConfig lacks: squared
ReLU, layernorm-1p, ...) are refused by name.

Mixture of Experts: every MoEConfig field is stored under its own name, which is Megatron's arg
name (num_experts, moe_ffn_hidden_size, moe_layer_freq, moe_router_topk, ...; one-element
load-balancing type and coefficient lists as scalars, as Megatron's validate_args leaves
them), with expert_model_parallel_size and expert_tensor_parallel_size, so Megatron's
core_transformer_config_from_args builds the same model from our args. The fields that decide
the experts' shapes and routing arithmetic (MOE_SHAPE_FIELDS) must agree on load; the expert
layout may change.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

import torch

from app.checkpoint import CheckpointError
from app.config import ModelConfig, RunConfig
from app.config.data import tokenizer_type_in_effect
from app.config.moe import MoEConfig
from app.data.tokenizer_identity import TokenizerSpec, compare_tokenizers, gpt2_bpe_in_directory
from app.utils.dtypes import dtype_name, torch_dtype
from app.utils.release import PROJECT, VERSION

logger = logging.getLogger(__name__)

FIXED_ARCHITECTURE: Dict[str, Any] = {
    "normalization": "LayerNorm", "swiglu": False, "add_bias_linear": True,
    "squared_relu": False, "qk_layernorm": False, "layernorm_zero_centered_gamma": False,
    "add_qkv_bias": False, "use_rope_scaling": False,
    "apply_residual_connection_post_layernorm": False, "multi_latent_attention": False}
"""Megatron args that change the model's arithmetic, with Megatron's defaults (what an args
Namespace lacking one means; `_meaning` reads the older apply_layernorm_1p of core_v0.4 to
v0.12 for layernorm_zero_centered_gamma, and add_qkv_bias is on whenever add_bias_linear is, as
Megatron's validate_args sets it). A ModelConfig without a field of that name builds only the
default; a checkpoint with another value is refused by name."""

MOE_SHAPE_FIELDS = ("num_experts", "moe_ffn_hidden_size", "moe_layer_freq", "moe_router_topk",
                    "moe_router_score_function", "moe_router_pre_softmax",
                    "moe_router_topk_scaling_factor", "moe_shared_expert_intermediate_size",
                    "moe_shared_expert_gate", "moe_router_enable_expert_bias")
"""The MoE args that decide the expert weights' shapes and what the routing computes; their
meaning without experts (num_experts None) is None (`_meaning`)."""

MODEL_SHAPE_FIELDS = (*FIXED_ARCHITECTURE, "num_layers", "hidden_size", "num_attention_heads",
                      "ffn_hidden_size", "max_position_embeddings", "padded_vocab_size",
                      "tokenizer_type", "position_embedding_type", "rotary_percent",
                      "rotary_base", "rope_scaling_factor", "rotary_seq_len_interpolation_factor",
                      "num_query_groups", "kv_channels", "untie_embeddings_and_output_weights",
                      *MOE_SHAPE_FIELDS)
"""Fields that must agree between a checkpoint and the run loading it (`_meaning` says how an
absent or unused field reads)."""

MEGATRON_BUILDER_ROPE_SCALING_FACTOR = 8.0
"""The RoPE scaling factor Megatron-LM's pretrain_gpt.py builds with whatever its
--rope-scaling-factor says (its GPT builder passes only --use-rope-scaling, core_v0.16.1 to
main); we honour the flag and mark our args with ROPE_FACTOR_APPLIED."""
ROPE_FACTOR_APPLIED = "rope_scaling_factor_applied"
"""An arg of ours (Megatron has none): True when the model computed with the args'
rope_scaling_factor. Args without it were written by Megatron-LM, whose model used
MEGATRON_BUILDER_ROPE_SCALING_FACTOR."""


def model_option_args(m: ModelConfig) -> Dict[str, Any]:
    """The model's options beyond its sizes under Megatron's arg names (positions, RoPE and its
    scaling, query groups, the architecture fields, tying), as a checkpoint's args hold them."""
    return dict(
        position_embedding_type=m.position_embedding_type,
        add_position_embedding=m.add_position_embedding,  # Megatron's: False only with rope
        use_rotary_position_embeddings=m.position_embedding_type == "rope",
        rotary_percent=m.rotary_percent, rotary_base=m.rotary_base,
        rope_scaling_factor=m.rope_scaling_factor, **{ROPE_FACTOR_APPLIED: True},
        rotary_seq_len_interpolation_factor=m.rotary_seq_len_interpolation_factor,
        group_query_attention=m.group_query_attention, num_query_groups=m.num_kv_heads,
        **{name: getattr(m, name, default) for name, default in FIXED_ARCHITECTURE.items()
           if name != "add_qkv_bias"},
        add_qkv_bias=m.qkv_bias,  # Megatron's validate_args: on whenever add_bias_linear
        norm_epsilon=m.layernorm_epsilon,
        untie_embeddings_and_output_weights=m.untie_embeddings_and_output_weights)


def checkpoint_args_namespace(cfg: RunConfig, consumed_train_samples: int,
                              consumed_valid_samples: int, iteration: int,
                              data_order: Optional[Dict[str, Any]] = None) -> argparse.Namespace:
    """The `args` Namespace stored in a checkpoint: Megatron's names, from `cfg` and the position.

    Carries the model shape, the parallel layout, the data position, the data-order record
    (`data_order`, app.data.plan.order_record; None when not known), the tokenizer as its flags
    name it (the type in effect: NullTokenizer for --vocab-size without --vocab-file; the
    --vocab-file / --merge-file / --tokenizer-model it reads) and a few fields Megatron tools
    read (params_dtype, position_embedding_type, ...). Plain Python values and one
    torch.dtype only, so it loads under weights_only with Namespace allow-listed.
    """
    m, p, t, o = cfg.model, cfg.parallel, cfg.training, cfg.optimizer
    return argparse.Namespace(
        num_layers=m.num_layers, hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads, ffn_hidden_size=m.ffn_hidden_size,
        kv_channels=m.head_dim, max_position_embeddings=m.max_position_embeddings,
        seq_length=m.seq_length, padded_vocab_size=m.padded_vocab_size,
        vocab_size=cfg.raw_vocab_size,
        make_vocab_size_divisible_by=cfg.make_vocab_size_divisible_by,
        tokenizer_type=tokenizer_type_in_effect(cfg.data.tokenizer_type, cfg.data.vocab_file,
                                                cfg.data.vocab_size),
        vocab_file=cfg.data.vocab_file, merge_file=cfg.data.merge_file,
        tiktoken_pattern=cfg.data.tiktoken.tiktoken_pattern,
        tiktoken_num_special_tokens=cfg.data.tiktoken.tiktoken_num_special_tokens,
        tokenizer_special_tokens=cfg.data.tiktoken.tokenizer_special_tokens,
        layernorm_epsilon=m.layernorm_epsilon,
        hidden_dropout=m.hidden_dropout, attention_dropout=m.attention_dropout,
        init_method_std=m.init_method_std, openai_gelu=m.openai_gelu,
        bias_gelu_fusion=m.bias_gelu_fusion, masked_softmax_fusion=m.masked_softmax_fusion,
        bias_dropout_fusion=m.bias_dropout_fusion, use_flash_attn=m.attention_impl == "flash",
        params_dtype=torch_dtype(m.params_dtype), fp16=cfg.precision.fp16,
        bf16=cfg.precision.bf16, attention_softmax_in_fp32=m.attention_softmax_in_fp32,
        apply_query_key_layer_scaling=m.apply_query_key_layer_scaling,
        fp16_lm_cross_entropy=m.fp16_lm_cross_entropy,
        accumulate_allreduce_grads_in_fp32=cfg.precision.grads_accumulate_in_fp32,
        **model_option_args(m), bias_swiglu_fusion=m.bias_swiglu_fusion,
        tokenizer_model=cfg.data.tokenizer_model, sequence_parallel=m.sequence_parallel,
        recompute_granularity=m.recompute_granularity, recompute_method=m.recompute_method,
        recompute_num_layers=m.recompute_num_layers, recompute_modules=list(m.recompute_modules),
        moe_layer_recompute=m.moe_layer_recompute,
        tensor_model_parallel_size=p.tensor_model_parallel_size,
        pipeline_model_parallel_size=p.pipeline_model_parallel_size,
        context_parallel_size=p.context_parallel_size,
        expert_model_parallel_size=p.expert_model_parallel_size,
        expert_tensor_parallel_size=p.expert_tensor_parallel_size, **moe_args(m.moe),
        num_layers_per_virtual_pipeline_stage=p.num_layers_per_virtual_pipeline_stage,
        virtual_pipeline_model_parallel_size=(cfg.virtual_pipeline_model_parallel_size
                                              if p.num_layers_per_virtual_pipeline_stage else None),
        data_parallel_size=p.data_parallel_size, world_size=p.world_size,
        micro_batch_size=t.micro_batch_size, global_batch_size=t.global_batch_size,
        train_iters=t.train_iters, seed=t.seed, lr=o.lr, min_lr=o.min_lr,
        decoupled_lr=o.decoupled_lr, decoupled_min_lr=o.decoupled_min_lr,
        calculate_per_token_loss=t.calculate_per_token_loss,
        grad_reduce_in_bf16=cfg.precision.grad_reduce_in_bf16,
        lr_decay_style=o.lr_decay_style, lr_decay_iters=o.lr_decay_iters,
        lr_warmup_iters=o.lr_warmup_iters,
        consumed_train_samples=int(consumed_train_samples),
        consumed_valid_samples=int(consumed_valid_samples), iteration=int(iteration),
        data_path=list(cfg.data.data_path), split=cfg.data.split, data_order=data_order,
        writer=writer_record())


def writer_record() -> Dict[str, str]:
    """What a checkpoint records of the code that wrote it (the args' `writer`, and the
    client state's): this project and its release (app.utils.release)."""
    return {"project": PROJECT, "version": VERSION}


ARGS_BEFORE_0_4 = frozenset((
    "accumulate_allreduce_grads_in_fp32", "add_bias_linear", "add_position_embedding",
    "apply_query_key_layer_scaling", "apply_residual_connection_post_layernorm",
    "attention_dropout", "attention_softmax_in_fp32", "bf16", "bias_dropout_fusion",
    "bias_gelu_fusion", "consumed_train_samples", "consumed_valid_samples", "data_parallel_size",
    "data_path", "ffn_hidden_size", "fp16", "fp16_lm_cross_entropy", "global_batch_size",
    "group_query_attention", "hidden_dropout", "hidden_size", "init_method_std", "iteration",
    "kv_channels", "layernorm_epsilon", "lr", "lr_decay_iters", "lr_decay_style",
    "lr_warmup_iters", "make_vocab_size_divisible_by", "masked_softmax_fusion",
    "max_position_embeddings", "micro_batch_size", "min_lr", "normalization",
    "num_attention_heads", "num_layers", "num_layers_per_virtual_pipeline_stage",
    "num_query_groups", "openai_gelu", "padded_vocab_size", "params_dtype",
    "pipeline_model_parallel_size", "position_embedding_type", "recompute_granularity",
    "recompute_method", "recompute_num_layers", "rotary_base", "rotary_percent", "seed",
    "seq_length", "sequence_parallel", "swiglu", "tensor_model_parallel_size", "tokenizer_type",
    "train_iters", "untie_embeddings_and_output_weights", "use_flash_attn",
    "use_rotary_position_embeddings", "virtual_pipeline_model_parallel_size", "vocab_size",
    "world_size"))
"""Every field of the args this trainer wrote in releases 0.1.0 to 0.3.0, which recorded
neither their version nor their data order: a few of Megatron's names, where Megatron-LM's
args hold all of its hundreds (rank, save, load, ...)."""
CONVERTER_FIELDS = frozenset(("expert_model_parallel_size", "expert_tensor_parallel_size"))
"""Layout fields the converter writes into the args it copies from its source
(app.checkpoint.param_layout.target_args): a converted checkpoint keeps its writer's marks."""
ARGS_OF_0_4 = ARGS_BEFORE_0_4 | {"data_order", "split"}
"""The fields of 0.4.0's args (and the code's up to 0.5.0's data order), whose torch_dist
checkpoints left their data-order record empty."""


@dataclass(frozen=True)
class CheckpointWriter:
    """Who wrote a checkpoint: this project (`ours`) and its release when recorded, else the
    release the marks of its args say it predates (`before`)."""

    ours: bool
    version: Optional[str] = None
    before: Optional[str] = None

    def describe(self) -> str:
        if not self.ours:
            return "not this project (Megatron-LM or another trainer: no writer recorded)"
        if self.version is not None:
            return f"{PROJECT} {self.version}"
        releases = {"0.4.0": "0.1.0 to 0.3.0", "0.5.0": "0.4.0, or the code before 0.5.0",
                    "0.6.0": "0.5.x"}.get(str(self.before), "an earlier release")
        return f"{PROJECT} {releases} (no version recorded; known by the fields of its args)"


def converted_writer_record(args: Optional[argparse.Namespace]) -> Optional[Dict[str, str]]:
    """The writer record a converter stores in the args it copies from `args`, whose fields it
    extends (which would hide the marks `checkpoint_writer` reads): a release before 0.6.0's
    marks as {"project", "before"}; None where `args` record their writer or are not ours."""
    writer = checkpoint_writer(args)
    if not writer.ours or writer.version is not None:
        return None
    return {"project": PROJECT, "before": str(writer.before)}


def checkpoint_writer(args: Optional[argparse.Namespace],
                      record: Optional[Dict[str, Any]] = None) -> CheckpointWriter:
    """Who wrote a checkpoint whose args are `args` (None: it has none) or whose client state
    holds the writer `record`: the recorded release (`writer_record`), else this trainer by the
    marks its args always carried (only fields of ARGS_BEFORE_0_4 before 0.4.0, of ARGS_OF_0_4
    in 0.4.0, a `data_order` field in 0.5.x; a converter's CONVERTER_FIELDS aside, or the marks
    a converter recorded: `converted_writer_record`), else another writer."""
    record = record or getattr(args, "writer", None)
    if isinstance(record, dict) and record.get("project") == PROJECT:
        if record.get("version") is None:  # a converted checkpoint of a release before 0.6.0
            return CheckpointWriter(True, before=record.get("before"))
        return CheckpointWriter(True, str(record.get("version")))
    fields = set(vars(args)) - CONVERTER_FIELDS if isinstance(args, argparse.Namespace) else set()
    if fields and fields <= ARGS_BEFORE_0_4:
        return CheckpointWriter(True, before="0.4.0")
    if "data_order" in fields:
        return CheckpointWriter(True, before="0.5.0" if fields <= ARGS_OF_0_4 else "0.6.0")
    return CheckpointWriter(False)


def moe_args(moe: MoEConfig) -> Dict[str, Any]:
    """Megatron's MoE args of `moe`: every field under its name, the one-element lists of the
    load-balancing types and coefficients as scalars (Megatron's validate_args)."""
    out = {f.name: copy.copy(getattr(moe, f.name)) for f in dataclasses.fields(MoEConfig)}
    for name in ("moe_router_load_balancing_type", "moe_aux_loss_coeff"):
        if isinstance(out[name], list) and len(out[name]) == 1:
            out[name] = out[name][0]
    return out


def moe_config_from_args(args: argparse.Namespace) -> MoEConfig:
    """The MoEConfig that `args` describe (Megatron's or ours; absent fields take MoEConfig's
    defaults, so args without num_experts describe a dense model). ValueError, with the rule's
    words, for options this code refuses (app.config.moe)."""
    fields: Dict[str, Any] = {}
    for f in dataclasses.fields(MoEConfig):
        value = getattr(args, f.name, None)
        if value is None:
            continue
        if f.name in ("moe_router_load_balancing_type", "moe_aux_loss_coeff"):
            value = list(value) if isinstance(value, (list, tuple)) else [value]
        elif isinstance(value, tuple):
            value = list(value)
        fields[f.name] = value
    return MoEConfig(**fields)


NOT_SAVED = ("layernorm_fusion", "cross_entropy_loss_fusion", "attention_backend")
"""ModelConfig fields that the args do not record (Megatron has no such args; an attention
backend "flash" is recorded as use_flash_attn): read back as ModelConfig's defaults."""

_REQUIRED = ("num_layers", "hidden_size", "num_attention_heads", "max_position_embeddings")

_ARCHITECTURE: Dict[str, Callable[[Any], Any]] = {
    "ffn_hidden_size": int, "layernorm_epsilon": float, "openai_gelu": bool,
    "attention_softmax_in_fp32": bool, "apply_query_key_layer_scaling": bool,
    "position_embedding_type": str, "rotary_percent": float, "rotary_base": int,
    "rotary_seq_len_interpolation_factor": int, "add_position_embedding": bool,
    "untie_embeddings_and_output_weights": bool, "kv_channels": int, "swiglu": bool,
    "normalization": str, "add_bias_linear": bool, "qk_layernorm": bool}
"""Fields besides the shape that decide what the weights compute, with their types."""

_TRAINING: Dict[str, Callable[[Any], Any]] = {
    "hidden_dropout": float, "attention_dropout": float, "init_method_std": float,
    "recompute_granularity": str, "recompute_method": str, "recompute_num_layers": int,
    "recompute_modules": list, "moe_layer_recompute": bool, "sequence_parallel": bool, "bias_gelu_fusion": bool, "bias_dropout_fusion": bool,
    "masked_softmax_fusion": bool, "bias_swiglu_fusion": bool, "use_flash_attn": bool,
    "fp16_lm_cross_entropy": bool, "seed": int}
"""Fields that change only how the model trains, with their types."""


def model_config_from_args(args: argparse.Namespace, padded_vocab_size: Optional[int] = None,
                           *, for_inference: bool = False) -> ModelConfig:
    """The ModelConfig that a checkpoint's `args` describe: checkpoint_args_namespace's inverse
    on every field it stores (NOT_SAVED come back as defaults).

    A field an older checkpoint lacks (or holds as None) takes ModelConfig's default;
    seq_length defaults to max_position_embeddings. `padded_vocab_size` replaces the saved
    rows (a model resharded for another tensor-parallel size). `for_inference` reads only what
    decides the weights' meaning: dropout is 0 and the training options (recompute, sequence
    parallelism, fusions, flash attention, init std, seed) keep their defaults. Raises
    CheckpointError naming a missing shape field, or the rule the saved options break.
    """
    rows = padded_vocab_size or getattr(args, "padded_vocab_size", None)
    missing = [name for name in _REQUIRED if getattr(args, name, None) is None]
    missing += [] if rows else ["padded_vocab_size"]
    if missing:
        raise CheckpointError(f"the checkpoint's args lack {', '.join(missing)}, so its model "
                              "shape is unknown; was it written by Megatron-LM or this code?")
    fields: Dict[str, Any] = {name: int(getattr(args, name)) for name in _REQUIRED}
    fields["padded_vocab_size"] = int(rows)
    fields["seq_length"] = int(getattr(args, "seq_length", None) or args.max_position_embeddings)
    for table in (_ARCHITECTURE,) if for_inference else (_ARCHITECTURE, _TRAINING):
        fields.update({name: convert(getattr(args, name)) for name, convert in table.items()
                       if getattr(args, name, None) is not None})
    if getattr(args, "layernorm_epsilon", None) is None and getattr(args, "norm_epsilon", None):
        fields["layernorm_epsilon"] = float(args.norm_epsilon)  # older Megatron's name
    if for_inference:
        fields.update(hidden_dropout=0.0, attention_dropout=0.0)
    fields["position_embedding_type"] = _meaning(args, "position_embedding_type")
    fields.update(_architecture(args))
    if fields.get("add_bias_linear", True):  # the QKV bias is implied: keep the flag's value
        fields["add_qkv_bias"] = False
    if fields["position_embedding_type"] != "rope":  # meaningless there (Megatron writes them)
        for name in ("rotary_seq_len_interpolation_factor", "add_position_embedding"):
            fields.pop(name, None)
    if fields.get("use_rope_scaling"):
        fields["rope_scaling_factor"] = _meaning(args, "rope_scaling_factor")
    fields["group_query_attention"] = bool(getattr(args, "group_query_attention", False))
    if fields["group_query_attention"] and getattr(args, "num_query_groups", None) is not None:
        fields["num_query_groups"] = int(args.num_query_groups)
    dtype = getattr(args, "params_dtype", None)
    fields["params_dtype"] = dtype_name(dtype) if isinstance(dtype, torch.dtype) else "float32"
    try:
        fields["moe"] = moe_config_from_args(args)
        return ModelConfig(**fields)
    except ValueError as exc:
        raise CheckpointError(f"the checkpoint's args describe a model this code cannot build: "
                              f"{exc}") from exc


def _architecture(args: argparse.Namespace) -> Dict[str, Any]:
    """The FIXED_ARCHITECTURE fields that ModelConfig has, from `args`; CheckpointError naming
    a field whose value this code cannot build (a ModelConfig without that field, or a
    kv_channels other than hidden_size / num_attention_heads)."""
    out: Dict[str, Any] = {}
    for name, default in FIXED_ARCHITECTURE.items():
        value = _meaning(args, name)
        if name in _MODEL_FIELDS:
            out[name] = value
        elif value != default:
            raise CheckpointError(f"the checkpoint's args describe a model this code cannot "
                                  f"build: {name} {value} (this code builds only {name} "
                                  f"{default})")
    channels = _meaning(args, "kv_channels")
    per_head = int(args.hidden_size) // int(args.num_attention_heads)
    if "kv_channels" not in _MODEL_FIELDS and channels is not _UNKNOWN and \
            int(channels) != per_head:
        raise CheckpointError(f"the checkpoint's args describe a model this code cannot build: "
                              f"kv_channels {channels} (this code builds hidden_size / "
                              f"num_attention_heads = {per_head})")
    return out


def check_checkpoint_args(ckpt_args: Optional[argparse.Namespace],
                          current: argparse.Namespace, reshardable: bool = False) -> List[str]:
    """Raise CheckpointError if the checkpoint's model shape, tokenizer or TP/PP layout differs
    from ours; returns the notes to log (a tokenizer named another way but the same).

    Fields missing from an older checkpoint are skipped. The message names the field, both
    values and the flag that would load the checkpoint; a tensor/pipeline size mismatch says
    how to reshard (tools/convert_checkpoint.py). A `reshardable` checkpoint (torch_dist) may
    have any TP/PP layout and vocabulary padding (its tensors' global shapes are checked when
    they are read). The tokenizers are compared by what they do (`check_tokenizer`).
    """
    if ckpt_args is None:
        return []
    for name in () if reshardable else ("tensor_model_parallel_size",
                                        "pipeline_model_parallel_size"):
        saved, now = getattr(ckpt_args, name, 1), getattr(current, name, 1)
        if saved != now:
            tp = getattr(current, "tensor_model_parallel_size", 1)
            pp = getattr(current, "pipeline_model_parallel_size", 1)
            raise CheckpointError(f"checkpoint was saved with {name} {saved} but this run uses "
                                  f"{now}; reshard it first: tools/convert_checkpoint.py "
                                  "--input-format megatron --load CKPT --save NEW "
                                  f"--target-tensor-model-parallel-size {tp} "
                                  f"--target-pipeline-model-parallel-size {pp} "
                                  "--include-optimizer, then --load NEW")
    notes = check_tokenizer(ckpt_args, current)
    for name in MODEL_SHAPE_FIELDS:
        if (reshardable and name == "padded_vocab_size") or name == "tokenizer_type":
            continue
        saved, now = _meaning(ckpt_args, name), _meaning(current, name)
        if saved is _UNKNOWN or now is _UNKNOWN or saved == now:
            continue
        raise CheckpointError(f"checkpoint was saved with {name} {saved} but this run uses "
                              f"{now}; {_fix(name, saved, ckpt_args)}")
    return notes


def check_tokenizer(ckpt_args: argparse.Namespace, current: argparse.Namespace) -> List[str]:
    """CheckpointError when the checkpoint's tokenizer is not this run's, naming the flags that
    would load it; the notes to log when it is the same tokenizer under another name.

    Compared by what the tokenizers do (app.data.tokenizer_identity.compare_tokenizers): the
    same vocabulary, merges and special tokens are the same tokenizer whatever the type says.
    When a file is not here to compare, the type names must agree (as before the comparison
    existed); a checkpoint saved before the type in effect was recorded names GPT2BPETokenizer
    for a --vocab-size run without a vocabulary file, which is NullTokenizer of that size."""
    saved, ours = TokenizerSpec.from_args(ckpt_args), TokenizerSpec.from_args(current)
    if saved is None or ours is None:
        return []
    match = compare_tokenizers(saved, ours)
    if match.same:
        if saved.tokenizer_type == ours.tokenizer_type:
            return []
        return [f"tokenizer: this run's {ours.flags()} is the checkpoint's {saved.flags()}: "
                f"{match.detail}"]
    older_null = (saved.tokenizer_type == "GPT2BPETokenizer" and not saved.vocab_file
                  and ours.tokenizer_type == "NullTokenizer"
                  and saved.vocab_size == ours.vocab_size)
    if match.same is None and (saved.tokenizer_type == ours.tokenizer_type or older_null):
        return []
    why = (f"it is not the same tokenizer ({match.detail})" if match.same is False else
           f"the two cannot be compared ({match.detail})")
    gpt2 = (saved.tokenizer_type == "HuggingFaceTokenizer" and saved.tokenizer_model
            and os.path.isdir(saved.tokenizer_model)
            and gpt2_bpe_in_directory(saved.tokenizer_model) is not None)
    also = (" (or --tokenizer-type GPT2BPETokenizer with --vocab-file/--merge-file of the same "
            "vocabulary and merges: it is a GPT-2 BPE)" if gpt2 else "")
    raise CheckpointError(f"checkpoint was saved with tokenizer {saved.flags()} but this run "
                          f"uses {ours.flags()}, and {why}; to load it pass {saved.flags()}"
                          f"{also}")


def _fix(name: str, saved: Any, ckpt_args: argparse.Namespace) -> str:
    """The flags that give this run the checkpoint's `name` = `saved`."""
    if name in FIXED_ARCHITECTURE and name not in _MODEL_FIELDS:
        return f"this code builds only {name} {FIXED_ARCHITECTURE[name]}"
    if name == "padded_vocab_size":
        divisor = getattr(ckpt_args, "make_vocab_size_divisible_by", None)
        raw = getattr(ckpt_args, "vocab_size", None)
        return (f"its vocabulary of {raw or '?'} tokens was padded to a multiple of "
                f"--make-vocab-size-divisible-by {divisor or '?'} x the tensor-parallel size: "
                f"pass --make-vocab-size-divisible-by {divisor or 'N'} and its tokenizer")
    if name == "num_query_groups":
        heads = getattr(ckpt_args, "num_attention_heads", None)
        return ("drop --group-query-attention / --num-query-groups" if saved == heads else
                f"pass --group-query-attention --num-query-groups {saved}")
    flag = _MODEL_FLAGS.get(name)
    if flag is None:
        return "pass the same model flags as the run that saved it"
    if isinstance(saved, bool):
        wanted = saved != (flag.action == "store_false")  # whether the flag must be given
        return f"{'pass' if wanted else 'drop'} {flag.name}, as the run that saved it did"
    return f"pass {flag.name} {saved}"


_UNKNOWN = object()
_MODEL_FIELDS = frozenset(f.name for f in dataclasses.fields(ModelConfig))
_MODEL_FLAGS = {f.name: f.metadata["flag"] for f in dataclasses.fields(ModelConfig)
                if "flag" in f.metadata}
"""ModelConfig's fields with their command-line flags (app.config.options.Flag)."""


def _meaning(args: argparse.Namespace, name: str) -> Any:
    """The value of `name` as Megatron means it (megatron/training/arguments.py, core_v0.16.1
    to today's main), or _UNKNOWN for a shape field the args lack.

    num_query_groups counts key/value groups only under group_query_attention (Megatron keeps
    its argparse default 1 otherwise: one group per head then); kv_channels None is
    hidden_size / num_attention_heads; rotary_percent and rotary_base mean nothing without
    rope (nor do the RoPE scaling and interpolation settings); position_embedding_type is rope
    under the older use_rotary_position_embeddings; rope_scaling_factor is the factor the model
    computed with (`_rope_scaling_factor`); layernorm_zero_centered_gamma falls back to the
    older apply_layernorm_1p; add_qkv_bias is on with add_bias_linear; an absent
    FIXED_ARCHITECTURE field has Megatron's default.
    """
    value = getattr(args, name, None)
    heads = getattr(args, "num_attention_heads", None)
    if name == "num_query_groups" and not getattr(args, "group_query_attention", False):
        return heads if heads is not None else _UNKNOWN
    if name == "kv_channels" and value is None and heads:
        hidden = getattr(args, "hidden_size", None)
        return hidden // heads if hidden else _UNKNOWN
    if name == "position_embedding_type" and value is None:
        rope = getattr(args, "use_rotary_position_embeddings", False)
        return "rope" if rope else "learned_absolute"
    if name in ("rotary_percent", "rotary_base", "rotary_seq_len_interpolation_factor",
                "use_rope_scaling", "rope_scaling_factor") and \
            _meaning(args, "position_embedding_type") != "rope":
        return False if name == "use_rope_scaling" else None
    if name == "rope_scaling_factor":
        return _rope_scaling_factor(args)
    if name == "layernorm_zero_centered_gamma" and value is None:
        value = getattr(args, "apply_layernorm_1p", None)  # core_v0.4 to v0.12's name
    if name == "add_qkv_bias":
        return bool(value) or bool(_meaning(args, "add_bias_linear"))
    if name in FIXED_ARCHITECTURE:
        return FIXED_ARCHITECTURE[name] if value is None else value
    if name == "rotary_seq_len_interpolation_factor":
        return value
    if name in MOE_SHAPE_FIELDS:
        return _moe_meaning(args, name, value)
    return _UNKNOWN if value is None else value


def _rope_scaling_factor(args: argparse.Namespace) -> Optional[float]:
    """The RoPE scaling factor the model of `args` computed with: None without
    use_rope_scaling; the args' own factor when we wrote them (ROPE_FACTOR_APPLIED); else
    (Megatron-LM's args) the factor its GPT builder always uses, noted in the log when its
    args say otherwise."""
    if not getattr(args, "use_rope_scaling", False):
        return None
    saved = float(getattr(args, "rope_scaling_factor", None) or
                  MEGATRON_BUILDER_ROPE_SCALING_FACTOR)
    if getattr(args, ROPE_FACTOR_APPLIED, False):
        return saved
    if saved != MEGATRON_BUILDER_ROPE_SCALING_FACTOR:
        logger.warning("the checkpoint's args (written by Megatron-LM) say rope_scaling_factor "
                       "%s, but Megatron-LM's GPT builder ignores it and computes with %s: "
                       "reading the model with %s", saved, MEGATRON_BUILDER_ROPE_SCALING_FACTOR,
                       MEGATRON_BUILDER_ROPE_SCALING_FACTOR)
    return MEGATRON_BUILDER_ROPE_SCALING_FACTOR


def _moe_meaning(args: argparse.Namespace, name: str, value: Any) -> Any:
    """An MOE_SHAPE_FIELDS arg as Megatron means it: None without experts (num_experts 0 or
    absent); moe_ffn_hidden_size None is ffn_hidden_size; moe_layer_freq is the tuple of which
    layers are MoE layers (an int N: i % N == 0)."""
    experts = getattr(args, "num_experts", None) or None
    if experts is None:
        return None
    if name == "num_experts":
        return experts
    if name == "moe_ffn_hidden_size" and value is None:
        return getattr(args, "ffn_hidden_size", None)
    if value is None:  # an older Megatron's args without the field: its default
        value = getattr(MoEConfig(), name)
    if name == "moe_layer_freq":
        layers = int(getattr(args, "num_layers", 0) or 0)
        freq = 1 if value is None else value
        return tuple(bool(v) for v in freq) if isinstance(freq, (list, tuple)) else \
            tuple(i % int(freq) == 0 for i in range(layers))
    return value
