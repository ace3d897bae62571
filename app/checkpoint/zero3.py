"""ZeRO-3's partitioned checkpoint files merged back into whole tensors (torch only, no DeepSpeed).

At stage 3 DeepSpeed splits every parameter on its own: its flattened values, padded with
zeros to a multiple of the data-parallel size N, are cut into N equal pieces of
ceil(numel / N) elements, piece r kept by data-parallel rank r. Rank r's optimizer file
(`zero_pp_rank_{r}_mp_rank_XX_optim_states.pt`) holds, under `optimizer_state_dict`:

    fp32_flat_groups               one fp32 vector per sub-group: rank r's pieces of the
                                   sub-group's parameters, one after the other
    optimizer_state_dict.state[i]  the torch optimizer's state of sub-group i, laid out like
                                   fp32_flat_groups[i] (Adam: exp_avg, exp_avg_sq, step)
    optimizer_state_dict.param_groups[i]   its hyper-parameters
    partition_count                N;  zero_stage: 3

Sub-groups cut the param groups into runs of at most `sub_group_size` elements, in order, so
rank r's vectors concatenated over sub-groups hold its pieces of every parameter in the order
of the module file's `param_shapes` (a list of name -> shape maps, one per param group).
Parameter p starts at offset o_p = sum over the parameters before it of ceil(numel / N) in
every rank's vector, and its whole value is the concatenation over ranks of
vector_r[o_p : o_p + ceil(numel_p / N)], cut to numel_p. The module files of ZeRO-3 hold
empty tensors: the weights live only in these fp32 pieces.
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List

import torch

from app.checkpoint import CheckpointError

STATE_KINDS = ("exp_avg", "exp_avg_sq")
"""The per-element optimizer states merged (Adam's moments)."""


@dataclass
class Zero3Merged:
    """One model-parallel rank's whole tensors, from its N data-parallel partitions."""

    weights: Dict[str, torch.Tensor]
    """fp32 master weights by parameter name, full shape."""
    moments: Dict[str, Dict[str, torch.Tensor]] = field(default_factory=dict)
    """STATE_KINDS -> name -> full-shape fp32 state (when asked for)."""
    steps: Dict[str, torch.Tensor] = field(default_factory=dict)
    """name -> the optimizer's step count of the parameter's sub-group."""
    hparams: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    """name -> hyper-parameters of its param group (lr, betas, weight_decay, ...)."""


def partition_numel(numel: int, data_parallel_size: int) -> int:
    """Elements of one data-parallel rank's piece of a parameter of `numel` elements."""
    return math.ceil(numel / data_parallel_size)


def merge_zero3(param_shapes: List[Dict[str, Any]], optim_states: List[Dict[str, Any]],
                where: str, include_optimizer: bool = False) -> Zero3Merged:
    """Whole tensors of one model-parallel rank from `optim_states` (each file's
    `optimizer_state_dict`, in data-parallel rank order) and the module file's `param_shapes`;
    CheckpointError naming `where` when the files do not fit together."""
    count = len(optim_states)
    for r, part in enumerate(optim_states):
        if int(part.get("zero_stage", 0)) != 3 or int(part.get("partition_count", -1)) != count:
            raise CheckpointError(
                f"{where}: data-parallel rank {r}'s optimizer file is not one of {count} ZeRO-3 "
                f"partitions (zero_stage {part.get('zero_stage')}, partition_count "
                f"{part.get('partition_count')}); the checkpoint is incomplete or mixed")
    shapes = {name: tuple(shape) for group in param_shapes for name, shape in group.items()}
    flats = [_rank_vector(part["fp32_flat_groups"]) for part in optim_states]
    sub_sizes = [t.numel() for t in optim_states[0]["fp32_flat_groups"]]
    needed = sum(partition_numel(math.prod(s), count) for s in shapes.values())
    if any(f.numel() != needed for f in flats):
        raise CheckpointError(f"{where}: the ZeRO-3 partitions hold {[f.numel() for f in flats]} "
                              f"values per rank but the parameter shapes need {needed}; the "
                              "checkpoint is inconsistent")
    merged = Zero3Merged(weights=_cut(flats, shapes, count))
    if include_optimizer:
        base = [part["optimizer_state_dict"] for part in optim_states]
        for kind in STATE_KINDS:
            vectors = [_rank_vector([b["state"][i][kind] for i in range(len(sub_sizes))])
                       for b in base]
            merged.moments[kind] = _cut(vectors, shapes, count)
        starts = [0]
        for size in sub_sizes:
            starts.append(starts[-1] + size)
        offset = 0
        for name, shape in shapes.items():  # each parameter's sub-group: where its piece starts
            sub = bisect.bisect_right(starts, offset) - 1
            step = base[0]["state"][sub]["step"]
            merged.steps[name] = (step.clone() if isinstance(step, torch.Tensor)
                                  else torch.tensor(float(step)))
            merged.hparams[name] = {k: v for k, v in base[0]["param_groups"][sub].items()
                                    if k != "params"}
            offset += partition_numel(math.prod(shape), count)
    return merged


def _rank_vector(pieces: List[torch.Tensor]) -> torch.Tensor:
    """One rank's sub-group vectors as one fp32 vector."""
    return torch.cat([p.reshape(-1).float() for p in pieces])


def _cut(vectors: List[torch.Tensor], shapes: Dict[str, tuple],
         count: int) -> Dict[str, torch.Tensor]:
    """Every parameter's whole value from the ranks' vectors (module docstring)."""
    out, offset = {}, 0
    for name, shape in shapes.items():
        numel = math.prod(shape)
        piece = partition_numel(numel, count)
        whole = torch.cat([v.narrow(0, offset, piece) for v in vectors])  # [count x piece]
        out[name] = whole[:numel].view(shape).clone()
        offset += piece
    return out
