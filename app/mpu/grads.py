"""Gradient reductions: global-norm clipping over model-parallel ranks, data-parallel averaging.

Counting rule for the norm: a parameter's gradient counts on a rank when the parameter is
tensor-parallel (each rank holds a different shard) or when the rank is tensor-parallel rank 0
(replicated LayerNorm weights and row-parallel biases are counted once), and never for a
parameter marked `param.shared = True` (the last pipeline stage's tied copy of the word
embeddings, counted on the first stage). A tensor-parallel parameter whose rows [first:] are
replicated on `r` ranks (`param.replicated_rows = (first, r)`: key/value heads shared under
grouped-query attention) counts those rows' squares divided by r. The squared sums are then
added over the model-parallel (TP x PP) group. Data-parallel replicas hold identical (averaged)
gradients.
"""
from __future__ import annotations

import math
from typing import Iterable, List, Optional

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from app.mpu import collectives
from app.mpu.parallel_state import ParallelState, get_parallel_state


def counts_toward_norm(param: torch.Tensor, tensor_model_parallel_rank: int) -> bool:
    """True when this rank owns `param`'s gradient for the global norm (see module docstring)."""
    if getattr(param, "shared", False):
        return False
    return bool(getattr(param, "tensor_model_parallel", False)) or tensor_model_parallel_rank == 0


def grad_norm(parameters: Iterable[torch.Tensor], parallel_state: Optional[ParallelState] = None,
              norm_type: float = 2.0) -> float:
    """Global gradient norm over the model-parallel group, each parameter counted once."""
    state = get_parallel_state() if parallel_state is None else parallel_state
    owned = [p for p in parameters
             if p.grad is not None and counts_toward_norm(p, state.tensor_model_parallel_rank)]
    grads = [p.grad for p in owned]
    device = grads[0].device if grads else torch.device("cpu")
    if math.isinf(norm_type):
        local = torch.stack([g.detach().abs().max().float() for g in grads]).max() \
            if grads else torch.zeros((), device=device)
        local = local.reshape(1).to(torch.float32)
        collectives.all_reduce(local, state.model_parallel_group, op="max")
        return float(local.item())
    total = torch.zeros(1, dtype=torch.float32, device=device)
    for p in owned:
        total += norm_power(p, p.grad, norm_type)
    collectives.all_reduce(total, state.model_parallel_group)
    return float(total.item()) ** (1.0 / norm_type)


def norm_power(param: torch.Tensor, grad: torch.Tensor, norm_type: float = 2.0,
               flat_start: Optional[int] = None) -> torch.Tensor:
    """sum |grad|^p of one parameter for the global norm; rows replicated on r ranks
    (`param.replicated_rows = (first_row, r)`) count 1/r.

    `grad` is the whole gradient, shaped like `param`, or with `flat_start` the flat slice of it
    that begins at that element (a distributed-optimizer shard).
    """
    g = grad.detach().float()
    rows = getattr(param, "replicated_rows", None)
    if rows is None:
        return g.norm(norm_type) ** norm_type
    first, replicas = rows
    cut = first
    if flat_start is not None:
        cut = min(max(first * (param.numel() // param.shape[0]) - flat_start, 0), g.numel())
    return g[:cut].norm(norm_type) ** norm_type + g[cut:].norm(norm_type) ** norm_type / replicas


def clip_grad_norm(parameters: Iterable[torch.Tensor], max_norm: float,
                   parallel_state: Optional[ParallelState] = None,
                   norm_type: float = 2.0) -> float:
    """Scale every gradient by min(1, max_norm / norm); return the pre-clip global norm.

    The norm is the one of the full (unsharded, single-replica) model; `max_norm <= 0` only
    measures. Every rank of the model-parallel group must call this (it all-reduces).
    """
    params: List[torch.Tensor] = [p for p in parameters if p.grad is not None]
    total = grad_norm(params, parallel_state, norm_type)
    if max_norm > 0:
        coeff = max_norm / (total + 1e-6)
        if coeff < 1.0:
            for p in params:
                p.grad.detach().mul_(coeff)
    return total


def allreduce_gradients(parameters: Iterable[torch.Tensor], data_parallel_group: object,
                        bucket_size_mb: float = 25.0) -> None:
    """Average `.grad` over the data-parallel group (see allreduce_grad_tensors)."""
    allreduce_grad_tensors([p.grad for p in parameters if p.grad is not None],
                           data_parallel_group, bucket_size_mb)


def allreduce_grad_tensors(grads: Iterable[torch.Tensor], data_parallel_group: object,
                           bucket_size_mb: float = 25.0) -> None:
    """Average gradient tensors in place over the data-parallel group, in flat buckets of at
    most bucket_size_mb.

    Tensors are bucketed by (dtype, device) in the given order; a tensor larger than a bucket
    goes alone. No-op for a None / one-rank group.
    """
    size = collectives.group_size(data_parallel_group)
    if size == 1:
        return
    limit = bucket_size_mb * 1024 * 1024
    buckets: dict = {}
    for grad in grads:
        key = (grad.dtype, grad.device)
        bucket = buckets.setdefault(key, [[], 0])
        grad_bytes = grad.numel() * grad.element_size()
        if bucket[0] and bucket[1] + grad_bytes > limit:
            _reduce_bucket(bucket[0], data_parallel_group, size)
            bucket[0], bucket[1] = [], 0
        bucket[0].append(grad)
        bucket[1] += grad_bytes
    for bucket_grads, _ in buckets.values():
        if bucket_grads:
            _reduce_bucket(bucket_grads, data_parallel_group, size)


def _reduce_bucket(grads: List[torch.Tensor], group: object, size: int) -> None:
    flat = _flatten_dense_tensors(grads)
    collectives.all_reduce(flat, group)
    flat.div_(size)
    for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
        g.copy_(synced)


def allreduce_embedding_grads(word_embeddings: Optional[torch.Tensor],
                              parallel_state: Optional[ParallelState] = None) -> None:
    """Sum the tied word-embedding gradient of the first and last pipeline stage (PP > 1).

    Call on every rank after backward with that stage's `word_embeddings.weight` (None on
    middle stages, which are not in an embedding group).
    """
    grad = None if word_embeddings is None else word_embeddings.grad
    allreduce_embedding_grad(grad, parallel_state)


def allreduce_embedding_grad(grad: Optional[torch.Tensor],
                             parallel_state: Optional[ParallelState] = None) -> None:
    """Sum a gradient tensor of the tied word embeddings over the embedding group (first and
    last pipeline stage); no-op with one stage or without a tensor (middle stages)."""
    state = get_parallel_state() if parallel_state is None else parallel_state
    if state.pipeline_model_parallel_size == 1 or grad is None:
        return
    if state.embedding_group is not None:
        collectives.all_reduce(grad, state.embedding_group)
