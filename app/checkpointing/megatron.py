"""Megatron-LM-layout checkpoints: crash-safe writer, safe reader, args check, RNG state.

On disk (exactly Megatron-LM's legacy layout, so its tools read our files)::

    {save}/latest_checkpointed_iteration.txt        "<iteration>" or "release"
    {save}/iter_{iteration:07d}/mp_rank_{tp:02d}/model_optim_rng.pt             (PP == 1)
    {save}/iter_{iteration:07d}/mp_rank_{tp:02d}_{pp:03d}/model_optim_rng.pt    (PP > 1)

Beside each `model_optim_rng.pt` we write `model_optim_rng.pt.sha256` (sha256sum format); the
reader verifies it when present, so a flipped byte is caught before unpickling. Megatron's
readers ignore it. Files are unpickled with weights_only=True and a small allow-list
(`safe_torch_load`, also used for DeepSpeed's files), so a checkpoint cannot run code on load.

Each file holds Megatron's dict: `iteration`, `checkpoint_version` (3.0), `args` (an
argparse.Namespace with the model shape, the parallel layout and the data position), `model`
(nested: language_model -> embedding / transformer), `optimizer`, `lr_scheduler` and
`rng_state` (a list with one dict per saved rank state). See docs/checkpoints.md.

Crash safety: every file is written under a temporary name, fsynced and renamed; all ranks pass
a barrier before one rank replaces the tracker atomically, so the tracker never names an
iteration with a missing or partial file. Old iterations are rotated away only after that. A
save that fails on any rank (a full disk) is undone on every rank (CheckpointSaveError).
"""
from __future__ import annotations

import argparse
import contextlib
import errno
import os
import re
import shutil
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch

from app.config import RunConfig
from app.checkpointing.files import (CheckpointError, read_checksums, safe_torch_load,
                                           sha256_file, sidecar_path, verify_checksum,
                                           write_checksums)
from app.utils.dtypes import torch_dtype
from app.utils.fileio import atomic_write_bytes, fsync_dir, tmp_path, write_durably

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
MODEL_FILENAME = "model_optim_rng.pt"
CHECKPOINT_VERSION = 3.0
"""3.0: fused QKV rows ordered [heads, (q, k, v), head_dim]."""

Iteration = Union[int, str]  # an iteration number or "release"

SAVE_HOOK: Optional[Callable[[str], None]] = None
"""Test seam: called with the name of each stage of `save_checkpoint` (see SAVE_STAGES)."""
SAVE_STAGES = ("start", "rank_tmp_written", "rank_checksum_committed", "rank_file_committed",
               "before_tracker", "tracker_tmp_written", "tracker_committed", "rotated")

_ITER_DIR_RE = re.compile(r"^iter_(\d{7,})$")


def _noop() -> None:
    return None


def _hook(stage: str) -> None:
    if SAVE_HOOK is not None:
        SAVE_HOOK(stage)


# ---------------------------------------------------------------------------- paths

def checkpoint_dir(save_dir: str, iteration: Iteration) -> str:
    """`{save_dir}/iter_{iteration:07d}`, or `{save_dir}/release` for "release"."""
    if iteration == "release":
        return os.path.join(save_dir, "release")
    return os.path.join(save_dir, f"iter_{int(iteration):07d}")


def rank_dir_name(tp_rank: int, pp_rank: int, pp_size: int) -> str:
    """`mp_rank_{tp:02d}` when PP == 1, else `mp_rank_{tp:02d}_{pp:03d}` (Megatron's names)."""
    if pp_size == 1:
        return f"mp_rank_{tp_rank:02d}"
    return f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


def checkpoint_path(save_dir: str, iteration: Iteration, *, tp_rank: int = 0, pp_rank: int = 0,
                    pp_size: int = 1) -> str:
    """Path of one rank's `model_optim_rng.pt` for `iteration`."""
    return os.path.join(checkpoint_dir(save_dir, iteration),
                        rank_dir_name(tp_rank, pp_rank, pp_size), MODEL_FILENAME)


def tracker_path(save_dir: str) -> str:
    """`{save_dir}/latest_checkpointed_iteration.txt`."""
    return os.path.join(save_dir, TRACKER_FILENAME)


def list_checkpoint_iterations(save_dir: str) -> List[int]:
    """Iterations that have an `iter_XXXXXXX` directory under `save_dir`, ascending."""
    if not os.path.isdir(save_dir):
        return []
    found = (_ITER_DIR_RE.match(name) for name in os.listdir(save_dir))
    return sorted(int(m.group(1)) for m in found if m)


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


# ---------------------------------------------------------------------------- args

MODEL_SHAPE_FIELDS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                      "max_position_embeddings", "padded_vocab_size", "tokenizer_type",
                      "position_embedding_type", "rotary_percent", "rotary_base",
                      "num_query_groups", "untie_embeddings_and_output_weights")
