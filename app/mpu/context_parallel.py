"""Context parallelism (Megatron's --context-parallel-size C): each sequence split over C ranks.

The sequence of length s is cut into 2C chunks of s/2C tokens; context rank i holds chunks i
and 2C-1-i (an early and a late chunk, so every rank does the same share of causal attention
work). Everything outside attention is per token and runs on the rank's s/C tokens unchanged;
positions (learned or RoPE) are the tokens' global positions, taken from the sliced
`position_ids`.

Attention ("p2p", a ring): each rank's queries meet every rank's keys/values. The key/value
block travels around the context group (C - 1 shifts to the next rank, each posted before the
current block's attention so the transfer overlaps it); for each block the rank computes the
scores of its queries against it with the exact causal mask of the two blocks' global token
indices (after the rank's own block only half of each block pair can be unmasked, and only
that half is computed: `block_plan`), the block's log-sum-exp and its softmax-weighted values,
and folds them into the running result with the log-sum-exp rule

    lse = log sum_b exp(lse_b),   out = sum_b exp(lse_b - lse) out_b

which is the softmax over all keys. Backward keeps only q, k, v, the output and lse (no score
block): the blocks go round the ring again, each block's probabilities exp(S_b - lse) are
recomputed (flash attention's backward), and each block's key/value gradient travels with it
and is sent home at the end (as Megatron's Transformer Engine ring does), so the attention's
activation memory per rank is linear in s/C.

Attention ("a2a", Ulysses): an all-to-all turns this rank's s/C tokens of every head into the
whole sequence of 1/C of the heads; the ordinary causal attention runs on it (in sequence
order), and a second all-to-all turns the result back. Needs the query and key/value heads of a
tensor-parallel rank divisible by C. The loss is the one-process mean: per-token loss sums and
token counts are added over the context group (`context_parallel_mean_loss`).
"""
from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Tuple

import torch

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


def post_ring_shift(x: torch.Tensor, parallel_state: ParallelState
                    ) -> Tuple[torch.Tensor, List[object]]:
    """Start one step of the ring: send `x` to the next context rank and receive the previous
    one's into a new buffer; returns (buffer, requests), the buffer valid after `wait_all`."""
    ranks, rank = parallel_state.context_parallel_ranks, parallel_state.context_parallel_rank
    cp, received = len(ranks), torch.empty_like(x)
    requests = collectives.post_send_recv([(x, ranks[(rank + 1) % cp])],
                                          [(received, ranks[(rank - 1) % cp])],
                                          parallel_state.context_parallel_group)
    return received, requests


def block_plan(cp_size: int, cp_rank: int, source: int, local_length: int,
               device: Optional[torch.device] = None
               ) -> Tuple[slice, slice, Optional[torch.Tensor]]:
    """(query rows, key rows, masked [rows, keys] or None) of context rank `cp_rank`'s queries
    against context rank `source`'s keys, computing only what the causal mask lets through
    (Megatron's load-balanced ring; True in `masked` = not attended):

    - its own block: both chunks, with the causal mask of their global token indices;
    - an earlier rank's (source < rank): its early chunk precedes both of ours and its late
      chunk follows both: all queries against the early half of the keys, no mask;
    - a later rank's: our early chunk precedes both of its chunks, our late chunk follows both:
      the late half of the queries against all keys, no mask.
    """
    half, whole = local_length // 2, slice(0, local_length)
    if source == cp_rank:
        index = token_indices(local_length, cp_size, cp_rank, device)  # [s/C]
        return whole, whole, index.unsqueeze(0) > index.unsqueeze(1)
    if source < cp_rank:
        return whole, slice(0, half), None
    return slice(half, local_length), whole, None


def _scores(q: torch.Tensor, k: torch.Tensor, masked: Optional[torch.Tensor],
            scale: float) -> torch.Tensor:
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [b, n, sq, sk]
    if masked is not None:
        scores = scores.masked_fill(masked, torch.finfo(scores.dtype).min)
    return scores


