"""Where a rank's tensors lie in the global tensors of a `torch_dist` checkpoint (pure arithmetic).

A rank holds a *local* tensor of each parameter: its tensor-parallel shard (the whole tensor
when replicated), of one layer. Megatron Core's ShardedTensor says the same thing as a global
key, a global shape and the offset of the local tensor in it; a layer's tensor is a slice of a
global tensor stacked over the layers (`stacked`: a leading layer dimension). `place` turns a
parameter's marks (app.mpu's `partition_dim` and, for grouped-query attention with fewer
key/value groups than TP ranks, `replicated_rows`; for SwiGLU's first projection, `glu_halves`;
for a Mixture-of-Experts layer's experts, their expert axis: dim 0 holds this expert-parallel
rank's experts, and the TP split is over the expert tensor-parallel ranks) into `Region`s:
boxes of the local tensor with their global offset and how many TP ranks hold the same values.

Saving writes boxes, loading reads boxes, so a new layout is only a new set of boxes. The
distributed optimizer holds a flat range [lo, hi) of a local tensor; `flat_boxes` cuts it into
boxes that are contiguous in the flat order (a partial first row, whole rows, a partial last
row, recursively), so every rank writes and reads exactly its own elements.

`assign_writers` decides which of the ranks holding the same values writes them: replicas are
spread over the data-parallel (and, for replicated parameters, tensor-parallel) ranks by a greedy
balance of bytes that every holder computes alike, so no rank idles while another writes; an
expert's replicas are the expert data-parallel ranks (Megatron Core's replica id of an expert
tensor is its expert-DP rank).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from math import prod
from typing import Dict, List, Optional, Sequence, Tuple

Shape = Tuple[int, ...]


@dataclass(frozen=True)
class Region:
    """A box of a local tensor and where it lies in the global tensor."""

    local_start: Shape
    """First index of the box in the local tensor (the local tensor's dimensions)."""
    size: Shape
    global_offset: Shape
    """First index of the box in the global tensor (layer dimension first when stacked)."""
    copies: int = 1
    """Tensor-parallel ranks holding these same values (1: only this rank)."""
    copy_index: int = 0
    """This rank's index among those `copies`."""

    @property
    def numel(self) -> int:
        return prod(self.size)


@dataclass(frozen=True)
class Placement:
    """A local tensor of one parameter in the global tensor `key` of shape `global_shape`."""

    key: str
    global_shape: Shape
    stacked: bool
    regions: Tuple[Region, ...]


def place(key: str, local_shape: Sequence[int], *, partition_dim: int, tp_rank: int,
          tp_size: int, layer: Optional[int] = None, num_layers: Optional[int] = None,
          replicated_rows: Optional[Tuple[int, int]] = None,
          glu_halves: bool = False,
          expert_axis: Optional[Tuple[int, int]] = None) -> Placement:
    """The placement of a rank's local tensor of shape `local_shape`.

    `partition_dim` -1: replicated over the TP group (one region, `tp_size` copies); 0 or 1: the
    TP shard `tp_rank` of `tp_size` contiguous chunks along that dimension. `replicated_rows`
    (first_row, r) (grouped-query attention with fewer groups than TP ranks, app.mpu.mappings):
    rows [0, first_row) are this rank's query heads, rows [first_row:] its group's key and value
    heads, shared by r ranks; rank t is share t % r of group t // r, and each group's rows are
    [its r x first_row query rows, its key/value rows] in the global tensor. `glu_halves`
    (--swiglu's fc1): along `partition_dim` the local tensor is [gate_r; up_r], this rank's
    shard of each half, and the global tensor is [gate; up] (Megatron Core's
    `apply_swiglu_sharded_factory`: the gate half at offset tp_rank x n/2, the up half at
    offset (tp_size + tp_rank) x n/2, n the local size; the whole model's tensor at TP 1).
    `expert_axis` (ep_rank, ep_size) (an MoE layer's experts [E/EP, ...], tp_rank and tp_size
    then the expert tensor-parallel ones): dim 0 is this expert-parallel rank's slice of the
    experts, at offset ep_rank x E/EP of E = E/EP x ep_size. `layer` (with `num_layers`)
    stacks the tensor as slice `layer` of a leading layer dimension.
    """
    local = tuple(int(s) for s in local_shape)
    whole = (0,) * len(local)
    if partition_dim < 0:
        global_shape, regions = local, [Region(whole, local, whole, tp_size, tp_rank)]
    elif glu_halves:
        global_shape, regions = _glu_halves(local, partition_dim, tp_rank, tp_size)
    elif replicated_rows is None:
        d = partition_dim
        global_shape = local[:d] + (local[d] * tp_size,) + local[d + 1:]
        offset = tuple(tp_rank * local[d] if i == d else 0 for i in range(len(local)))
        regions = [Region(whole, local, offset)]
    else:
        global_shape, regions = _replicated_rows(local, tp_rank, tp_size, replicated_rows)
    if expert_axis is not None:
        ep_rank, ep_size = expert_axis
        global_shape = (global_shape[0] * ep_size,) + global_shape[1:]
        regions = [replace(r, global_offset=(r.global_offset[0] + ep_rank * local[0],)
                           + r.global_offset[1:]) for r in regions]
    if layer is not None:
        if num_layers is None or not 0 <= layer < num_layers:
            raise ValueError(f"{key}: layer {layer} is outside [0, {num_layers})")
        global_shape = (num_layers,) + global_shape
        regions = [replace(r, global_offset=(layer,) + r.global_offset) for r in regions]
    return Placement(key, global_shape, layer is not None, tuple(regions))


def _glu_halves(local: Shape, partition_dim: int, tp_rank: int, tp_size: int
                ) -> Tuple[Shape, List[Region]]:
    d = partition_dim
    if local[d] % 2:
        raise ValueError(f"glu_halves: a local tensor of shape {local} split along dimension "
                         f"{d} does not hold [gate; up] rows")
    half = local[d] // 2

    def at(index: int) -> Shape:  # a start along d, zeros elsewhere
        return tuple(index if i == d else 0 for i in range(len(local)))
    size = local[:d] + (half,) + local[d + 1:]
    gate = Region(at(0), size, at(tp_rank * half))
    up = Region(at(half), size, at((tp_size + tp_rank) * half))
    return local[:d] + (local[d] * tp_size,) + local[d + 1:], [gate, up]


def _replicated_rows(local: Shape, tp_rank: int, tp_size: int, replicated_rows: Tuple[int, int]
                     ) -> Tuple[Shape, List[Region]]:
    first_row, ranks = replicated_rows
    q_rows, kv_rows = first_row, local[0] - first_row
    if tp_size % ranks or q_rows <= 0 or kv_rows <= 0:
        raise ValueError(f"replicated_rows {replicated_rows} do not fit a local tensor of shape "
                         f"{local} at tensor-parallel size {tp_size}")
    group, share = divmod(tp_rank, ranks)
    stride = ranks * q_rows + kv_rows  # rows of one group in the global tensor
    rest = local[1:]
    zeros = (0,) * len(rest)
    query = Region((0,) + zeros, (q_rows,) + rest, (group * stride + share * q_rows,) + zeros)
    key_value = Region((q_rows,) + zeros, (kv_rows,) + rest,
                       (group * stride + ranks * q_rows,) + zeros, ranks, share)
    return ((tp_size // ranks) * stride,) + rest, [query, key_value]


def flat_boxes(shape: Sequence[int], lo: int, hi: int) -> List[Tuple[Shape, Shape]]:
    """[(start, size)] boxes covering the flat (row-major) range [lo, hi) of a tensor of
    `shape`, in order; each box is contiguous in the flat order."""
    shape = tuple(int(s) for s in shape)
    total = prod(shape)
    if not 0 <= lo <= hi <= total:
        raise ValueError(f"flat range [{lo}, {hi}) is outside a tensor of {total} elements")
    if lo == hi:
        return []
    if len(shape) <= 1:
        return [((lo,), (hi - lo,))] if shape else [((), ())]
    inner = prod(shape[1:])
    first, first_col = divmod(lo, inner)
    last, last_col = divmod(hi, inner)
    if first == last:  # within one row
        return [((first,) + s, (1,) + z) for s, z in flat_boxes(shape[1:], first_col, last_col)]
    boxes: List[Tuple[Shape, Shape]] = []
    if first_col:
        boxes += [((first,) + s, (1,) + z) for s, z in flat_boxes(shape[1:], first_col, inner)]
        first += 1
    if last > first:
        boxes.append(((first,) + (0,) * (len(shape) - 1), (last - first,) + shape[1:]))
    if last_col:
        boxes += [((last,) + s, (1,) + z) for s, z in flat_boxes(shape[1:], 0, last_col)]
    return boxes


def clip(region: Region, start: Sequence[int], size: Sequence[int]) -> Optional[Region]:
    """The part of `region` inside the local box (`start`, `size`), with its global offset;
    None when they do not overlap."""
    lows = [max(a, b) for a, b in zip(region.local_start, start)]
    highs = [min(a + n, b + m) for a, n, b, m in zip(region.local_start, region.size, start, size)]
    if any(h <= low for low, h in zip(lows, highs)) and region.size:
        return None
    lead = len(region.global_offset) - len(region.local_start)  # the stacked layer dimension
    moved = tuple(g + low - s for g, low, s in
                  zip(region.global_offset[lead:], lows, region.local_start))
    return replace(region, local_start=tuple(lows), size=tuple(h - low for low, h in zip(lows, highs)),
                   global_offset=region.global_offset[:lead] + moved)


def piece_regions(placement: Placement, local_shape: Sequence[int],
                  piece: Optional[Tuple[int, int]]) -> List[Tuple[Region, int]]:
    """The regions covering a local tensor (`piece` None) or its flat range `piece` = (lo, hi),
    each with the flat offset of its first element within that range; every region is
    contiguous in the flat order, so it is `flat[offset:offset + numel].view(size)`."""
    shape = tuple(int(s) for s in local_shape)
    lo, hi = piece if piece is not None else (0, prod(shape))
    out: List[Tuple[Region, int]] = []
    strides = [prod(shape[i + 1:]) for i in range(len(shape))]
    for start, size in flat_boxes(shape, lo, hi):
        for region in placement.regions:
            part = clip(region, start, size)
            if part is not None:
                flat = sum(i * s for i, s in zip(part.local_start, strides))
                out.append((part, flat - lo))
    return out


@dataclass(frozen=True)
class Candidate:
    """Values some ranks hold alike and one of them writes."""

    key: str
    global_offset: Shape
    nbytes: int
    copies: int
    """Tensor-parallel ranks holding the values (Region.copies)."""
    copy_index: int
    dp_replicated: bool
    """Every data-parallel rank holds them too (model weights, plain optimizer states), rather
    than only this one (the distributed optimizer's shards)."""
    expert: bool = False
    """Values of an MoE layer's experts: their data-parallel replicas are the expert
    data-parallel ranks."""


def assign_writers(candidates: Sequence[Candidate], dp_size: int, dp_rank: int,
                   expert_dp_size: int = 1, expert_dp_rank: int = 0) -> List[bool]:
    """Whether this rank writes each candidate.

    The holders of a candidate are its `copies` TP ranks, times the DP ranks when
    `dp_replicated` (the expert DP ranks for an `expert` candidate): `slots` writers, this rank
    being slot copy_index x (DP or 1) + (dp_rank or 0). Candidates of one kind (copies,
    dp_replicated, expert) are handed out largest first (ties by key and offset) to the least
    loaded slot: every holder sees the same candidates of that kind, so all compute the same
    assignment and each candidate gets exactly one writer.
    """
    mine = [False] * len(candidates)
    kinds: Dict[Tuple[int, bool, bool], List[int]] = {}
    for i, c in enumerate(candidates):
        kinds.setdefault((c.copies, c.dp_replicated, c.expert), []).append(i)
    for (copies, dp_replicated, expert), indices in kinds.items():
        size, rank = (expert_dp_size, expert_dp_rank) if expert else (dp_size, dp_rank)
        per_copy = size if dp_replicated else 1
        slots = copies * per_copy
        loads = [0] * slots
        ordered = sorted(indices, key=lambda i: (-candidates[i].nbytes, candidates[i].key,
                                                 candidates[i].global_offset))
        for i in ordered:
            c = candidates[i]
            slot = min(range(slots), key=lambda s: (loads[s], s))
            loads[slot] += max(c.nbytes, 1)
            me = c.copy_index * per_copy + (rank if dp_replicated else 0)
            mine[i] = slot == me
    return mine
