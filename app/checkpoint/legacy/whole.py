"""Megatron-LM's legacy format (`--ckpt-format torch`), the whole model at any TP/PP: read into a
ModelCheckpoint, written at any target TP/PP/dtype (the files per rank are
app.checkpoint.legacy.per_rank's).

Reading merges every rank's shard of every parameter (and, when present, of its Adam moments)
into full tensors; writing splits them for the target layout. With Mixture of Experts the files
are per expert-parallel rank too: the experts are merged over the expert-parallel files and
written for the request's expert-parallel size, each expert split over the target's tensor
ranks (the format's expert tensor-parallel size is its tensor-parallel size). The padded
vocabulary is re-padded with Megatron's rule for the target tensor-parallel size
(pad_vocab_size), so TP1 -> TP2xPP2 -> TP4 -> TP1 gives back the same tensors bit for bit.
"""
from __future__ import annotations

import argparse
import copy
import itertools
import logging
from typing import Any, Dict, List, Optional, Tuple

import torch

from app.checkpoint import CheckpointError
from app.checkpoint import param_layout as layout
from app.checkpoint.legacy.per_rank import (build_checkpoint_dict, fp32_main_weights,
                                            from_megatron_model, load_checkpoint_dict,
                                            save_checkpoint, saved_virtual_pipeline_size)
from app.checkpoint.mcore.state import check_checkpoint_version
from app.checkpoint.names import write_tracker
from app.checkpoint.request import WriteRequest
from app.checkpoint.saved_layout import SavedCheckpoint
from app.checkpoint.state import ModelCheckpoint, OptimizerState, Progress, cast_weights, describe
from app.optim.distributed_optimizer import STATE_TENSORS
from app.optim.mixed_precision import is_mixed_state
from app.pipeline.partition import stage_layer_range, stage_of_layer
from app.utils.dtypes import torch_dtype

logger = logging.getLogger(__name__)


def describe_legacy(saved: SavedCheckpoint) -> List[str]:
    """Lines describing every rank file of a legacy checkpoint: keys, shapes, dtypes."""
    iteration = saved.numbered_iteration()
    (tp, pp), files = read_rank_files(saved)
    ep = saved.expert_model_parallel_size
    lines = [f"Megatron checkpoint {saved.load}, iteration {iteration}: TP {tp}, PP {pp}"
             + (f", EP {ep}" if ep > 1 else "")]
    order = sorted(files.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0]))
    for (tp_rank, pp_rank, ep_rank), state in order:
        lines.append(f"rank file (tp {tp_rank}, pp {pp_rank}"
                     + (f", ep {ep_rank}):" if ep > 1 else "):"))
        lines += describe(state, 1)
    return lines


def read_rank_files(saved: SavedCheckpoint
                    ) -> Tuple[Tuple[int, int], Dict[Tuple[int, int, int], Dict[str, Any]]]:
    """((tp, pp), {(tp_rank, pp_rank, ep_rank): checkpoint dict}) of every rank file of the
    legacy checkpoint `saved` (its TP x PP x EP from the detection)."""
    iteration, directory = saved.numbered_iteration(), saved.folder
    if saved.tensor_pipeline_sizes is None:
        raise CheckpointError(f"{directory} holds no mp_rank_XX folders: not a Megatron-layout "
                              "checkpoint (a DeepSpeed one? use --input-format deepspeed)")
    tp, pp = saved.tensor_pipeline_sizes
    ep = saved.expert_model_parallel_size
    files = {}
    for pp_rank in range(pp):
        for ep_rank in range(ep):
            for tp_rank in range(tp):
                state, _ = load_checkpoint_dict(saved.load, tp_rank=tp_rank, pp_rank=pp_rank,
                                                pp_size=pp, iteration=iteration, tp_size=tp,
                                                ep_rank=ep_rank, ep_size=ep)
                check_checkpoint_version(state, directory)
                files[(tp_rank, pp_rank, ep_rank)] = state
    return (tp, pp), files


