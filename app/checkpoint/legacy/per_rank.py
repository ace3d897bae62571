"""Megatron-LM's legacy checkpoint format (`--ckpt-format torch`), per rank: the state dict, its
crash-safe writer and its safe reader, and the RNG states (app.checkpoint.legacy.whole reads and
writes the whole model at any TP/PP).

On disk exactly Megatron-LM's legacy layout, so its tools read our files (app.checkpoint.names
spells every name): `{save}/iter_{iteration:07d}/mp_rank_{tp:02d}[_{pp:03d}][_{ep:03d}]/
model_optim_rng.pt` and the tracker `{save}/latest_checkpointed_iteration.txt`. With Mixture
of Experts and expert parallelism each file is one (tensor, pipeline, expert-parallel) rank's:
its dense tensor-parallel shard and its expert box, the E/EP experts of expert-parallel rank ep
split over the expert tensor-parallel ranks, whose rank is the file's tensor rank (the format
holds experts split like that only: expert tensor-parallel size equal to the tensor-parallel
size, Megatron's default).

Beside each `model_optim_rng.pt` we write `model_optim_rng.pt.sha256` (sha256sum format); the
reader verifies it when present, so a flipped byte is caught before unpickling. Megatron's
readers ignore it. Files are unpickled with weights_only=True and a small allow-list
(`safe_torch_load`, also used for DeepSpeed's files), so a checkpoint cannot run code on load.

Each file holds Megatron's dict: `iteration`, `checkpoint_version` (3.0), `args` (an
argparse.Namespace with the model shape, the parallel layout and the data position; see
app.checkpoint.model_args), `model` (nested: language_model -> embedding / transformer),
`optimizer`, `lr_scheduler` and `rng_state` (a list with one dict per saved rank state). See
docs/checkpoints.md. A Megatron Core model saved in this format (Megatron Core's parameter
keys, app.checkpoint.mcore.names) is read under our names.

Crash safety is app.checkpoint.commit's: every file is written under a temporary name,
fsynced and renamed; all ranks agree before one rank replaces the tracker atomically, so the
tracker never names an iteration with a missing or partial file. Old iterations are rotated
away only after that. A save that fails on any rank (a full disk) is undone on every rank
(CheckpointSaveError).
"""
from __future__ import annotations

import argparse
import os
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from app.checkpoint import CheckpointError, commit, names
from app.checkpoint.commit import PendingSave, remove_written_file, write_checked_file
from app.checkpoint.files import megatron_args_globals, safe_torch_load, verify_checksum
from app.checkpoint.mcore.names import from_mcore_model, is_mcore_model
from app.checkpoint.mcore.state import CHECKPOINT_VERSION
from app.checkpoint.names import Iteration, checkpoint_dir, checkpoint_path, read_tracker

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
    for group_names, values in zip(opt["param_names"], opt["fp32_from_fp16_params"]):
        for name, value in zip(group_names, values):
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
                    tp_rank: int = 0, pp_rank: int = 0, pp_size: int = 1, ep_rank: int = 0,
                    ep_size: int = 1, barrier: Callable[[], None] = lambda: None,
                    is_tracker_writer: bool = True, keep_last_n: Optional[int] = None,
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
                      pp_size=pp_size, ep_rank=ep_rank, ep_size=ep_size, barrier=barrier,
                      is_tracker_writer=is_tracker_writer, keep_last_n=keep_last_n,
                      agree=agree).finish()


def start_save(save_dir: str, iteration: Iteration, ckpt_dict: Dict[str, Any], *,
               tp_rank: int = 0, pp_rank: int = 0, pp_size: int = 1, ep_rank: int = 0,
               ep_size: int = 1, barrier: Callable[[], None] = lambda: None,
               is_tracker_writer: bool = True,
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
                           pp_size=pp_size, ep_rank=ep_rank, ep_size=ep_size)
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
    state = safe_torch_load(path, extra_safe_globals=megatron_args_globals(path))
    if not isinstance(state, dict) or "model" not in state:
        raise CheckpointError(f"checkpoint file {path} is not a Megatron checkpoint dict "
                              "(no 'model' entry)")
    return state