def block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  masked: Optional[torch.Tensor], scale: float, keep: Optional[torch.Tensor]
                  ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Attention of queries q [b, n, sq, hd] to one key/value block k, v [b, n, sk, hd] with
    `masked` [sq, sk] (None: every key attended): (out_b [b, n, sq, hd], lse_b [b, n, sq]),
    out_b normalised within the block. `keep` [b, n, sq, sk] is the dropout factor (0 or
    1/(1-p)); dropout of the in-block probabilities equals dropout of the merged ones (the
    merge weight is a per-row factor)."""
    scores = _scores(q, k, masked, scale)  # [b, n, sq, sk]
    lse = torch.logsumexp(scores, dim=-1)  # [b, n, sq]
    probs = torch.exp(scores - lse.unsqueeze(-1))  # [b, n, sq, sk]
    if keep is not None:
        probs = probs * keep
    return torch.matmul(probs, v), lse


def block_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   masked: Optional[torch.Tensor], scale: float, keep: Optional[torch.Tensor],
                   lse: torch.Tensor, delta: torch.Tensor, grad_out: torch.Tensor
                   ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of one block from its recomputed scores (flash attention's backward):
    P = exp(S - lse) with `lse` [b, n, sq] the log-sum-exp over ALL keys, dV = (P·keep)^T dO,
    dS = P (dO V^T·keep - delta) with delta [b, n, sq] = rowsum(dO · O) of the merged output."""
    probs = torch.exp(_scores(q, k, masked, scale) - lse.unsqueeze(-1))  # [b, n, sq, sk]
    dropped = probs if keep is None else probs * keep
    grad_v = torch.matmul(dropped.transpose(-1, -2), grad_out)  # [b, n, sk, hd]
    grad_probs = torch.matmul(grad_out, v.transpose(-1, -2))  # [b, n, sq, sk]
    if keep is not None:
        grad_probs = grad_probs * keep
    grad_scores = probs * (grad_probs - delta.unsqueeze(-1)) * scale  # [b, n, sq, sk]
    grad_q = torch.matmul(grad_scores, k)  # [b, n, sq, hd]
    grad_k = torch.matmul(grad_scores.transpose(-1, -2), q)  # [b, n, sk, hd]
    return grad_q, grad_k, grad_v


def merge_block(out: torch.Tensor, lse: torch.Tensor, rows: slice, out_b: torch.Tensor,
                lse_b: torch.Tensor) -> None:
    """Fold one block into the running result in place (rows `rows` of out [b, n, sq, hd],
    lse [b, n, sq]): lse = log(exp(lse) + exp(lse_b)), out = sum_b exp(lse_b - lse) out_b."""
    old = lse[:, :, rows]
    new = torch.logaddexp(old, lse_b)  # [b, n, rows]
    out[:, :, rows] = (out[:, :, rows] * torch.exp(old - new).unsqueeze(-1)
                       + out_b * torch.exp(lse_b - new).unsqueeze(-1))
    lse[:, :, rows] = new


ROW_TILE = 256
"""Query rows per score tile: a block's scores are made a tile at a time (fp32 [b, n, 256, sk]),
so the transient memory of the ring does not grow with the block's rows either."""


def _dropout_keep(generator: Optional[torch.Generator], shape: torch.Size, dropout_p: float,
                  device: torch.device) -> Optional[torch.Tensor]:
    """The next dropout factor (0 or 1/(1-p)) [shape] drawn from a block's own generator (None
    without dropout), so the backward draws the same ones again without keeping them."""
    if generator is None:
        return None
    keep = torch.empty(shape, device=device).bernoulli_(1.0 - dropout_p, generator=generator)
    return keep / (1.0 - dropout_p)


def _block_tiles(kv: torch.Tensor, q: torch.Tensor, source: int, parallel_state: ParallelState,
                 seed: int, dropout_p: float):
    """Yield (rows, keys, masked, k, v, keep) for each query-row tile of rank `source`'s block
    kv [2, b, ng, s/C, hd] against this rank's queries q [b, nh, s/C, hd]: the tile's query
    rows and key columns (slices), its mask, the block's fp32 keys/values [b, nh, keys, hd]
    and the tile's dropout factor; the same tiles and factors in forward and backward."""
    cp, rank = parallel_state.context_parallel_size, parallel_state.context_parallel_rank
    rows, cols, masked = block_plan(cp, rank, source, q.shape[2], q.device)
    kb, vb = _expand_heads(kv, q.shape[1], cols)  # [b, nh, keys, hd]
    generator = (torch.Generator(device=q.device).manual_seed(seed) if dropout_p else None)
    for start in range(rows.start, rows.stop, ROW_TILE):
        tile = slice(start, min(start + ROW_TILE, rows.stop))
        tile_masked = None if masked is None else masked[tile]
        shape = q.shape[:2] + (tile.stop - tile.start, kb.shape[2])  # [b, nh, tile, keys]
        yield tile, cols, tile_masked, kb, vb, _dropout_keep(generator, shape, dropout_p,
                                                             q.device)


