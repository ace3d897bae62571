"""Megatron's model-maths flags against independent references: zero-centred norms
(--apply-layernorm-1p) against transformers' GemmaRMSNorm and NemotronLayerNorm1P, Llama 3.1's
RoPE frequencies (--use-rope-scaling, --rope-scaling-factor) against transformers' "llama3"
rope initialisation, the position interpolation of --rotary-seq-len-interpolation-factor and
--squared-relu's MLP against their formulas, --add-qkv-bias's parameters. (Whole models against
LlamaForCausalLM, Qwen2ForCausalLM and NemotronForCausalLM through the Hugging Face export:
tests/unit/test_checkpoint_hf_llama.py.)"""

import pytest
import torch

from app.config import ModelConfig
from app.model import GPT2Model, fused
from app.model.gpt2 import ParamInit
from app.model.mlp import ParallelMLP
from app.model.positions import RotaryEmbedding
from app.mpu.parallel_state import ParallelState

transformers = pytest.importorskip("transformers")


def _config(**overrides) -> ModelConfig:
    kw = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
              padded_vocab_size=64, hidden_dropout=0.0, attention_dropout=0.0, seed=3)
    kw.update(overrides)
    return ModelConfig(**kw)


def test_zero_centred_norms_equal_gemma_and_nemotron_norms():
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.nemotron.modeling_nemotron import NemotronLayerNorm1P
    torch.manual_seed(0)
    x = torch.randn(2, 5, 16, requires_grad=True)
    for ours, theirs in ((fused.norm("RMSNorm", 16, 1e-6, zero_centered_gamma=True),
                          GemmaRMSNorm(16, eps=1e-6)),
                         (fused.norm("LayerNorm", 16, 1e-5, zero_centered_gamma=True),
                          NemotronLayerNorm1P(16, eps=1e-5))):
        assert torch.count_nonzero(ours.weight) == 0  # starts as the identity scale 1 + 0
        with torch.no_grad():
            for name, param in ours.named_parameters():
                param.uniform_(-0.5, 0.5)
                getattr(theirs, name).copy_(param)
        got, want = ours(x), theirs(x)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        g = torch.randn_like(got)
        grads = torch.autograd.grad(got, [x, ours.weight], g)
        torch.testing.assert_close(grads, torch.autograd.grad(want, [x, theirs.weight], g),
                                   rtol=1e-5, atol=1e-6)
        plain = fused.norm(type(ours).__name__, 16, ours.eps)
        with torch.no_grad():
            for name, param in plain.named_parameters():
                param.copy_(getattr(ours, name) + (1.0 if name == "weight" else 0.0))
        torch.testing.assert_close(plain(x), got)  # 1p is the plain norm with weight + 1
    bf16 = fused.norm("RMSNorm", 16, 1e-6, dtype=torch.bfloat16, zero_centered_gamma=True)
    with torch.no_grad():
        bf16.weight.fill_(2 ** -9)  # below bf16's spacing at 1: kept because 1 + w is fp32
    out = bf16(x.detach().bfloat16())
    want = (fused.rms_norm(x.detach().bfloat16().float(), torch.full((16,), 1 + 2 ** -9), 1e-6)
            .bfloat16())
    assert torch.equal(out, want)


@pytest.mark.parametrize("factor", [8.0, 32.0])
def test_llama3_rope_frequencies_equal_transformers(factor):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    head_dim, base = 64, 500000
    hf = LlamaConfig(hidden_size=head_dim * 2, num_attention_heads=2, head_dim=head_dim,
                     rope_parameters={"rope_type": "llama3", "rope_theta": float(base),
                                      "factor": factor, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 8192})
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, torch.device("cpu"))
    ours = RotaryEmbedding(head_dim, base, scaling_factor=factor).inv_freq
    assert torch.equal(ours, want.float())  # the same fp32 arithmetic, bit for bit
    from megatron.core.models.common.embeddings.rotary_pos_embedding import (
        RotaryEmbedding as MegatronRotary)
    megatron = MegatronRotary(kv_channels=head_dim, rotary_percent=1.0, rotary_base=base,
                              rope_scaling=True, rope_scaling_factor=factor,
                              use_cpu_initialization=True)
    assert torch.equal(ours, megatron.inv_freq)
    plain = RotaryEmbedding(head_dim, base).inv_freq
    assert (ours < plain).any() and torch.equal(ours[0], plain[0])  # low bands scaled only
    config = _config(position_embedding_type="rope", rotary_base=base, kv_channels=head_dim,
                     use_rope_scaling=True, rope_scaling_factor=factor)
    torch.testing.assert_close(GPT2Model(config).rotary.inv_freq, ours, rtol=0, atol=0)


def test_interpolation_factor_divides_the_positions():
    """--rotary-seq-len-interpolation-factor: against the formula, and against Megatron Core's
    RotaryEmbedding (positions x 1/N, then the outer product with the frequencies)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import (
        RotaryEmbedding as MegatronRotary)
    positions = torch.arange(12).view(1, 12)
    cos, sin = RotaryEmbedding(8, 10000, interpolation_factor=4)(positions)
    megatron = MegatronRotary(kv_channels=16, rotary_percent=0.5, rotary_base=10000,
                              seq_len_interpolation_factor=4, use_cpu_initialization=True)
    freqs = megatron.get_freqs_non_repeated(12)  # [s, rd/2]
    torch.testing.assert_close(cos[0, 0, :, :4], freqs.cos(), rtol=0, atol=1e-6)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    angles = (positions.double().view(12, 1) / 4) * inv_freq  # [s, rd/2]
    angles = torch.cat([angles, angles], -1).view(1, 1, 12, 8)
    torch.testing.assert_close(cos.double(), angles.cos(), rtol=0, atol=1e-6)
    torch.testing.assert_close(sin.double(), angles.sin(), rtol=0, atol=1e-6)


def test_squared_relu_mlp_is_relu_squared():
    config = _config(squared_relu=True)
    mlp = ParallelMLP(config, ParallelState.single(), ParamInit(config), "layers.0.mlp")
    with torch.no_grad():
        for p in mlp.parameters():
            p.normal_()
    x = torch.randn(2, 3, 32)
    out, bias = mlp(x)
    fc1, fc2 = mlp.dense_h_to_4h, mlp.dense_4h_to_h
    want = torch.relu(x @ fc1.weight.T + fc1.bias) ** 2 @ fc2.weight.T
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(bias, fc2.bias)
    gelu = ParallelMLP(_config(), ParallelState.single(), ParamInit(config), "layers.0.mlp")
    gelu.load_state_dict(mlp.state_dict())
    assert not torch.allclose(gelu(x)[0], out)  # the activation really changed


def test_qkv_bias_without_linear_biases():
    config = _config(add_bias_linear=False, add_qkv_bias=True, group_query_attention=True,
                     num_query_groups=2)
    model = GPT2Model(config)
    biases = sorted(n for n, _ in model.named_parameters() if n.endswith(".bias"))
    assert biases == sorted([f"language_model.transformer.layers.{i}.{part}.bias"
                             for i in (0, 1) for part in ("attention.query_key_value",
                                                          "input_layernorm",
                                                          "post_attention_layernorm")]
                            + ["language_model.transformer.final_layernorm.bias"])
    assert config.num_parameters() == sum(p.numel() for p in model.parameters())
    assert _config().qkv_bias and not _config(add_bias_linear=False).qkv_bias
