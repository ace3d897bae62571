"""Parameter init: Megatron statistics, and values that depend only on (seed, global name)."""
import math

import pytest
import torch

from app.config import ModelConfig
from app.model import GPT2Model, param_seed
from app.mpu.parallel_state import ParallelState


def _config(**kw) -> ModelConfig:
    base = dict(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=16,
                max_position_embeddings=32, padded_vocab_size=128, seed=11)
    base.update(kw)
    return ModelConfig(**base)


def _params(model) -> dict:
    return {n: p.detach() for n, p in model.named_parameters()}


def test_init_statistics():
    cfg = ModelConfig(num_layers=2, hidden_size=256, num_attention_heads=4, seq_length=16,
                      max_position_embeddings=256, padded_vocab_size=1024, init_method_std=0.02)
    params = _params(GPT2Model(cfg))
    scaled = 0.02 / math.sqrt(2 * cfg.num_layers)
    for name, p in params.items():
        if name.endswith("bias"):
            assert torch.count_nonzero(p) == 0, name
        elif "layernorm" in name:
            assert torch.equal(p, torch.ones_like(p)), name
        else:
            expected = scaled if ("attention.dense" in name or "dense_4h_to_h" in name) else 0.02
            assert p.mean().abs() < 3 * expected / math.sqrt(p.numel()) + 1e-6, name
            assert p.std().item() == pytest.approx(expected, rel=0.03), name
    # Distinct parameters get independent draws.
    l0 = "language_model.transformer.layers.0.mlp.dense_h_to_4h.weight"
    l1 = "language_model.transformer.layers.1.mlp.dense_h_to_4h.weight"
    corr = torch.corrcoef(torch.stack([params[l0].flatten(), params[l1].flatten()]))[0, 1]
    assert abs(corr) < 0.02


def test_param_seed_depends_on_seed_and_name_only():
    assert param_seed(1, "a.weight") == param_seed(1, "a.weight")
    seeds = {param_seed(1, "a.weight"), param_seed(2, "a.weight"), param_seed(1, "b.weight")}
    assert len(seeds) == 3
    assert 0 <= param_seed(123, "x") < 2 ** 63


def test_init_independent_of_global_rng_and_pipeline_split():
    cfg = _config()
    torch.manual_seed(0)
    full = _params(GPT2Model(cfg))
    torch.manual_seed(999)
    torch.randn(1000)
    # Build the later stage first: construction order must not matter.
    last = GPT2Model(cfg, pre_process=False, post_process=True, layer_range=(2, 4))
    first = GPT2Model(cfg, pre_process=True, post_process=False, layer_range=(0, 2))
    staged = {**_params(first), **_params(last)}
    tied = staged.pop("word_embeddings.weight")
    assert last.word_embeddings.weight.shared
    assert set(staged) == set(full)  # global layer indices in every stage's names
    for name, value in full.items():
        assert torch.equal(staged[name], value), name
    assert torch.equal(tied, full["language_model.embedding.word_embeddings.weight"])
    other_seed = _params(GPT2Model(_config(seed=12)))
    assert not torch.equal(other_seed["language_model.embedding.word_embeddings.weight"],
                           full["language_model.embedding.word_embeddings.weight"])


@pytest.mark.parametrize("rank", [0, 1])
def test_tensor_parallel_shards_are_slices_of_the_full_init(rank):
    cfg = _config()
    full = _params(GPT2Model(cfg))
    state = ParallelState(tensor_model_parallel_size=2, tensor_model_parallel_rank=rank)
    shard = GPT2Model(cfg, state)  # building needs no process group; forward would
    for name, p in shard.named_parameters():
        dim = p.partition_dim if getattr(p, "tensor_model_parallel", False) else -1
        expected = full[name]
        if dim >= 0:
            expected = expected.chunk(2, dim=dim)[rank]
        assert torch.equal(p.detach(), expected), name
    qkv = shard.language_model.transformer.layers["0"].attention.query_key_value.weight
    assert qkv.shape == (3 * 64 // 2, 64) and qkv.partition_dim == 0
    ln = shard.language_model.transformer.layers["0"].input_layernorm.weight
    assert ln.tensor_model_parallel is False


def test_params_dtype_keeps_the_same_values():
    full = _params(GPT2Model(_config()))
    half = _params(GPT2Model(_config(params_dtype="bfloat16")))
    for name, value in half.items():
        assert value.dtype == torch.bfloat16
        assert torch.equal(value, full[name].to(torch.bfloat16)), name
