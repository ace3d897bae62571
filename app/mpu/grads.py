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

Expert parameters (Mixture of Experts, marked `allreduce = False`) live on the expert grid:
they are deduplicated by the expert-tensor-parallel rank and their squares added over the
expert tensor x expert x pipeline group (`expert_model_group`), then joined with the dense sum
(Megatron's ChainedOptimizer norm). Every rank of a layout with experts makes both all-reduces,
a pipeline stage without MoE layers included, so none waits for another. Their gradients are
summed over the expert-data-parallel group and divided by the data x context size
(`allreduce_expert_grad_tensors`): an expert already received the gradients of every token of
its expert group through the dispatcher.
"""
from __future__ import annotations

import math
from typing import Iterable, List, Optional

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from app.mpu import collectives
from app.mpu.parallel_state import ParallelState, get_parallel_state


def is_expert(param: torch.Tensor) -> bool:
    """A Mixture-of-Experts expert parameter (marked `allreduce = False`)."""
    return getattr(param, "allreduce", True) is False


def counts_toward_norm(param: torch.Tensor, tensor_model_parallel_rank: int,
                       expert_tensor_parallel_rank: int = 0) -> bool:
    """True when this rank owns `param`'s gradient for the global norm (see module docstring);
    an expert parameter is deduplicated by the expert-tensor-parallel rank."""
    if getattr(param, "shared", False):
        return False
    rank = expert_tensor_parallel_rank if is_expert(param) else tensor_model_parallel_rank
    return bool(getattr(param, "tensor_model_parallel", False)) or rank == 0


def reduce_norm_powers(dense: torch.Tensor, expert: torch.Tensor, state: ParallelState,
                       op: str = "sum") -> torch.Tensor:
    """The global sum (or max) of the dense powers [1] over the model-parallel group and the
    expert ones [1] over the expert tensor x expert x pipeline group, combined; every rank
    calls both all-reduces of a layout with experts."""
    collectives.all_reduce(dense, state.model_parallel_group, op=op)
    if state.expert_model_group is not None:
        collectives.all_reduce(expert, state.expert_model_group, op=op)
    return torch.maximum(dense, expert) if op == "max" else dense + expert


def grad_norm(parameters: Iterable[torch.Tensor], parallel_state: Optional[ParallelState] = None,
              norm_type: float = 2.0) -> float:
    """Global gradient norm over the model-parallel (and expert) groups, each parameter counted
    once."""
    state = get_parallel_state() if parallel_state is None else parallel_state
    owned = [p for p in parameters
             if p.grad is not None and counts_toward_norm(p, state.tensor_model_parallel_rank,
                                                          state.expert_tensor_parallel_rank)]
    device = owned[0].grad.device if owned else torch.device("cpu")
    sums = {kind: torch.zeros(1, dtype=torch.float32, device=device) for kind in (0, 1)}
    for p in owned:
        part = sums[int(is_expert(p))]
        if math.isinf(norm_type):
            part.copy_(torch.maximum(part, p.grad.detach().abs().max().float().reshape(1)))
        else:
            part += norm_power(p, p.grad, norm_type)
    if math.isinf(norm_type):
        return float(reduce_norm_powers(sums[0], sums[1], state, op="max").item())
    total = reduce_norm_powers(sums[0], sums[1], state)
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


def allreduce_expert_grad_tensors(grads: Iterable[torch.Tensor], parallel_state: ParallelState,
                                  bucket_size_mb: float = 25.0) -> None:
    """Expert gradients in place: summed over the expert-data-parallel group, divided by the
    data x context size (see the module docstring)."""
    replicas = parallel_state.gradient_state().data_parallel_size
    allreduce_grad_tensors(grads, parallel_state.expert_data_parallel_group, bucket_size_mb,
                           divisor=replicas)


def allreduce_grad_tensors(grads: Iterable[torch.Tensor], data_parallel_group: object,
                           bucket_size_mb: float = 25.0, divisor: Optional[int] = None) -> None:
    """Average gradient tensors in place over the data-parallel group (sum, then divide by the
    group size, or by `divisor` when given), in flat buckets of at most bucket_size_mb.

    Tensors are bucketed by (dtype, device) in the given order; a tensor larger than a bucket
    goes alone. No-op for a None / one-rank group without a divisor other than 1.
    """
    size = collectives.group_size(data_parallel_group) if divisor is None else divisor
    if size == 1 and collectives.group_size(data_parallel_group) == 1:
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
    if size != 1:
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
