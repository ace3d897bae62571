"""app.mpu at TP = 2 (and DP = 2) on 2 gloo ranks, against dense computations in each process.

One spawn runs every check (`run_checks` in `_tp2_checks`); each check's outcome is reported
back and asserted by its own pytest item, so a failure names the piece that broke without
spawning again. Comparisons use `expect_close`, which records instead of raising, so the ranks
stay in step when a number is wrong.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from app import mpu
from app.kernels import library as kernel_library
from app.mpu import collectives
from app.mpu.cross_entropy import (fused_vocab_parallel_cross_entropy, grad_reference,
                                   row_stats_reference)
from tests.harness.distributed import expect_close, run_checks, run_distributed

ATOL, RTOL = 1e-5, 1e-5


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    expect_close(actual, expected, what, atol=ATOL, rtol=RTOL)


def _init(seed: int, std: float = 0.3) -> Callable[[torch.Tensor], None]:
    """init_method drawing the full weight from a fixed seed (same on every rank, any TP)."""
    def init(w: torch.Tensor) -> None:
        w.normal_(0.0, std, generator=torch.Generator().manual_seed(seed))
    return init


def _rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _shard(t: torch.Tensor, dim: int, ps: mpu.ParallelState) -> torch.Tensor:
    return t.chunk(ps.tensor_model_parallel_size, dim=dim)[ps.tensor_model_parallel_rank]


# ---- checks run on every rank ------------------------------------------------------------------

def check_state(ps: mpu.ParallelState) -> None:
    rank = dist.get_rank()
    assert (ps.tensor_model_parallel_size, ps.pipeline_model_parallel_size,
            ps.data_parallel_size) == (2, 1, 1)
    assert ps.tensor_model_parallel_rank == rank and ps.data_parallel_rank == 0
    assert ps.get_model_parallel_world_size() == 2 and ps.get_model_parallel_rank() == rank
    assert ps.get_data_parallel_world_size() == 1 and ps.get_data_parallel_rank() == 0
    assert collectives.group_size(ps.get_model_parallel_group()) == 2
    assert ps.is_pipeline_first_stage() and ps.is_pipeline_last_stage()
    assert mpu.get_parallel_state() is ps


def check_collectives(ps: mpu.ParallelState) -> None:
    rank, g = dist.get_rank(), ps.tensor_model_parallel_group
    t = torch.tensor([1.0 + rank, 10.0])
    _close(collectives.all_reduce(t.clone(), g), torch.tensor([3.0, 20.0]), "sum")
    _close(collectives.all_reduce(t.clone(), g, op="avg"), torch.tensor([1.5, 10.0]), "avg")
    _close(collectives.all_reduce(t.clone(), g, op="max"), torch.tensor([2.0, 10.0]), "max")
    _close(collectives.all_reduce(t.clone(), None), t, "group None is identity")
    x = torch.arange(6.0).reshape(2, 3) + 100 * rank
    gathered = collectives.all_gather_last_dim(x, g)
    _close(gathered, torch.cat([torch.arange(6.0).reshape(2, 3),
                                torch.arange(6.0).reshape(2, 3) + 100], -1), "all_gather_last_dim")
    _close(collectives.split_last_dim(gathered, g), x, "split_last_dim")
    full = torch.arange(8.0).reshape(2, 4) * (rank + 1)
    _close(collectives.reduce_scatter(full, g), _shard(torch.arange(8.0).reshape(2, 4) * 3, -1, ps),
           "reduce_scatter")
    b = torch.full((3,), float(rank))
    _close(collectives.broadcast(b, 1, g), torch.ones(3), "broadcast from rank 1")
    assert collectives.broadcast_object({"r": rank}, 0, g) == {"r": 0}
    other = 1 - rank
    inbox = torch.empty(4)
    collectives.send_recv([(torch.full((4,), float(rank)), other)], [(inbox, other)])
    _close(inbox, torch.full((4,), float(other)), "send_recv both ways at once")
    collectives.barrier(g)


def check_mappings(ps: mpu.ParallelState) -> None:
    rank = ps.tensor_model_parallel_rank
    up = [_rand(2, 4, seed=10), _rand(2, 4, seed=11)]  # per-rank upstream grads
    x = _rand(2, 4, seed=1).requires_grad_()
    y = mpu.copy_to_tensor_model_parallel_region(x, ps)
    _close(y, x.detach(), "copy forward")
    y.backward(up[rank])
    _close(x.grad, up[0] + up[1], "copy backward = all-reduce")

    x = (_rand(2, 4, seed=2) * (rank + 1)).requires_grad_()
    y = mpu.reduce_from_tensor_model_parallel_region(x, ps)
    _close(y, _rand(2, 4, seed=2) * 3, "reduce forward")
    y.backward(up[rank])
    _close(x.grad, up[rank], "reduce backward = identity")

    x = _rand(2, 8, seed=3).requires_grad_()
    y = mpu.scatter_to_tensor_model_parallel_region(x, ps)
    _close(y, _shard(x.detach(), -1, ps), "scatter forward")
    y.backward(_shard(up[rank].repeat(1, 2), -1, ps))
    _close(x.grad, torch.cat([_shard(up[r].repeat(1, 2), -1, _fake_ps(r)) for r in (0, 1)], -1),
           "scatter backward = all-gather")

    x = (_rand(2, 4, seed=4) + rank).requires_grad_()
    y = mpu.gather_from_tensor_model_parallel_region(x, ps)
    _close(y, torch.cat([_rand(2, 4, seed=4), _rand(2, 4, seed=4) + 1], -1), "gather forward")
    g = _rand(2, 8, seed=12)
    y.backward(g)
    _close(x.grad, _shard(g, -1, ps), "gather backward = split")
    # the group form and the default-state form are the same functions
    z = mpu.reduce_from_tensor_model_parallel_region(torch.ones(2), ps.tensor_model_parallel_group)
    _close(z, torch.full((2,), 2.0), "reduce with a process group")
    _close(mpu.reduce_from_tensor_model_parallel_region(torch.ones(2)), torch.full((2,), 2.0),
           "reduce with the default state")


def _fake_ps(tp_rank: int) -> mpu.ParallelState:
    return mpu.ParallelState(tensor_model_parallel_size=2, tensor_model_parallel_rank=tp_rank)


def check_column_parallel(ps: mpu.ParallelState) -> None:
    w_full = torch.empty(12, 6)
    _init(5)(w_full)
    b_full = _rand(12, seed=6)
    x_full = _rand(3, 2, 6, seed=7)
    grad_out = _rand(3, 2, 12, seed=8)
    xd = x_full.clone().requires_grad_()
    wd = w_full.clone().requires_grad_()
    bd = b_full.clone().requires_grad_()
    yd = F.linear(xd, wd, bd)
    yd.backward(grad_out)
    for gather in (False, True):
        layer = mpu.ColumnParallelLinear(6, 12, gather_output=gather, init_method=_init(5),
                                         parallel_state=ps)
        assert layer.weight.shape == (6, 6) and layer.bias.shape == (6,)
        assert layer.weight.tensor_model_parallel and layer.weight.partition_dim == 0
        assert layer.bias.tensor_model_parallel and layer.bias.partition_dim == 0
        _close(layer.weight.detach(), _shard(w_full, 0, ps), "column weight shard")
        with torch.no_grad():
            layer.bias.copy_(_shard(b_full, 0, ps))
        x = x_full.clone().requires_grad_()
        y = layer(x)
        expected = yd.detach() if gather else _shard(yd.detach(), -1, ps)
        _close(y, expected, f"column output (gather={gather})")
        y.backward(grad_out if gather else _shard(grad_out, -1, ps))
        _close(x.grad, xd.grad, f"column input grad (gather={gather})")
        _close(layer.weight.grad, _shard(wd.grad, 0, ps), f"column weight grad (gather={gather})")
        _close(layer.bias.grad, _shard(bd.grad, 0, ps), f"column bias grad (gather={gather})")
    layer = mpu.ColumnParallelLinear(6, 12, init_method=_init(5), parallel_state=ps,
                                     skip_bias_add=True)
    out, bias = layer(x_full)
    assert bias is layer.bias
    _close(out, _shard(F.linear(x_full, w_full), -1, ps), "column skip_bias_add output")


def check_row_parallel(ps: mpu.ParallelState) -> None:
    w_full = torch.empty(5, 8)
    _init(9)(w_full)
    b_full = _rand(5, seed=10)
    x_full = _rand(3, 2, 8, seed=11)
    grad_out = _rand(3, 2, 5, seed=12)
    xd, wd, bd = (t.clone().requires_grad_() for t in (x_full, w_full, b_full))
    F.linear(xd, wd, bd).backward(grad_out)
    yd = F.linear(x_full, w_full, b_full)
    for parallel_input in (True, False):
        layer = mpu.RowParallelLinear(8, 5, input_is_parallel=parallel_input,
                                      init_method=_init(9), parallel_state=ps)
        assert layer.weight.shape == (5, 4) and layer.bias.shape == (5,)
        assert layer.weight.tensor_model_parallel and layer.weight.partition_dim == 1
        assert layer.bias.tensor_model_parallel is False
        _close(layer.weight.detach(), _shard(w_full, 1, ps), "row weight shard")
        with torch.no_grad():
            layer.bias.copy_(b_full)
        x = (_shard(x_full, -1, ps) if parallel_input else x_full).clone().requires_grad_()
        y = layer(x)
        _close(y, yd, f"row output (input_is_parallel={parallel_input})")
        y.backward(grad_out)
        expected_xg = _shard(xd.grad, -1, ps) if parallel_input else xd.grad
        _close(x.grad, expected_xg, f"row input grad (input_is_parallel={parallel_input})")
        _close(layer.weight.grad, _shard(wd.grad, 1, ps), "row weight grad shard")
        _close(layer.bias.grad, bd.grad, "row bias grad (replicated)")
    layer = mpu.RowParallelLinear(8, 5, init_method=_init(9), parallel_state=ps, skip_bias_add=True)
    out, bias = layer(_shard(x_full, -1, ps))
    assert bias is layer.bias
    _close(out, F.linear(x_full, w_full), "row skip_bias_add output")


def check_mlp_block(ps: mpu.ParallelState) -> None:
    """Column (no gather) -> GeLU -> Row: the Megatron MLP, end to end against dense."""
    fc1 = mpu.ColumnParallelLinear(6, 16, init_method=_init(21), parallel_state=ps)
    fc2 = mpu.RowParallelLinear(16, 6, init_method=_init(22), parallel_state=ps)
    w1, w2 = torch.empty(16, 6), torch.empty(6, 16)
    _init(21)(w1)
    _init(22)(w2)
    w1.requires_grad_()
    w2.requires_grad_()
    x = _rand(2, 3, 6, seed=23)
    xp, xd = x.clone().requires_grad_(), x.clone().requires_grad_()
    yp = fc2(F.gelu(fc1(xp)))
    yd = F.linear(F.gelu(F.linear(xd, w1)), w2)
    _close(yp, yd, "mlp output")
    yp.square().sum().backward()
    yd.square().sum().backward()
    _close(xp.grad, xd.grad, "mlp input grad")
    _close(fc1.weight.grad, _shard(w1.grad, 0, ps), "mlp fc1 weight grad shard")
    _close(fc2.weight.grad, _shard(w2.grad, 1, ps), "mlp fc2 weight grad shard")


def check_vocab_embedding(ps: mpu.ParallelState) -> None:
    emb = mpu.VocabParallelEmbedding(10, 4, init_method=_init(31), parallel_state=ps)
    full = torch.empty(10, 4)
    _init(31)(full)
    assert emb.weight.shape == (5, 4) and emb.weight.tensor_model_parallel
    assert (emb.vocab_start_index, emb.vocab_end_index) == (5 * ps.tensor_model_parallel_rank,
                                                            5 * ps.tensor_model_parallel_rank + 5)
    ids = torch.tensor([[0, 4, 5, 9], [9, 9, 1, 6]])
    fd = full.clone().requires_grad_()
    grad_out = _rand(2, 4, 4, seed=32)
    F.embedding(ids, fd).backward(grad_out)
    out = emb(ids)
    _close(out, F.embedding(ids, full), "embedding output")
    out.backward(grad_out)
    _close(emb.weight.grad, _shard(fd.grad, 0, ps), "embedding weight grad shard")


def _cross_entropy_case(seed: int):
    """(logits [3, 5, 12], targets [3, 5], upstream gradient [3, 5], dense loss, dense logits
    gradient); a large offset on the logits, so the max subtraction matters."""
    logits = _rand(3, 5, 12, seed=seed) * 4 + 30
    target = torch.tensor([[0, 11, 5, 6, 3], [7, 7, 1, 10, 2], [11, 0, 6, 5, 9]])
    grad_loss = _rand(3, 5, seed=seed + 1)
    ld = logits.clone().requires_grad_()
    ref = F.cross_entropy(ld.reshape(-1, 12), target.reshape(-1), reduction="none").reshape(3, 5)
    ref.backward(grad_loss)
    return logits, target, grad_loss, ref.detach(), ld.grad


def check_cross_entropy(ps: mpu.ParallelState) -> None:
    logits, target, grad_loss, ref, ref_grad = _cross_entropy_case(41)
    lp = _shard(logits, -1, ps).clone().requires_grad_()
    loss = mpu.vocab_parallel_cross_entropy(lp, target, ps)
    assert loss.dtype == torch.float32 and loss.shape == (3, 5)
    _close(loss, ref, "cross-entropy loss")
    loss.backward(grad_loss)
    _close(lp.grad, _shard(ref_grad, -1, ps), "cross-entropy logits grad shard")
    lp = _shard(logits, -1, ps).to(torch.bfloat16).requires_grad_()
    loss = mpu.vocab_parallel_cross_entropy(lp, target)  # default state
    assert loss.dtype == torch.float32
    expect_close(loss, ref, "bf16 cross-entropy loss", atol=0.2, rtol=0.02)
    loss.sum().backward()
    assert lp.grad.dtype == torch.bfloat16


def check_fused_cross_entropy(ps: mpu.ParallelState) -> None:
    """The fused variant (one-pass row stats, here their PyTorch references) equals the dense
    loss and gradient, in fp32 and from bf16 logits without an fp32 copy."""
    logits = _rand(3, 5, 12, seed=41) * 4 + 30
    target = torch.tensor([[0, 11, 5, 6, 3], [7, 7, 1, 10, 2], [11, 0, 6, 5, 9]])
    grad_loss = _rand(3, 5, seed=42)
    for dtype, tol in ((torch.float32, {}), (torch.bfloat16, dict(atol=1e-5, rtol=1e-5))):
        ld = logits.to(dtype).float().clone().requires_grad_()  # dense reference, same values
        ref = F.cross_entropy(ld.reshape(-1, 12), target.reshape(-1), reduction="none")
        ref.reshape(3, 5).backward(grad_loss)
        lp = _shard(logits, -1, ps).to(dtype).requires_grad_()
        loss = fused_vocab_parallel_cross_entropy(lp, target, ps, row_stats_reference,
                                                  grad_reference)
        assert loss.dtype == torch.float32 and loss.shape == (3, 5)
        expect_close(loss, ref.detach().reshape(3, 5), f"fused {dtype} loss", **tol)
        loss.backward(grad_loss)
        assert lp.grad.dtype == dtype
        # fp32 exp/log of logits near 40 differ by ~40 eps(fp32) ~ 5e-6 relative between the
        # two orders of operations; that may move a bf16 result by one rounding step (eps).
        want = _shard(ld.grad, -1, ps).to(dtype).float()
        expect_close(lp.grad.float(), want, f"fused {dtype} grad shard", atol=1e-5,
                     rtol=1e-5 + (torch.finfo(dtype).eps if dtype != torch.float32 else 0.0))


def check_mixed_cross_entropy_paths(ps: mpu.ParallelState) -> None:
    """Rank 0 on the fused path, rank 1 on the PyTorch one: the two issue the same all-reduces
    with the same meaning, so even mixed they give the dense loss and gradient."""
    logits, target, grad_loss, ref, ref_grad = _cross_entropy_case(43)
    lp = _shard(logits, -1, ps).clone().requires_grad_()
    if ps.tensor_model_parallel_rank == 0:
        loss = fused_vocab_parallel_cross_entropy(lp, target, ps, row_stats_reference,
                                                  grad_reference)
    else:
        loss = mpu.vocab_parallel_cross_entropy(lp, target, ps)
    _close(loss, ref, "mixed-path cross-entropy loss")
    loss.backward(grad_loss)
    _close(lp.grad, _shard(ref_grad, -1, ps), "mixed-path logits grad shard")


def check_kernel_choice_is_agreed(ps: mpu.ParallelState) -> None:
    """app.kernels.agree_across_ranks: the kernels stay on only where every rank has them; when
    only rank 1 has them (rank 0's build failed, say), rank 1 falls back too."""
    rank, world = dist.get_rank(), dist.group.WORLD
    obtain = kernel_library._obtain
    outcomes = []
    try:
        for have in ((True, True), (False, True)):
            kernel_library._obtain = lambda: kernel_library.Status(
                have[rank], "pretend: loaded" if have[rank] else "pretend: build failed")
            kernel_library.reset()
            agreed = kernel_library.agree_across_ranks(world, torch.device("cpu"))
            assert kernel_library.status() is agreed  # what every op consults from now on
            both = collectives.all_gather(torch.tensor([int(agreed.available)]), world)
            outcomes.append((have, agreed, [int(t) for t in both]))
    finally:
        kernel_library._obtain = obtain
        kernel_library.reset()
    (_, all_have, both_on), (_, one_lacks, both_off) = outcomes
    assert all_have.available and both_on == [1, 1], outcomes
    assert both_off == [0, 0], outcomes
    want = "pretend: build failed" if rank == 0 else "off on every rank: rank(s) [0] lack them"
    assert one_lacks.reason == want, outcomes


def _dropout_masks(ps: mpu.ParallelState):
    ones = torch.ones(64)
    inside, outside = [], []
    for _ in range(2):
        outside.append(F.dropout(ones, 0.5) > 0)
        with mpu.get_rng_tracker().fork():
            inside.append(F.dropout(ones, 0.5) > 0)
    return torch.stack(inside), torch.stack(outside)


def check_rng_tracker(ps: mpu.ParallelState) -> None:
    g = ps.tensor_model_parallel_group
    mpu.model_parallel_seed(1234, ps)
    inside, outside = _dropout_masks(ps)
    all_in = collectives.all_gather(inside.float(), g)
    all_out = collectives.all_gather(outside.float(), g)
    assert torch.equal(all_out[0], all_out[1]), "dropout outside the tracker must match across TP"
    assert not torch.equal(all_in[0], all_in[1]), "dropout inside the tracker must differ across TP"
    # the fork leaves the default stream as if it had not happened
    mpu.model_parallel_seed(1234, ps)
    a = torch.rand(5)
    with mpu.get_rng_tracker().fork():
        torch.rand(7)
    b = torch.rand(5)
    mpu.model_parallel_seed(1234, ps)
    _close(torch.cat([a, b]), torch.rand(10), "fork does not disturb the default stream")
    # state dict round trip reproduces both streams
    state = mpu.rng_state_dict()
    first = _dropout_masks(ps)
    mpu.load_rng_state_dict(state)
    second = _dropout_masks(ps)
    assert all(torch.equal(x, y) for x, y in zip(first, second)), "rng_state_dict round trip"


class _Block(torch.nn.Module):
    """Column -> dropout inside the tracker -> Row -> dropout outside (Megatron's layout)."""

    def __init__(self, ps: mpu.ParallelState) -> None:
        super().__init__()
        self.fc1 = mpu.ColumnParallelLinear(6, 16, init_method=_init(51), parallel_state=ps)
        self.fc2 = mpu.RowParallelLinear(16, 6, init_method=_init(52), parallel_state=ps)

    def forward(self, x: torch.Tensor, scale: Optional[float]) -> torch.Tensor:
        h = F.gelu(self.fc1(x))
        with mpu.get_rng_tracker().fork():
            h = F.dropout(h, 0.3)
        return F.dropout(self.fc2(h), 0.3) * (scale or 1.0)


def check_activation_checkpointing(ps: mpu.ParallelState) -> None:
    block = _Block(ps)
    x = _rand(2, 3, 6, seed=53)
    results = []
    for use_checkpoint in (False, True, True):
        mpu.model_parallel_seed(77, ps)
        block.zero_grad()
        xi = x.clone().requires_grad_()
        y = block(xi, None)
        y = mpu.checkpoint(block, y, 2.0) if use_checkpoint else block(y, 2.0)
        torch.rand(3)  # the default stream moves on before backward, as in training
        y.square().sum().backward()
        results.append([y.detach(), xi.grad] + [p.grad.clone() for p in block.parameters()])
    for use, got in zip(("checkpoint", "checkpoint again"), results[1:]):
        for i, (a, b) in enumerate(zip(got, results[0])):
            _close(a, b, f"{use}: tensor {i} equals the run without checkpointing")
    # parameters receive grads even when no input requires grad
    block.zero_grad()
    mpu.checkpoint(block, x, None).sum().backward()
    assert all(p.grad is not None for p in block.parameters())


def check_clip_grad_norm(ps: mpu.ParallelState) -> None:
    fc1 = mpu.ColumnParallelLinear(6, 8, init_method=_init(61), parallel_state=ps)
    fc2 = mpu.RowParallelLinear(8, 6, init_method=_init(62), parallel_state=ps)
    ln = torch.nn.LayerNorm(6)
    mpu.set_tensor_model_parallel_attributes(ln.weight, False)
    w1, w2 = torch.empty(8, 6), torch.empty(6, 8)
    _init(61)(w1)
    _init(62)(w2)
    dense = [w1.requires_grad_(), torch.zeros(8, requires_grad=True), w2.requires_grad_(),
             torch.zeros(6, requires_grad=True), torch.ones(6, requires_grad=True)]
    x = _rand(4, 6, seed=63)

    def dense_fwd(x):
        h = F.linear(F.gelu(F.linear(x, dense[0], dense[1])), dense[2], dense[3])
        return F.layer_norm(h, (6,), dense[4], None)
    dense_fwd(x).pow(3).sum().backward()
    expected = torch.norm(torch.stack([p.grad.norm() for p in dense])).item()
    ln.bias.requires_grad_(False)
    ln(fc2(F.gelu(fc1(x)))).pow(3).sum().backward()
    params = list(fc1.parameters()) + list(fc2.parameters()) + [ln.weight]
    norm = mpu.grad_norm(params, ps)
    assert abs(norm - expected) <= 1e-5 * expected, (norm, expected)
    inf_norm = mpu.grad_norm(params, ps, norm_type=float("inf"))
    assert abs(inf_norm - max(p.grad.abs().max().item() for p in dense)) < 1e-5
    returned = mpu.clip_grad_norm(params, expected / 4, ps)
    assert abs(returned - expected) <= 1e-5 * expected
    after = mpu.grad_norm(params, ps)
    assert abs(after - expected / 4) <= 1e-4 * expected, (after, expected / 4)
    _close(fc1.weight.grad, _shard(w1.grad, 0, ps) / 4, "clipped shard = dense grad / 4")


def check_data_parallel(ps_tp: mpu.ParallelState) -> None:
    """Re-layout the same 2 ranks as DP = 2 and average grads in small buckets."""
    ps = mpu.initialize_model_parallel(1, 1)
    rank = dist.get_rank()
    assert ps.data_parallel_size == 2 and ps.data_parallel_rank == rank
    assert ps.tensor_model_parallel_size == 1 and ps.get_model_parallel_world_size() == 1
    params = [torch.nn.Parameter(torch.zeros(n, dtype=dt))
              for n, dt in ((1000, torch.float32), (3, torch.float32), (70000, torch.float32),
                            (5, torch.float64), (2, torch.float32))]
    for i, p in enumerate(params):
        p.grad = torch.full_like(p, float(rank + i))
    params.append(torch.nn.Parameter(torch.zeros(2)))  # no grad: skipped
    mpu.allreduce_gradients(params, ps.data_parallel_group, bucket_size_mb=0.1)
    for i, p in enumerate(params[:-1]):
        _close(p.grad, torch.full_like(p, i + 0.5), f"DP-averaged grad {i}")
    assert params[-1].grad is None
    mpu.set_parallel_state(ps_tp)


CHECKS: Dict[str, Callable[[mpu.ParallelState], None]] = {
    f.__name__: f for f in (check_state, check_collectives, check_mappings, check_column_parallel,
                            check_row_parallel, check_mlp_block, check_vocab_embedding,
                            check_cross_entropy, check_fused_cross_entropy,
                            check_mixed_cross_entropy_paths, check_kernel_choice_is_agreed,
                            check_rng_tracker,
                            check_activation_checkpointing, check_clip_grad_norm,
                            check_data_parallel)}


def _tp2_checks() -> Dict[str, Optional[str]]:
    """Rank entry: build the TP = 2 layout, run every check, return {name: traceback or None}."""
    torch.manual_seed(0)
    return run_checks(CHECKS, mpu.initialize_model_parallel(2, 1))


@pytest.fixture(scope="module")
def tp2_outcome():
    return run_distributed(_tp2_checks, 2, timeout=60)


@pytest.mark.parametrize("name", list(CHECKS))
def test_mpu_tp2(tp2_outcome, name):
    for rank, outcome in enumerate(tp2_outcome):
        assert outcome[name] is None, f"rank {rank}:\n{outcome[name]}"
