"""The fused ops' PyTorch paths (the references the CUDA kernels are tested against), how each op
reports its choice, and the fusion flags. The kernels themselves: tests/integration/
test_kernels_cuda.py (GPU only)."""
import logging

import pytest
import torch
import torch.nn.functional as F

import arguments
from app.config import ModelConfig
from app.model import GPT2Model, fused
from app.optim.param_groups import _NORM_TYPES


def _softmax64(scores, keep, scale):
    """softmax(scale * scores) over kept positions, in float64, written out by hand."""
    z = (scores.double() * scale).masked_fill(~keep, float("-inf"))
    z = (z - z.max(-1, keepdim=True).values).exp()
    return z / z.sum(-1, keepdim=True)


@pytest.mark.parametrize("s_q,s_k", [(5, 5), (3, 7), (1, 1), (1, 33)])
def test_causal_softmax_reference(s_q, s_k):
    scores = torch.randn(2, 3, s_q, s_k, dtype=torch.float64)
    rows = torch.arange(s_q).view(-1, 1) + (s_k - s_q)
    keep = torch.arange(s_k).view(1, -1) <= rows  # key c visible from query r
    assert torch.equal(fused.causal_mask(s_q, s_k, scores.device), ~keep)
    want = _softmax64(scores, keep, 0.3)
    torch.testing.assert_close(fused.scale_causal_softmax(scores, 0.3), want)
    half = fused.scale_causal_softmax(scores.to(torch.bfloat16), 0.3)
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.double(), _softmax64(scores.to(torch.bfloat16), keep, 0.3),
                               atol=0, rtol=2 ** -8)  # one bf16 rounding of an fp32 result


