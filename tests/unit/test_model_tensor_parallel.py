"""Whole GPT-2 at TP = 2 on 2 gloo ranks against the one-process model built in the same rank.

One spawn: each rank builds the dense model (ParallelState.single()) and its TP shard from the
same config and seed, runs both on the same batch (causal SDPA path and explicit-mask path),
and returns the largest differences of loss, logits and each parameter gradient (its shard).
"""
from __future__ import annotations

from typing import Dict

import torch

from app.config import ModelConfig
from app.model import GPT2Model
from app.mpu.parallel_state import ParallelState, initialize_model_parallel
from tests.harness.distributed import run_distributed

B, S, V = 2, 8, 64


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (tuple(a.shape), tuple(b.shape))
    return (a - b).abs().max().item()


def _tp2_rank() -> Dict[str, float]:
    state = initialize_model_parallel(2, 1)
    rank = state.tensor_model_parallel_rank
    cfg = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=S,
                      max_position_embeddings=S, padded_vocab_size=V, hidden_dropout=0.0,
                      attention_dropout=0.0, seed=5)
    dense, sharded = GPT2Model(cfg, ParallelState.single()), GPT2Model(cfg, state)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, V, (B, S + 1), generator=gen)
    ids, labels, pos = tokens[:, :-1], tokens[:, 1:], torch.arange(S).expand(B, S)
    causal = torch.triu(torch.ones(S, S, dtype=torch.bool), diagonal=1).view(1, 1, S, S)
    diffs: Dict[str, float] = {}
    with torch.no_grad():
        logits = sharded(ids, pos)  # [b, s, V/2]
        diffs["logits"] = _max_diff(logits, dense(ids, pos).chunk(2, dim=-1)[rank])
    for mask_name, mask in (("sdpa", None), ("mask", causal)):
        losses = []
        for model in (dense, sharded):
            model.zero_grad(set_to_none=True)
            loss = model(ids, pos, mask, labels)
            loss.mean().backward()
            losses.append(loss.detach())
        diffs[f"loss/{mask_name}"] = _max_diff(losses[1], losses[0])
        full_grads = {n: p.grad for n, p in dense.named_parameters()}
        for name, p in sharded.named_parameters():
            expected = full_grads[name]
            if getattr(p, "tensor_model_parallel", False):
                expected = expected.chunk(2, dim=p.partition_dim)[rank]
            diffs[f"grad/{mask_name}/{name}"] = _max_diff(p.grad, expected)
    return diffs


def test_gpt2_tp2_matches_one_process_model():
    for rank, diffs in enumerate(run_distributed(_tp2_rank, 2, timeout=120)):
        assert len(diffs) == 1 + 2 * (1 + 2 + 2 * 12 + 2), sorted(diffs)
        bad = {k: v for k, v in diffs.items() if v > 2e-5}
        assert not bad, f"rank {rank}: {bad}"
