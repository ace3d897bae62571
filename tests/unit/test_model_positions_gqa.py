"""RoPE, ALiBi and grouped-query attention against references written here from the papers.

The reference attention below works head by head with plain loops: RoPE as complex
multiplication (RoFormer, eq. 34, in Megatron's half-split pairing), ALiBi slopes written out
from the paper's recipe and the bias -m (i - j), each query head reading the key/value head of
its group. Our ParallelAttention (TP = 1) must give the same output and gradients.
"""
from __future__ import annotations

import math

import pytest
import torch

from app.config import ModelConfig
from app.model import GPT2Model
from app.model.positions import RotaryEmbedding, alibi_slopes, apply_rotary

B, S, V, H = 2, 10, 64, 48


def _config(heads=6, **kw) -> ModelConfig:
    base = dict(num_layers=2, hidden_size=H, num_attention_heads=heads, seq_length=S,
                max_position_embeddings=S, padded_vocab_size=V, hidden_dropout=0.0,
                attention_dropout=0.0, seed=11)
    base.update(kw)
    return ModelConfig(**base)


def rope_reference(x: torch.Tensor, positions: torch.Tensor, rotary_dim: int,
                   base: float) -> torch.Tensor:
    """x [b, s, d]: pair channel i with i + rotary_dim/2, rotate by p * base^(-2i/rotary_dim)."""
    half = rotary_dim // 2
    z = torch.complex(x[..., :half].double(), x[..., half:rotary_dim].double())
    theta = base ** (-2.0 * torch.arange(half, dtype=torch.float64) / rotary_dim)
    z = z * torch.polar(torch.ones_like(theta), positions.double()[..., None] * theta)
    return torch.cat([z.real, z.imag, x[..., rotary_dim:].double()], dim=-1).to(x.dtype)


# ALiBi slopes from the paper's recipe, written out: 8 heads -> 2^-1 ... 2^-8; 6 heads -> the
# 4-head slopes 2^-2, 2^-4, 2^-6, 2^-8 followed by every other 8-head slope, 2^-1, 2^-3.
PAPER_SLOPES = {8: [2.0 ** -(i + 1) for i in range(8)],
                6: [2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8, 2.0 ** -1, 2.0 ** -3],
                4: [2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8]}


def reference_attention(x, attention, cfg: ModelConfig, positions, mask=None):
    """Causal attention of x [b, s, h] with `attention`'s weights, head by head."""
    nh, ng, hd = cfg.num_attention_heads, cfg.num_kv_heads, cfg.head_dim
    w, bias = attention.query_key_value.weight, attention.query_key_value.bias
    qkv = (x @ w.t() + bias).view(B, S, ng, nh // ng + 2, hd)  # documented layout
    future = torch.ones(S, S, dtype=torch.bool).triu(1)
    heads = []
    for head in range(nh):
        group, index = divmod(head, nh // ng)
        q, k, v = qkv[:, :, group, index], qkv[:, :, group, -2], qkv[:, :, group, -1]
        if cfg.position_embedding_type == "rope":
            q = rope_reference(q, positions, cfg.rotary_dim, cfg.rotary_base)
            k = rope_reference(k, positions, cfg.rotary_dim, cfg.rotary_base)
        scores = q @ k.transpose(1, 2) / math.sqrt(hd)  # [b, s, s]
        if cfg.position_embedding_type == "alibi":  # distance in sequence offsets
            i, j = torch.arange(S)[:, None].float(), torch.arange(S)[None, :].float()
            scores = scores - PAPER_SLOPES[nh][head] * (i - j)
        masked = future if mask is None else future | mask[:, 0]
        heads.append(torch.softmax(scores.masked_fill(masked, float("-inf")), dim=-1) @ v)
    context = torch.stack(heads, dim=2).reshape(B, S, nh * hd)
    return context @ attention.dense.weight.t() + attention.dense.bias


def test_rotary_tables_match_the_complex_rotation_and_depend_on_offsets_only():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(B, 3, S, 16, generator=gen, dtype=torch.float64)  # [b, heads, s, d]
    positions = torch.arange(S).unsqueeze(0) + torch.tensor([[0], [5]])  # [b, s]
    for rotary_dim, base in ((16, 10000), (8, 500)):
        tables = RotaryEmbedding(rotary_dim, base)(positions)
        got = apply_rotary(x, tables)
        want = torch.stack([rope_reference(x[:, n], positions, rotary_dim, base)
                            for n in range(3)], dim=1)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    # <R_m q, R_n k> depends on m - n only: shifting all positions changes no score
    q, k = x[:, :1], x[:, 1:2]
    rope = RotaryEmbedding(16, 10000)
    scores = [apply_rotary(q, rope(p)) @ apply_rotary(k, rope(p)).transpose(-1, -2)
              for p in (positions, positions + 37)]
    torch.testing.assert_close(scores[0], scores[1], rtol=1e-5, atol=1e-5)


def test_alibi_slopes_follow_the_paper():
    for heads, slopes in PAPER_SLOPES.items():
        assert alibi_slopes(heads) == pytest.approx(slopes, rel=1e-12)


ATTENTION_CASES = {
    "rope": dict(position_embedding_type="rope"),
    "rope-half-base500": dict(position_embedding_type="rope", rotary_percent=0.5, rotary_base=500),
    "alibi-6-heads": dict(position_embedding_type="alibi"),
    "alibi-gqa": dict(position_embedding_type="alibi", heads=8, group_query_attention=True,
                      num_query_groups=2),
    "gqa3": dict(group_query_attention=True, num_query_groups=3),
    "rope-mqa": dict(position_embedding_type="rope", group_query_attention=True,
                     num_query_groups=1),
}
# ALiBi runs through SDPA only (--attention-backend local is refused: tests/unit/test_arguments.py)
ATTENTION_RUNS = [(name, backend) for name in ATTENTION_CASES for backend in ("auto", "local")
                  if not (backend == "local" and name.startswith("alibi"))]


@pytest.mark.parametrize("case,backend", ATTENTION_RUNS)
def test_attention_matches_the_reference(case, backend):
    """Output and input gradient of layer 0's attention, causal and explicit-mask paths, with
    positions that restart inside the sequence (--reset-position-ids), through SDPA and through
    Megatron's local core attention (ALiBi: SDPA with its bias only)."""
    flags = dict(ATTENTION_CASES[case])
    cfg = _config(heads=flags.pop("heads", 6), attention_backend=backend, **flags)
    model = GPT2Model(cfg)
    attention = model.language_model.transformer.layers["0"].attention
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(B, S, H, generator=gen, requires_grad=True)
    positions = torch.cat([torch.arange(4), torch.arange(S - 4)]).expand(B, S)
    block = torch.ones(S, S, dtype=torch.bool).triu(1).expand(B, 1, S, S).clone()  # causal
    block[:, :, 4:, :4] = True  # and the second document does not see the first
    for mask in (None, block):
        bias_or_mask, rotary = mask, None
        if model.rotary is not None:
            rotary = model.rotary(positions)
        if model.alibi_slopes is not None:
            from app.model.positions import alibi_bias
            bias_or_mask = alibi_bias(model.alibi_slopes, S, S, mask, x.dtype)
        out, dense_bias = attention(x, bias_or_mask, rotary)
        got = out + dense_bias
        want = reference_attention(x, attention, cfg, positions, mask)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        grad_got, = torch.autograd.grad(got.square().sum(), x)
        grad_want, = torch.autograd.grad(want.square().sum(), x)
        torch.testing.assert_close(grad_got, grad_want, rtol=1e-4, atol=1e-5)


def test_gqa_with_one_group_per_head_is_multi_head_attention():
    """Same parameters (names, shapes, values), losses and gradients, exactly."""
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, V, (B, S + 1), generator=gen)
    results = []
    for flags in ({}, dict(group_query_attention=True, num_query_groups=6)):
        model = GPT2Model(_config(**flags))
        loss = model(ids[:, :-1], None, None, ids[:, 1:])
        loss.mean().backward()
        results.append((loss.detach(), {n: (p.detach(), p.grad) for n, p in
                                        model.named_parameters()}))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=0, atol=0)
    assert results[0][1].keys() == results[1][1].keys()
    for name, (value, grad) in results[0][1].items():
        torch.testing.assert_close(results[1][1][name][0], value, rtol=0, atol=0)
        torch.testing.assert_close(results[1][1][name][1], grad, rtol=0, atol=0)


