"""Megatron-LM-layout checkpoints: the state dict, its writer and its safe reader per rank, RNG
state, and the whole model at any TP/PP (read into a ModelCheckpoint, written at any target
TP/PP/dtype).

On disk exactly Megatron-LM's legacy layout, so its tools read our files (app.checkpoint.names
spells every name): `{save}/iter_{iteration:07d}/mp_rank_{tp:02d}[_{pp:03d}]/model_optim_rng.pt`
and the tracker `{save}/latest_checkpointed_iteration.txt`.

Beside each `model_optim_rng.pt` we write `model_optim_rng.pt.sha256` (sha256sum format); the
reader verifies it when present, so a flipped byte is caught before unpickling. Megatron's
readers ignore it. Files are unpickled with weights_only=True and a small allow-list
(`safe_torch_load`, also used for DeepSpeed's files), so a checkpoint cannot run code on load.

Each file holds Megatron's dict: `iteration`, `checkpoint_version` (3.0), `args` (an
argparse.Namespace with the model shape, the parallel layout and the data position; see
app.checkpoint.model_args), `model` (nested: language_model -> embedding / transformer),
`optimizer`, `lr_scheduler` and `rng_state` (a list with one dict per saved rank state). See
docs/checkpoints.md.

Crash safety is app.checkpoint.commit's: every file is written under a temporary name,
fsynced and renamed; all ranks agree before one rank replaces the tracker atomically, so the
tracker never names an iteration with a missing or partial file. Old iterations are rotated
away only after that. A save that fails on any rank (a full disk) is undone on every rank
(CheckpointSaveError).

The whole model: reading merges every rank's shard of every parameter (and, when present, of
its Adam moments) into full tensors; writing splits them for the target layout. The padded
vocabulary is re-padded with Megatron's rule for the target tensor-parallel size
(pad_vocab_size), so TP1 -> TP2xPP2 -> TP4 -> TP1 gives back the same tensors bit for bit.
"""
from __future__ import annotations

import argparse
import copy
import logging
import os
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch

from app.checkpoint import CheckpointError, commit, dcp_files, layout, layouts, names
from app.checkpoint.commit import PendingSave, remove_written_file, write_checked_file
from app.checkpoint.files import safe_torch_load, verify_checksum
from app.checkpoint.mcore_names import from_mcore_model, is_mcore_model
from app.checkpoint.mcore_state import CHECKPOINT_VERSION, check_checkpoint_version
from app.checkpoint.names import (Iteration, checkpoint_dir, checkpoint_path, read_tracker,
                                  write_tracker)
from app.checkpoint.state import ModelCheckpoint, OptimizerState, Progress, cast_weights, describe
from app.optim.distributed_optimizer import STATE_TENSORS
from app.optim.mixed_precision import is_mixed_state
from app.pipeline.partition import stage_layer_range, stage_of_layer
from app.utils.dtypes import torch_dtype

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------------- model layout

_EMBEDDING_PREFIX = "language_model.embedding."
_TRANSFORMER_PREFIX = "language_model.transformer."
_LM_PREFIX = "language_model."
_HEAD_PREFIX = "word_embeddings."
_HEAD_KEY = "word_embeddings_for_head"