def saved_layout(directory: str) -> Optional[Tuple[int, int, int]]:
    """(tensor, pipeline, expert) parallel sizes of the legacy checkpoint in `directory` (an
    iteration folder), read from the names of its mp_rank_XX[_YYY[_ZZZ]] folders (the format's
    one file-name rule; app.checkpoint.saved_layout lists the files it implies); None when it
    holds none. A one-suffix name is a pipeline rank, or an expert-parallel one when the saved
    args say EP > 1 (then rank 0's args are read, its tensors left on disk)."""
    found = {name: rank for name in (os.listdir(directory) if os.path.isdir(directory) else [])
             for rank in [names.parse_rank_dir(name)]
             if rank is not None and os.path.isdir(os.path.join(directory, name))}
    if not found:
        return None
    ranks = list(found.values())
    tp = max(r[0] for r in ranks) + 1
    if any(len(r) == 3 for r in ranks):
        return tp, max(r[1] for r in ranks) + 1, max(r[2] for r in ranks) + 1
    second = max((r[1] for r in ranks if len(r) == 2), default=-1) + 1
    if second == 0:
        return tp, 1, 1
    first = os.path.join(directory, min(found, key=found.get), names.MODEL_FILENAME)
    experts = _saved_expert_parallel_size(first) if os.path.isfile(first) else 1
    return (tp, 1, second) if experts > 1 else (tp, second, 1)


def _saved_expert_parallel_size(path: str) -> int:
    """expert_model_parallel_size of the args in the legacy file `path` (1 when absent, or when
    the file cannot be read: its load names the damage)."""
    try:
        state = safe_torch_load(path, extra_safe_globals=megatron_args_globals(path), mmap=True)
    except CheckpointError:
        return 1
    args = state.get("args") if isinstance(state, dict) else None
    return int(getattr(args, "expert_model_parallel_size", 1) or 1)


def load_checkpoint_dict(load_dir: str, *, tp_rank: int = 0, pp_rank: int = 0, pp_size: int = 1,
                         iteration: Optional[Iteration] = None, tp_size: Optional[int] = None,
                         ep_rank: int = 0, ep_size: int = 1
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
                           pp_size=pp_size, ep_rank=ep_rank, ep_size=ep_size)
    if not os.path.isfile(path):
        directory = checkpoint_dir(load_dir, iteration)
        present = sorted(os.listdir(directory)) if os.path.isdir(directory) else []
        layout = saved_layout(directory)
        if layout and tp_size is not None and layout != (tp_size, pp_size, ep_size):
            raise CheckpointError(
                f"checkpoint in {directory} was saved with tensor_model_parallel_size "
                f"{layout[0]}, pipeline_model_parallel_size {layout[1]} and "
                f"expert_model_parallel_size {layout[2]}, but this run uses {tp_size}, "
                f"{pp_size} and {ep_size}; use the saved sizes, or reshard it with "
                "tools/convert_checkpoint.py (--target-tensor-model-parallel-size, "
                "--target-pipeline-model-parallel-size, --target-expert-model-parallel-size, "
                "--include-optimizer)")
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


def load_weights_across_experts(load_dir: str, iteration: Iteration, state: Dict[str, Any],
                                expert_names: Sequence[str], *, tp_rank: int, pp_rank: int,
                                pp_size: int, saved_ep: int, ep_rank: int, ep_size: int
                                ) -> Tuple[Dict[str, Any], Optional[Dict[str, torch.Tensor]]]:
    """(weights, fp32 main weights or None) of a rank at expert-parallel size `ep_size` from a
    legacy checkpoint saved at `saved_ep`, same tensor and pipeline sizes: the dense weights of
    `state` (the file of expert-parallel rank 0), each weight of `expert_names` the experts
    [ep_rank E/ep_size, (ep_rank + 1) E/ep_size) of those every expert-parallel file of this
    tensor x pipeline rank holds (the expert tensor split is the tensor-parallel one)."""
    weights = from_megatron_model(state["model"])
    mains = fp32_main_weights(state)
    parts: Dict[str, List[torch.Tensor]] = {name: [] for name in expert_names}
    main_parts: Dict[str, List[torch.Tensor]] = {name: [] for name in expert_names}
    for saved_rank in range(saved_ep):
        other = state if saved_rank == 0 else load_checkpoint_dict(
            load_dir, iteration=iteration, tp_rank=tp_rank, pp_rank=pp_rank, pp_size=pp_size,
            ep_rank=saved_rank, ep_size=saved_ep)[0]
        flat, main = from_megatron_model(other["model"]), fp32_main_weights(other) or {}
        for name in expert_names:
            parts[name].append(flat[name])
            if name in main:
                main_parts[name].append(main[name])
    for name in expert_names:
        weights[name] = torch.cat(parts[name]).chunk(ep_size)[ep_rank].clone()
        if mains is not None and main_parts[name]:
            mains[name] = torch.cat(main_parts[name]).chunk(ep_size)[ep_rank].clone()
    return weights, mains


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
