"""Cross-entropy over logits split by vocabulary across the tensor-parallel group.

loss_i = log(sum_v exp(z_iv)) - z_i,target over the full vocabulary, computed from each rank's
[*, V/tp] slice with two all-reduces: the max [*], then [sum of exp(z - max), target logit]
stacked as [2, *]; the full [*, V] logits are never gathered. Arithmetic in fp32, per-token
loss, no reduction. The arithmetic lives in plain functions; the communication in
`_row_totals`, which both variants below (PyTorch and fused kernel) call, so the two issue the
same collectives with the same meaning: ranks that somehow chose different variants still add
like quantities (app.kernels.agree_across_ranks keeps them on one variant in the first place).
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

from app.mpu import collectives
from app.mpu.parallel_state import ParallelState, get_parallel_state
from app.mpu.utils import vocab_range


def local_targets(target: torch.Tensor, start: int, end: int
                  ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(ids relative to this rank's [start, end), mask of ids outside it); outside ids -> 0."""
    outside = (target < start) | (target >= end)
    return (target - start).masked_fill(outside, 0), outside


def target_logits(logits: torch.Tensor, local_ids: torch.Tensor,
                  outside: torch.Tensor) -> torch.Tensor:
    """logits[..., local_ids] with zeros where the target is on another rank. [*, v] -> [*]."""
    picked = logits.gather(-1, local_ids.unsqueeze(-1)).squeeze(-1)
    return picked.masked_fill(outside, 0.0)