def to_megatron_model(flat: Dict[str, Any]) -> Dict[str, Any]:
    """Our flat state dict -> Megatron's nested `model` dict (exact inverse: from_megatron_model).

    `language_model.embedding.{word,position}_embeddings.weight` ->
    model['language_model']['embedding'][sub]['weight']; `language_model.transformer.<rest>` ->
    model['language_model']['transformer'][<rest>] (rest keeps its dots, e.g.
    'layers.3.mlp.dense_h_to_4h.weight'); `word_embeddings.weight` (tied copy on a last pipeline
    stage without the embedding) -> model['word_embeddings_for_head']['weight']. Any other
    `language_model.<module>.<rest>` goes to model['language_model'][module][rest].
    """
    out: Dict[str, Any] = {}
    for name, value in flat.items():
        if name.startswith(_EMBEDDING_PREFIX):
            sub, _, rest = name[len(_EMBEDDING_PREFIX):].partition(".")
            path = ("language_model", "embedding", sub, rest)
        elif name.startswith(_TRANSFORMER_PREFIX):
            path = ("language_model", "transformer", name[len(_TRANSFORMER_PREFIX):])
        elif name.startswith(_HEAD_PREFIX):
            path = (_HEAD_KEY, name[len(_HEAD_PREFIX):])
        elif name.startswith(_LM_PREFIX) and "." in name[len(_LM_PREFIX):]:
            module, _, rest = name[len(_LM_PREFIX):].partition(".")
            path = ("language_model", module, rest)
        else:
            raise ValueError(f"parameter {name!r} does not follow the Megatron naming "
                             "(language_model.embedding.*, language_model.transformer.*, "
                             "word_embeddings.*)")
        if not all(path):
            raise ValueError(f"parameter {name!r} has an empty name component")
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return out


def from_megatron_model(nested: Dict[str, Any]) -> Dict[str, Any]:
    """Megatron's nested `model` dict -> our flat state dict (exact inverse of to_megatron_model)."""
    flat: Dict[str, Any] = {}
    for top, sub in nested.items():
        if top == _HEAD_KEY:
            for rest, value in sub.items():
                flat[_HEAD_PREFIX + rest] = value
        elif top == "language_model":
            for module, entries in sub.items():
                if module == "embedding":
                    for emb, params in entries.items():
                        for rest, value in params.items():
                            flat[f"{_EMBEDDING_PREFIX}{emb}.{rest}"] = value
                else:
                    for rest, value in entries.items():
                        flat[f"{_LM_PREFIX}{module}.{rest}"] = value
        else:
            raise CheckpointError(f"unexpected top-level model key {top!r} in checkpoint "
                                  f"(expected 'language_model' or '{_HEAD_KEY}')")
    return flat


def fp32_main_weights(state: Dict[str, Any]) -> Optional[Dict[str, torch.Tensor]]:
    """{parameter name: fp32 main weight} of a mixed-precision checkpoint, else None.

    Mixed-precision runs save Megatron's `fp32_from_fp16_params` (lists per param group) in
    `optimizer`, plus `param_names` in the same order; the `model` entry holds the fp16/bf16
    weights, as Megatron's tools expect.
    """
    opt = state.get("optimizer")
    if not isinstance(opt, dict) or "fp32_from_fp16_params" not in opt or "param_names" not in opt:
        return None
    out: Dict[str, torch.Tensor] = {}
    for names, values in zip(opt["param_names"], opt["fp32_from_fp16_params"]):
        for name, value in zip(names, values):
            out[name] = value
    return out


# ---------------------------------------------------------------------------- RNG state

def apply_rng_state(rng_state: Union[Dict[str, Any], List[Dict[str, Any]]],
                    restore: Callable[[Dict[str, Any]], None], index: int = 0) -> None:
    """Hand this rank's saved RNG states to `restore` (app.mpu.random.load_rng_state_dict).

    Accepts Megatron's list (takes entry `index`) or one dict, with Megatron's keys
    (random_rng_state, np_rng_state, torch_rng_state, cuda_rng_state, rng_tracker_states); an
    incomplete or malformed entry raises CheckpointError. Capturing the states is
    app.mpu.random.rng_state_dict's job, so this module does not depend on the RNG streams.
    """
    state = rng_state[index] if isinstance(rng_state, (list, tuple)) else rng_state
    try:
        restore(state)
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"checkpoint RNG state is incomplete or malformed ({exc!r}); "
                              "pass --no-load-rng to resume without it") from exc


# ---------------------------------------------------------------------------- the dict

