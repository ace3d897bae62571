"""Position information applied inside attention: rotary embeddings (RoPE) and ALiBi biases.

Both are functions of the token positions only (no parameters), computed once per model
forward and shared by every layer.

RoPE (Su et al. 2021, "RoFormer"), in Megatron's non-interleaved layout: the first
`rotary_dim` channels of each query and key head are split into halves (x1, x2); channel pair
(i, i + rotary_dim/2) is rotated by the angle p * theta_i at position p, with
theta_i = base^(-2i / rotary_dim):

    x1' = x1 cos(p theta) - x2 sin(p theta),   x2' = x2 cos(p theta) + x1 sin(p theta)

The other head_dim - rotary_dim channels pass through (`--rotary-percent` < 1).
`--use-rope-scaling` rescales the frequencies theta_i as Llama 3.1 does (`llama3_inv_freq`),
`--rotary-seq-len-interpolation-factor N` divides the positions p by N (Megatron Core's
RotaryEmbedding, both).

ALiBi (Press et al. 2022, "Train Short, Test Long"): head n adds -m_n * (i - j) to the
attention score of query index i and key index j, with the slopes m_n a geometric
sequence starting at 2^(-8/H) for H heads (for H not a power of two: the slopes of the closest
power of two below H, then every other slope of twice that many).
"""
from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch
from torch import nn

RotaryTables = Tuple[torch.Tensor, torch.Tensor]
"""(cos, sin), each [b or 1, 1, s, rotary_dim] fp32, broadcast over the heads."""


LLAMA3_LOW_FREQ_FACTOR, LLAMA3_HIGH_FREQ_FACTOR, LLAMA3_ORIGINAL_CONTEXT = 1.0, 4.0, 8192
"""Llama 3.1's fixed RoPE scaling constants (Megatron Core has no flags for them)."""


def llama3_inv_freq(inv_freq: torch.Tensor, factor: float,
                    low_freq_factor: float = LLAMA3_LOW_FREQ_FACTOR,
                    high_freq_factor: float = LLAMA3_HIGH_FREQ_FACTOR,
                    original_context: int = LLAMA3_ORIGINAL_CONTEXT) -> torch.Tensor:
    """Llama 3.1's frequency scaling of `inv_freq` [rd/2] (the rope_type "llama3" of Hugging
    Face, `_apply_scaling` of Megatron Core): with wavelength w = 2 pi / theta, frequencies of
    w > original / low_freq_factor are divided by `factor`, those of w < original /
    high_freq_factor are kept, and in between theta ((1 - a) / factor + a) with
    a = (original / w - low_freq_factor) / (high_freq_factor - low_freq_factor)."""
    wavelength = 2 * math.pi / inv_freq
    a = (original_context / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - a) * inv_freq / factor + a * inv_freq
    long = wavelength > original_context / low_freq_factor
    short = wavelength < original_context / high_freq_factor
    return torch.where(long, inv_freq / factor, torch.where(short, inv_freq, blended))


class RotaryEmbedding(nn.Module):
    """positions [b or 1, s] -> (cos, sin) tables [b or 1, 1, s, rotary_dim] in fp32.

    `scaling_factor` (--use-rope-scaling with --rope-scaling-factor) applies `llama3_inv_freq`;
    `interpolation_factor` (--rotary-seq-len-interpolation-factor) multiplies the positions by
    its reciprocal."""

    def __init__(self, rotary_dim: int, base: float, scaling_factor: Optional[float] = None,
                 interpolation_factor: Optional[float] = None) -> None:
        super().__init__()
        if rotary_dim < 2 or rotary_dim % 2:
            raise ValueError(f"rotary_dim must be even and >= 2, got {rotary_dim}")
        self.rotary_dim = rotary_dim
        if scaling_factor is None:  # fp64, then rounded (what runs of earlier releases used)
            exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim
            inv_freq = (1.0 / (float(base) ** exponents)).float()  # [rotary_dim / 2]
        else:  # fp32 throughout, as Megatron Core and transformers compute Llama 3.1's
            exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim
            inv_freq = llama3_inv_freq(1.0 / (base ** exponents), float(scaling_factor))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.position_scale = None if interpolation_factor is None else 1.0 / interpolation_factor

    def forward(self, position_ids: torch.Tensor) -> RotaryTables:
        positions = position_ids.float()
        if self.position_scale is not None:
            positions = positions * self.position_scale
        angles = positions.unsqueeze(-1) * self.inv_freq  # [b, s, rd/2]
        angles = torch.cat((angles, angles), dim=-1).unsqueeze(1)  # [b, 1, s, rd]
        return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, tables: RotaryTables) -> torch.Tensor:
    """Rotate the first rotary_dim channels of x [b, heads, s, head_dim]; same shape and dtype."""
    cos, sin = tables
    rd = cos.shape[-1]
    rot, rest = x[..., :rd], x[..., rd:]
    x1, x2 = rot.chunk(2, dim=-1)  # [b, n, s, rd/2] each
    rotated = rot * cos.to(x.dtype) + torch.cat((-x2, x1), dim=-1) * sin.to(x.dtype)
    return rotated if rest.shape[-1] == 0 else torch.cat((rotated, rest), dim=-1)


def alibi_slopes(num_heads: int) -> List[float]:
    """The ALiBi slope of each of `num_heads` heads (the paper's recipe)."""
    def power_of_two_slopes(n: int) -> List[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    if num_heads <= 0:
        raise ValueError(f"num_heads must be positive, got {num_heads}")
    closest = 2 ** int(math.floor(math.log2(num_heads)))
    slopes = power_of_two_slopes(closest)
    if closest < num_heads:
        slopes += power_of_two_slopes(2 * closest)[0::2][:num_heads - closest]
    return slopes


def alibi_bias(slopes: torch.Tensor, query_length: int, key_length: int,
               attention_mask: Optional[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """Additive attention bias [b or 1, heads, s_q, s_k]: -m_n (i - j) for query index i and
    key index j, with masked entries (the causal future, and `attention_mask` True entries when
    given) at dtype's minimum.

    The queries are the last `query_length` of `key_length` positions (s_q < s_k when decoding
    after cached keys), so query i sits at index s_k - s_q + i. Distances are sequence offsets,
    as in the paper (documents split by --reset-attention-mask are masked apart anyway).
    `slopes` [heads] are this rank's heads' slopes; the bias is computed in fp32 and cast to
    `dtype` (the attention scores' dtype).
    """
    device = slopes.device
    rows = torch.arange(query_length, device=device) + (key_length - query_length)
    distance = (rows.unsqueeze(1) - torch.arange(key_length, device=device)).float()  # [s_q, s_k]
    bias = -slopes.float().view(1, -1, 1, 1) * distance  # [1, n, s_q, s_k]
    masked = distance < 0  # the future
    if attention_mask is not None:
        masked = masked | attention_mask  # [b or 1, 1, s_q, s_k]
    return bias.masked_fill(masked, torch.finfo(dtype).min).to(dtype)
