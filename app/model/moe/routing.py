"""The arithmetic of Mixture-of-Experts routing, as Megatron Core defines it: pure functions of
tensors, no modules, no communication (the router and the dispatchers call them).

Notation: T tokens of one router call, E experts, k = top-k. Tokens are rows; experts columns.

    topk_routing         logits [T, E] -> probs [T, E] (zero off the top k), routing map [T, E]
    aux_loss_scores      the full score distribution the load-balancing losses use, and its
                         own top-k map (before capacity dropping, without the expert bias)
    load_balancing_loss  coeff E / (k T_total^2) sum_i (sum_local_tokens score_i) count_i
    z_loss               coeff mean(logsumexp(logits)^2)
    expert_capacity, drop_over_capacity      capacity per expert and the drop / pad masks
    expert_bias_update   bias + rate sign(mean load - load) (aux-loss-free balancing)
    sort_by_expert       the (token, expert) pairs of a routing map, expert-major then token
"""
from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch


def topk_routing(logits: torch.Tensor, topk: int, score_function: str = "softmax",
                 pre_softmax: bool = False, scaling_factor: Optional[float] = None,
                 expert_bias: Optional[torch.Tensor] = None
                 ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(probs [T, E], routing_map [T, E] bool) of top-k routing.

    softmax, not `pre_softmax` (Megatron's default): top-k of the logits, then a softmax over
    those k (= the renormalised top-k of the full softmax); softmax with `pre_softmax`: softmax
    over all E, then top-k (not renormalised); sigmoid: top-k of sigmoid(logits) (of
    sigmoid + `expert_bias` when given: the bias selects, it does not weight), renormalised to
    sum 1 when k > 1. Then x `scaling_factor` when set. Softmax and sigmoid run in fp32 and
    return the logits' dtype.
    """
    if score_function == "softmax":
        if pre_softmax:
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32).type_as(logits)
            top, index = torch.topk(scores, topk, dim=1)
        else:
            top_logits, index = torch.topk(logits, topk, dim=1)
            top = torch.softmax(top_logits, dim=-1, dtype=torch.float32).type_as(logits)
    elif score_function == "sigmoid":
        scores = torch.sigmoid(logits.float()).type_as(logits)
        if expert_bias is not None:
            _, index = torch.topk(scores + expert_bias, topk, dim=1)
            top = torch.gather(scores, 1, index)
        else:
            top, index = torch.topk(scores, topk, dim=1)
        if topk > 1:
            top = top / (top.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        raise ValueError(f"score function {score_function!r}: use softmax or sigmoid")
    if scaling_factor:
        top = top * scaling_factor
    probs = torch.zeros_like(logits).scatter(1, index, top)  # [T, E]
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, index, True)
    return probs, routing_map


def aux_loss_scores(logits: torch.Tensor, topk: int, score_function: str
                    ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(scores [T, E], routing_map [T, E]) for the load-balancing losses: the softmax over all
    experts in fp32 (or sigmoid normalised to sum 1) and the top-k map of those scores."""
    if score_function == "softmax":
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    elif score_function == "sigmoid":
        scores = torch.sigmoid(logits)
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        raise ValueError(f"score function {score_function!r}: use softmax or sigmoid")
    _, index = torch.topk(scores, topk, dim=1)
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, index, True)
    return scores, routing_map


def load_balancing_loss(scores: torch.Tensor, tokens_per_expert: torch.Tensor,
                        total_tokens: int, topk: int, num_experts: int, coeff: float
                        ) -> torch.Tensor:
    """Switch Transformer's balancing loss as Megatron computes it on one rank:
    coeff E / (k T_total^2) sum_i (sum over this rank's rows of scores[:, i]) tokens_per_expert[i].

    `tokens_per_expert` and `total_tokens` are counted over the whole group whose tokens make
    one batch (the ranks sharing the micro-batch), so the ranks' values add up to the loss of
    that batch. Balanced routing gives coeff (E f_i = 1 and sum_i P_i = 1).
    """
    per_expert = scores.sum(dim=0)  # [E]
    scale = num_experts * coeff / (topk * float(total_tokens) * float(total_tokens))
    return torch.sum(per_expert * tokens_per_expert) * scale


def z_loss(logits: torch.Tensor, coeff: float) -> torch.Tensor:
    """ST-MoE's router z-loss: coeff x mean over tokens of logsumexp(logits)^2."""
    return torch.mean(torch.square(torch.logsumexp(logits, dim=-1))) * coeff


def expert_capacity(num_tokens: int, num_experts: int, topk: int, capacity_factor: float) -> int:
    """Megatron's capacity per expert: ceil(num_tokens x k / E x capacity_factor)."""
    return math.ceil(num_tokens * topk / num_experts * capacity_factor)


def drop_over_capacity(probs: torch.Tensor, routing_map: torch.Tensor, topk: int,
                       capacity_factor: float, policy: str = "probs", pad: bool = False
                       ) -> Tuple[torch.Tensor, torch.Tensor]:
    """(probs, routing_map) with each expert kept to its capacity (Megatron's
    apply_router_token_dropping): per expert (column), the `capacity` highest probabilities
    (`policy` "probs") or routed tokens first (`policy` "position"); nothing drops when the
    capacity exceeds the tokens. Without `pad` a dropped pair gets probability 0 and leaves the
    map (the token keeps its other experts, not renormalised); with `pad` every expert's map is
    exactly its capacity mask (extra rows carry probability 0)."""
    if policy not in ("probs", "position"):
        raise ValueError(f"drop policy {policy!r}: use probs or position")
    num_tokens, num_experts = probs.shape
    capacity = expert_capacity(num_tokens, num_experts, topk, capacity_factor)
    if capacity > num_tokens:
        keep = torch.ones_like(routing_map)
    else:
        ranked = probs if policy == "probs" else routing_map.to(torch.int32)
        _, index = torch.topk(ranked, capacity, dim=0, sorted=False)
        keep = torch.zeros_like(routing_map).scatter(0, index, True)
    final = keep if pad else routing_map & keep
    return probs * final, final


def expert_bias_update(bias: torch.Tensor, tokens_per_expert: torch.Tensor,
                       rate: float) -> torch.Tensor:
    """bias + rate x sign(mean(tokens) - tokens): raises the bias of under-loaded experts."""
    load = tokens_per_expert.float()
    return bias + torch.sign(load.mean() - load) * rate


def sort_by_expert(routing_map: torch.Tensor) -> Tuple[torch.Tensor, List[int]]:
    """(token index [N], tokens per expert [E]) of the pairs of a routing map [T, E]: for
    expert 0 its tokens in ascending order, then expert 1's, ... (N = routing_map.sum()).
    One host sync for the counts."""
    expert_major = routing_map.t()  # [E, T]
    token_index = expert_major.nonzero()[:, 1]  # nonzero is row-major: experts, then tokens
    counts = expert_major.sum(dim=1).tolist()
    return token_index, counts


def sorted_probs(probs: torch.Tensor, routing_map: torch.Tensor) -> torch.Tensor:
    """The probabilities of `sort_by_expert`'s pairs, in its order: [N]."""
    return probs.t()[routing_map.t()]


class _Unsort(torch.autograd.Function):
    """index_add of rows into zeros; backward gathers the gradient rows back (keeping only the
    index: torch's index_add would also keep the [N, H] rows for their shape)."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, token_index: torch.Tensor, num_tokens: int):
        ctx.save_for_backward(token_index)
        out = rows.new_zeros((num_tokens,) + tuple(rows.shape[1:]))
        return out.index_add_(0, token_index, rows)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (token_index,) = ctx.saved_tensors
        return grad.index_select(0, token_index), None, None


def unsort(rows: torch.Tensor, token_index: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Sum each pair's row back into its token: rows [N, H] -> [num_tokens, H] (tokens without a
    pair get zeros)."""
    return _Unsort.apply(rows, token_index, num_tokens)