def read_legacy(saved: SavedCheckpoint, include_optimizer: bool = False) -> ModelCheckpoint:
    """The whole model (and, with `include_optimizer`, its Adam state) of the legacy checkpoint
    `saved` (app.checkpoint.saved_layout.detect)."""
    iteration = saved.numbered_iteration()
    (tp, pp), files = read_rank_files(saved)
    ep = saved.expert_model_parallel_size
    load_dir = saved.load
    args = files[(0, 0, 0)].get("args")
    if args is None:
        raise CheckpointError(f"{saved.folder} has no 'args': its "
                              "model shape is unknown, so it cannot be converted")
    flat = {}
    for key, state in files.items():
        flat[key] = from_megatron_model(state["model"])
        main = fp32_main_weights(state)  # mixed precision: the exact fp32 weights
        if main:
            flat[key].update({n: v for n, v in main.items() if n in flat[key]})
    if any(fp32_main_weights(state) for state in files.values()):
        logger.info("mixed-precision checkpoint: reading the fp32 main weights of its optimizer")
    weights = layout.merge_ranks(args, flat, tp, pp, "weights", ep=ep)
    result = ModelCheckpoint(args=copy.copy(args), weights=weights, iteration=iteration,
                             source_layout=(tp, pp),
                             rng_states={k[:2]: s["rng_state"] for k, s in files.items()
                                         if s.get("rng_state") is not None and k[2] == 0})
    if include_optimizer:
        if saved_virtual_pipeline_size(args) > 1:
            raise CheckpointError(
                f"{saved.folder} was saved with interleaved model "
                "chunks (--num-layers-per-virtual-pipeline-stage): its weights convert, its "
                "optimizer states do not; drop --include-optimizer")
        result.optimizer = _read_optimizer(args, files, tp, pp, load_dir, ep)
        result.lr_scheduler = files[(0, 0, 0)].get("lr_scheduler")
        stored = files[(0, 0, 0)].get("optimizer") or {}
        result.optimizer.grad_scaler = (stored.get("grad_scaler") if is_mixed_state(stored)
                                        else None)
    return result


def _read_optimizer(args: argparse.Namespace, files: Dict[Tuple[int, int, int], Dict[str, Any]],
                    tp: int, pp: int, load_dir: str, ep: int = 1) -> OptimizerState:
    """Optimizer states of every rank file (AdamW's moments and step, SGD's or Muon's momentum),
    mapped to parameter names and merged like the weights."""
    per_rank: Dict[str, Dict[Tuple[int, int, int], Dict[str, torch.Tensor]]] = {
        kind: {key: {} for key in files} for kind in STATE_TENSORS}
    steps: Dict[str, torch.Tensor] = {}
    hparams: Dict[str, Dict[str, Any]] = {}
    placement = layout.Layout.of_args(args, pp)
    for (tp_rank, stage, ep_rank), state in files.items():
        where = f"{load_dir} (tp {tp_rank}, pp {stage}" + (f", ep {ep_rank})" if ep > 1 else ")")
        opt = state.get("optimizer")
        if is_mixed_state(opt):  # Megatron's Float16Optimizer layout: AdamW's state inside
            opt = opt["optimizer"]
        if opt is None:
            raise CheckpointError(f"--include-optimizer: {where} has no optimizer state (saved "
                                  "with --no-save-optim?)")
        index_to_name = _index_names(opt, placement, placement.stage_names(stage), where)
        for index, name in index_to_name.items():
            entry = opt["state"].get(index)
            if not entry:
                raise CheckpointError(f"--include-optimizer: no optimizer state for {name!r} "
                                      f"in {where}; was it saved before the first step?")
            for kind in per_rank:
                if kind in entry:
                    per_rank[kind][(tp_rank, stage, ep_rank)][name] = entry[kind]
            if "step" in entry:
                steps[name] = entry["step"]
        for group in opt["param_groups"]:
            hparams.setdefault(group.get("name", "decay"),
                               {k: v for k, v in group.items() if k != "params"})
    per_param: Dict[str, Dict[str, torch.Tensor]] = {}
    for kind, ranks in per_rank.items():
        present = {name for rank_dict in ranks.values() for name in rank_dict}
        if present:
            merged = layout.merge_ranks(args, ranks, tp, pp, f"optimizer {kind}", present, ep)
            for name, value in merged.items():
                per_param.setdefault(name, {})[kind] = value
    for name, entry in per_param.items():
        if name in steps:  # AdamW's step first, as torch stores it
            per_param[name] = {"step": steps[name], **entry}
    return OptimizerState(per_param=per_param, group_hparams=hparams)