def build_checkpoint_dict(iteration: Iteration, model_flat_state: Dict[str, Any],
                          optimizer_state: Optional[Dict[str, Any]],
                          scheduler_state: Optional[Dict[str, Any]],
                          rng_state: Optional[Union[Dict[str, Any], List[Dict[str, Any]]]],
                          args_ns: argparse.Namespace) -> Dict[str, Any]:
    """Megatron's checkpoint dict; optimizer/lr_scheduler/rng_state keys only when given."""
    state: Dict[str, Any] = {
        "args": args_ns,
        "checkpoint_version": CHECKPOINT_VERSION,
        "iteration": iteration,
        "model": to_megatron_model(model_flat_state),
    }
    if optimizer_state is not None:
        state["optimizer"] = optimizer_state
    if scheduler_state is not None:
        state["lr_scheduler"] = scheduler_state
    if rng_state is not None:
        state["rng_state"] = [rng_state] if isinstance(rng_state, dict) else list(rng_state)
    return state


def save_checkpoint(save_dir: str, iteration: Iteration, ckpt_dict: Dict[str, Any], *,
                    tp_rank: int = 0, pp_rank: int = 0, pp_size: int = 1,
                    barrier: Callable[[], None] = lambda: None, is_tracker_writer: bool = True,
                    keep_last_n: Optional[int] = None,
                    agree: Optional[Callable[[bool], bool]] = None) -> str:
    """Write this rank's file of `iteration`, then (one rank) commit the tracker. Crash-safe.

    Every writing rank calls this (app.checkpoint.commit.commit_save: ranks that write no
    file call that with a step that writes nothing). Ranks synchronise twice: after this
    rank's file is committed and after the tracker is committed. `agree(ok)` does it when given
    (every rank passes whether its part succeeded and gets whether all did, e.g. an
    all-reduce); else `barrier()` is called (exactly twice) and only this rank's outcome
    counts. Only `is_tracker_writer` replaces the tracker and, if `keep_last_n` is set, rotates
    old iterations after the commit. An I/O error (a full disk) on any rank removes this save's
    new files on every rank and raises CheckpointSaveError; the tracker keeps naming the
    previous checkpoint. Returns the iteration directory.
    """
    return start_save(save_dir, iteration, ckpt_dict, tp_rank=tp_rank, pp_rank=pp_rank,
                      pp_size=pp_size, barrier=barrier, is_tracker_writer=is_tracker_writer,
                      keep_last_n=keep_last_n, agree=agree).finish()


def start_save(save_dir: str, iteration: Iteration, ckpt_dict: Dict[str, Any], *,
               tp_rank: int = 0, pp_rank: int = 0, pp_size: int = 1,
               barrier: Callable[[], None] = lambda: None, is_tracker_writer: bool = True,
               keep_last_n: Optional[int] = None,
               agree: Optional[Callable[[bool], bool]] = None,
               background: bool = False) -> PendingSave:
    """`save_checkpoint` (same arguments) up to this rank's file, written in a background
    thread with `background` (then `ckpt_dict` must be a copy nobody changes, e.g.
    app.checkpoint.snapshot.host_copy's); `PendingSave.finish` commits it."""
    if agree is None:
        def agree(ok: bool) -> bool:
            barrier()
            return ok
    path = checkpoint_path(save_dir, iteration, tp_rank=tp_rank, pp_rank=pp_rank,
                           pp_size=pp_size)
    existed = False  # whether this save replaces the file (then a failed save keeps it)

    def write() -> Optional[Tuple[str, OSError]]:
        nonlocal existed
        existed = os.path.exists(path)
        try:
            write_checked_file(path, lambda f: torch.save(ckpt_dict, f))
        except OSError as exc:
            return path, exc
        return None

    def undo() -> None:
        if not existed:
            remove_written_file(path, checkpoint_dir(save_dir, iteration))

    return commit.start_save(save_dir, iteration, write=write, undo=undo, agree=agree,
                             is_tracker_writer=is_tracker_writer, keep_last_n=keep_last_n,
                             background=background)


# ---------------------------------------------------------------------------- reading

