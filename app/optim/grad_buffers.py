"""The distributed optimizer's flat buffers: one `ShardedBuffers` per group of replicas.

The parameters of one replica group become views of one contiguous weight buffer, and their
gradients accumulate into a contiguous gradient buffer of the same layout (fp32, or the half
dtype without --accumulate-allreduce-grads-in-fp32). Both are cut into buckets of whole
parameters, in reverse order (roughly the order backward produces them), each padded to a
multiple of the group size G and split into G equal shards:

    bucket b = [shard of rank 0 | shard of rank 1 | ... ]       (flat, elements)
    this rank owns its shard of every bucket: fp32 main weights (for fp32 models, a view of the
    weight buffer itself), the fp32 gradient shard, and the optimizer's states for those
    elements (the `Piece` of each parameter its shard overlaps)

A bucket's gradients are reduce-scattered over the group (summed), then divided by `divisor`;
the updated shards are cast into the weight buffer and all-gathered over the group.

app.optim.distributed_optimizer keeps one for the dense parameters (the data x context group,
divisor its size: an average) and, with Mixture of Experts, one for the expert parameters (the
expert-data-parallel group, divisor the data x context size: the experts already hold every
token of their expert group, Megatron Core's rule).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch
from torch import nn

from app.mpu import collectives

PARALLEL_ATTRS = ("tensor_model_parallel", "partition_dim", "shared", "sequence_parallel",
                  "replicated_rows", "allreduce", "expert_tensor_parallel", "group_name",
                  "expert_axis")
"""The marks a main weight copies from its model parameter (app.mpu.layers' contract)."""


@dataclass
class Bucket:
    """A contiguous range [start, end) of the flat buffers and this rank's shard of it."""

    start: int
    end: int
    params: List[nn.Parameter]
    shard_start: int = 0
    shard_end: int = 0
    deferred: bool = False
    """Holds the tied word embeddings: reduced in step(), after the engine's embedding sum."""
    main: Optional[torch.Tensor] = None
    """fp32 main weights of the shard [shard] (a view of the weight buffer for fp32 models)."""
    main_grad: Optional[torch.Tensor] = None
    """fp32 reduced gradient of the shard [shard] (a view of the gradient buffer for fp32)."""
    reduced: Optional[torch.Tensor] = None
    """This rank's shard of the gradient buffer, where the reduce-scatter lands (main_grad
    itself when the gradient dtype is fp32)."""
    grad_request: Any = None
    grad_launched: bool = False
    param_request: Any = None
    ready: int = 0


@dataclass
class Piece:
    """The part [lo, hi) (flat, within the parameter) of a parameter that this rank's shard
    holds, with its fp32 main weight (a view of the bucket's shard)."""

    param: nn.Parameter
    name: str
    main: nn.Parameter
    lo: int
    hi: int


@dataclass
class ShardedBuffers:
    """The flat buffers of `params`, sharded over `group` (see the module docstring)."""

    params: List[nn.Parameter]
    group: Any
    size: int
    rank: int
    divisor: int
    """The reduced gradients are divided by it (the group size for an average)."""
    buckets: List[Bucket] = field(default_factory=list)
    offset: Dict[int, int] = field(default_factory=dict)
    bucket_of: Dict[int, Bucket] = field(default_factory=dict)
    param_buffer: Optional[torch.Tensor] = None
    grad_buffer: Optional[torch.Tensor] = None

    def build(self, param_dtype: torch.dtype, grad_dtype: torch.dtype, bucket_size: int,
              tied: Optional[nn.Parameter]) -> None:
        """Place every parameter (reverse order) in buckets; make the weights views of the
        weight buffer and give each a `main_grad` view of the gradient buffer."""
        current: List[nn.Parameter] = []
        start = offset = 0

        def close(end: int) -> int:
            padded = start + math.ceil((end - start) / self.size) * self.size
            self.buckets.append(Bucket(start=start, end=padded, params=list(current)))
            return padded

        for p in reversed(self.params):
            self.offset[id(p)] = offset
            current.append(p)
            offset += p.numel()
            if offset - start >= bucket_size:
                offset = start = close(offset)
                current = []
        if current:
            offset = close(offset)
        device = self.params[0].device
        self.param_buffer = torch.zeros(offset, dtype=param_dtype, device=device)
        self.grad_buffer = torch.zeros(offset, dtype=grad_dtype, device=device)
        for bucket in self.buckets:
            for p in bucket.params:
                self.bucket_of[id(p)] = bucket
                begin = self.offset[id(p)]
                view = self.param_buffer[begin:begin + p.numel()]
                view.copy_(p.detach().reshape(-1))
                p.data = view.view_as(p)
                p.main_grad = self.grad_buffer[begin:begin + p.numel()].view_as(p)
            bucket.deferred = tied is not None and any(p is tied for p in bucket.params)

    def shards(self, name_of: Dict[int, str]) -> List[Piece]:
        """This rank's shard of every bucket: fp32 main weights, gradients, the pieces."""
        pieces = []
        for bucket in self.buckets:
            size = (bucket.end - bucket.start) // self.size
            bucket.shard_start = bucket.start + self.rank * size
            bucket.shard_end = bucket.shard_start + size
            weights = self.param_buffer[bucket.shard_start:bucket.shard_end]
            bucket.main = weights if weights.dtype == torch.float32 else weights.float()
            # the reduce-scatter writes in place into this rank's shard of the gradient buffer
            bucket.reduced = self.grad_buffer[bucket.shard_start:bucket.shard_end]
            bucket.main_grad = (bucket.reduced if bucket.reduced.dtype == torch.float32 else
                                torch.zeros(size, dtype=torch.float32, device=weights.device))
            for p in bucket.params:
                begin = self.offset[id(p)]
                lo = max(begin, bucket.shard_start)
                hi = min(begin + p.numel(), bucket.shard_end)
                if lo >= hi:
                    continue
                a, b = lo - bucket.shard_start, hi - bucket.shard_start
                main = nn.Parameter(bucket.main[a:b])  # shares the shard's storage
                main.grad = bucket.main_grad[a:b]
                for attr in PARALLEL_ATTRS:
                    if hasattr(p, attr):
                        setattr(main, attr, getattr(p, attr))
                pieces.append(Piece(p, name_of[id(p)], main, lo - begin, hi - begin))
        return pieces

    def zero(self) -> None:
        self.grad_buffer.zero_()
        for bucket in self.buckets:
            bucket.ready, bucket.grad_launched, bucket.grad_request = 0, False, None

    def launch_reduce(self, bucket: Bucket, async_op: bool) -> None:
        bucket.grad_launched = True
        bucket.grad_request = collectives.reduce_scatter_flat(
            bucket.reduced, self.grad_buffer[bucket.start:bucket.end], self.group,
            async_op=async_op)

    def reduced_grads(self) -> List[torch.Tensor]:
        """Finish every bucket's reduce-scatter; the fp32 gradient shards / divisor."""
        for bucket in self.buckets:
            if not bucket.grad_launched:
                self.launch_reduce(bucket, async_op=False)
        collectives.wait_all([b.grad_request for b in self.buckets])
        grads = []
        for bucket in self.buckets:
            if bucket.reduced is not bucket.main_grad:
                bucket.main_grad.copy_(bucket.reduced)
            if self.divisor > 1:
                bucket.main_grad.div_(self.divisor)
            grads.append(bucket.main_grad)
        return grads

    def gather_weights(self, async_op: bool) -> None:
        """Cast the updated main shards into the weight buffer and all-gather it over the group
        (left in flight with `async_op`)."""
        for bucket in self.buckets:
            shard = self.param_buffer[bucket.shard_start:bucket.shard_end]
            if bucket.main.data_ptr() != shard.data_ptr():
                shard.copy_(bucket.main)
            bucket.param_request = collectives.all_gather_flat(  # in place: the shard is a view
                self.param_buffer[bucket.start:bucket.end], shard, self.group,
                async_op=async_op)

    def full(self, pieces: List[Piece], per_piece: Dict[int, torch.Tensor],
             params: List[nn.Parameter]) -> Dict[int, torch.Tensor]:
        """{id(param): full fp32 tensor} for `params` (of this group) from this rank's
        `pieces`' values `per_piece` (by id of their main weight; zeros where none is given),
        all-gathered over the group."""
        flat = torch.zeros(self.param_buffer.numel(), dtype=torch.float32,
                           device=self.param_buffer.device)
        shards = {id(b): torch.zeros(b.shard_end - b.shard_start, dtype=torch.float32,
                                     device=flat.device) for b in self.buckets}
        for piece in pieces:
            if id(piece.main) in per_piece and id(piece.param) in self.bucket_of:
                bucket = self.bucket_of[id(piece.param)]
                start = self.offset[id(piece.param)] + piece.lo - bucket.shard_start
                shards[id(bucket)][start:start + piece.hi - piece.lo] = per_piece[id(piece.main)]
        for bucket in self.buckets:
            collectives.all_gather_flat(flat[bucket.start:bucket.end], shards[id(bucket)],
                                        self.group)
        return {id(p): flat[self.offset[id(p)]:self.offset[id(p)] + p.numel()].view_as(p).clone()
                for p in params if id(p) in self.bucket_of}
