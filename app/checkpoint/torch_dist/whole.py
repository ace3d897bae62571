"""Megatron-LM's `--ckpt-format torch_dist`, the whole model in one process (the converter's and
inference's): the files already hold global tensors under Megatron Core's keys, so reading is one
full read per key (the stacked layer tensors cut back into our per-layer names,
app.checkpoint.mcore.names) and writing is one box per tensor from a single rank: its TP x PP is
irrelevant, training reshards it on load (app.checkpoint.torch_dist.per_rank). Mixed-precision
checkpoints give their fp32 main weights (`optimizer.state.fp32_param` / `.param`), as the
legacy reader does.
"""
from __future__ import annotations

import copy
import os
from typing import Any, Dict, List, Tuple

import torch

from app.checkpoint import CheckpointError
from app.checkpoint import param_layout as layout
from app.checkpoint.mcore import names as mcore_names
from app.checkpoint.mcore import state as mcore_state
from app.checkpoint.mcore.names import stacks_layers
from app.checkpoint.names import checkpoint_dir, write_tracker
from app.checkpoint.param_layout import target_args
from app.checkpoint.request import WriteRequest
from app.checkpoint.saved_layout import SavedCheckpoint
from app.checkpoint.state import (ModelCheckpoint, OptimizerState, Progress, cast_weights,
                                  describe)
from app.checkpoint.torch_dist import dcp_files
from app.checkpoint.torch_dist.per_rank import (RankLayout, read_common, save_entries,
                                                write_common_pt)
from app.optim.model_space import MAIN, MOMENTS, MOMENTUM, ModelSpaceState, ParamState
from app.utils.dtypes import torch_dtype


def _by_name(reader: dcp_files.Reader, prefix: str, num_layers: int, progress: Progress
             ) -> Dict[str, torch.Tensor]:
    """{our parameter name: full tensor} of every model key stored under `prefix` + key (the
    model itself for "", an optimizer state for `optimizer.state.<state>.`): stacked layer
    tensors cut into their layers, per-layer keys (a model with MoE and dense layers) taken
    as they are."""
    out: Dict[str, torch.Tensor] = {}
    for stored in reader.keys():
        if not stored.startswith(prefix) or reader.tensor_meta(stored) is None:
            continue
        key = stored[len(prefix):]
        try:
            name = mcore_names.from_mcore(key, 0) if mcore_names.is_stacked(key) else \
                mcore_names.from_mcore(key)
        except KeyError:
            continue  # another prefix's key (optimizer.state.* under the model's "")
        tensor = dcp_files.read_full(reader, stored)
        progress.add(tensor)
        if mcore_names.is_stacked(key):
            if tensor.shape[0] != num_layers:
                raise CheckpointError(f"{reader.directory}: {stored} stacks "
                                      f"{tensor.shape[0]} layers, the args say {num_layers}")
            out.update({mcore_names.from_mcore(key, i): tensor[i].clone()
                        for i in range(num_layers)})
        else:
            out[name] = tensor
    return out


def describe_torch_dist(saved: SavedCheckpoint) -> List[str]:
    """Lines describing a torch_dist checkpoint: every stored key with its global shape, dtype
    and number of chunks, every object, then the common state."""
    directory = saved.folder
    reader = dcp_files.Reader(directory)
    lines = [f"torch_dist checkpoint {directory} ({len(reader.keys())} keys):"]
    for key in reader.keys():
        meta = reader.tensor_meta(key)
        if meta is None:
            lines.append(f"  {key}: object")
        else:
            dtype = str(meta.properties.dtype).replace("torch.", "")
            lines.append(f"  {key}: {list(meta.size)} {dtype}, {len(meta.chunks)} chunk(s)")
    lines.append("common_state:")
    return lines + describe(read_common(reader), 1)


def read_torch_dist(saved: SavedCheckpoint, include_optimizer: bool = False) -> ModelCheckpoint:
    """The whole model (and, with `include_optimizer`, its optimizer state, LR schedule and RNG
    states) of a torch_dist checkpoint."""
    iteration, directory = saved.numbered_iteration(), saved.folder
    if not dcp_files.is_dcp_checkpoint(directory):
        raise CheckpointError(f"{directory} is not a torch_dist checkpoint (no metadata.json "
                              "or .metadata); use --input-format torch or deepspeed")
    reader = dcp_files.Reader(directory)
    common = read_common(reader)
    mcore_state.check_checkpoint_version(common, directory)
    args = common.get("args")
    if args is None:
        raise CheckpointError(f"{directory} has no 'args': its model shape is unknown")
    num_layers = int(args.num_layers)
    progress = Progress("reading torch_dist")
    weights = _by_name(reader, "", num_layers, progress)
    for main in mcore_names.MAIN_WEIGHT_KEYS:  # mixed precision: the exact fp32 weights
        weights.update(_by_name(reader, mcore_names.optimizer_key(main, ""), num_layers,
                                progress))
    missing = sorted(set(layout.Layout.of_args(args, 1).names()) - set(weights))
    if missing:
        raise CheckpointError(f"{directory} lacks {missing[:3]}: not a GPT-2 checkpoint")
    source_tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
    source_pp = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
    result = ModelCheckpoint(args=copy.copy(args), weights=weights, iteration=iteration,
                             source_layout=(source_tp, source_pp))
    if include_optimizer:
        result.optimizer = _read_optimizer(reader, common, num_layers, progress)
        result.lr_scheduler = mcore_state.scheduler_state(common)
        result.rng_states = _rng_states(reader, source_tp, source_pp)
    progress.report(final=True)
    return result


