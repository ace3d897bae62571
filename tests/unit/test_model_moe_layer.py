"""The MoE layer in one process against a dense loop over experts written token by token: the
output and every gradient (input, router, experts, shared expert and its gate), with the
load-balancing and z losses' gradients injected at the scale an engine sets; the grouped
matmul path against the loop; both dispatchers; the expert marks and initial values at any
expert-parallel rank; which layers are MoE layers; the parameter count formula."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from app.config import ModelConfig, MoEConfig
from app.model.gpt2 import GPT2Model, ParamInit
from app.model.moe import begin_iteration
from app.model.moe.experts import grouped_mm_applies
from app.model.moe.layer import MoELayer
from app.mpu.parallel_state import ParallelState

H, E, FFN, TOKENS = 16, 4, 8, 12


def _config(swiglu=True, **moe) -> ModelConfig:
    settings = dict(num_experts=E, moe_ffn_hidden_size=FFN, moe_router_topk=2,
                    moe_aux_loss_coeff=[1e-2], moe_z_loss_coeff=1e-3)
    settings.update(moe)
    return ModelConfig(num_layers=2, hidden_size=H, num_attention_heads=4, padded_vocab_size=64,
                       seq_length=TOKENS // 2, swiglu=swiglu, add_bias_linear=False,
                       ffn_hidden_size=32, normalization="RMSNorm", moe=MoEConfig(**settings))


def _layer(config: ModelConfig, ps: ParallelState = None) -> MoELayer:
    return MoELayer(config, ps or ParallelState.single(), ParamInit(config),
                    "language_model.transformer.layers.0.mlp", 0)


def _dense_reference(layer: MoELayer, x: torch.Tensor, swiglu: bool, scale: float):
    """out [b, s, h] and the loss terms, one token and one expert at a time, from the layer's
    weights (Megatron's definitions: top-k of the logits, softmax over the k; aux loss with
    the full softmax's top-k counts; z-loss the mean squared logsumexp)."""
    w_router = layer.router.weight
    fc1, fc2 = layer.experts.dense_h_to_4h.weight, layer.experts.dense_4h_to_h.weight
    tokens = x.reshape(-1, H)
    logits = tokens @ w_router.t()
    out_rows = []
    for t in range(tokens.shape[0]):
        top = torch.topk(logits[t], 2)
        weights = torch.softmax(top.values, -1)
        acc = torch.zeros(H)
        for p, e in zip(weights, top.indices.tolist()):
            mid = fc1[e] @ tokens[t]
            act = F.silu(mid[:FFN]) * mid[FFN:] if swiglu else F.gelu(mid)
            acc = acc + fc2[e] @ (p * act)
        out_rows.append(acc)
    out = torch.stack(out_rows).view_as(x)
    if layer.shared_experts is not None:
        s = layer.shared_experts
        mid = tokens @ s.dense_h_to_4h.weight.t()
        f = mid.shape[-1] // 2
        shared = (F.silu(mid[:, :f]) * mid[:, f:]) @ s.dense_4h_to_h.weight.t()
        if s.gate_weight is not None:
            shared = shared * torch.sigmoid(tokens @ s.gate_weight.t())
        out = out + shared.view_as(x)
    full = torch.softmax(logits, -1)
    counts = torch.zeros(E).scatter_add(0, torch.topk(full, 2).indices.reshape(-1),
                                        torch.ones(tokens.shape[0] * 2))
    t = tokens.shape[0]
    aux = 1e-2 * E / (2 * t * t) * (full.sum(0) * counts).sum()
    z = 1e-3 * (torch.logsumexp(logits, -1) ** 2).mean()
    return out, scale * (aux + z)


@pytest.mark.parametrize("swiglu,shared,dispatcher,grouped", [
    (True, None, "allgather", False), (True, 8, "alltoall", False),
    (False, None, "allgather", True), (True, 16, "allgather", True)])
def test_layer_equals_dense_loop_over_experts(swiglu, shared, dispatcher, grouped):
    config = _config(swiglu, moe_shared_expert_intermediate_size=shared,
                     moe_shared_expert_gate=shared is not None,
                     moe_token_dispatcher_type=dispatcher, moe_grouped_gemm=grouped)
    layer = _layer(config).train()
    begin_iteration(layer, 2.0, 1, 8)  # loss scale x CP / micro-batches = 0.25
    x = torch.randn(2, TOKENS // 2, H, generator=torch.Generator().manual_seed(0),
                    requires_grad=True)
    grad_out = torch.randn(2, TOKENS // 2, H, generator=torch.Generator().manual_seed(1))
    out, bias = layer(x)
    assert bias is None
    out.backward(grad_out)
    got = {n: p.grad.clone() for n, p in layer.named_parameters()}
    got_x = x.grad.clone()
    for p in layer.parameters():
        p.grad = None
    x.grad = None
    want, extra = _dense_reference(layer, x, swiglu, 0.25)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    ((want * grad_out).sum() + extra).backward()
    for name, param in layer.named_parameters():
        torch.testing.assert_close(got[name], param.grad, rtol=1e-5, atol=1e-7, msg=name)
    torch.testing.assert_close(got_x, x.grad, rtol=1e-5, atol=1e-7)


def test_grouped_matmul_equals_the_loop():
    """--moe-grouped-gemm (torch's grouped_mm where the shapes allow) against the loop, with an
    expert that receives no token (its weights still get a zero gradient)."""
    runs = []
    for grouped in (False, True):
        layer = _layer(_config(moe_grouped_gemm=grouped)).train()
        x = torch.randn(TOKENS, H, generator=torch.Generator().manual_seed(2), requires_grad=True)
        counts = [5, 0, 11, 8]
        rows = torch.randn(sum(counts), H, generator=torch.Generator().manual_seed(3))
        probs = torch.rand(sum(counts), generator=torch.Generator().manual_seed(4))
        if grouped:
            assert grouped_mm_applies(rows, layer.experts.dense_h_to_4h.weight)
        out = layer.experts(rows.requires_grad_(), counts, probs)
        out.square().sum().backward()
        runs.append((out.detach(), rows.grad, layer.experts.dense_h_to_4h.weight.grad,
                     layer.experts.dense_4h_to_h.weight.grad))
        del x
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert torch.count_nonzero(runs[1][2][1]) == 0  # expert 1: no tokens, zero gradient


def test_experts_are_marked_and_drawn_independently_of_expert_parallelism():
    config = _config()
    whole = _layer(config)
    for rank in (0, 1):  # the EP2 ranks' layers, built in this process (no communication)
        ps = ParallelState(expert_model_parallel_size=2, expert_model_parallel_rank=rank)
        part = _layer(config, ps)
        for name in ("dense_h_to_4h", "dense_4h_to_h"):
            mine = getattr(part.experts, name).weight
            assert mine.allreduce is False and mine.expert_axis == (0, rank, 2)
            assert mine.group_name == "ep_size_2" and mine.tensor_model_parallel
            torch.testing.assert_close(mine, getattr(whole.experts, name).weight[2 * rank:
                                                                                  2 * rank + 2])
    for rank in (0, 1):  # expert tensor parallelism: [gate_r; up_r] rows, fc2 columns
        ps = ParallelState(expert_tensor_parallel_size=2, expert_tensor_parallel_rank=rank)
        part = _layer(config, ps)
        fc1 = whole.experts.dense_h_to_4h.weight
        gate, up = fc1[:, :FFN], fc1[:, FFN:]
        want = torch.cat([gate[:, rank * 4:rank * 4 + 4], up[:, rank * 4:rank * 4 + 4]], 1)
        torch.testing.assert_close(part.experts.dense_h_to_4h.weight, want)
        torch.testing.assert_close(part.experts.dense_4h_to_h.weight,
                                   whole.experts.dense_4h_to_h.weight[:, :, rank * 4:rank * 4 + 4])
    assert whole.router.weight.tensor_model_parallel is False
    assert getattr(whole.router.weight, "allreduce", True) is True


def test_layer_freq_and_parameter_count():
    config = dataclasses.replace(_config(), num_layers=4,
                                 moe=MoEConfig(num_experts=E, moe_ffn_hidden_size=FFN,
                                               moe_layer_freq=[0, 1, 1, 0]))
    model = GPT2Model(config)
    kinds = [type(model.language_model.transformer.layers[str(i)].mlp).__name__
             for i in range(4)]
    assert kinds == ["ParallelMLP", "MoELayer", "MoELayer", "ParallelMLP"]
    assert config.parameter_numels() == [p.numel() for p in model.parameters()]
    every_other = MoEConfig(num_experts=E, moe_layer_freq=2)
    assert every_other.layer_pattern(5) == [True, False, True, False, True]
    shared = dataclasses.replace(config, moe=MoEConfig(
        num_experts=E, moe_ffn_hidden_size=FFN, moe_shared_expert_intermediate_size=8,
        moe_shared_expert_gate=True))
    model = GPT2Model(shared)
    assert shared.parameter_numels() == [p.numel() for p in model.parameters()]
    ps = ParallelState(expert_model_parallel_size=2, expert_tensor_parallel_size=2)
    model = GPT2Model(shared, ps)
    assert shared.parameter_numels(expert_model_parallel_size=2,
                                   expert_tensor_parallel_size=2) == [
        p.numel() for p in model.parameters()]
