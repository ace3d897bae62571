"""app.mpu in one process: rank layout arithmetic, the single state, TP = 1 layers, RNG."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from app import mpu
from app.mpu import collectives
from app.mpu.utils import divide, shard_range, vocab_range


def test_rank_layout_matches_megatron_example():
    # Megatron's docstring: 16 GPUs, TP=2, PP=4 -> DP=2.
    layout = mpu.rank_layout(16, 2, 4)
    assert layout["tensor"] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13],
                                [14, 15]]
    assert layout["data"] == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14],
                              [13, 15]]
    assert layout["pipeline"] == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert layout["model"] == [[0, 1, 4, 5, 8, 9, 12, 13], [2, 3, 6, 7, 10, 11, 14, 15]]
    assert layout["embedding"] == [[0, 12], [1, 13], [2, 14], [3, 15]]


@pytest.mark.parametrize("world,tp,pp", [(1, 1, 1), (2, 2, 1), (2, 1, 2), (8, 2, 2), (12, 3, 2)])
def test_rank_layout_partitions_world(world, tp, pp):
    layout = mpu.rank_layout(world, tp, pp)
    dp = world // (tp * pp)
    for kind, size, count in (("tensor", tp, world // tp), ("data", dp, world // dp),
                              ("pipeline", pp, world // pp), ("model", tp * pp, dp)):
        groups = layout[kind]
        assert len(groups) == count and all(len(g) == size for g in groups)
        assert sorted(r for g in groups for r in g) == list(range(world)), kind


def test_rank_layout_validation_names_values():
    with pytest.raises(ValueError, match=r"world size \(6\) is not divisible by "
                                         r"tensor_model_parallel_size \(2\) x "
                                         r"pipeline_model_parallel_size \(2\)"):
        mpu.rank_layout(6, 2, 2)
    with pytest.raises(ValueError, match="tensor_model_parallel_size must be positive"):
        mpu.rank_layout(4, 0, 1)


def test_utils_arithmetic():
    assert divide(12, 4) == 3
    with pytest.raises(ValueError, match=r"vocab size \(10\) is not divisible by "
                                         r"tensor_model_parallel_size \(4\)"):
        vocab_range(10, 0, 4)
    assert vocab_range(12, 2, 3) == (8, 12)
    assert shard_range(8, 1, 2) == (4, 8)


def test_single_state_and_deepspeed_interface():
    ps = mpu.ParallelState.single()
    assert ps.world_size == 1 and ps.model_parallel_size == 1
    assert ps.get_model_parallel_rank() == 0 and ps.get_model_parallel_world_size() == 1
    assert ps.get_data_parallel_rank() == 0 and ps.get_data_parallel_world_size() == 1
    assert ps.get_model_parallel_group() is None and ps.get_data_parallel_group() is None
    assert ps.is_pipeline_first_stage() and ps.is_pipeline_last_stage()
    assert ps.pipeline_next_rank() is None and ps.pipeline_prev_rank() is None
    import copy
    assert copy.deepcopy(ps) is ps
    assert not dist.is_initialized()
    assert mpu.initialize_model_parallel(1, 1) == ps
    with pytest.raises(RuntimeError, match="init_process_group"):
        mpu.initialize_model_parallel(2, 1)


def test_collectives_short_circuit_without_distributed():
    t = torch.ones(3)
    assert collectives.all_reduce(t, None) is t
    assert collectives.all_gather_last_dim(t, None) is t
    assert collectives.reduce_scatter(t, None) is t
    assert collectives.broadcast(t, 0, None) is t
    collectives.barrier(None)
    assert collectives.group_size(None) == 1 and collectives.group_rank(None) == 0
    with pytest.raises(ValueError, match="op must be"):
        collectives.all_reduce(t, None, op="mean")


def _init(seed):
    return lambda w: w.normal_(0, 0.2, generator=torch.Generator().manual_seed(seed))


def test_layers_tp1_match_dense_and_mark_params():
    ps = mpu.ParallelState.single()
    col = mpu.ColumnParallelLinear(4, 6, init_method=_init(1), parallel_state=ps)
    row = mpu.RowParallelLinear(6, 4, init_method=_init(2), parallel_state=ps, bias=False)
    emb = mpu.VocabParallelEmbedding(9, 4, init_method=_init(3))
    assert col.weight.tensor_model_parallel and col.weight.partition_dim == 0
    assert row.weight.tensor_model_parallel and row.weight.partition_dim == 1 and row.bias is None
    ids = torch.tensor([[0, 8, 3]])
    w = torch.empty(9, 4)
    _init(3)(w)
    torch.testing.assert_close(emb(ids), F.embedding(ids, w))
    x = torch.randn(2, 3, 4)
    wc, wr = torch.empty(6, 4), torch.empty(4, 6)
    _init(1)(wc)
    _init(2)(wr)
    torch.testing.assert_close(row(col(x)), F.linear(F.linear(x, wc), wr))
    out, bias = mpu.ColumnParallelLinear(4, 6, init_method=_init(1), skip_bias_add=True)(x)
    assert bias.shape == (6,)
    half = mpu.ColumnParallelLinear(4, 6, init_method=_init(1), params_dtype=torch.bfloat16)
    assert half.weight.dtype == torch.bfloat16 and half.bias.dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"output_size \(6\) is not divisible"):
        mpu.ColumnParallelLinear(4, 6, init_method=_init(1),
                                 parallel_state=mpu.ParallelState(tensor_model_parallel_size=4))


def test_cross_entropy_tp1_matches_torch():
    logits = torch.randn(2, 5, 11, dtype=torch.float64).float().requires_grad_()
    target = torch.randint(0, 11, (2, 5))
    loss = mpu.vocab_parallel_cross_entropy(logits, target)
    ref_logits = logits.detach().clone().requires_grad_()
    ref = F.cross_entropy(ref_logits.view(-1, 11), target.view(-1), reduction="none").view(2, 5)
    torch.testing.assert_close(loss, ref)
    loss.mean().backward()
    ref.mean().backward()
    torch.testing.assert_close(logits.grad, ref_logits.grad)


def test_rng_tracker_single_process():
    mpu.model_parallel_seed(5)
    tracker = mpu.get_rng_tracker()
    with pytest.raises(ValueError, match="already exists"):
        tracker.add("model-parallel-rng", 99)
    with pytest.raises(KeyError, match="never added"):
        with tracker.fork("nope"):
            pass
    outside = torch.rand(4)
    with tracker.fork():
        inside = torch.rand(4)
    assert not torch.equal(outside, inside)
    state = mpu.rng_state_dict()
    a = (torch.rand(3), __import__("numpy").random.rand(2))
    with tracker.fork():
        a_in = torch.rand(3)
    mpu.load_rng_state_dict(state)
    b = (torch.rand(3), __import__("numpy").random.rand(2))
    with tracker.fork():
        b_in = torch.rand(3)
    assert torch.equal(a[0], b[0]) and (a[1] == b[1]).all() and torch.equal(a_in, b_in)


def test_checkpoint_single_process_with_dropout_and_tuple_output():
    lin = torch.nn.Linear(4, 4)

    def fn(x, mask):
        y = F.dropout(lin(x), 0.5)
        with mpu.get_rng_tracker().fork():
            z = F.dropout(y, 0.5)
        return y, z if mask is None else z * mask

    x = torch.randn(3, 4)
    grads = []
    for ckpt in (False, True):
        mpu.model_parallel_seed(11)
        lin.zero_grad()
        xi = x.clone().requires_grad_()
        y, z = mpu.checkpoint(fn, xi, None) if ckpt else fn(xi, None)
        (y.sum() + z.square().sum()).backward()
        grads.append((xi.grad, lin.weight.grad.clone(), lin.bias.grad.clone()))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


def test_grad_helpers_single_process():
    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = torch.full((4,), 2.0)
    q = torch.nn.Parameter(torch.zeros(2))
    q.grad = torch.ones(2)
    q.shared = True  # a tied copy: not counted
    assert mpu.clip_grad_norm([p, q], 0.0) == pytest.approx(4.0)
    assert mpu.clip_grad_norm([p, q], 1.0) == pytest.approx(4.0)
    torch.testing.assert_close(p.grad, torch.full((4,), 0.5), atol=1e-5, rtol=1e-5)
    mpu.allreduce_gradients([p], None)
    mpu.allreduce_embedding_grads(p)


def test_set_checkpoint_implementation_routes_and_restores():
    from app.mpu import random as mpu_random
    calls = []
    other_tracker = mpu.RNGStatesTracker()
    mpu_random.set_checkpoint_implementation(lambda fn, *a: calls.append(a) or fn(*a),
                                             lambda: other_tracker)
    try:
        assert mpu.get_rng_tracker() is other_tracker
        assert mpu.checkpoint(lambda x: x + 1, torch.ones(1)).item() == 2.0 and len(calls) == 1
    finally:
        mpu_random.set_checkpoint_implementation(None, None)
    assert mpu.get_rng_tracker() is not other_tracker


def test_partition_layers_keeps_global_indices():
    from app.pipeline import partition_layers, stage_layer_range, stage_of_layer
    assert partition_layers(8, 4) == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert stage_layer_range(12, 3, 2) == range(8, 12)
    assert partition_layers(5, 1) == [range(0, 5)]
    assert [stage_of_layer(12, 3, layer) for layer in (0, 3, 4, 11)] == [0, 0, 1, 2]
    with pytest.raises(ValueError, match=r"layer 12 is not in"):
        stage_of_layer(12, 3, 12)
    with pytest.raises(ValueError, match=r"num_layers \(6\) is not divisible by "
                                         r"pipeline_model_parallel_size \(4\)"):
        partition_layers(6, 4)
    with pytest.raises(ValueError, match=r"pipeline_model_parallel_rank \(2\)"):
        stage_layer_range(4, 2, 2)


def test_no_pipelining_schedule_accumulates_mean_gradient():
    from app.pipeline import forward_backward_no_pipelining, get_forward_backward_func
    ps = mpu.ParallelState.single()
    assert get_forward_backward_func(ps) is forward_backward_no_pipelining
    w = torch.nn.Parameter(torch.tensor(2.0))
    batches = iter([torch.tensor(1.0), torch.tensor(3.0)])
    seen = []

    def backward(loss):
        seen.append(loss.item())
        loss.backward()
    losses = forward_backward_no_pipelining(
        forward_step_func=lambda x: (w * x, None), batch_func=lambda: next(batches), model=w,
        num_microbatches=2, loss_func=lambda out, mask: out, backward_func=backward,
        parallel_state=ps)
    assert [x.item() for x in losses] == [2.0, 6.0] and seen == [1.0, 3.0]  # loss / M
    assert w.grad.item() == pytest.approx(2.0)  # mean of d(w x)/dw over x = 1, 3
    batches = iter([torch.tensor(1.0)])
    with pytest.raises(ValueError, match=r"pipeline_model_parallel_size 1, got 2"):
        forward_backward_no_pipelining(
            forward_step_func=None, batch_func=None, model=None, num_microbatches=1,
            loss_func=None, backward_func=None,
            parallel_state=mpu.ParallelState(pipeline_model_parallel_size=2))
    losses = forward_backward_no_pipelining(
        forward_step_func=lambda x: (w * x, None), batch_func=lambda: next(batches), model=w,
        num_microbatches=1, loss_func=lambda out, mask: out, backward_func=backward,
        parallel_state=ps, forward_only=True)
    assert [x.item() for x in losses] == [2.0] and len(seen) == 2 and not losses[0].requires_grad