def test_new_options_change_the_parameters_as_documented():
    """Megatron's names: no position table with rope/alibi; language_model.output_layer when
    untied (drawn from its own seed); the QKV projection shrinks with query groups."""
    names = lambda m: set(dict(m.named_parameters()))  # noqa: E731
    plain = GPT2Model(_config())
    pos = "language_model.embedding.position_embeddings.weight"
    for kind in ("rope", "alibi"):
        assert names(GPT2Model(_config(position_embedding_type=kind))) == names(plain) - {pos}
    untied = GPT2Model(_config(untie_embeddings_and_output_weights=True))
    assert names(untied) == names(plain) | {"language_model.output_layer.weight"}
    out = untied.language_model.output_layer.weight
    assert out.shape == (V, H) and not torch.equal(out, untied.word_embeddings_weight())
    assert 0.015 < out.std().item() < 0.025  # N(0, init_method_std)
    gqa = GPT2Model(_config(group_query_attention=True, num_query_groups=2))
    qkv = gqa.language_model.transformer.layers["0"].attention.query_key_value.weight
    assert qkv.shape == ((6 + 2 * 2) * 8, H)
    for cfg in (_config(), _config(position_embedding_type="rope",
                                   untie_embeddings_and_output_weights=True,
                                   group_query_attention=True, num_query_groups=2)):
        assert sum(p.numel() for p in GPT2Model(cfg).parameters()) == cfg.num_parameters()


@pytest.mark.parametrize("flags", [
    dict(position_embedding_type="rope", rotary_percent=0.5),
    dict(position_embedding_type="alibi"),
    dict(group_query_attention=True, num_query_groups=2),
    dict(position_embedding_type="alibi", heads=8, group_query_attention=True, num_query_groups=1),
], ids=["rope", "alibi", "gqa", "alibi-mqa"])
def test_incremental_decoding_with_the_kv_cache_equals_the_full_forward(flags):
    """Prefill 4 tokens, then decode one at a time: each step's logits equal those of the whole
    sequence at once (RoPE rotates before caching, ALiBi's query indices follow the cache)."""
    from app.inference.kv_cache import KVCache
    flags = dict(flags)
    model = GPT2Model(_config(heads=flags.pop("heads", 6), **flags)).eval()
    ids = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(3))
    positions = torch.arange(S).expand(B, S)
    with torch.no_grad():
        full = model(ids, positions)  # [b, s, V]
        cache = KVCache(B, S)
        steps = [model(ids[:, :4], positions[:, :4], inference_cache=cache)]
        cache.advance(4)
        for i in range(4, S):
            steps.append(model(ids[:, i:i + 1], positions[:, i:i + 1], inference_cache=cache))
            cache.advance(1)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)
