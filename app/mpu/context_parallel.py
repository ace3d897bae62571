"""Context parallelism (Megatron's --context-parallel-size C): each sequence split over C ranks.

The sequence of length s is cut into 2C chunks of s/2C tokens; context rank i holds chunks i
and 2C-1-i (an early and a late chunk, so every rank does the same share of causal attention
work). Everything outside attention is per token and runs on the rank's s/C tokens unchanged;
positions (learned or RoPE) are the tokens' global positions, taken from the sliced
`position_ids`.

Attention ("p2p", a ring): each rank's queries meet every rank's keys/values. The key/value
block travels around the context group (C - 1 shifts to the next rank); for each block the
rank computes the scores of its queries against it with the exact causal mask of the two
blocks' global token indices (after the rank's own block only half of each block pair can be
unmasked, and only that half is computed: `ring_block`), the block's log-sum-exp and its
softmax-weighted values; the blocks are merged with the log-sum-exp rule

    lse = log sum_b exp(lse_b),   out = sum_b exp(lse_b - lse) out_b

which is the softmax over all keys. The backward is autograd's: a shift's gradient travels the
ring the other way.

Attention ("a2a", Ulysses): an all-to-all turns this rank's s/C tokens of every head into the
whole sequence of 1/C of the heads; the ordinary causal attention runs on it (in sequence
order), and a second all-to-all turns the result back. Needs the query and key/value heads of a
tensor-parallel rank divisible by C. The loss is the one-process mean: per-token loss sums and token counts
are added over the context group (`context_parallel_mean_loss`).
"""
from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

from app.mpu import collectives
from app.mpu.parallel_state import ParallelState