def _torch_load(path: str) -> Dict[str, Any]:
    state = safe_torch_load(path, extra_safe_globals=dcp_files.megatron_args_globals(path))
    if not isinstance(state, dict) or "model" not in state:
        raise CheckpointError(f"checkpoint file {path} is not a Megatron checkpoint dict "
                              "(no 'model' entry)")
    return state


def saved_layout(directory: str) -> Optional[Tuple[int, int]]:
    """(tensor, pipeline) parallel sizes of the Megatron-layout checkpoint in `directory`, read
    from the names of its mp_rank_XX / mp_rank_XX_YYY folders (app.checkpoint.layouts);
    None when it holds none."""
    layout = layouts.inspect_directory(directory)
    if layout is None or layout.format != layouts.TORCH:
        return None
    return layout.tensor_model_parallel_size, layout.pipeline_model_parallel_size


def load_checkpoint_dict(load_dir: str, *, tp_rank: int = 0, pp_rank: int = 0, pp_size: int = 1,
                         iteration: Optional[Iteration] = None, tp_size: Optional[int] = None
                         ) -> Tuple[Optional[Dict[str, Any]], Optional[Iteration]]:
    """Load this rank's checkpoint dict; (None, None) when `load_dir` has no tracker.

    Uses the tracker unless `iteration` is given. Verifies the SHA-256 sidecar when present and
    unpickles with weights_only=True and a small allow-list. A missing, truncated, garbled or
    unsafe file raises CheckpointError naming the file.
    """
    if iteration is None:
        iteration = read_tracker(load_dir)
        if iteration is None:
            return None, None
    path = checkpoint_path(load_dir, iteration, tp_rank=tp_rank, pp_rank=pp_rank,
                           pp_size=pp_size)
    if not os.path.isfile(path):
        directory = checkpoint_dir(load_dir, iteration)
        present = sorted(os.listdir(directory)) if os.path.isdir(directory) else []
        layout = saved_layout(directory)
        if layout and tp_size is not None and layout != (tp_size, pp_size):
            raise CheckpointError(
                f"checkpoint in {directory} was saved with tensor_model_parallel_size "
                f"{layout[0]} and pipeline_model_parallel_size {layout[1]}, but this run uses "
                f"{tp_size} and {pp_size}; use the saved sizes, or reshard it with "
                "tools/convert_checkpoint.py (--target-tensor-model-parallel-size, "
                "--target-pipeline-model-parallel-size, --include-optimizer)")
        raise CheckpointError(
            f"checkpoint file {path} does not exist (found {present} in {directory}); was it "
            "saved with a different tensor/pipeline parallel size, or did the save not finish?")
    verify_checksum(path)
    state = _torch_load(path)
    saved = state.get("iteration")
    if iteration != "release" and saved is not None and saved != iteration:
        raise CheckpointError(f"checkpoint file {path} says iteration {saved} but lies in the "
                              f"directory of iteration {iteration}")
    if is_mcore_model(state["model"]):  # Megatron Core's model saved as --ckpt-format torch
        layers = int(getattr(state.get("args"), "num_layers", 0) or 0)
        state["model"] = to_megatron_model(from_mcore_model(state["model"],
                                                            pp_rank * (layers // pp_size)))
    return state, iteration


def saved_virtual_pipeline_size(ckpt_args: Optional[argparse.Namespace]) -> int:
    """Model chunks per pipeline rank of the run that saved `ckpt_args` (1: not interleaved)."""
    return int(getattr(ckpt_args, "virtual_pipeline_model_parallel_size", None) or 1)


def load_weights_by_name(load_dir: str, iteration: Iteration, names: List[str], *,
                         tp_rank: int, pp_size: int
                         ) -> Tuple[Dict[str, Any], Optional[Dict[str, torch.Tensor]]]:
    """(weights, fp32 main weights or None) called `names`, from the files of every pipeline
    stage of `tp_rank`.

    Parameter names carry global layer indices, so a stage can take its layers from a
    checkpoint whose stages held other layers (an interleaved run's chunks, or the reverse).
    The tied copy of the word embeddings on the last stage (`word_embeddings.weight`) is the
    same in every layout. Raises CheckpointError naming a weight no file holds.
    """
    found: Dict[str, Any] = {}
    mains: Dict[str, torch.Tensor] = {}
    for pp_rank in range(pp_size):
        state, _ = load_checkpoint_dict(load_dir, iteration=iteration, tp_rank=tp_rank,
                                        pp_rank=pp_rank, pp_size=pp_size)
        flat = from_megatron_model(state["model"])
        found.update({name: flat[name] for name in names if name in flat})
        main = fp32_main_weights(state) or {}
        mains.update({name: main[name] for name in names if name in main})
    missing = [name for name in names if name not in found]
    if missing:
        raise CheckpointError(f"no pipeline stage of {checkpoint_dir(load_dir, iteration)} holds "
                              f"{missing[:4]}; was it saved with another --num-layers?")
    return found, (mains or None)


# ---------------------------------------------------------------------------- the whole model


def describe_megatron(load_dir: str, iteration: Optional[Iteration] = None) -> List[str]:
    """Lines describing every rank file of a Megatron-layout checkpoint: keys, shapes, dtypes."""
    iteration = names.resolve_iteration_number(load_dir, iteration)
    (tp, pp), files = read_rank_files(load_dir, iteration)
    lines = [f"Megatron checkpoint {load_dir}, iteration {iteration}: TP {tp}, PP {pp}"]
    for (tp_rank, pp_rank), state in sorted(files.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        lines.append(f"rank file (tp {tp_rank}, pp {pp_rank}):")
        lines += describe(state, 1)
    return lines


def read_rank_files(load_dir: str, iteration: Iteration
                    ) -> Tuple[Tuple[int, int], Dict[Tuple[int, int], Dict[str, Any]]]:
    """((tp, pp), {(tp_rank, pp_rank): checkpoint dict}) of every rank file of `iteration`."""
    directory = names.checkpoint_dir(load_dir, iteration)
    found = saved_layout(directory)
    if found is None:
        raise CheckpointError(f"{directory} holds no mp_rank_XX folders: not a Megatron-layout "
                              "checkpoint (a DeepSpeed one? use --input-format deepspeed)")
    tp, pp = found
    files = {}
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            state, _ = load_checkpoint_dict(load_dir, tp_rank=tp_rank, pp_rank=pp_rank,
                                            pp_size=pp, iteration=iteration, tp_size=tp)
            check_checkpoint_version(state, directory)
            files[(tp_rank, pp_rank)] = state
    return (tp, pp), files


def read_megatron(load_dir: str, iteration: Optional[Iteration] = None,
                  include_optimizer: bool = False) -> ModelCheckpoint:
    """The whole model (and, with `include_optimizer`, its Adam state) of a Megatron checkpoint."""
    iteration = names.resolve_iteration_number(load_dir, iteration)
    (tp, pp), files = read_rank_files(load_dir, iteration)
    args = files[(0, 0)].get("args")
    if args is None:
        raise CheckpointError(f"{names.checkpoint_dir(load_dir, iteration)} has no 'args': its "
                              "model shape is unknown, so it cannot be converted")
    flat = {}
    for key, state in files.items():
        flat[key] = from_megatron_model(state["model"])
        main = fp32_main_weights(state)  # mixed precision: the exact fp32 weights
        if main:
            flat[key].update({n: v for n, v in main.items() if n in flat[key]})
    if any(fp32_main_weights(state) for state in files.values()):
        logger.info("mixed-precision checkpoint: reading the fp32 main weights of its optimizer")
    weights = layout.merge_ranks(args, flat, tp, pp, "weights")
    result = ModelCheckpoint(args=copy.copy(args), weights=weights, iteration=iteration,
                             source_layout=(tp, pp),
                             rng_states={k: s["rng_state"] for k, s in files.items()
                                         if s.get("rng_state") is not None})
    if include_optimizer:
        if saved_virtual_pipeline_size(args) > 1:
            raise CheckpointError(
                f"{names.checkpoint_dir(load_dir, iteration)} was saved with interleaved model "
                "chunks (--num-layers-per-virtual-pipeline-stage): its weights convert, its "
                "optimizer states do not; drop --include-optimizer")
        result.optimizer = _read_optimizer(args, files, tp, pp, load_dir)
        result.lr_scheduler = files[(0, 0)].get("lr_scheduler")
        saved = files[(0, 0)].get("optimizer") or {}
        result.optimizer.grad_scaler = saved.get("grad_scaler") if is_mixed_state(saved) else None
    return result


def _read_optimizer(args: argparse.Namespace, files: Dict[Tuple[int, int], Dict[str, Any]],
                    tp: int, pp: int, load_dir: str) -> OptimizerState:
    """Optimizer states of every rank file (AdamW's moments and step, SGD's or Muon's momentum),
    mapped to parameter names and merged like the weights."""
    per_rank: Dict[str, Dict[Tuple[int, int], Dict[str, torch.Tensor]]] = {
        kind: {key: {} for key in files} for kind in STATE_TENSORS}
    steps: Dict[str, torch.Tensor] = {}
    hparams: Dict[str, Dict[str, Any]] = {}
    placement = layout.Layout.of_args(args, pp)
    for (tp_rank, stage), state in files.items():
        opt = state.get("optimizer")
        if is_mixed_state(opt):  # Megatron's Float16Optimizer layout: AdamW's state inside
            opt = opt["optimizer"]
        if opt is None:
            raise CheckpointError(f"--include-optimizer: {load_dir} (tp {tp_rank}, pp {stage}) "
                                  "has no optimizer state (saved with --no-save-optim?)")
        index_to_name = _index_names(opt, placement, placement.stage_names(stage),
                                     f"{load_dir} (tp {tp_rank}, pp {stage})")
        for index, name in index_to_name.items():
            entry = opt["state"].get(index)
            if not entry:
                raise CheckpointError(f"--include-optimizer: no optimizer state for {name!r} "
                                      f"in {load_dir} (tp {tp_rank}, pp {stage}); was it "
                                      "saved before the first step?")
            for kind in per_rank:
                if kind in entry:
                    per_rank[kind][(tp_rank, stage)][name] = entry[kind]
            if "step" in entry:
                steps[name] = entry["step"]
        for group in opt["param_groups"]:
            hparams.setdefault(group.get("name", "decay"),
                               {k: v for k, v in group.items() if k != "params"})
    per_param: Dict[str, Dict[str, torch.Tensor]] = {}
    for kind, ranks in per_rank.items():
        present = {name for rank_dict in ranks.values() for name in rank_dict}
        if present:
            merged = layout.merge_ranks(args, ranks, tp, pp, f"optimizer {kind}", present)
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


def write_megatron(source: ModelCheckpoint, save_dir: str, tp: int, pp: int,
                   dtype_name: Optional[str] = None, iteration: Optional[Iteration] = None,
                   include_optimizer: bool = False) -> Iteration:
    """Write `source` as a Megatron checkpoint at TP `tp`, PP `pp` into `save_dir` (which the
    caller stages); returns the iteration written ('release' unless given)."""
    heads = int(source.args.num_attention_heads)
    if heads % tp:
        raise layout.LayoutError(f"num_attention_heads ({heads}) is not divisible by the target "
                                 f"tensor-parallel size ({tp})")
    saved_dtype = getattr(source.args, "params_dtype", None)
    dtype = (torch_dtype(dtype_name) if dtype_name else saved_dtype
             if isinstance(saved_dtype, torch.dtype) else source.weights[layout.WORD_EMBEDDINGS].dtype)
    iteration = "release" if iteration is None else iteration
    rows = layout.target_padded_vocab(source.args, source.weights[layout.WORD_EMBEDDINGS].shape[0],
                                      tp)
    try:
        placement = layout.Layout.of_args(source.args, pp, rows)
    except layout.LayoutError as exc:
        raise layout.LayoutError(f"--target-pipeline-model-parallel-size {pp}: {exc}") from exc
    vocab_size = getattr(source.args, "vocab_size", None)
    full_precision = layout.pad_vocabulary(source.weights, rows, vocab_size)
    weights = cast_weights(full_precision, dtype)
    opt = source.optimizer if include_optimizer else None
    if include_optimizer and opt is None:
        raise CheckpointError("--include-optimizer: the source checkpoint has no optimizer state")
    args = layout.target_args(source, tp, pp, dtype, rows, iteration)
    progress = Progress("writing", total=len(placement.names()) * tp)
    for stage in range(pp):
        names = placement.stage_names(stage)
        for tp_rank in range(tp):
            flat = {n: placement.split(n, weights[n], tp)[tp_rank]
                    for n in names}
            for tensor in flat.values():
                progress.add(tensor)
            optimizer = (_optimizer_shard(opt, placement, stage, tp, tp_rank, rows, vocab_size)
                         if opt else None)
            if optimizer is not None and dtype != torch.float32:  # keep the fp32 main weights
                optimizer = _mixed_state(optimizer, full_precision, placement, stage, tp,
                                         tp_rank, opt)
            state = build_checkpoint_dict(
                iteration, flat, optimizer, source.lr_scheduler if opt else None,
                _rng_for(source, tp_rank, stage, pp) if opt else None, args)
            save_checkpoint(save_dir, iteration, state, tp_rank=tp_rank, pp_rank=stage,
                            pp_size=pp, is_tracker_writer=False)
    write_tracker(save_dir, iteration)
    progress.report(final=True)
    return iteration


def write_converted(source: ModelCheckpoint, save_dir: str, opts: Any) -> str:
    """The converter's write (opts: app.checkpoint.convert.ConvertOptions); returns what was
    written, in words."""
    tp, pp = opts.target_tensor_model_parallel_size, opts.target_pipeline_model_parallel_size
    iteration = opts.iteration
    if opts.include_optimizer and iteration is None:
        iteration = source.iteration
    written = write_megatron(source, save_dir, tp, pp, opts.target_params_dtype, iteration,
                             opts.include_optimizer)
    if opts.include_optimizer:
        logger.info("wrote iteration %s with the optimizer state: --load resumes it with "
                    "its Adam moments and LR schedule", written)
    else:
        logger.info("wrote %s weights only: load it with --load (a release checkpoint) or "
                    "--finetune; training starts at iteration 0 with a fresh optimizer",
                    "a release checkpoint of" if written == "release" else f"iteration {written},")
    return f"Megatron checkpoint (iteration {written}, TP {tp}, PP {pp})"


def _optimizer_shard(opt: OptimizerState, placement: layout.Layout, stage: int, tp: int,
                     tp_rank: int, rows: int, vocab_size: Optional[int]) -> Dict[str, Any]:
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
                split[kind] = placement.split(name, full, tp)[tp_rank]
            state[index] = split
            indices.append(index)
            index += 1
        hparams = dict(opt.group_hparams.get(group_name, {}))
        hparams["name"] = group_name
        param_groups.append({**hparams, "params": indices})
    return {"state": state, "param_groups": param_groups}


def _mixed_state(adam: Dict[str, Any], full: Dict[str, torch.Tensor], placement: layout.Layout,
                 stage: int, tp: int, tp_rank: int, opt: OptimizerState) -> Dict[str, Any]:
    """Megatron's Float16Optimizer layout (what a native fp16/bf16 run saves): AdamW's state,
    the loss scaler's, and the fp32 main weights with their names, per param group."""
    groups = [g for g in placement.optimizer_groups(placement.stage_names(stage),
                                                 "muon" in opt.group_hparams).values() if g]
    mains = [[placement.split(n, full[n].float(), tp)[tp_rank] for n in group]
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
