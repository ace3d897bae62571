"""Token dispatchers: the only part of an MoE layer that moves tokens between ranks.

Both take this rank's routed tokens (hidden [T, H], probs [T, E], routing map [T, E]) and hand
the experts of this rank the rows they process, grouped by local expert (expert-major, then by
source rank, then ascending token: the order of Megatron Core's permutation), with their
probabilities and the row count of each local expert; `combine` sums each token's expert
outputs back into [T, H]. The group is expert-tensor x expert (`tp_ep`, its rank
g = etp + ETP x ep): the ranks whose experts, or expert shards, a token may need.

- `AllGatherDispatcher` (--moe-token-dispatcher-type allgather, Megatron's default): every rank
  all-gathers the group's tokens, probabilities and map, keeps the pairs of its local experts;
  combine scatters each pair's output into its token row and reduce-scatters over the group,
  which also sums the expert-tensor shards' partial fc2 products.
- `AllToAllDispatcher` (alltoall): each rank sends every rank of the group the rows of that
  rank's experts (all-to-all with uneven splits, which gloo and NCCL both take), so an expert
  rank receives only its tokens; the expert-tensor ranks of an expert rank all receive them;
  combine sends the outputs back and the source adds the expert-tensor partial sums. One
  all-to-all instead of Megatron's all-to-all over EP then all-gather over ETP: the same rows
  arrive, in the same order.

Each dispatch costs one host sync (the row counts); combine needs the `Dispatched` it returned.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List

import torch

from app.model.moe import routing
from app.mpu import collectives
from app.mpu.mappings import all_to_all_rows, gather_rows, reduce_scatter_rows
from app.mpu.parallel_state import ParallelState


@dataclass
class Dispatched:
    """This rank's expert input: `rows` [N, H] grouped by local expert, `probs` [N], and
    `tokens_per_expert` (rows of each local expert); `state` is what combine needs."""

    rows: torch.Tensor
    probs: torch.Tensor
    tokens_per_expert: List[int]
    state: Any


class _Dispatcher:
    def __init__(self, num_experts: int, parallel_state: ParallelState) -> None:
        ps = parallel_state
        self.group = ps.expert_tensor_and_expert_group
        self.size = collectives.group_size(self.group)
        self.rank = collectives.group_rank(self.group)
        self.etp = ps.expert_tensor_parallel_size
        self.ep = ps.expert_model_parallel_size
        self.num_local = num_experts // self.ep
        self.first = ps.expert_model_parallel_rank * self.num_local


class AllGatherDispatcher(_Dispatcher):
    """See the module docstring."""

    def dispatch(self, hidden: torch.Tensor, probs: torch.Tensor,
                 routing_map: torch.Tensor) -> Dispatched:
        hidden_all = gather_rows(hidden, self.group)  # [T G, H]
        probs_all = gather_rows(probs, self.group)  # [T G, E]
        map_all = routing_map  # [T G, E]
        if self.size > 1:
            with torch.no_grad():
                map_all = collectives.all_gather_dim(routing_map.to(torch.uint8), self.group,
                                                     0).bool()
        local = slice(self.first, self.first + self.num_local)
        local_map = map_all[:, local]  # [T G, E/EP]
        token_index, counts = routing.sort_by_expert(local_map)
        rows = hidden_all.index_select(0, token_index)  # [N, H]
        row_probs = routing.sorted_probs(probs_all[:, local], local_map)  # [N]
        return Dispatched(rows, row_probs, counts,
                          (token_index, hidden_all.shape[0], hidden.dtype, probs.dtype))

    def combine(self, expert_rows: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        """Expert outputs [N, H] -> this rank's tokens [T, H] (summed in the probabilities'
        dtype: fp32 with --moe-router-dtype fp32, as Megatron)."""
        token_index, total, dtype, sum_dtype = dispatched.state
        summed = routing.unsort(expert_rows.to(sum_dtype), token_index, total)  # [T G, H]
        return reduce_scatter_rows(summed, self.group).to(dtype)  # [T, H]


class AllToAllDispatcher(_Dispatcher):
    """See the module docstring."""

    def dispatch(self, hidden: torch.Tensor, probs: torch.Tensor,
                 routing_map: torch.Tensor) -> Dispatched:
        token_index, counts = routing.sort_by_expert(routing_map)  # all E experts
        rows = hidden.index_select(0, token_index)  # [T k, H] (dropless)
        row_probs = routing.sorted_probs(probs, routing_map)
        mine = torch.tensor(counts, dtype=torch.int64, device=hidden.device)
        every = [c.tolist() for c in collectives.all_gather(mine, self.group)]  # [G][E]
        e_l, my_ep = self.num_local, self.rank // self.etp
        per_ep = [sum(counts[e * e_l:(e + 1) * e_l]) for e in range(self.ep)]
        send_splits = [per_ep[g // self.etp] for g in range(self.size)]
        recv_splits = [sum(every[g][my_ep * e_l:(my_ep + 1) * e_l]) for g in range(self.size)]
        blocks = rows.split(per_ep)
        prob_blocks = row_probs.split(per_ep)
        sent = torch.cat([blocks[g // self.etp] for g in range(self.size)])
        sent_probs = torch.cat([prob_blocks[g // self.etp] for g in range(self.size)])
        got = all_to_all_rows(sent, recv_splits, send_splits, self.group)
        got_probs = all_to_all_rows(sent_probs, recv_splits, send_splits, self.group)
        # received chunks [source g][local expert j] -> [j][g]
        sizes = [every[g][my_ep * e_l + j] for g in range(self.size) for j in range(e_l)]
        order = [g * e_l + j for j in range(e_l) for g in range(self.size)]
        by_expert = [sum(every[g][my_ep * e_l + j] for g in range(self.size))
                     for j in range(e_l)]
        chunks, prob_chunks = got.split(sizes), got_probs.split(sizes)
        return Dispatched(torch.cat([chunks[i] for i in order]),
                          torch.cat([prob_chunks[i] for i in order]), by_expert,
                          (token_index, hidden.shape[0], hidden.dtype, probs.dtype, sizes,
                           order, send_splits, recv_splits, per_ep))

    def combine(self, expert_rows: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        """Expert outputs [N, H] -> this rank's tokens [T, H]: back to the sources, expert-
        tensor partial sums added, then each pair's row summed into its token."""
        (token_index, total, dtype, sum_dtype, sizes, order, send_splits, recv_splits,
         per_ep) = dispatched.state
        pieces = expert_rows.to(sum_dtype).split([sizes[i] for i in order])
        by_source: List[Any] = [None] * len(order)
        for position, index in enumerate(order):
            by_source[index] = pieces[position]
        back = all_to_all_rows(torch.cat(by_source), send_splits, recv_splits, self.group)
        copies = back.split(send_splits)  # one per group rank: its expert rank's block
        blocks = [sum(copies[e * self.etp + t] for t in range(self.etp)) for e in range(self.ep)]
        rows = torch.cat(blocks) if len(blocks) > 1 else blocks[0]  # [T k, H], expert-major
        return routing.unsort(rows, token_index, total).to(dtype)  # [T, H]


def build_dispatcher(kind: str, num_experts: int, parallel_state: ParallelState) -> _Dispatcher:
    """The dispatcher of --moe-token-dispatcher-type `kind`."""
    kinds = {"allgather": AllGatherDispatcher, "alltoall": AllToAllDispatcher}
    if kind not in kinds:
        raise ValueError(f"--moe-token-dispatcher-type {kind}: use allgather or alltoall")
    return kinds[kind](num_experts, parallel_state)