def _read_optimizer(reader: dcp_files.Reader, common: Dict[str, Any], num_layers: int,
                    progress: Progress) -> OptimizerState:
    saved = mcore_state.optimizer_common(common, reader.directory)
    per_param: Dict[str, Dict[str, torch.Tensor]] = {}
    for state in MOMENTS + MOMENTUM:
        found = _by_name(reader, mcore_names.optimizer_key(state, ""), num_layers, progress)
        for name, tensor in found.items():
            per_param.setdefault(name, {})[state] = tensor.float()
    if saved.step is not None:
        for entry in per_param.values():
            if "exp_avg" in entry:
                entry["step"] = torch.tensor(saved.step, dtype=torch.float32)
    names = ["muon", "decay", "no_decay"] if len(saved.param_groups) == 3 else ["decay", "no_decay"]
    hparams = {g.get("name", default): dict(g) for g, default in zip(saved.param_groups, names)}
    return OptimizerState(per_param, hparams, saved.grad_scaler)


def _rng_states(reader: dcp_files.Reader, tp: int, pp: int) -> Dict[Tuple[int, int], Any]:
    """{(tp_rank, pp_rank): RNG states} of the saving run's ranks, where stored."""
    out = {}
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            key = mcore_names.object_key("rng_state", (pp_rank, tp_rank), (pp, tp))
            if reader.has_object(key):
                value = dcp_files.load_object(reader.read([], [key])[key], key)
                out[(tp_rank, pp_rank)] = value[0] if isinstance(value, list) else value
    return out


def _model_space(opt: OptimizerState, weights: Dict[str, torch.Tensor], half: bool,
                 placement: layout.Layout) -> ModelSpaceState:
    """The whole model's optimizer state as one rank's model-space state."""
    muon = "muon" in opt.group_hparams
    groups = placement.optimizer_groups(list(weights), muon=muon)
    params: List[ParamState] = []
    step = None
    for group_name, members in groups.items():
        keys = MOMENTUM if group_name == "muon" or "betas" not in opt.group_hparams.get(
            group_name, {"betas": None}) else MOMENTS
        for name in members:
            entry = opt.per_param.get(name, {})
            tensors = {k: entry[k] for k in keys if k in entry}
            if "step" in entry:
                step = float(entry["step"])
            if half:
                tensors[MAIN] = weights[name].float()
            params.append(ParamState(name, None, tensors, keys))
    param_groups = [{**opt.group_hparams.get(g, {}), "name": g} for g, m in groups.items() if m]
    return ModelSpaceState(params, param_groups, step, opt.grad_scaler)


def write_torch_dist(source: ModelCheckpoint, save_dir: str, request: WriteRequest) -> str:
    """Write `source` as a torch_dist checkpoint into `save_dir` (which the caller stages): one
    process writes every tensor whole, in the request's dtype, with the optimizer state when the
    request includes it; training loads it at any TP x PP x DP. Returns what was written, in
    words."""
    include_optimizer = request.include_optimizer
    saved_dtype = getattr(source.args, "params_dtype", None)
    dtype = (torch_dtype(request.params_dtype) if request.params_dtype else saved_dtype
             if isinstance(saved_dtype, torch.dtype) else source.weights[layout.WORD_EMBEDDINGS].dtype)
    iteration = request.iteration_written(source)
    full = dict(source.weights)
    weights = cast_weights(full, dtype)
    opt = source.optimizer if include_optimizer else None
    if include_optimizer and opt is None:
        raise CheckpointError("--include-optimizer: the source checkpoint has no optimizer "
                              "state")
    rows = weights[layout.WORD_EMBEDDINGS].shape[0]
    args = target_args(source, 1, 1, dtype, rows, iteration)
    args.data_parallel_size, args.world_size = 1, 1
    placement = layout.Layout.of_args(args, 1, rows)
    state = _model_space(opt, full, dtype != torch.float32, placement) if opt else None
    common = mcore_state.build_common(
        args, iteration, scheduler=source.lr_scheduler if opt else None,
        optimizer=None if state is None else mcore_state.optimizer_part(state, distributed=False),
        distributed_optimizer=False)
    moe = placement.config.moe
    single = RankLayout(0, 1, 0, 1, 0, 1, 0, source.num_layers,
                        stacked=stacks_layers(moe.moe_layer_freq, moe.num_experts))
    rng = source.rng_states.get((0, 0)) if opt else None
    entries = save_entries(weights, single, state, common,
                           rng[0] if isinstance(rng, list) else rng)
    directory = checkpoint_dir(save_dir, iteration)
    os.makedirs(directory, exist_ok=True)
    record = dcp_files.write_rank_files(directory, 0, entries)
    write_common_pt(directory, entries, record)
    dcp_files.publish(directory, [record])
    write_tracker(save_dir, iteration)
    return f"torch_dist checkpoint (iteration {iteration}; loads at any TP x PP x DP)"
