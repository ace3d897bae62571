"""Selective recompute of --recompute-modules (core_attn, mlp, moe, shared_experts) and
--moe-layer-recompute on a tiny GPT with a dense and an MoE layer, dropout on, two
micro-batches per iteration: the losses, every parameter's gradient, the MoE log (load-balancing,
global and z losses, tokens per expert, dropped tokens) and the expert-bias update equal the
run without recompute bit for bit, and each named module really goes through the checkpoint."""
import warnings

import pytest
import torch

from app.config import ModelConfig, MoEConfig
from app.model import GPT2Model
from app.model.moe import begin_iteration, update_expert_bias
from app.model.moe.metrics import MoEMetrics
from app.mpu import random as mpu_random
from app.mpu.parallel_state import ParallelState

B, S, V, MICRO_BATCHES = 2, 8, 64, 2
ROUTERS = {  # two routers that record everything the log and the expert bias read
    "softmax_capacity": dict(moe_router_load_balancing_type=["aux_loss", "global_aux_loss"],
                             moe_aux_loss_coeff=[1e-2, 1e-2], moe_z_loss_coeff=1e-3,
                             moe_expert_capacity_factor=1.0),
    "sigmoid_expert_bias": dict(moe_router_score_function="sigmoid",
                                moe_router_enable_expert_bias=True,
                                moe_router_load_balancing_type=["seq_aux_loss"],
                                moe_aux_loss_coeff=[1e-2]),
}
MODES = {  # flags -> the checkpointed callables' names in one forward (layer 0 MoE, 1 dense)
    "moe_and_mlp": (dict(recompute_granularity="selective", recompute_modules=["moe", "mlp"]),
                    ["output", "output"]),
    "moe_layer_recompute": (dict(moe_layer_recompute=True), ["_core", "output", "_core"]),
    "shared_experts": (dict(recompute_granularity="selective",
                            recompute_modules=["shared_experts"]), ["SharedExpert"]),
    "all": (dict(recompute_granularity="selective",
                 recompute_modules=["core_attn", "mlp", "moe", "shared_experts"]),
            ["_core", "output", "_core", "output"]),
    "none_named": (dict(recompute_granularity="selective", recompute_modules=[]), []),
}


def _config(router, **flags):
    moe = MoEConfig(num_experts=4, moe_ffn_hidden_size=16, moe_router_topk=2,
                    moe_layer_freq=[1, 0], moe_shared_expert_intermediate_size=24,
                    moe_shared_expert_gate=True, **ROUTERS[router])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # --moe-layer-recompute's deprecation
        return ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=S,
                           max_position_embeddings=S, padded_vocab_size=V, swiglu=True,
                           normalization="RMSNorm", add_bias_linear=False, ffn_hidden_size=48,
                           hidden_dropout=0.1, attention_dropout=0.1, seed=5, moe=moe,
                           **flags)


def _iteration(config):
    """(losses, gradients, MoE log, expert biases) of one iteration of two micro-batches."""
    model = GPT2Model(config).train()
    mpu_random.model_parallel_seed(11)
    gen = torch.Generator().manual_seed(0)
    begin_iteration(model, None, 1, MICRO_BATCHES)
    losses = []
    for _ in range(MICRO_BATCHES):
        tokens = torch.randint(0, V, (B, S + 1), generator=gen)
        loss = model(tokens[:, :-1], torch.arange(S).expand(B, S), labels=tokens[:, 1:])
        (loss.mean() / MICRO_BATCHES).backward()
        losses.append(loss.detach())
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    log = MoEMetrics(model, config, ParallelState.single(), None).take(MICRO_BATCHES)
    update_expert_bias(model)
    biases = {n: b.clone() for n, b in model.named_buffers() if n.endswith("expert_bias")}
    return losses, grads, log, biases


@pytest.mark.parametrize("router", sorted(ROUTERS))
def test_recomputed_modules_give_identical_losses_gradients_and_moe_log(router, monkeypatch):
    calls = []
    real_checkpoint = mpu_random.checkpoint

    def counting_checkpoint(fn, *args, **kwargs):
        calls.append(getattr(fn, "__name__", getattr(getattr(fn, "func", None), "__name__",
                                                     type(fn).__name__)))
        return real_checkpoint(fn, *args, **kwargs)
    monkeypatch.setattr(mpu_random, "checkpoint", counting_checkpoint)
    plain = _iteration(_config(router))
    assert not calls
    log = plain[2]
    assert log["load_balancing_loss" if router != "sigmoid_expert_bias"
               else "seq_load_balancing_loss"] > 0 and sum(log["tokens_per_expert"]) > 0
    if router == "softmax_capacity":
        assert log["dropped_tokens"] > 0 and log["z_loss"] > 0
    else:
        assert any(b.abs().sum() > 0 for b in plain[3].values())
    for name, (flags, expected) in MODES.items():
        calls.clear()
        recomputed = _iteration(_config(router, **flags))
        assert calls == expected * MICRO_BATCHES, (name, calls)
        for a, b in zip(plain[0], recomputed[0]):
            torch.testing.assert_close(b, a, rtol=0, atol=0, msg=name)
        for param, grad in plain[1].items():
            torch.testing.assert_close(recomputed[1][param], grad, rtol=0, atol=0,
                                       msg=f"{name}: {param}")
        assert recomputed[2] == log, name  # recorded once per micro-batch, not twice
        for buffer, bias in plain[3].items():
            torch.testing.assert_close(recomputed[3][buffer], bias, rtol=0, atol=0, msg=name)


def test_evaluation_and_no_grad_forwards_recompute_nothing(monkeypatch):
    calls = []
    monkeypatch.setattr(mpu_random, "checkpoint", lambda *a, **k: calls.append(a))
    model = GPT2Model(_config("softmax_capacity", **MODES["all"][0]))
    tokens = torch.randint(0, V, (B, S))
    model.eval()(tokens, torch.arange(S).expand(B, S))
    with torch.no_grad():
        model.train()(tokens, torch.arange(S).expand(B, S))
    assert not calls