"""Fields that must agree between a checkpoint and the run loading it."""


def checkpoint_args_namespace(cfg: RunConfig, consumed_train_samples: int,
                              consumed_valid_samples: int, iteration: int) -> argparse.Namespace:
    """The `args` Namespace stored in a checkpoint: Megatron's names, from `cfg` and the position.

    Carries the model shape, the parallel layout, the data position and a few fields Megatron
    tools read (params_dtype, position_embedding_type, ...). Plain Python values and one
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
        tokenizer_type=cfg.data.tokenizer_type, layernorm_epsilon=m.layernorm_epsilon,
        hidden_dropout=m.hidden_dropout, attention_dropout=m.attention_dropout,
        init_method_std=m.init_method_std, openai_gelu=m.openai_gelu,
        bias_gelu_fusion=m.bias_gelu_fusion, masked_softmax_fusion=m.masked_softmax_fusion,
        bias_dropout_fusion=m.bias_dropout_fusion, use_flash_attn=m.attention_impl == "flash",
        params_dtype=torch_dtype(m.params_dtype), fp16=cfg.precision.fp16,
        bf16=cfg.precision.bf16, attention_softmax_in_fp32=m.attention_softmax_in_fp32,
        apply_query_key_layer_scaling=m.apply_query_key_layer_scaling,
        fp16_lm_cross_entropy=m.fp16_lm_cross_entropy,
        accumulate_allreduce_grads_in_fp32=cfg.precision.grads_accumulate_in_fp32,
        position_embedding_type=m.position_embedding_type,
        add_position_embedding=m.position_embedding_type == "learned_absolute",
        use_rotary_position_embeddings=m.position_embedding_type == "rope",
        rotary_percent=m.rotary_percent, rotary_base=m.rotary_base,
        group_query_attention=m.group_query_attention, num_query_groups=m.num_kv_heads,
        normalization="LayerNorm", add_bias_linear=True, swiglu=False,
        untie_embeddings_and_output_weights=m.untie_embeddings_and_output_weights,
        apply_residual_connection_post_layernorm=False,
        sequence_parallel=m.sequence_parallel, recompute_granularity=m.recompute_granularity,
        recompute_method=m.recompute_method, recompute_num_layers=m.recompute_num_layers,
        tensor_model_parallel_size=p.tensor_model_parallel_size,
        pipeline_model_parallel_size=p.pipeline_model_parallel_size,
        num_layers_per_virtual_pipeline_stage=p.num_layers_per_virtual_pipeline_stage,
        virtual_pipeline_model_parallel_size=(cfg.virtual_pipeline_model_parallel_size
                                              if p.num_layers_per_virtual_pipeline_stage else None),
        data_parallel_size=p.data_parallel_size, world_size=p.world_size,
        micro_batch_size=t.micro_batch_size, global_batch_size=t.global_batch_size,
        train_iters=t.train_iters, seed=t.seed, lr=o.lr, min_lr=o.min_lr,
        lr_decay_style=o.lr_decay_style, lr_decay_iters=o.lr_decay_iters,
        lr_warmup_iters=o.lr_warmup_iters,
        consumed_train_samples=int(consumed_train_samples),
        consumed_valid_samples=int(consumed_valid_samples), iteration=int(iteration),
        data_path=list(cfg.data.data_path))


def check_checkpoint_args(ckpt_args: Optional[argparse.Namespace],
                          current: argparse.Namespace) -> None:
    """Raise CheckpointError if the checkpoint's model shape or TP/PP layout differs from ours.

    Fields missing from an older checkpoint are skipped. The message names the field and both
    values; a tensor/pipeline size mismatch also says how to reshard (tools/convert_checkpoint.py).
    """
    if ckpt_args is None:
        return
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
        saved, now = getattr(ckpt_args, name, 1), getattr(current, name, 1)
        if saved != now:
            raise CheckpointError(f"checkpoint was saved with {name} {saved} but this run uses "
                                  f"{now}; reshard it first: tools/convert_checkpoint.py "
                                  "--input-format megatron --target-tensor-model-parallel-size T "
                                  "--target-pipeline-model-parallel-size P --include-optimizer")
    for name in MODEL_SHAPE_FIELDS:
        if not hasattr(ckpt_args, name) or not hasattr(current, name):
            continue
        saved, now = getattr(ckpt_args, name), getattr(current, name)
        if saved != now:
            raise CheckpointError(f"checkpoint was saved with {name} {saved} but this run uses "
                                  f"{now}; pass the same model flags as the run that saved it")


def check_checkpoint_version(state: Dict[str, Any], where: str) -> None:
    """Refuse checkpoints whose fused QKV rows are not ordered [heads, (q, k, v), head_dim].

    Megatron checkpoints before version 3.0 order them differently; loading one as is would
    scramble attention without any shape error.
    """
    version = float(state.get("checkpoint_version", 0) or 0)
    if version < CHECKPOINT_VERSION:
        raise CheckpointError(
            f"{where} has checkpoint_version {version}: its fused QKV rows are ordered "
            f"differently from version {CHECKPOINT_VERSION}; convert it first (Megatron-LM's "
            "checkpoint conversion to version 3.0)")


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


# ---------------------------------------------------------------------------- writing

def write_checked_file(path: str, write: Callable[[Any], Any], hidden_sidecar: bool = False
                       ) -> None:
    """Write `path` with `write(f)` crash-safely, with a SHA-256 sidecar (`sidecar_path`).

    tmp file + fsync, checksum sidecar, then atomic rename; safe to crash at any point, and a
    failed write (a full disk) leaves no temporary file. While the data file is being replaced
    the sidecar lists both the old and the new digest, so whichever file is on disk after a
    crash still verifies. Used for Megatron's files and, through the checkpoint-engine hook of
    app.training.engines.deepspeed, for DeepSpeed's.
    """
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    tmp = tmp_path(path)
    write_durably(tmp, write)
    try:
        _hook("rank_tmp_written")
        digest, sidecar = sha256_file(tmp), sidecar_path(path, hidden_sidecar)
        name = os.path.basename(path)
        old = read_checksums(sidecar) if os.path.exists(path) else []
        write_checksums(sidecar, name, [digest] + [d for d in old if d != digest])
        _hook("rank_checksum_committed")
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    if old:
        write_checksums(sidecar, name, [digest])
    fsync_dir(directory)
    _hook("rank_file_committed")


def remove_written_file(path: str, stop_at: str) -> None:
    """Delete `path` and its sidecar, then the directories above it up to (and including)
    `stop_at` that are left empty: the undo of a save that did not complete everywhere."""
    for victim in (path, sidecar_path(path, False), sidecar_path(path, True)):
        with contextlib.suppress(OSError):
            os.remove(victim)
    directory = os.path.dirname(path)
    stop_at = os.path.abspath(stop_at)
    while os.path.abspath(directory).startswith(stop_at):
        try:
            os.rmdir(directory)
        except OSError:
            return
        if os.path.abspath(directory) == stop_at:
            return
        directory = os.path.dirname(directory)


class CheckpointSaveError(CheckpointError):
    """A checkpoint could not be written; its partial files were removed and the previous
    checkpoint stays the latest (the message says which)."""


def save_failure(save_dir: str, iteration: Iteration, error: Optional[BaseException],
                 path: str = "") -> CheckpointSaveError:
    """The error every rank raises after a failed save: this rank's own cause when it had one
    (`error`), else that another rank failed; with the free space and the latest checkpoint."""
    try:
        latest = read_tracker(save_dir)
    except CheckpointError:
        latest = None
    try:
        free = f"{shutil.disk_usage(save_dir).free / 2**20:.0f} MiB free there now"
    except OSError:
        free = "free space unknown"
    if error is None:
        cause = "another rank could not write its part (its message says why)"
    else:
        what = getattr(error, "strerror", None) or str(error)
        code = errno.errorcode.get(getattr(error, "errno", None) or -1, "")
        cause = f"writing {path or save_dir} failed: {what}{f' ({code})' if code else ''}"
    still = (f"the latest checkpoint is still iteration {latest}" if latest is not None
             else "there is no earlier checkpoint")
    return CheckpointSaveError(
        f"could not save the checkpoint of iteration {iteration} to {save_dir}: {cause}; "
        f"{free}. The partial files of this save were removed and {still}. Free space or fix "
        "the directory, then relaunch to resume.")


def write_tracker(save_dir: str, iteration: Iteration) -> None:
    """Atomically replace the tracker with `iteration` (tmp file + fsync + os.replace)."""
    atomic_write_bytes(tracker_path(save_dir), str(iteration).encode("ascii"), durable=True,
                       before_replace=lambda: _hook("tracker_tmp_written"))


def rotate_checkpoints(save_dir: str, keep_last_n: int, current: int) -> List[int]:
    """Delete iter_ directories older than `current`, keeping the newest `keep_last_n` in all.

    Call only after the tracker names `current`. Directories newer than `current` (left by an
    abandoned run) and `release/` are never touched. Returns the iterations deleted.
    """
    if keep_last_n < 1:
        raise ValueError(f"keep_last_n_checkpoints must be >= 1, got {keep_last_n}")
    older = [i for i in list_checkpoint_iterations(save_dir) if i < current]
    doomed = older[:max(0, len(older) - (keep_last_n - 1))]
    for iteration in doomed:
        shutil.rmtree(checkpoint_dir(save_dir, iteration), ignore_errors=True)
    return doomed


def save_checkpoint(save_dir: str, iteration: Iteration, ckpt_dict: Dict[str, Any], *,
                    tp_rank: int = 0, pp_rank: int = 0, pp_size: int = 1,
                    barrier: Callable[[], None] = _noop, is_tracker_writer: bool = True,
                    keep_last_n: Optional[int] = None,
                    agree: Optional[Callable[[bool], bool]] = None) -> str:
    """Write this rank's file of `iteration`, then (one rank) commit the tracker. Crash-safe.

    Every writing rank calls this. Ranks synchronise twice: after this rank's file is committed
    and after the tracker is committed. `agree(ok)` does it when given (every rank passes
    whether its part succeeded and gets whether all did, e.g. an all-reduce); else `barrier()`
    is called (exactly twice) and only this rank's outcome counts. Ranks that write no file
    synchronise twice themselves. Only `is_tracker_writer` replaces the tracker and, if
    `keep_last_n` is set, rotates old iterations after the commit. An I/O error (a full disk)
    on any rank removes this save's new files on every rank and raises CheckpointSaveError; the
    tracker keeps naming the previous checkpoint. Returns the iteration directory.
    """
    if agree is None:
        def agree(ok: bool) -> bool:
            barrier()
            return ok
    _hook("start")
    path = checkpoint_path(save_dir, iteration, tp_rank=tp_rank, pp_rank=pp_rank,
                           pp_size=pp_size)
    directory = checkpoint_dir(save_dir, iteration)
    existed, fresh = os.path.exists(path), not os.path.isdir(directory)
    error: Optional[OSError] = None
    try:
        write_checked_file(path, lambda f: torch.save(ckpt_dict, f))
    except OSError as exc:
        error = exc
    if not agree(error is None):  # every rank's file of this iteration is complete, or none
        _undo(path, existed, directory, fresh)
        raise save_failure(save_dir, iteration, error, path)
    if is_tracker_writer:
        _hook("before_tracker")
        try:
            write_tracker(save_dir, iteration)
        except OSError as exc:
            error = exc
        else:
            _hook("tracker_committed")
            if keep_last_n and iteration != "release":
                rotate_checkpoints(save_dir, keep_last_n, int(iteration))
                _hook("rotated")
    if not agree(error is None):  # the tracker names this iteration on every rank's return
        _undo(path, existed, directory, fresh)
        raise save_failure(save_dir, iteration, error, tracker_path(save_dir))
    return directory


def _undo(path: str, existed: bool, directory: str, fresh: bool) -> None:
    """Undo this rank's part of a failed save: its new file, and the iteration directory when
    this save created it (a rank that saw it missing before writing removes it all)."""
    if not existed:
        remove_written_file(path, directory)
    if fresh:
        shutil.rmtree(directory, ignore_errors=True)


# ---------------------------------------------------------------------------- reading

def read_tracker(load_dir: str) -> Optional[Iteration]:
    """The iteration the tracker names (an int or "release"); None when there is no tracker.

    Raises CheckpointError, naming the file and the fix, when the tracker is empty or not a
    number, or names a directory that does not exist.
    """
    path = tracker_path(load_dir)
    if not os.path.isfile(path):
        return None
    with open(path, "r", encoding="utf-8", errors="replace") as f:
        text = f.read().strip()
    available = list_checkpoint_iterations(load_dir)
    hint = (f"complete iterations may be among {available}; write one of them into it"
            if available else "delete it to start from scratch")
    if text == "release":
        iteration: Iteration = "release"
    elif re.fullmatch(r"\d+", text):
        iteration = int(text)
    else:
        raise CheckpointError(f"tracker file {path} holds {text!r}, not an iteration number or "
                              f"'release'; {hint}")
    directory = checkpoint_dir(load_dir, iteration)
    if not os.path.isdir(directory):
        raise CheckpointError(f"tracker file {path} names iteration {iteration}, but "
                              f"{directory} does not exist; {hint}")
    return iteration


def _torch_load(path: str) -> Dict[str, Any]:
    state = safe_torch_load(path)
    if not isinstance(state, dict) or "model" not in state:
        raise CheckpointError(f"checkpoint file {path} is not a Megatron checkpoint dict "
                              "(no 'model' entry)")
    return state


def saved_layout(directory: str) -> Optional[Tuple[int, int]]:
    """(tensor, pipeline) parallel sizes of the checkpoint in `directory`, read from the names
    of its mp_rank_XX / mp_rank_XX_YYY folders; None when it holds none."""
    tp, pp = set(), set()
    for name in os.listdir(directory) if os.path.isdir(directory) else []:
        parts = name.split("_")
        if name.startswith("mp_rank_") and all(p.isdigit() for p in parts[2:]) and len(parts) > 2:
            tp.add(int(parts[2]))
            pp.add(int(parts[3]) if len(parts) > 3 else 0)
    return (len(tp), len(pp)) if tp else None


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