def chunk_ids(cp_size: int, cp_rank: int) -> Tuple[int, int]:
    """The two of the 2C sequence chunks context rank `cp_rank` holds: (i, 2C - 1 - i)."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def token_indices(local_length: int, cp_size: int, cp_rank: int,
                  device: Optional[torch.device] = None) -> torch.Tensor:
    """Global sequence indices [local_length] of the tokens context rank `cp_rank` holds
    (its two chunks, in order), for a local length of s / C."""
    half = local_length // 2
    first, second = chunk_ids(cp_size, cp_rank)
    arange = torch.arange(half, device=device)
    return torch.cat([first * half + arange, second * half + arange])  # [s / C]


def slice_sequence(tensor: torch.Tensor, cp_size: int, cp_rank: int, dim: int = 1
                   ) -> torch.Tensor:
    """This rank's two chunks of `tensor` along the sequence dimension `dim`: s -> s / C."""
    s = tensor.shape[dim]
    if s % (2 * cp_size):
        raise ValueError(f"sequence length ({s}) is not divisible by 2 x context-parallel size "
                         f"({2 * cp_size})")
    index = token_indices(s // cp_size, cp_size, cp_rank, tensor.device)
    return tensor.index_select(dim, index).contiguous()


def get_batch_on_this_cp_rank(batch: Dict[str, Optional[torch.Tensor]],
                              parallel_state: ParallelState) -> Dict[str, Optional[torch.Tensor]]:
    """The micro-batch's tokens, labels, loss mask and position ids [b, s] cut to this context
    rank's two chunks [b, s / C] (Megatron's get_batch_on_this_cp_rank); the batch itself
    without context parallelism. A per-sample attention mask is refused (RunConfig refuses
    --reset-attention-mask with context parallelism)."""
    cp = parallel_state.context_parallel_size
    if cp == 1:
        return batch
    if batch.get("attention_mask") is not None:
        raise ValueError("context parallelism takes plain causal attention only (no "
                         "--reset-attention-mask)")
    out = dict(batch)
    for key in ("tokens", "labels", "loss_mask", "position_ids"):
        if out.get(key) is not None:
            out[key] = slice_sequence(out[key], cp, parallel_state.context_parallel_rank)
    return out


def context_parallel_mean_loss(per_token_loss: torch.Tensor, loss_mask: torch.Tensor,
                               parallel_state: ParallelState) -> torch.Tensor:
    """The masked mean of the per-token loss over the whole sequence, as one process computes
    it, from this context rank's tokens [b, s / C].

    The value is sum(loss x mask) / sum(mask), both summed over the context group. The gradient
    is C x (this rank's sum) / (total count): averaged over data x context ranks (the gradient
    all-reduce) it is the one-process gradient (Megatron multiplies by C the same way).
    """
    mask = loss_mask.to(torch.float32)
    local_sum = (per_token_loss.float() * mask).sum()
    totals = torch.stack([local_sum.detach(), mask.sum()])  # [2]: loss sum, token count
    collectives.all_reduce(totals, parallel_state.context_parallel_group)
    count = totals[1].clamp(min=1.0)
    scaled = local_sum * parallel_state.context_parallel_size / count
    return scaled + (totals[0] / count - scaled).detach()


class _RingShift(torch.autograd.Function):
    """x on context rank i -> the x of rank i - 1 (sent to i + 1); the gradient goes back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: object, next_rank: int,  # type: ignore[override]
                prev_rank: int) -> torch.Tensor:
        ctx.group, ctx.next_rank, ctx.prev_rank = group, next_rank, prev_rank
        received = torch.empty_like(x)
        collectives.send_recv([(x, next_rank)], [(received, prev_rank)], group)
        return received

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        received = torch.empty_like(grad)
        collectives.send_recv([(grad.contiguous(), ctx.prev_rank)],
                              [(received, ctx.next_rank)], ctx.group)
        return received, None, None, None


def ring_shift(x: torch.Tensor, parallel_state: ParallelState) -> torch.Tensor:
    """One step of the ring: returns the previous context rank's `x` (differentiable)."""
    ranks, rank = parallel_state.context_parallel_ranks, parallel_state.context_parallel_rank
    cp = len(ranks)
    return _RingShift.apply(x, parallel_state.context_parallel_group, ranks[(rank + 1) % cp],
                            ranks[(rank - 1) % cp])


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    masked: Optional[torch.Tensor], scale: float, dropout_p: float
                    ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Attention of queries q [b, n, sq, hd] to one key/value block k, v [b, n, sk, hd] (fp32)
    with `masked` [sq, sk] True = not attended (None: every key attended):
    (out_b [b, n, sq, hd], lse_b [b, n, sq]).

    out_b is normalised within the block; a row with every key masked gets an lse at the
    dtype's minimum, so its merge weight exp(lse_b - lse) is 0. Dropout on the in-block
    probabilities equals dropout on the merged ones (the merge weight is a per-row factor).
    """
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [b, n, sq, sk]
    if masked is not None:
        scores = scores.masked_fill(masked, torch.finfo(scores.dtype).min)
    lse = torch.logsumexp(scores, dim=-1)  # [b, n, sq]
    probs = torch.exp(scores - lse.unsqueeze(-1))  # [b, n, sq, sk]
    if dropout_p > 0.0:
        probs = F.dropout(probs, dropout_p, True)
    return torch.matmul(probs, v), lse


def ring_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp_size: int, cp_rank: int,
               source: int, scale: float, dropout_p: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """(out_b, lse_b) of context rank `cp_rank`'s queries q [b, n, s/C, hd] against context
    rank `source`'s keys/values [b, n, s/C, hd], computing only what the causal mask lets
    through (Megatron's load-balanced ring):

    - its own block: both chunks, with the causal mask of their global token indices;
    - an earlier rank's (source < rank): its early chunk precedes both of ours and its late
      chunk follows both: all queries against the early half of the keys, no mask;
    - a later rank's: our early chunk precedes both of its chunks, our late chunk follows both:
      the late half of the queries against all keys, no mask; the early rows get no weight.
    """
    half = q.shape[2] // 2
    if source == cp_rank:
        q_index = token_indices(q.shape[2], cp_size, cp_rank, q.device)  # [s/C]
        masked = q_index.unsqueeze(0) > q_index.unsqueeze(1)  # [s/C (q), s/C (k)]
        return block_attention(q, k, v, masked, scale, dropout_p)
    if source < cp_rank:
        return block_attention(q, k[:, :, :half], v[:, :, :half], None, scale, dropout_p)
    out, lse = block_attention(q[:, :, half:], k, v, None, scale, dropout_p)
    return (torch.cat([torch.zeros_like(out), out], dim=2),
            torch.cat([torch.full_like(lse, torch.finfo(lse.dtype).min), lse], dim=2))


def merge_blocks(outs: List[torch.Tensor], lses: List[torch.Tensor]) -> torch.Tensor:
    """Softmax over all keys from per-block results: sum_b exp(lse_b - lse) out_b."""
    lse = torch.logsumexp(torch.stack(lses), dim=0)  # [b, n, sq]
    merged = torch.zeros_like(outs[0])
    for out, block_lse in zip(outs, lses):
        merged = merged + torch.exp(block_lse - lse).unsqueeze(-1) * out  # [b, n, sq, hd]
    return merged


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   parallel_state: ParallelState, dropout_p: float = 0.0) -> torch.Tensor:
    """Causal attention of this context rank's queries q [b, nh, s/C, hd] to the whole
    sequence's keys/values, given this rank's k, v [b, ng, s/C, hd] (ng divides nh: grouped
    queries); returns [b, nh, s/C, hd] in q's dtype. Arithmetic in fp32, scale 1/sqrt(hd)."""
    cp, rank = parallel_state.context_parallel_size, parallel_state.context_parallel_rank
    nh, hd = q.shape[1], q.shape[3]
    repeat = nh // k.shape[1]
    qf, scale = q.float(), 1.0 / math.sqrt(hd)
    kv = torch.stack([k, v])  # [2, b, ng, s/C, hd]: one message per ring step
    outs, lses = [], []
    for step in range(cp):
        if step:
            kv = ring_shift(kv, parallel_state)
        kb, vb = (t.float().repeat_interleave(repeat, dim=1) for t in kv)  # [b, nh, s/C, hd]
        out, lse = ring_block(qf, kb, vb, cp, rank, (rank - step) % cp, scale, dropout_p)
        outs.append(out)
        lses.append(lse)
    return merge_blocks(outs, lses).to(q.dtype)


class _AllToAll(torch.autograd.Function):
    """x split in C along `scatter_dim` (part j to context rank j), the parts received
    concatenated along `gather_dim` in rank order; the gradient takes the inverse way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: object, scatter_dim: int,  # type: ignore[override]
                gather_dim: int) -> torch.Tensor:
        ctx.group, ctx.scatter_dim, ctx.gather_dim = group, scatter_dim, gather_dim
        parts = x.chunk(collectives.group_size(group), dim=scatter_dim)
        return torch.cat(collectives.all_to_all(parts, group), dim=gather_dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        parts = grad.chunk(collectives.group_size(ctx.group), dim=ctx.gather_dim)
        back = torch.cat(collectives.all_to_all(parts, ctx.group), dim=ctx.scatter_dim)
        return back, None, None, None


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      parallel_state: ParallelState,
                      attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
                      ) -> torch.Tensor:
    """Causal attention by all-to-all over heads: q [b, nh, s/C, hd], k, v [b, ng, s/C, hd]
    (this rank's tokens) -> [b, nh, s/C, hd]. `attend(q, k, v)` is plain causal attention of a
    whole sequence in order ([b, nh/C, s, hd] -> same)."""
    cp, group = parallel_state.context_parallel_size, parallel_state.context_parallel_group
    s_local = q.shape[2]
    # the gathered sequence holds rank 0's tokens, then rank 1's, ...: restore sequence order
    gathered = torch.cat([token_indices(s_local, cp, r, q.device) for r in range(cp)])  # [s]
    order = torch.argsort(gathered)  # sequence position -> index in the gathered layout

    def to_heads(x: torch.Tensor) -> torch.Tensor:  # [b, n, s/C, hd] -> [b, n/C, s, hd]
        return _AllToAll.apply(x, group, 1, 2).index_select(2, order)

    out = attend(to_heads(q), to_heads(k), to_heads(v))  # [b, nh/C, s, hd], sequence order
    out = out.index_select(2, gathered)  # back to the gathered layout
    return _AllToAll.apply(out, group, 2, 1)  # [b, nh, s/C, hd]
