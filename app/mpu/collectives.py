"""Every torch.distributed collective of the project, the same on gloo (CPU) and NCCL (GPU).

Rules: a group of None (the one-process layout) or of one rank short-circuits without touching
torch.distributed; new tensors are allocated on the input's device with its dtype; nothing here
calls torch.cuda. Ranks passed to broadcast / send / recv are global ranks (torch's convention).
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

ProcessGroup = Optional[object]

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
        "product": dist.ReduceOp.PRODUCT}


def group_size(group: ProcessGroup) -> int:
    """Ranks in `group`; 1 for None (the one-process layout)."""
    if group is None:
        return 1
    return dist.get_world_size(group)


def group_rank(group: ProcessGroup) -> int:
    """This process's rank inside `group`; 0 for None."""
    if group is None:
        return 0
    return dist.get_rank(group)


def _trivial(group: ProcessGroup) -> bool:
    return group is None or dist.get_world_size(group) == 1


def all_reduce(tensor: torch.Tensor, group: ProcessGroup, op: str = "sum") -> torch.Tensor:
    """In-place all-reduce of `tensor` over `group` with op sum | avg | max | min | product.

    Returns `tensor`. "avg" is a sum divided by the group size (gloo has no AVG).
    """
    if op not in _OPS and op != "avg":
        raise ValueError(f"op must be one of sum, avg, max, min, product; got {op!r}")
    if _trivial(group):
        return tensor
    dist.all_reduce(tensor, op=_OPS["sum" if op == "avg" else op], group=group)
    if op == "avg":
        tensor.div_(dist.get_world_size(group))
    return tensor


def agree(values: Sequence[Any], group: ProcessGroup, device: Any, op: str = "max"
          ) -> List[float]:
    """The one way ranks decide together: `values` (bools, numbers or 0-dim tensors) combined
    element-wise over `group` by `op` ("max": set on any rank; "min": set on every rank; "sum"),
    returned as Python floats that are the same on every rank of the group.

    One all-reduce of a float64 vector on `device` (NCCL reduces device tensors only), so
    iteration numbers stay exact; it is also a barrier. No communication for a one-rank group.
    """
    flags = torch.stack([torch.as_tensor(v, device=device).detach().reshape(())
                         .to(torch.float64) for v in values])  # [len(values)]
    all_reduce(flags, group, op=op)
    return flags.tolist()


def all_gather(tensor: torch.Tensor, group: ProcessGroup) -> List[torch.Tensor]:
    """Each rank's `tensor` (same shape everywhere), in group-rank order."""
    if _trivial(group):
        return [tensor]
    tensor = tensor.contiguous()
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor, group=group)
    return parts


def all_gather_dim(tensor: torch.Tensor, group: ProcessGroup, dim: int) -> torch.Tensor:
    """Each rank's `tensor` concatenated along `dim` in group-rank order: n -> n * group_size."""
    if _trivial(group):
        return tensor
    return torch.cat(all_gather(tensor, group), dim=dim)


def all_to_all(parts: Sequence[torch.Tensor], group: ProcessGroup) -> List[torch.Tensor]:
    """parts[j] goes to group rank j; returns what each rank j sent to this one (shaped like
    this rank's parts[j] there), in group-rank order."""
    if _trivial(group):
        return list(parts)
    parts = [p.contiguous() for p in parts]
    received = [torch.empty_like(p) for p in parts]
    dist.all_to_all(received, parts, group=group)
    return received


def all_to_all_single(tensor: torch.Tensor, output_splits: Sequence[int],
                      input_splits: Sequence[int], group: ProcessGroup) -> torch.Tensor:
    """Rows [input_splits[j] of them, in order] of `tensor` go to group rank j; returns the rows
    every rank j sent here, concatenated in group-rank order (output_splits[j] from rank j).
    Uneven splits work on gloo and NCCL alike (torch's all_to_all_single)."""
    if _trivial(group):
        return tensor
    tensor = tensor.contiguous()
    out = tensor.new_empty((int(sum(output_splits)),) + tuple(tensor.shape[1:]))
    dist.all_to_all_single(out, tensor, [int(n) for n in output_splits],
                           [int(n) for n in input_splits], group=group)
    return out


def split_dim(tensor: torch.Tensor, group: ProcessGroup, dim: int) -> torch.Tensor:
    """This rank's contiguous chunk along `dim`: n -> n / group_size (no communication)."""
    if _trivial(group):
        return tensor
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if tensor.shape[dim] % size:
        raise ValueError(f"dimension {dim} ({tensor.shape[dim]}) is not divisible by the "
                         f"group size ({size})")
    return tensor.chunk(size, dim=dim)[rank].contiguous()