def _row_totals(sum_exp: torch.Tensor, predicted: torch.Tensor, group: object
                ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Sums over the group of each rank's sum of exp(z - global max) and of its target logit
    (raw, 0 where the target is elsewhere): one all-reduce of the two stacked. [*] each."""
    totals = collectives.all_reduce(torch.stack([sum_exp, predicted]), group)  # [2, *]
    return totals[0], totals[1]


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, group: object,
                start: int, end: int) -> torch.Tensor:
        z = logits.float()  # [*, v]
        z_max = z.max(dim=-1).values  # [*]
        collectives.all_reduce(z_max, group, op="max")
        local_ids, outside = local_targets(target, start, end)
        predicted = target_logits(z, local_ids, outside)  # [*], raw logit
        z = z - z_max.unsqueeze(-1)  # new tensor; the input logits are untouched
        exp = z.exp_()  # [*, v]
        sum_exp, predicted = _row_totals(exp.sum(dim=-1), predicted, group)  # [*] each
        loss = torch.log(sum_exp) - (predicted - z_max)  # [*]
        softmax = exp.div_(sum_exp.unsqueeze(-1))  # [*, v], this rank's slice
        ctx.save_for_backward(softmax, local_ids, outside)
        ctx.input_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        softmax, local_ids, outside = ctx.saved_tensors
        # d loss / d z = softmax - onehot(target); in place on the saved softmax to save a
        # [*, V/tp] fp32 buffer, so this backward can run only once (no retain_graph reuse).
        grad = softmax
        onehot = (~outside).to(grad.dtype).unsqueeze(-1)  # [*, 1]
        grad.scatter_add_(-1, local_ids.unsqueeze(-1), -onehot)
        grad.mul_(grad_loss.float().unsqueeze(-1))
        return grad.to(ctx.input_dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor,
                                 parallel_state: Optional[ParallelState] = None) -> torch.Tensor:
    """Per-token fp32 cross-entropy from vocab-split logits [*, V/tp] and targets [*] -> [*].

    Targets are global vocabulary ids. `parallel_state=None` uses the current default state.
    """
    state = get_parallel_state() if parallel_state is None else parallel_state
    tp, rank = state.tensor_model_parallel_size, state.tensor_model_parallel_rank
    start, end = vocab_range(logits.shape[-1] * tp, rank, tp)
    return _VocabParallelCrossEntropy.apply(logits, target, state.tensor_model_parallel_group,
                                            start, end)


# ---- the fused variant: one-pass row statistics from the kernels -------------------------------
def row_stats_reference(logits: torch.Tensor, target: torch.Tensor, start: int
                        ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PyTorch version of the cross_entropy_stats kernel: per row of this rank's slice [*, v],
    (max, sum exp(z - max), z[target - start] or 0 when the target is elsewhere), fp32 [*]."""
    z = logits.float()  # [*, v]
    row_max = z.max(dim=-1).values  # [*]
    sum_exp = (z - row_max.unsqueeze(-1)).exp().sum(dim=-1)  # [*]
    local_ids, outside = local_targets(target, start, start + logits.shape[-1])
    return row_max, sum_exp, target_logits(z, local_ids, outside)


def grad_reference(grad_loss: torch.Tensor, logits: torch.Tensor, target: torch.Tensor,
                   logsumexp: torch.Tensor, start: int) -> torch.Tensor:
    """PyTorch version of the cross_entropy_backward kernel: (softmax - onehot) * grad_loss,
    in the logits' dtype. logits [*, v]; grad_loss, logsumexp fp32 [*]."""
    grad = (logits.float() - logsumexp.unsqueeze(-1)).exp()  # [*, v]
    local_ids, outside = local_targets(target, start, start + logits.shape[-1])
    grad.scatter_add_(-1, local_ids.unsqueeze(-1), -(~outside).to(grad.dtype).unsqueeze(-1))
    return (grad * grad_loss.float().unsqueeze(-1)).to(logits.dtype)


def combine_row_stats(row_max: torch.Tensor, sum_exp: torch.Tensor,
                      global_max: torch.Tensor) -> torch.Tensor:
    """This rank's sum of exponentials rescaled from its own row max to the global one. [*]."""
    return sum_exp * torch.exp(row_max - global_max)


class _FusedVocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, group: object, start: int,
                stats_fn: Callable, grad_fn: Callable) -> torch.Tensor:
        row_max, sum_exp, predicted = stats_fn(logits, target, start)  # 3 x [*] fp32
        global_max = collectives.all_reduce(row_max.clone(), group, op="max")
        total, predicted = _row_totals(combine_row_stats(row_max, sum_exp, global_max),
                                       predicted, group)
        logsumexp = global_max + torch.log(total)  # [*]
        ctx.save_for_backward(logits, target, logsumexp)
        ctx.start, ctx.grad_fn = start, grad_fn
        return logsumexp - predicted

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        logits, target, logsumexp = ctx.saved_tensors
        grad = ctx.grad_fn(grad_loss, logits, target, logsumexp, ctx.start)
        return grad, None, None, None, None, None


def fused_vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor,
                                       parallel_state: Optional[ParallelState],
                                       stats_fn: Callable, grad_fn: Callable) -> torch.Tensor:
    """The loss of `vocab_parallel_cross_entropy` without an fp32 copy of the logits. [*] fp32.

    Per row, one pass gives this rank's (max, sum of exp, target logit); ranks agree on the max,
    then sum their rescaled sums and their target logits (the same two all-reduces as the
    PyTorch variant: max [*], then [2, *]). Backward
    writes (softmax - onehot) * grad in the logits' dtype from the saved logsumexp. `stats_fn`
    and `grad_fn` are the CUDA kernels (app.kernels.ops.cross_entropy_stats / _grad) or the
    `row_stats_reference` / `grad_reference` above, which run anywhere.
    """
    state = get_parallel_state() if parallel_state is None else parallel_state
    tp, rank = state.tensor_model_parallel_size, state.tensor_model_parallel_rank
    start, _ = vocab_range(logits.shape[-1] * tp, rank, tp)
    return _FusedVocabParallelCrossEntropy.apply(logits, target,
                                                 state.tensor_model_parallel_group, start,
                                                 stats_fn, grad_fn)
