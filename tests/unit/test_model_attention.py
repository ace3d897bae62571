"""Attention paths, fused-op references, pipeline stages and activation checkpointing."""
import math

import pytest
import torch

from app.config import ModelConfig
from app.model import GPT2Model, fused
from app.mpu import random as mpu_random

B, S, V = 2, 12, 64


def _config(**kw) -> ModelConfig:
    base = dict(num_layers=3, hidden_size=32, num_attention_heads=4, seq_length=S,
                max_position_embeddings=S, padded_vocab_size=V, hidden_dropout=0.0,
                attention_dropout=0.0, seed=3)
    base.update(kw)
    return ModelConfig(**base)


def _batch(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, V, (B, S + 1), generator=gen)
    return tokens[:, :-1], torch.arange(S).expand(B, S), tokens[:, 1:]


def _loss_and_grads(model, *args, **kwargs):
    model.zero_grad(set_to_none=True)
    loss = model(*args, **kwargs)
    loss.mean().backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _assert_same(a, b, **tol):
    torch.testing.assert_close(a[0], b[0], **tol)
    for name in a[1]:
        torch.testing.assert_close(a[1][name], b[1][name], msg=name, **tol)


def test_bias_gelu_matches_formulas():
    x, bias = torch.randn(4, 8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)
    y = x + bias
    exact = 0.5 * y * (1 + torch.erf(y / math.sqrt(2)))
    tanh = 0.5 * y * (1 + torch.tanh(math.sqrt(2 / math.pi) * (y + 0.044715 * y ** 3)))
    torch.testing.assert_close(fused.bias_gelu(bias, x), exact)
    torch.testing.assert_close(fused.bias_gelu(bias, x, openai_gelu=True), tanh)
    torch.testing.assert_close(fused.bias_gelu(None, y), exact)


def test_scale_mask_softmax_reference():
    scores = torch.randn(2, 3, 4, 4)
    mask = torch.zeros(1, 1, 4, 4, dtype=torch.bool)
    mask[..., 0, 1:] = True        # row 0 sees only key 0
    mask[..., 3, :] = True         # row 3 fully masked
    probs = fused.scale_mask_softmax(scores, mask, 0.5)
    assert torch.equal(probs[..., 0, :], torch.tensor([1.0, 0.0, 0.0, 0.0]).expand(2, 3, 4))
    torch.testing.assert_close(probs[..., 3, :], torch.full((2, 3, 4), 0.25))  # uniform, no NaN
    torch.testing.assert_close(probs[..., 1:3, :], torch.softmax(0.5 * scores[..., 1:3, :], -1))
    half = fused.scale_mask_softmax(scores.half(), None, 0.5)
    assert half.dtype == torch.float16
    torch.testing.assert_close(half.float(), torch.softmax(0.5 * scores, -1), atol=1e-3, rtol=1e-3)


def test_explicit_causal_mask_equals_sdpa_causal_path():
    model = GPT2Model(_config())
    ids, pos, labels = _batch()
    causal = torch.triu(torch.ones(S, S, dtype=torch.bool), diagonal=1).view(1, 1, S, S)
    sdpa = _loss_and_grads(model, ids, pos, None, labels)
    explicit = _loss_and_grads(model, ids, pos, causal, labels)
    _assert_same(sdpa, explicit, rtol=1e-5, atol=1e-6)


def test_block_diagonal_mask_equals_separate_documents():
    """Reset-attention-mask style: each document attends only to itself (positions reset too)."""
    model = GPT2Model(_config()).eval()
    ids, _, _ = _batch(1)
    bounds = [(0, 5), (5, 12)]  # two documents per row
    doc = torch.zeros(S, dtype=torch.long)
    doc[5:] = 1
    pos = torch.cat([torch.arange(5), torch.arange(7)]).expand(B, S)
    causal = torch.triu(torch.ones(S, S, dtype=torch.bool), diagonal=1)
    mask = (causal | (doc[:, None] != doc[None, :])).view(1, 1, S, S)
    with torch.no_grad():
        joint = model(ids, pos, mask)  # [b, s, V]
        for start, end in bounds:
            alone = model(ids[:, start:end], torch.arange(end - start).expand(B, -1))
            torch.testing.assert_close(joint[:, start:end], alone, rtol=1e-5, atol=1e-5)
        plain = model(ids, pos)
    assert not torch.allclose(joint[:, 5:], plain[:, 5:], atol=1e-3)  # the mask did something