def _index_names(opt: Dict[str, Any], placement: layout.Layout, names: List[str], where: str
                 ) -> Dict[int, str]:
    """{optimizer index: parameter name} of one stage from its groups' 'params' lists."""
    saved = opt.get("param_groups", [])
    groups = placement.optimizer_groups(names, muon=any(g.get("name") == "muon" for g in saved))
    mapping: Dict[int, str] = {}
    order = [g["name"] if "name" in g else ("decay", "no_decay")[i] for i, g in enumerate(saved)]
    for group, group_name in zip(saved, order):
        wanted = groups.get(group_name)
        if wanted is None or len(wanted) != len(group["params"]):
            raise CheckpointError(
                f"--include-optimizer: the optimizer of {where} has a param group {group_name!r} of "
                f"{len(group['params'])} parameters; the GPT-2 layout expects "
                f"{len(wanted or [])}: it cannot be mapped to parameter names")
        mapping.update(zip(group["params"], wanted))
    return mapping


# ---------------------------------------------------------------------------- writing


def _rank_part(placement: layout.Layout, name: str, full: torch.Tensor, tp: int, tp_rank: int,
               ep: int, ep_rank: int) -> torch.Tensor:
    """What file (tp_rank, ep_rank) holds of `full`: the TP shard, or an expert weight's
    expert-parallel group split over the tensor ranks (expert tensor size = TP here)."""
    if placement.is_expert(name):
        return placement.split_experts(name, full, ep, tp)[ep_rank][tp_rank]
    return placement.split(name, full, tp)[tp_rank]


def write_legacy(source: ModelCheckpoint, save_dir: str, request: WriteRequest) -> str:
    """Write `source` as a legacy checkpoint at the request's TP x PP (x EP) and dtype into
    `save_dir` (which the caller stages), with its optimizer state when the request includes it;
    returns what was written, in words."""
    tp, pp = request.tensor_model_parallel_size, request.pipeline_model_parallel_size
    ep = request.expert_model_parallel_size
    if request.expert_tensor_parallel_size not in (None, tp):
        raise layout.LayoutError(
            f"--target-expert-tensor-parallel-size {request.expert_tensor_parallel_size}: the "
            f"legacy format splits experts over the tensor-parallel ranks ({tp}); write "
            "--output-format torch_dist, which any layout loads")
    heads = int(source.args.num_attention_heads)
    if heads % tp:
        raise layout.LayoutError(f"num_attention_heads ({heads}) is not divisible by the target "
                                 f"tensor-parallel size ({tp})")
    saved_dtype = getattr(source.args, "params_dtype", None)
    dtype = (torch_dtype(request.params_dtype) if request.params_dtype else saved_dtype
             if isinstance(saved_dtype, torch.dtype) else source.weights[layout.WORD_EMBEDDINGS].dtype)
    iteration = request.iteration_written(source)
    rows = layout.target_padded_vocab(source.args, source.weights[layout.WORD_EMBEDDINGS].shape[0],
                                      tp)
    try:
        placement = layout.Layout.of_args(source.args, pp, rows)
    except layout.LayoutError as exc:
        raise layout.LayoutError(f"--target-pipeline-model-parallel-size {pp}: {exc}") from exc
    vocab_size = getattr(source.args, "vocab_size", None)
    full_precision = layout.pad_vocabulary(source.weights, rows, vocab_size)
    weights = cast_weights(full_precision, dtype)
    opt = source.optimizer if request.include_optimizer else None
    if request.include_optimizer and opt is None:
        raise CheckpointError("--include-optimizer: the source checkpoint has no optimizer state")
    if ep > 1 and not any(placement.is_expert(n) for n in placement.names()):
        raise layout.LayoutError(f"--target-expert-model-parallel-size {ep}: the model has no "
                                 "experts (--num-experts)")
    args = layout.target_args(source, tp, pp, dtype, rows, iteration, ep, tp)
    progress = Progress("writing", total=len(placement.names()) * tp * ep)
    for stage, ep_rank, tp_rank in itertools.product(range(pp), range(ep), range(tp)):
        names = placement.stage_names(stage)
        flat = {n: _rank_part(placement, n, weights[n], tp, tp_rank, ep, ep_rank) for n in names}
        for tensor in flat.values():
            progress.add(tensor)
        where = (tp, tp_rank, ep, ep_rank)
        optimizer = (_optimizer_shard(opt, placement, stage, where, rows, vocab_size)
                     if opt else None)
        if optimizer is not None and dtype != torch.float32:  # keep the fp32 main weights
            optimizer = _mixed_state(optimizer, full_precision, placement, stage, where, opt)
        state = build_checkpoint_dict(
            iteration, flat, optimizer, source.lr_scheduler if opt else None,
            _rng_for(source, tp_rank, stage, pp) if opt else None, args)
        save_checkpoint(save_dir, iteration, state, tp_rank=tp_rank, pp_rank=stage,
                        pp_size=pp, ep_rank=ep_rank, ep_size=ep, is_tracker_writer=False)
    write_tracker(save_dir, iteration)
    progress.report(final=True)
    if opt is not None:
        logger.info("wrote iteration %s with the optimizer state: --load resumes it with "
                    "its Adam moments and LR schedule", iteration)
    else:
        logger.info("wrote %s weights only: load it with --load (a release checkpoint) or "
                    "--finetune; training starts at iteration 0 with a fresh optimizer",
                    "a release checkpoint of" if iteration == "release" else f"iteration {iteration},")
    return (f"Megatron checkpoint (iteration {iteration}, TP {tp}, PP {pp}"
            + (f", EP {ep})" if ep > 1 else ")"))


