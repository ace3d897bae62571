"""Pipeline parallelism (PP = 2 on 2 ranks, TP = 2 x PP = 2 on 4 ranks) against one process.

A toy model of residual MLP layers built from the tensor-parallel layers is split into stages
by global layer index and trained one iteration with the 1F1B schedule; losses and every
rank's gradient shards must equal the single-process run of the whole model (no pipelining),
built in the same process from the same seeds.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional

import pytest
import torch
import torch.distributed as dist
from torch import nn

from app import mpu
from app.mpu import collectives
from app.pipeline import (forward_backward_no_pipelining, forward_backward_pipelining_1f1b,
                          get_forward_backward_func, stage_layer_range)
from app.pipeline import p2p
from tests.harness.distributed import expect_close, run_checks, run_distributed

NUM_LAYERS, HIDDEN, MICRO_BATCH, SEQ = 4, 8, 2, 3


def _init(seed: int) -> Callable[[torch.Tensor], None]:
    def init(w: torch.Tensor) -> None:
        w.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(seed))
    return init


class ToyLayer(nn.Module):
    """h + Row(tanh(Column(h))): a residual MLP whose init depends only on the global index."""

    def __init__(self, index: int, ps: mpu.ParallelState) -> None:
        super().__init__()
        self.fc1 = mpu.ColumnParallelLinear(HIDDEN, 2 * HIDDEN, init_method=_init(100 + index),
                                            parallel_state=ps)
        self.fc2 = mpu.RowParallelLinear(2 * HIDDEN, HIDDEN, init_method=_init(200 + index),
                                         parallel_state=ps)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.fc2(torch.tanh(self.fc1(h)))  # [b, s, h]


class ToyStage(nn.Module):
    """The layers of one pipeline stage; the last stage returns the MSE loss."""

    def __init__(self, ps: mpu.ParallelState) -> None:
        super().__init__()
        self.ps = ps
        layer_range = stage_layer_range(NUM_LAYERS, ps.pipeline_model_parallel_size,
                                        ps.pipeline_model_parallel_rank)
        self.layers = nn.ModuleDict({str(i): ToyLayer(i, ps) for i in layer_range})
        self.input_tensor: Optional[torch.Tensor] = None

    def set_input_tensor(self, tensor: Optional[torch.Tensor]) -> None:
        self.input_tensor = tensor

    def forward(self, batch: Dict[str, torch.Tensor]) -> torch.Tensor:
        h = batch["x"] if self.ps.is_pipeline_first_stage() else self.input_tensor
        for layer in self.layers.values():
            h = layer(h)
        if self.ps.is_pipeline_last_stage():
            return (h - batch["y"]).square().sum(-1)  # per-token loss [b, s]
        return h


def _loss_func(per_token: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    return (per_token * loss_mask).sum() / loss_mask.sum()


def _batches(n: int) -> List[Dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [{"x": torch.randn(MICRO_BATCH, SEQ, HIDDEN, generator=g),
             "y": torch.randn(MICRO_BATCH, SEQ, HIDDEN, generator=g),
             "loss_mask": (torch.rand(MICRO_BATCH, SEQ, generator=g) > 0.3).float()}
            for _ in range(n)]


def _schedule_kwargs(model: nn.Module, num_microbatches: int, backward, ps):
    batches = iter(_batches(num_microbatches))
    return dict(forward_step_func=lambda batch: (model(batch), batch["loss_mask"]),
                batch_func=lambda: next(batches), model=model,
                num_microbatches=num_microbatches, loss_func=_loss_func,
                backward_func=backward, parallel_state=ps)


def _reference(num_microbatches: int):
    """Whole model in this process: (losses, {param name: full grad})."""
    model = ToyStage(mpu.ParallelState.single())
    losses = forward_backward_no_pipelining(
        **_schedule_kwargs(model, num_microbatches, torch.Tensor.backward,
                           mpu.ParallelState.single()))
    return torch.stack(losses), {n: p.grad for n, p in model.named_parameters()}


def _shard_of(full: torch.Tensor, param: torch.Tensor, ps: mpu.ParallelState) -> torch.Tensor:
    if not getattr(param, "tensor_model_parallel", False):
        return full
    return full.chunk(ps.tensor_model_parallel_size,
                      dim=param.partition_dim)[ps.tensor_model_parallel_rank]


def _run_pipeline(ps: mpu.ParallelState, num_microbatches: int, forward_only: bool = False):
    model = ToyStage(ps)
    calls = []

    def backward(loss):  # an engine's backward: called with the (scaled) loss only
        assert loss.dim() == 0
        calls.append(loss)
        loss.backward()
    schedule = get_forward_backward_func(ps)
    assert schedule is forward_backward_pipelining_1f1b
    losses = schedule(**_schedule_kwargs(model, num_microbatches, backward, ps),
                      tensor_shape=(MICRO_BATCH, SEQ, HIDDEN), forward_only=forward_only)
    return model, losses, calls


def check_pipeline_matches_single_process(ps: mpu.ParallelState) -> None:
    for m in (1, 2, 5):
        model, losses, calls = _run_pipeline(ps, m)
        ref_losses, ref_grads = _reference(m)
        expect_close(len(calls), m if ps.is_pipeline_last_stage() else 0,
                     f"M={m}: engine backward calls")
        if ps.is_pipeline_last_stage():
            expect_close(torch.stack(losses), ref_losses, f"M={m}: losses", atol=1e-6)
        else:
            assert losses == []
        names = dict(model.named_parameters())
        assert names, "every stage holds layers"
        for name, param in names.items():
            expect_close(param.grad, _shard_of(ref_grads[name], param, ps), f"M={m}: {name} grad")


def check_forward_only(ps: mpu.ParallelState) -> None:
    model, losses, calls = _run_pipeline(ps, 3, forward_only=True)
    assert calls == [] and all(p.grad is None for p in model.parameters())
    if ps.is_pipeline_last_stage():
        expect_close(torch.stack(losses), _reference(3)[0], "forward-only losses", atol=1e-6)


def check_p2p(ps: mpu.ParallelState) -> None:
    shape = (2, 3)
    if ps.is_pipeline_first_stage():
        p2p.send_forward(ps, torch.full(shape, 5.0))
        grad = p2p.recv_backward(ps, shape, torch.float32, torch.device("cpu"))
        assert torch.equal(grad, torch.full(shape, 6.0))
        assert p2p.recv_forward(ps, shape, torch.float32, torch.device("cpu")) is None
    else:
        act = p2p.recv_forward(ps, shape, torch.float32, torch.device("cpu"))
        assert act.requires_grad and torch.equal(act.detach(), torch.full(shape, 5.0))
        p2p.send_backward(ps, act.detach() + 1)
        assert p2p.recv_backward(ps, shape, torch.float32, torch.device("cpu")) is None


def check_clip_and_tied_embeddings(ps: mpu.ParallelState) -> None:
    """Norm over TP x PP equals the dense norm; a `shared` tied copy is counted once."""
    model, _, _ = _run_pipeline(ps, 2)
    _, ref_grads = _reference(2)
    tied = nn.Parameter(torch.zeros(4))  # a word embedding held by the first and last stage
    tied.tensor_model_parallel = False
    tied.grad = torch.full((4,), 1.0 + ps.pipeline_model_parallel_rank)
    if ps.is_pipeline_last_stage() and ps.pipeline_model_parallel_size > 1:
        tied.shared = True
    mpu.allreduce_embedding_grads(tied, ps)
    expect_close(tied.grad, torch.full((4,), 3.0), "tied grad summed")  # 1 + 2 over the two stages
    dense_sq = sum(g.pow(2).sum() for g in ref_grads.values()) + tied.grad.pow(2).sum()
    norm = mpu.clip_grad_norm(list(model.parameters()) + [tied], 0.0, ps)
    assert abs(norm - dense_sq.sqrt().item()) < 1e-5 * norm, (norm, dense_sq.sqrt().item())


def check_layout(ps: mpu.ParallelState) -> None:
    rank = dist.get_rank()
    layout = mpu.rank_layout(dist.get_world_size(), ps.tensor_model_parallel_size,
                             ps.pipeline_model_parallel_size)
    mine = {kind: next(g for g in groups if rank in g) for kind, groups in layout.items()
            if kind != "embedding"}
    assert ps.tensor_model_parallel_ranks == mine["tensor"]
    assert ps.pipeline_ranks == mine["pipeline"]
    assert ps.data_parallel_ranks == mine["data"]
    for kind, group in (("tensor", ps.tensor_model_parallel_group),
                        ("pipeline", ps.pipeline_model_parallel_group),
                        ("data", ps.data_parallel_group), ("model", ps.model_parallel_group)):
        assert collectives.group_size(group) == len(mine[kind]), kind
        assert collectives.group_rank(group) == mine[kind].index(rank), kind
    total = collectives.all_reduce(torch.ones(1), ps.model_parallel_group)
    assert total.item() == ps.model_parallel_size
    assert ps.get_model_parallel_rank() == mine["model"].index(rank)
    assert ps.pipeline_next_rank() == (None if ps.is_pipeline_last_stage()
                                       else mine["pipeline"][ps.pipeline_model_parallel_rank + 1])


CHECKS: Dict[str, Callable[[mpu.ParallelState], None]] = {
    f.__name__: f for f in (check_layout, check_p2p, check_pipeline_matches_single_process,
                            check_forward_only, check_clip_and_tied_embeddings)}


def _pipeline_checks(tp: int, pp: int) -> Dict[str, Optional[str]]:
    return run_checks(CHECKS, mpu.initialize_model_parallel(tp, pp))


LAYOUTS = {"pp2": (2, 1, 2), "tp2_pp2": (4, 2, 2)}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def pipeline_outcome(request):
    world, tp, pp = LAYOUTS[request.param]
    return run_distributed(_pipeline_checks, world, tp, pp, timeout=60)


@pytest.mark.parametrize("name", list(CHECKS))
def test_mpu_pipeline(pipeline_outcome, name):
    for rank, outcome in enumerate(pipeline_outcome):
        assert outcome[name] is None, f"rank {rank}:\n{outcome[name]}"
