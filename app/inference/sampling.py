"""Choosing the next token from logits: greedy, temperature, top-k, top-p (Megatron's rule, with
its per-step top-p decay and lower bound). Pure functions on [b, V] tensors."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class SamplingConfig:
    """How tokens are chosen. greedy, or temperature + top_k + top_p sampling (both filters may
    be set: top-k first, then top-p); after every generated token top_p becomes
    max(top_p * top_p_decay, top_p_bound) when top_p_decay > 0 (Megatron's decay and bound)."""

    greedy: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 0.0
    top_p_decay: float = 0.0
    top_p_bound: float = 0.0
    seed: Optional[int] = None

    def __post_init__(self) -> None:
        if not self.temperature > 0.0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        for name in ("top_p", "top_p_decay", "top_p_bound"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.top_p_bound > 0.0 and self.top_p_bound > self.top_p:
            raise ValueError(f"top_p_bound ({self.top_p_bound}) must not exceed top_p ({self.top_p})")
        if self.top_k == 1:
            self.greedy = True

    def next_top_p(self, top_p: float) -> float:
        """The top-p of the next step (Megatron's decay and bound)."""
        if top_p > 0.0 and self.top_p_decay > 0.0:
            top_p = top_p * self.top_p_decay
            if self.top_p_bound > 0.0:
                top_p = max(top_p, self.top_p_bound)
        return top_p


def filter_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """logits [b, V] with everything below the k-th largest per row set to -inf."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]  # [b, 1]
    return logits.masked_fill(logits < kth, float("-inf"))


def filter_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """logits [b, V] keeping the smallest set of most likely tokens whose probability reaches p
    (the token that crosses p is kept, so at least one survives); others -inf."""
    if p <= 0.0 or p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=True, dim=-1)  # [b, V]
    cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
    drop = cumulative > p
    drop[..., 1:] = drop[..., :-1].clone()  # shift right: keep the first token past p
    drop[..., 0] = False
    mask = torch.zeros_like(drop).scatter(-1, order, drop)
    return logits.masked_fill(mask, float("-inf"))


def choose_tokens(logits: torch.Tensor, config: SamplingConfig, top_p: float,
                  generator: Optional[torch.Generator]) -> torch.Tensor:
    """Next token ids [b] from fp32 logits [b, V] (V = the tokenizer's vocabulary, unpadded)."""
    if config.greedy:
        return torch.argmax(logits, dim=-1)
    logits = logits / config.temperature
    logits = filter_top_p(filter_top_k(logits, config.top_k), top_p)
    probs = torch.softmax(logits, dim=-1)  # [b, V]
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
