"""The DeepSpeed engine's MoE marker without DeepSpeed: what the model's state dict holds once
markers are attached (each local expert's 2-D weights under DeepSpeed's MoE names, no 3-D
expert weights), a load of that state dict restores the 3-D weights exactly, the parameters are
untouched; DeepSpeed's expert groups are checked against the expert grid, and a checkpoint
whose experts are split over another number of ranks is refused naming both sizes."""
from __future__ import annotations

import pytest
import torch

from app.config import ModelConfig, MoEConfig
from app.model.gpt2 import GPT2Model
from app.mpu.parallel_state import ParallelState
from app.training.engines import deepspeed_moe

LAYER = "language_model.transformer.layers.{}.mlp"


def _model(ep: int = 1, ep_rank: int = 0, seed: int = 1234) -> GPT2Model:
    config = ModelConfig(num_layers=2, hidden_size=16, num_attention_heads=4,
                         padded_vocab_size=64, seq_length=8, swiglu=True, add_bias_linear=False,
                         ffn_hidden_size=32, normalization="RMSNorm", seed=seed,
                         moe=MoEConfig(num_experts=4, moe_ffn_hidden_size=8, moe_router_topk=2,
                                       moe_layer_freq=[0, 1]))
    ps = ParallelState(expert_model_parallel_size=ep, expert_model_parallel_rank=ep_rank)
    model = GPT2Model(config, ps)
    assert deepspeed_moe.attach_markers(model, deepspeed_moe.MoEMarker, 4, ep) == 1
    return model


def test_state_dict_holds_each_local_expert_under_deepspeeds_names():
    model = _model(ep=2, ep_rank=1)
    params = dict(model.named_parameters())
    state = model.state_dict()
    layer = LAYER.format(1)
    assert f"{layer}.experts.dense_h_to_4h.weight" in params  # the parameters are unchanged
    assert not [k for k in state if ".mlp.experts." in k]
    views = {k: v for k, v in state.items() if ".deepspeed_moe." in k}
    assert sorted(views) == sorted(
        f"{layer}.deepspeed_moe.experts.deepspeed_experts.{j}.{p}.weight"
        for j in range(2) for p in ("dense_h_to_4h", "dense_4h_to_h"))
    for j in range(2):
        for p, shape in (("dense_h_to_4h", (16, 16)), ("dense_4h_to_h", (16, 8))):
            view = views[f"{layer}.deepspeed_moe.experts.deepspeed_experts.{j}.{p}.weight"]
            assert view.shape == shape
            assert torch.equal(view, params[f"{layer}.experts.{p}.weight"][j])
    assert [n for n, _ in model.named_parameters()] == list(params)


def test_a_load_restores_the_experts_from_the_views():
    source, target = _model(), _model(seed=1)
    expert = f"{LAYER.format(1)}.experts.dense_h_to_4h.weight"
    assert not torch.equal(dict(source.named_parameters())[expert],
                           dict(target.named_parameters())[expert])
    state = source.state_dict()
    result = target.load_state_dict(state, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    for (name, got), want in zip(target.named_parameters(), source.parameters()):
        assert torch.equal(got, want), name
    del state[f"{LAYER.format(1)}.deepspeed_moe.experts.deepspeed_experts.3.dense_4h_to_h.weight"]
    with pytest.raises(RuntimeError, match=r"Missing key.*mlp\.experts\.dense_4h_to_h\.weight"):
        target.load_state_dict(state, strict=True)


def test_deepspeeds_groups_must_be_the_expert_grid():
    ps = ParallelState(rank=1, data_parallel_size=4, data_parallel_rank=1,
                       expert_model_parallel_size=2, expert_model_parallel_rank=1,
                       expert_data_parallel_size=2)
    deepspeed_moe.check_expert_groups(ps, [0, 1], [1, 3])  # EP consecutive, EDP strided
    with pytest.raises(RuntimeError, match="differ from this run's expert grid"):
        deepspeed_moe.check_expert_groups(ps, [1, 3], [0, 1])


def test_checkpoint_of_another_expert_split_is_refused():
    model = _model(ep=2)
    shapes = [{n: tuple(p.shape) for n, p in model.named_parameters()}]
    assert deepspeed_moe.expert_split_problem(model, shapes, "ck/iter_0000004") is None
    layer = LAYER.format(1)
    shapes[0][f"{layer}.experts.dense_h_to_4h.weight"] = (4, 16, 16)  # saved at EP1
    problem = deepspeed_moe.expert_split_problem(model, shapes, "ck/iter_0000004")
    assert problem.startswith("checkpoint ck/iter_0000004 holds 4 experts per rank of each MoE "
                              "layer (expert-parallel size 1), this run 2 "
                              "(--expert-model-parallel-size 2)"), problem