class _RingAttention(torch.autograd.Function):
    """Causal ring attention that keeps only q, k, v, the output and its log-sum-exp for
    backward (activation memory linear in s/C); each block's scores are recomputed in
    backward, and the blocks' key/value gradients travel the ring with the blocks."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,  # type: ignore[override]
                parallel_state: ParallelState, dropout_p: float) -> torch.Tensor:
        cp, rank = parallel_state.context_parallel_size, parallel_state.context_parallel_rank
        seeds = (torch.randint(2 ** 62, (cp,), device=q.device).tolist() if dropout_p else
                 [0] * cp)  # from the caller's (forked) generator: one seed per block
        ctx.parallel_state, ctx.dropout_p, ctx.seeds = parallel_state, dropout_p, seeds
        qf, scale = q.to(_work_dtype(q)), 1.0 / math.sqrt(q.shape[3])
        out = torch.zeros_like(qf)  # [b, nh, s/C, hd]
        lse = torch.full(q.shape[:3], -math.inf, dtype=qf.dtype, device=q.device)
        for step, kv in _ring_blocks(torch.stack([k, v]), parallel_state):
            source = (rank - step) % cp
            for rows, _, masked, kb, vb, keep in _block_tiles(kv, q, source, parallel_state,
                                                              seeds[source], dropout_p):
                merge_block(out, lse, rows,
                            *block_forward(qf[:, :, rows], kb, vb, masked, scale, keep))
        ctx.save_for_backward(q, k, v, out, lse)
        return out.to(q.dtype)  # [b, nh, s/C, hd]

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        ps = ctx.parallel_state
        cp, rank, groups = ps.context_parallel_size, ps.context_parallel_rank, k.shape[1]
        qf, scale = q.to(out.dtype), 1.0 / math.sqrt(q.shape[3])
        grad_out = grad_out.to(out.dtype)
        delta = (grad_out * out).sum(-1)  # [b, nh, s/C]
        grad_q = torch.zeros_like(qf)  # [b, nh, s/C, hd]
        grad_kv = torch.zeros((2,) + k.shape, dtype=out.dtype, device=k.device)
        for step, kv in _ring_blocks(torch.stack([k, v]), ps):
            if step:  # the gradient of the block now here, accumulated by the ranks before
                grad_kv, requests = post_ring_shift(grad_kv, ps)
                collectives.wait_all(requests)
            source = (rank - step) % cp
            for rows, cols, masked, kb, vb, keep in _block_tiles(kv, q, source, ps,
                                                                 ctx.seeds[source],
                                                                 ctx.dropout_p):
                dq, dk, dv = block_backward(qf[:, :, rows], kb, vb, masked, scale, keep,
                                            lse[:, :, rows], delta[:, :, rows],
                                            grad_out[:, :, rows])
                grad_q[:, :, rows] += dq
                grad_kv[:, :, :, cols] += torch.stack([_fold_heads(dk, groups),
                                                       _fold_heads(dv, groups)])
        if cp > 1:  # the last block's gradient goes home to the next rank
            grad_kv, requests = post_ring_shift(grad_kv, ps)
            collectives.wait_all(requests)
        return grad_q.to(q.dtype), grad_kv[0].to(k.dtype), grad_kv[1].to(v.dtype), None, None


def _work_dtype(x: torch.Tensor) -> torch.dtype:
    """The ring's arithmetic dtype: fp32 for half inputs, the input's own otherwise."""
    return torch.promote_types(x.dtype, torch.float32)


def _ring_blocks(kv: torch.Tensor, parallel_state: ParallelState):
    """Yield (step, key/value block [2, b, ng, s/C, hd]) for step 0 .. C-1, block `step`
    coming from context rank (rank - step); the next block's transfer is posted before the
    current one is handed out, so it overlaps the block's attention."""
    cp = parallel_state.context_parallel_size
    for step in range(cp):
        if step < cp - 1:
            following, requests = post_ring_shift(kv, parallel_state)
        yield step, kv
        if step < cp - 1:
            collectives.wait_all(requests)
            kv = following


def _expand_heads(kv: torch.Tensor, heads: int, cols: slice
                  ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [b, ng, s/C, hd] -> [b, heads, keys `cols`, hd], at least fp32 (each group
    repeated for its heads / ng query heads)."""
    kv = kv[:, :, :, cols].to(_work_dtype(kv))  # [2, b, ng, keys, hd]
    repeat = heads // kv.shape[2]
    return kv[0].repeat_interleave(repeat, dim=1), kv[1].repeat_interleave(repeat, dim=1)


def _fold_heads(grad: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient [b, nh, sk, hd] of repeated key/value heads summed back to their groups
    [b, ng, sk, hd] (the backward of _expand_heads)."""
    b, nh, sk, hd = grad.shape
    return grad.view(b, groups, nh // groups, sk, hd).sum(2)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   parallel_state: ParallelState, dropout_p: float = 0.0) -> torch.Tensor:
    """Causal attention of this context rank's queries q [b, nh, s/C, hd] to the whole
    sequence's keys/values, given this rank's k, v [b, ng, s/C, hd] (ng divides nh: grouped
    queries); returns [b, nh, s/C, hd] in q's dtype. Arithmetic in (at least) fp32, scale
    1/sqrt(hd); backward keeps q, k, v, the output and its log-sum-exp only (_RingAttention)."""
    return _RingAttention.apply(q, k, v, parallel_state, dropout_p)


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