def _optimizer_shard(opt: OptimizerState, placement: layout.Layout, stage: int,
                     where: Tuple[int, int, int, int], rows: int, vocab_size: Optional[int]
                     ) -> Dict[str, Any]:
    """torch.optim state dict of one rank: groups (muon,) decay, no_decay over the stage's
    parameters, as app.optim.get_param_groups builds them, with each parameter's states split
    like its weight."""
    groups = placement.optimizer_groups(placement.stage_names(stage),
                                        muon="muon" in opt.group_hparams)
    state: Dict[int, Dict[str, torch.Tensor]] = {}
    param_groups = []
    index = 0
    for group_name, members in groups.items():
        if not members:
            continue
        indices = []
        for name in members:
            source_name = layout.WORD_EMBEDDINGS if name == layout.TIED_HEAD else name
            entry = opt.per_param.get(source_name)
            if entry is None:
                raise CheckpointError(f"--include-optimizer: no optimizer state for "
                                      f"{source_name!r}")
            split = {"step": entry["step"].clone()} if "step" in entry else {}
            for kind in (k for k in STATE_TENSORS if k in entry):
                full = entry[kind]
                if source_name in layout.VOCABULARY:
                    full = layout.resize_vocab(full, rows, vocab_size, f"{kind} of {source_name}")
                split[kind] = _rank_part(placement, name, full, *where)
            state[index] = split
            indices.append(index)
            index += 1
        hparams = dict(opt.group_hparams.get(group_name, {}))
        hparams["name"] = group_name
        param_groups.append({**hparams, "params": indices})
    return {"state": state, "param_groups": param_groups}


def _mixed_state(adam: Dict[str, Any], full: Dict[str, torch.Tensor], placement: layout.Layout,
                 stage: int, where: Tuple[int, int, int, int], opt: OptimizerState
                 ) -> Dict[str, Any]:
    """Megatron's Float16Optimizer layout (what a native fp16/bf16 run saves): AdamW's state,
    the loss scaler's, and the fp32 main weights with their names, per param group."""
    groups = [g for g in placement.optimizer_groups(placement.stage_names(stage),
                                                 "muon" in opt.group_hparams).values() if g]
    mains = [[_rank_part(placement, n, full[n].float(), *where) for n in group]
             for group in groups]
    return {"optimizer": adam, "grad_scaler": opt.grad_scaler, "fp32_from_fp16_params": mains,
            "param_names": groups}


def _rng_for(source: ModelCheckpoint, tp_rank: int, stage: int, pp: int) -> Optional[Any]:
    """RNG states for a target rank: those of the source rank with the same TP rank (modulo the
    source TP size) on the stage that held this stage's first layer. Dropout streams of a
    changed layout cannot continue exactly; every other state does."""
    if not source.rng_states:
        return None
    src_tp, src_pp = source.source_layout
    first_layer = stage_layer_range(source.num_layers, pp, stage).start
    src_stage = stage_of_layer(source.num_layers, src_pp, first_layer)
    return source.rng_states.get((tp_rank % src_tp, src_stage))