def test_attention_backends_agree_on_cpu():
    """local and unfused (q k^T + causal softmax + @ v), auto, flash and fused (SDPA) give the
    same attention and gradients; an explicit causal mask through the masked softmax gives it
    too, and so does query-key layer scaling on either softmax."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 9, 8, generator=gen, dtype=torch.float64, requires_grad=True)
               for _ in range(3))
    mask = fused.causal_mask(9, 9, q.device).view(1, 1, 9, 9)
    results = []
    for backend, m, qk_coeff in (("auto", None, 1.0), ("flash", None, 1.0), ("local", None, 1.0),
                                 ("auto", mask, 1.0), ("local", None, 3.0), ("auto", mask, 2.0),
                                 ("fused", None, 1.0), ("unfused", None, 1.0),
                                 ("unfused", mask, 1.0)):
        # qk_coeff: --apply-query-key-layer-scaling divides by n and multiplies back: same result
        out = fused.attention(q, k, v, m, 0.0, backend, qk_coeff=qk_coeff)
        grads = torch.autograd.grad(out.square().sum(), (q, k, v))
        results.append((out, *grads))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="attention backend"):
        fused.attention(q, k, v, None, 0.0, "cudnn")


def test_layer_norm_mixed_precision_reference_and_module():
    x = torch.randn(4, 6, 16).to(torch.bfloat16)
    w, b = torch.randn(16), torch.randn(16)
    out = fused.layer_norm(x, w, b, 1e-5)
    assert out.dtype == torch.bfloat16  # fp32 params, bf16 activations: output in x's dtype
    want = F.layer_norm(x.double(), (16,), w.double(), b.double(), 1e-5)
    torch.testing.assert_close(out.double(), want, atol=1e-6, rtol=2 ** -8)
    norm = fused.LayerNorm(16, eps=1e-5)
    assert isinstance(norm, _NORM_TYPES)  # still excluded from weight decay
    assert set(norm.state_dict()) == {"weight", "bias"}  # checkpoint names unchanged
    y = torch.randn(3, 16)
    torch.testing.assert_close(norm(y), F.layer_norm(y, (16,), norm.weight, norm.bias, 1e-5))


def test_bias_dropout_add_eager_path():
    x, bias, res = torch.randn(4, 8), torch.randn(8), torch.randn(4, 8)
    assert torch.equal(fused.bias_dropout_add(x, bias, res, 0.5, False), res + (x + bias))
    assert torch.equal(fused.bias_dropout_add(x, bias, res, 0.0, True), res + (x + bias))
    torch.manual_seed(3)
    got = fused.bias_dropout_add(x, bias, res, 0.25, True)
    torch.manual_seed(3)
    torch.testing.assert_close(got, res + F.dropout(x + bias, 0.25, True), rtol=0, atol=0)


def test_compiled_fusions_match_eager():
    """The torch.compile'd bodies used on CUDA (compiled here for the CPU): same values and
    gradients as the eager formulas, and the dropout keep-mask is an input, so restoring the
    generator (activation checkpointing) reproduces it exactly."""
    gen = torch.Generator().manual_seed(1)
    x, bias, res = (torch.randn(*shape, generator=gen, dtype=torch.float64, requires_grad=True)
                    for shape in ((3, 5, 16), (16,), (3, 5, 16)))
    keep = torch.rand(3, 5, 16, generator=gen) > 0.2
    for op, fn, args, eager in (
            ("bias_dropout_add", fused._bias_dropout_add, (x, bias, res, keep, 1 / 0.8),
             lambda: res + (x + bias) * keep / 0.8),
            ("bias_gelu", fused._bias_gelu_tanh, (bias, x),
             lambda: F.gelu(x + bias, approximate="tanh"))):
        got = fused._compiled_call(op, fn, *args)
        assert got is not None, fused._COMPILE_FAILED.get(op)
        want = eager()
        torch.testing.assert_close(got, want)
        g = torch.randn_like(want)
        grads = torch.autograd.grad(got, (x, bias, res)[:3 if op != "bias_gelu" else 2], g)
        wants = torch.autograd.grad(want, (x, bias, res)[:3 if op != "bias_gelu" else 2], g)
        for a, b in zip(grads, wants):
            torch.testing.assert_close(a, b)


def test_each_op_announces_its_choice_once(caplog):
    config = ModelConfig(num_layers=2, hidden_size=16, num_attention_heads=2, seq_length=6,
                         max_position_embeddings=6, padded_vocab_size=32, hidden_dropout=0.0,
                         attention_dropout=0.0, layernorm_fusion=False)
    model = GPT2Model(config)
    ids = torch.randint(0, 32, (1, 6))
    fused.reset_selections()
    with caplog.at_level(logging.INFO, logger="app.model.fused"):
        for _ in range(2):
            model(ids, labels=ids).sum().backward()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == len(set(lines)) == len(fused.selections())
    chosen = fused.selections()
    assert chosen["layer_norm"] == ("PyTorch", "--layernorm-fusion off")
    assert chosen["cross_entropy"] == ("PyTorch", "no CUDA" if not torch.cuda.is_available()
                                       else "CPU tensors")
    assert chosen["attention"][0] == "SDPA" and chosen["attention"][1].startswith("CPU tensors")
    assert chosen["bias_dropout_add"][0] == "PyTorch eager"


def test_kernel_flags_and_their_validation():
    base = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2",
            "--seq-length", "8", "--train-iters", "1"]
    m = arguments.config_from_argv(base, 1, 100).model
    assert (m.masked_softmax_fusion, m.bias_gelu_fusion, m.bias_dropout_fusion,
            m.layernorm_fusion, m.cross_entropy_loss_fusion) == (True,) * 5
    assert m.attention_impl == "auto"
    cfg = arguments.config_from_argv(
        base + ["--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion",
                "--no-layernorm-fusion", "--no-cross-entropy-loss-fusion", "--use-flash-attn",
                "--require-fused-kernels", "--kernel-build-dir", "/tmp/k",
                "--kernel-build-timeout", "60"], 1, 100)
    m, k = cfg.model, cfg.kernels
    assert (m.masked_softmax_fusion, m.bias_gelu_fusion, m.bias_dropout_fusion,
            m.layernorm_fusion, m.cross_entropy_loss_fusion) == (False,) * 5
    assert m.attention_impl == "flash"
    assert (k.require_fused_kernels, k.build_dir, k.build_timeout) == (True, "/tmp/k", 60.0)
    local = arguments.config_from_argv(base + ["--attention-backend", "local",
                                               "--masked-softmax-fusion"], 1, 100).model
    assert local.attention_impl == "local" and local.masked_softmax_fusion
    with pytest.raises(ValueError, match="--use-flash-attn .* --attention-backend local"):
        arguments.config_from_argv(base + ["--use-flash-attn", "--attention-backend", "local"],
                                   1, 100)
    with pytest.raises(ValueError, match="--kernel-build-timeout must be positive"):
        arguments.config_from_argv(base + ["--kernel-build-timeout", "0"], 1, 100)
    # the other ranks wait for the build in a collective: it must end within the process-group
    # timeout (10 minutes unless --distributed-timeout-minutes says otherwise)
    two = base + ["--micro-batch-size", "1", "--global-batch-size", "2"]
    assert arguments.config_from_argv(two, 2, 100).kernels.build_timeout == 300.0
    assert arguments.config_from_argv(base + ["--kernel-build-timeout", "900"], 1, 100)
    with pytest.raises(ValueError, match=r"--kernel-build-timeout \(600 s\) must be below "
                                         r"--distributed-timeout-minutes \(10 min = 600 s\)"):
        arguments.config_from_argv(two + ["--kernel-build-timeout", "600"], 2, 100)
    longer = two + ["--distributed-timeout-minutes", "20"]
    assert arguments.config_from_argv(longer + ["--kernel-build-timeout", "900"], 2, 100)
    short = two + ["--distributed-timeout-minutes", "0.5"]  # without the flag: half of it
    assert arguments.config_from_argv(short, 2, 100).kernels.build_timeout == 15.0
    with pytest.raises(ValueError, match=r"--distributed-timeout-minutes \(0.5 min = 30 s\)"):
        arguments.config_from_argv(short + ["--kernel-build-timeout", "60"], 2, 100)