def all_gather_last_dim(tensor: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """[*, n] on each rank -> [*, n * group_size], concatenated in group-rank order."""
    return all_gather_dim(tensor, group, -1)


def split_last_dim(tensor: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """[*, n] -> this rank's contiguous chunk [*, n / group_size] (no communication)."""
    return split_dim(tensor, group, -1)


def reduce_scatter(tensor: torch.Tensor, group: ProcessGroup, dim: int = -1) -> torch.Tensor:
    """Sum `tensor` over `group` and return this rank's contiguous chunk along `dim`.

    [*, n] -> [*, n / group_size] for dim = -1. Uses NCCL's reduce-scatter along dim 0 when
    available; otherwise (gloo) an all-reduce followed by a split.
    """
    if _trivial(group):
        return tensor
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if tensor.shape[dim] % size:
        raise ValueError(f"dimension {dim} ({tensor.shape[dim]}) is not divisible by the "
                         f"group size ({size})")
    if dist.get_backend(group) == "nccl":
        moved = tensor.movedim(dim, 0).contiguous()
        out = torch.empty((moved.shape[0] // size,) + tuple(moved.shape[1:]),
                          dtype=tensor.dtype, device=tensor.device)
        dist.reduce_scatter_tensor(out, moved, group=group)
        return out.movedim(0, dim).contiguous()
    summed = tensor.clone()
    dist.all_reduce(summed, group=group)
    return summed.chunk(size, dim=dim)[rank].contiguous()


def reduce_scatter_flat(output: torch.Tensor, flat: torch.Tensor, group: ProcessGroup,
                        async_op: bool = False) -> Optional[Any]:
    """Sum the 1-D `flat` [n] over `group` into `output` [n / group_size], this rank's
    contiguous chunk (which may be that chunk of `flat` itself: in place, as NCCL documents and
    gloo does); with `async_op` returns a request for `wait_all` (None when nothing is in
    flight)."""
    if _trivial(group):
        if output.data_ptr() != flat.data_ptr():
            output.copy_(flat)
        return None
    work = dist.reduce_scatter_tensor(output, flat, group=group, async_op=async_op)
    return work if async_op else None


def all_gather_flat(output: torch.Tensor, shard: torch.Tensor, group: ProcessGroup,
                    async_op: bool = False) -> Optional[Any]:
    """Concatenate every rank's 1-D `shard` [n / group_size] into `output` [n] in group-rank
    order (`shard` may be this rank's chunk of `output`: in place); with `async_op` returns a
    request for `wait_all` (None when nothing is in flight)."""
    if _trivial(group):
        if output.data_ptr() != shard.data_ptr():
            output.copy_(shard)
        return None
    work = dist.all_gather_into_tensor(output, shard.contiguous(), group=group,
                                       async_op=async_op)
    return work if async_op else None


def broadcast(tensor: torch.Tensor, src: int, group: ProcessGroup) -> torch.Tensor:
    """In-place broadcast of `tensor` from global rank `src` to `group`; returns `tensor`."""
    if _trivial(group):
        return tensor
    dist.broadcast(tensor, src=src, group=group)
    return tensor


def broadcast_object(obj: object, src: int, group: ProcessGroup) -> object:
    """Any picklable object from global rank `src` to every rank of `group`."""
    if _trivial(group):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def gather_object(obj: object, dst: int, group: ProcessGroup) -> Optional[List[object]]:
    """Every rank's picklable `obj`, in group-rank order, on global rank `dst`; None elsewhere."""
    if _trivial(group):
        return [obj]
    out: Optional[List[object]] = ([None] * dist.get_world_size(group)
                                   if dist.get_rank() == dst else None)
    dist.gather_object(obj, out, dst=dst, group=group)
    return out


def host_groups(groups: Sequence[Sequence[int]]) -> List[ProcessGroup]:
    """One gloo group (host tensors, whatever the world's backend) per list of global ranks,
    in order; every rank must call it with the same lists (a collective), and one thread
    only may use a group returned (a background thread of its own may)."""
    return [dist.new_group(list(ranks), backend="gloo") for ranks in groups]


def barrier(group: ProcessGroup) -> None:
    """Wait until every rank of `group` arrives."""
    if _trivial(group):
        return
    dist.barrier(group=group)


def send(tensor: torch.Tensor, dst: int) -> None:
    """Blocking send of `tensor` to global rank `dst`."""
    dist.send(tensor.contiguous(), dst=dst)


def recv(tensor: torch.Tensor, src: int) -> torch.Tensor:
    """Blocking receive into `tensor` from global rank `src`; returns `tensor`."""
    dist.recv(tensor, src=src)
    return tensor


def send_recv(sends: Sequence[Tuple[torch.Tensor, int]],
              recvs: Sequence[Tuple[torch.Tensor, int]], group: ProcessGroup = None) -> None:
    """Post every send (tensor, dst) and receive (buffer, src) at once, then wait for all.

    Posting both directions before waiting is what keeps two neighbouring pipeline stages
    that send to each other at the same time from deadlocking. `group` None is the world.
    """
    wait_all(post_send_recv(sends, recvs, group))


def post_send_recv(sends: Sequence[Tuple[torch.Tensor, int]],
                   recvs: Sequence[Tuple[torch.Tensor, int]],
                   group: ProcessGroup = None) -> List[Any]:
    """Post sends and receives over `group` (global peer ranks) without waiting; returns the
    requests for `wait_all`. Messages between two ranks in one direction match in posting
    order within a group, never across groups."""
    ops = [dist.P2POp(dist.isend, t.contiguous(), peer, group) for t, peer in sends]
    ops += [dist.P2POp(dist.irecv, t, peer, group) for t, peer in recvs]
    if not ops:
        return []
    return list(dist.batch_isend_irecv(ops))


def wait_all(requests: Sequence[Any]) -> None:
    """Wait for every request returned by post_send_recv (or another async call); None entries
    (nothing was in flight) are skipped."""
    for work in requests:
        if work is not None:
            work.wait()
