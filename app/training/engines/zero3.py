"""The DeepSpeed engine's ZeRO-3 parts that need no deepspeed import: what a rank holds, its
pieces of the weights, the check of its own files before a load, the weights-only load (whole
weights read by app.checkpoint.deepspeed.read_rank, then cut by DeepSpeed's gather context) and
the repair of DeepSpeed's universal-checkpoint loader.

At stage 3 a parameter's `.data` is empty except while DeepSpeed has gathered it (around the
forward and backward of its module, and always for the small "persistent" ones under
`stage3_param_persistence_threshold`); this rank's piece of it is `param.ds_tensor`, a view into
the optimizer's `fp16_partitioned_groups_flat` (the working-precision pieces, of whatever
dtype). The optimizer (DeepSpeedZeroOptimizer_Stage3) keeps `fp32_partitioned_groups_flat` (the
fp32 master pieces, a copy in fp32 runs too), `grad_partitions_flat_buffer` (this
rank's gradient pieces) and the torch optimizer's states; with `offload_param` /
`offload_optimizer` DeepSpeed keeps those on the host (`offload_param`, `offload_optimizer`).
"""
from __future__ import annotations

import os
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch

from app.checkpoint import CheckpointError, names
from app.checkpoint import files as ckpt_files
from app.checkpoint.deepspeed import deepspeed_safe_globals
from app.launch.distributed import world_group
from app.mpu import collectives
from app.training.engines.base import optimizer_state_bytes, tensor_bytes


def local_pieces(module: torch.nn.Module) -> Iterator[Tuple[str, torch.Tensor]]:
    """(name, this rank's piece) of every ZeRO-3 parameter of `module`."""
    for name, param in module.named_parameters():
        yield name, param.ds_tensor


def _distinct_bytes(tensors: Any, exclude: set) -> int:
    """Bytes of the tensors whose storage is not in `exclude` (storage pointers)."""
    return sum(tensor_bytes(t) for t in tensors
               if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in exclude)


def state_bytes(module: torch.nn.Module, optimizer: Any) -> Dict[str, int]:
    """Bytes this rank holds at stage 3, on the device and (key "host") offloaded to the host.

    params: the working-precision pieces plus the parameters gathered whole right now (the
    persistent ones between iterations); grads: the gradient pieces; optimizer: the fp32
    master pieces (not counted twice if DeepSpeed steps the working pieces themselves), plus
    the torch optimizer's states. What offload_param / offload_optimizer keep on the host moves to "host".
    """
    pieces = [t for t in optimizer.fp16_partitioned_groups_flat if isinstance(t, torch.Tensor)]
    piece_bytes = sum(tensor_bytes(t) for t in pieces)
    gathered = sum(tensor_bytes(p.data) for p in module.parameters())
    shared = {t.untyped_storage().data_ptr() for t in pieces}
    masters = _distinct_bytes(optimizer.fp32_partitioned_groups_flat, shared)
    optim = optimizer_state_bytes(optimizer.optimizer) + masters
    grads = tensor_bytes(getattr(optimizer, "grad_partitions_flat_buffer", None))
    host = 0
    if getattr(optimizer, "offload_param", False):
        host, piece_bytes = host + piece_bytes, 0
    if getattr(optimizer, "offload_optimizer", False):
        host, grads, optim = host + grads + optim, 0, 0
    return {"params": piece_bytes + gathered, "grads": grads, "optimizer": optim, "host": host}


def load_whole_weights(module: torch.nn.Module, weights: Dict[str, torch.Tensor],
                       gathered: Callable[[torch.nn.Parameter], Any], is_source: bool,
                       optimizer: Any) -> None:
    """Copy whole fp32 `weights` (by parameter name) into the partitioned parameters, one at a
    time, cast to the parameters' dtype: `gathered(param)` is DeepSpeed's context that gathers it and, on exit, broadcasts
    the source rank's copy and cuts it into pieces again (`is_source` on that rank). The fp32
    master pieces are then refreshed from the new working pieces (DeepSpeed's own module-only
    load does the same). Every rank of the data-parallel group calls this."""
    for name, param in module.named_parameters():
        with gathered(param):
            if is_source:
                param.data.copy_(weights[name].view_as(param.data))
    optimizer.refresh_fp32_params()


def repair_universal_load(optimizer: Any, groups: List[Dict[str, Any]]) -> None:
    """Undo two slips of DeepSpeed's ZeRO-3 universal-checkpoint loader (0.19): it gives every
    param group the hyper-parameters of the first (the no-decay group would decay; this run's
    `groups`, taken before the load, are put back, the LR excepted), and one step-count tensor
    to every sub-group's state, which a fused or foreach Adam then advances once per sub-group
    per step (each sub-group gets its own copy)."""
    for group, kept in zip(optimizer.param_groups, groups):
        group.update(kept)
    base = optimizer.optimizer
    for flat in optimizer.fp32_partitioned_groups_flat:
        state = base.state.get(flat, {})
        if isinstance(state.get("step"), torch.Tensor):
            state["step"] = state["step"].clone()


def check_own_files(where: str, dp_rank: int, mp_rank: int, device: torch.device) -> None:
    """Check this rank's two ZeRO-3 files under `where` (checksum, pickled classes) and agree
    over the world: every rank raises (this rank's CheckpointError, or one saying another rank
    found the damage), or none. Each rank reads files no other rank reads, so a damaged one
    inside DeepSpeed's load would stop its rank alone while the others wait in collectives."""
    error: Optional[Exception] = None
    try:
        for name in (names.deepspeed_model_file(mp_rank, dp_rank),
                     names.deepspeed_optim_file(dp_rank, mp_rank)):
            path = os.path.join(where, name)
            ckpt_files.verify_checksum(path)
            ckpt_files.check_pickled_globals(path, deepspeed_safe_globals())
    except Exception as exc:  # noqa: BLE001  re-raised below, after the other ranks know
        error = exc
    if collectives.agree([error is not None], world_group(), device)[0] and error is None:
        raise CheckpointError(f"another rank found a damaged or unsafe file in {where}; its "
                              "message says which")
    if isinstance(error, CheckpointError):
        raise error
    if error is not None:
        raise CheckpointError(f"{where}: this rank's ZeRO-3 files cannot be read: "
                              f"{error}") from error