def test_pipeline_stages_compose_to_the_full_model():
    cfg = _config()
    ids, pos, labels = _batch()
    full = GPT2Model(cfg)
    first = GPT2Model(cfg, pre_process=True, post_process=False, layer_range=(0, 2))
    last = GPT2Model(cfg, pre_process=False, post_process=True, layer_range=(2, 3))
    hidden = first(ids, pos)
    assert hidden.shape == (B, S, cfg.hidden_size)
    with pytest.raises(RuntimeError, match="set_input_tensor"):
        last(None, pos, labels=labels)
    last.set_input_tensor([hidden])
    torch.testing.assert_close(last(None, pos, labels=labels), full(ids, pos, labels=labels))
    assert full(ids, pos).shape == (B, S, V)
    with pytest.raises(ValueError, match="layer_range"):
        GPT2Model(cfg, layer_range=(2, 5))


RECOMPUTE_MODES = {  # flags -> what app.mpu.random.checkpoint is handed in one forward
    "full uniform 2": (dict(recompute_granularity="full", recompute_num_layers=2),
                       lambda calls: [len(fn.layers) for fn in calls] == [2, 1]),
    "full block 2": (dict(recompute_granularity="full", recompute_method="block",
                          recompute_num_layers=2),
                     lambda calls: [len(fn.layers) for fn in calls] == [1, 1]),
    "selective": (dict(recompute_granularity="selective"),
                  lambda calls: [fn.func.__name__ for fn in calls] == ["_core"] * 3),
}


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_every_recompute_mode_gives_identical_grads(dropout, monkeypatch):
    """Full (uniform, block) and selective recompute give bit-identical losses and gradients
    to no recompute, on the SDPA and the explicit-mask paths, with dropout too (RNG restored)."""
    ids, pos, labels = _batch()
    causal = torch.triu(torch.ones(S, S, dtype=torch.bool), diagonal=1).view(1, 1, S, S)
    calls = []
    real_checkpoint = mpu_random.checkpoint
    def counting_checkpoint(fn, *args, **kwargs):
        calls.append(fn)
        return real_checkpoint(fn, *args, **kwargs)
    monkeypatch.setattr(mpu_random, "checkpoint", counting_checkpoint)

    def run(mask, **flags):
        model = GPT2Model(_config(hidden_dropout=dropout, attention_dropout=dropout,
                                  **flags)).train()
        mpu_random.model_parallel_seed(42)
        return _loss_and_grads(model, ids, pos, mask, labels), model

    for mask in (None, causal):
        calls.clear()
        plain, model = run(mask)
        assert not calls
        for name, (flags, expected_calls) in RECOMPUTE_MODES.items():
            calls.clear()
            recomputed, _ = run(mask, **flags)
            assert expected_calls(calls), (name, calls)
            _assert_same(plain, recomputed, rtol=0, atol=0)
    if dropout:
        model.eval()
        with torch.no_grad():
            assert not torch.allclose(model(ids, pos, labels=labels), plain[0])


def test_attention_dropout_on_explicit_path_uses_model_parallel_stream():
    cfg = _config(attention_dropout=0.5)
    model = GPT2Model(cfg).train()
    ids, pos, labels = _batch()
    causal = torch.triu(torch.ones(S, S, dtype=torch.bool), diagonal=1).view(1, 1, S, S)
    mpu_random.model_parallel_seed(5)
    default_before = torch.get_rng_state()
    a = model(ids, pos, causal, labels)
    assert torch.equal(default_before, torch.get_rng_state())  # only the tracker stream moved
    b = model(ids, pos, causal, labels)
    assert not torch.equal(a, b)
    mpu_random.model_parallel_seed(5)
    torch.testing.assert_close(model(ids, pos, causal, labels), a, rtol=0, atol=0)


def test_hidden_dropout_stream_follows_sequence_parallelism():
    """Embedding and residual dropout draw from the default stream (the same on TP ranks, which
    hold the same tokens), but from the model-parallel stream with sequence parallelism (each
    rank holds other tokens)."""
    ids, pos, labels = _batch()
    for sequence_parallel in (False, True):
        model = GPT2Model(_config(hidden_dropout=0.5,
                                  sequence_parallel=sequence_parallel)).train()
        mpu_random.model_parallel_seed(5)
        default_before = torch.get_rng_state()
        tracker_before = mpu_random.get_rng_tracker().get_states()
        model(ids, pos, None, labels)
        tracker_moved = not torch.equal(
            tracker_before["model-parallel-rng"]["cpu"],
            mpu_random.get_rng_tracker().get_states()["model-parallel-rng"]["cpu"])
        assert torch.equal(default_before, torch.get_rng_state()) == sequence_parallel
        assert tracker_moved == sequence_parallel