"""GPU only: the csrc/ kernels against their PyTorch references in fp32 arithmetic.

Run on a GPU machine with `bash scripts/test_gpu_kernels.sh` (or `pytest tests/integration/
test_kernels_cuda.py`); skipped without CUDA. The kernels are built once for the session with
--require-fused-kernels semantics, so a build failure fails here instead of falling back.

Tolerances, per dtype (eps = 2^-10 fp16, 2^-7 bf16, 2^-23 fp32; "one rounding" = eps/2 relative):
- forward softmax / LayerNorm / cross-entropy gradient: the kernel and the reference both compute
  in fp32 and round once to the output dtype, so they differ by at most one rounding step of the
  output (rtol = eps) plus fp32 arithmetic done in another order (~1e-5 relative to the largest
  term);
- softmax backward: the kernel works from the saved, already rounded probabilities y (relative
  error eps/2 each), so |dx - dx_ref| <= (eps + 1e-5) * (|dx_ref| + scale * y * (|dy| +
  sum |dy y|)) element-wise (the bound is evaluated, not guessed; 1e-5 covers fp32 sums in
  another order, which is all that is left for fp32 inputs);
- LayerNorm weight/bias gradients: fp32 sums over rows in another order, bounded by
  1e-5 * sum |terms| per column, plus one rounding to the parameter dtype.
"""
import pytest
import torch
import torch.nn.functional as F

from app.config import ModelConfig
from app.kernels import library, ops
from app.model import GPT2Model, fused
from app.mpu.cross_entropy import fused_vocab_parallel_cross_entropy
from app.mpu.parallel_state import ParallelState

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
EPS = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7, torch.float32: 2.0 ** -23}


@pytest.fixture(scope="module", autouse=True)
def kernels():
    library.reset()
    library.configure(required=True)  # a failed build fails the tests
    status = library.status()
    assert status.available, status.reason
    yield status
    library.reset()
    library.configure()


def test_start_up_keeps_the_kernels_on_when_every_rank_has_them():
    """prepare_kernels (the run's start-up) obtains the library and has the ranks agree on it;
    with every rank (here the only one) holding the kernels they stay on."""
    from arguments import config_from_argv
    from app.training.run import prepare_kernels

    cfg = config_from_argv(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads",
                            "2", "--seq-length", "8", "--train-iters", "1"], 1, 100)
    prepare_kernels(cfg, torch.device("cuda"))
    assert library.status().available, library.status().reason


def _rand(*shape, dtype, scale=1.0, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(dtype)


def _softmax_case(kind, b, heads, s_q, s_k, dtype, mask_batches=1):
    """(scores, mask or None, dy, scale) for one shape; some mask rows fully masked."""
    x = _rand(b, heads, s_q, s_k, dtype=dtype, scale=3.0, seed=1)
    dy = _rand(b, heads, s_q, s_k, dtype=dtype, seed=2)
    mask = None
    if kind == "masked":
        gen = torch.Generator(device="cuda").manual_seed(3)
        mask = torch.rand(mask_batches, 1, s_q, s_k, generator=gen, device="cuda") < 0.3
        mask[:, :, s_q // 2, :] = True  # a fully masked row: uniform output, zero gradient
    return x, mask, dy, 1.0 / (s_k ** 0.5)


def _softmax_reference(kind, x, mask, scale):
    x32 = x.float().requires_grad_()
    if kind == "causal":
        mask = fused.causal_mask(x.shape[-2], x.shape[-1], x.device)
    z = (x32 * scale).masked_fill(mask, torch.finfo(torch.float32).min)
    return x32, torch.softmax(z, -1)


SOFTMAX_SHAPES = [  # (b, heads, s_q, s_k): odd lengths, 1, 4096, many heads, s_q < s_k
    (1, 1, 1, 1), (2, 3, 17, 17), (1, 2, 5, 37), (2, 40, 33, 33), (1, 12, 1024, 1024),
    (3, 4, 1000, 1000), (1, 16, 2047, 2047), (1, 4, 4096, 4096), (1, 1, 9000, 9000),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SOFTMAX_SHAPES, ids=str)
@pytest.mark.parametrize("kind", ["causal", "masked"])
def test_softmax_kernels_match_fp32_reference(kind, shape, dtype):
    if kind == "masked" and shape[2] != shape[3]:
        shape = (*shape[:2], shape[3], shape[3])
    mask_batches = 1 if shape[1] % 2 else shape[0]  # broadcast over the batch, or one per sample
    x, mask, dy, scale = _softmax_case(kind, *shape, dtype=dtype, mask_batches=mask_batches)
    xk = x.clone().requires_grad_()
    y = ops.causal_softmax(xk, scale) if kind == "causal" else ops.masked_softmax(xk, mask, scale)
    y.backward(dy)
    x32, y_ref = _softmax_reference(kind, x, mask, scale)
    y_ref.backward(dy.float())
    eps = EPS[dtype]
    assert y.dtype == dtype and xk.grad.dtype == dtype
    torch.testing.assert_close(y.float(), y_ref.detach(), rtol=eps + 1e-5, atol=1e-6)
    p, tol = y_ref.detach(), eps + 1e-5  # + fp32 sums over s_k terms in another order
    bound = tol * (x32.grad.abs() + scale * p * (dy.float().abs()
                                                 + (dy.float() * p).abs().sum(-1, keepdim=True)))
    err = (xk.grad.float() - x32.grad).abs()
    assert bool((err <= bound + 1e-6).all()), f"max excess {(err - bound).max().item()}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("s_k", [17, 1000, 2047, 4096], ids=str)  # warp rows, then block rows
@pytest.mark.parametrize("kind", ["causal", "masked"])
def test_softmax_nan_rows_match_pytorch(kind, s_k, dtype):
    """NaN scores give NaN rows as in PyTorch, an all-NaN row included (a max that drops NaN
    made it look fully masked, hence uniform); masked NaNs are ignored like masked_fill's;
    other rows are unaffected, and masked or causally hidden columns get a zero gradient."""
    x, mask, dy, scale = _softmax_case(kind, 2, 3, s_k, s_k, dtype=dtype)
    nan = float("nan")
    x[0, 0, 1] = nan  # all NaN
    x[1, 2, -1, 0] = nan  # one NaN (the last causal row sees every column)
    x[0, 1, s_k // 2] = nan  # all NaN; fully masked in the masked case: uniform there
    xk = x.clone().requires_grad_()
    y = ops.causal_softmax(xk, scale) if kind == "causal" else ops.masked_softmax(xk, mask, scale)
    y.backward(dy)
    x32, y_ref = _softmax_reference(kind, x, mask, scale)
    y_ref.backward(dy.float())
    assert bool(y[0, 0, 1].isnan().all()) and bool(y_ref[0, 0, 1].isnan().all())
    assert torch.equal(y.isnan(), y_ref.isnan())
    finite = ~y_ref.isnan()
    torch.testing.assert_close(y.float()[finite], y_ref.detach()[finite],
                               rtol=EPS[dtype] + 1e-5, atol=1e-6)
    assert torch.equal(xk.grad.isnan(), x32.grad.isnan())
    zero = x32.grad == 0
    assert torch.equal(xk.grad[zero], torch.zeros_like(xk.grad[zero]))


LN_SHAPES = [(1, 1), (7, 33), (4096, 768), (2, 1024), (3, 1600), (5, 4100), (1000, 2049)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", LN_SHAPES, ids=str)
@pytest.mark.parametrize("fp32_params", [False, True])
def test_layer_norm_kernel_matches_fp32_reference(shape, dtype, fp32_params):
    rows, h = shape
    pdtype = torch.float32 if fp32_params else dtype
    x = _rand(rows, h, dtype=dtype, scale=2.0, seed=4) + 0.5
    w = (1 + _rand(h, dtype=torch.float32, scale=0.1, seed=5)).to(pdtype)
    b = _rand(h, dtype=torch.float32, scale=0.1, seed=6).to(pdtype)
    dy = _rand(rows, h, dtype=dtype, seed=7)
    xk, wk, bk = (t.clone().requires_grad_() for t in (x, w, b))
    y = ops.layer_norm(xk, wk, bk, 1e-5)
    y.backward(dy)
    x32, w32, b32 = (t.float().requires_grad_() for t in (x, w, b))
    y_ref = F.layer_norm(x32, (h,), w32, b32, 1e-5)
    y_ref.backward(dy.float())
    eps, peps = EPS[dtype], EPS[pdtype]
    assert y.dtype == dtype and wk.grad.dtype == pdtype
    torch.testing.assert_close(y.float(), y_ref.detach(), rtol=eps,
                               atol=1e-5 * y_ref.abs().max().item())
    # dx subtracts row means of h terms: fp32 sums in another order, ~sqrt(h) eps32 relative
    torch.testing.assert_close(xk.grad.float(), x32.grad, rtol=eps,
                               atol=1e-4 * x32.grad.abs().max().item())
    xhat = (y_ref.detach() - b32.detach()) / w32.detach()
    for got, want, terms in ((wk.grad, w32.grad, dy.float() * xhat), (bk.grad, b32.grad, dy)):
        bound = 1e-5 * terms.float().abs().sum(0) + peps * want.abs() + 1e-6
        assert bool(((got.float() - want).abs() <= bound).all())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", LN_SHAPES, ids=str)
@pytest.mark.parametrize("fp32_params", [False, True])
def test_rms_norm_kernel_matches_fp32_reference(shape, dtype, fp32_params):
    """The RMSNorm kernel against the formula in fp32 (x / sqrt(mean(x^2) + eps) * w)."""
    rows, h = shape
    pdtype = torch.float32 if fp32_params else dtype
    x = _rand(rows, h, dtype=dtype, scale=2.0, seed=4) + 0.5
    w = (1 + _rand(h, dtype=torch.float32, scale=0.1, seed=5)).to(pdtype)
    dy = _rand(rows, h, dtype=dtype, seed=7)
    xk, wk = (t.clone().requires_grad_() for t in (x, w))
    y = ops.rms_norm(xk, wk, 1e-5)
    y.backward(dy)
    x32, w32 = (t.float().requires_grad_() for t in (x, w))
    y_ref = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5) * w32
    y_ref.backward(dy.float())
    eps, peps = EPS[dtype], EPS[pdtype]
    assert y.dtype == dtype and wk.grad.dtype == pdtype
    torch.testing.assert_close(y.float(), y_ref.detach(), rtol=eps,
                               atol=1e-5 * y_ref.abs().max().item())
    torch.testing.assert_close(xk.grad.float(), x32.grad, rtol=eps,
                               atol=1e-4 * x32.grad.abs().max().item())
    terms = dy.float() * (y_ref.detach() / w32.detach())
    bound = 1e-5 * terms.abs().sum(0) + peps * w32.grad.abs() + 1e-6
    assert bool(((wk.grad.float() - w32.grad).abs() <= bound).all())
    # the module picks the kernel on CUDA, and gives what the fallback gives
    fused.reset_selections()
    torch.testing.assert_close(fused.rms_norm(x, w, 1e-5), y.detach())
    assert fused.selections()["rms_norm"][0] == "CUDA kernel"
    torch.testing.assert_close(fused.rms_norm(x, w, 1e-5, use_kernel=False).float(),
                               y.detach().float(), rtol=eps, atol=1e-5 * y_ref.abs().max().item())


CE_SHAPES = [(1, 1, 7), (2, 17, 50257), (4, 1024, 50304), (1, 3, 1000)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", CE_SHAPES, ids=str)
def test_cross_entropy_kernels_match_fp32_reference(shape, dtype):
    b, s, vocab = shape
    logits = _rand(b, s, vocab, dtype=dtype, scale=3.0, seed=8) + 20
    target = torch.randint(0, vocab, (b, s), device="cuda",
                           generator=torch.Generator(device="cuda").manual_seed(9))
    g = _rand(b, s, dtype=torch.float32, seed=10)
    lk = logits.clone().requires_grad_()
    loss = fused_vocab_parallel_cross_entropy(lk, target, ParallelState.single(),
                                              ops.cross_entropy_stats, ops.cross_entropy_grad)
    loss.backward(g)
    l32 = logits.float().requires_grad_()
    ref = F.cross_entropy(l32.view(-1, vocab), target.view(-1), reduction="none").view(b, s)
    ref.backward(g)
    assert loss.dtype == torch.float32 and lk.grad.dtype == dtype
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lk.grad.float(), l32.grad, rtol=EPS[dtype] + 1e-5,
                               atol=1e-6 * l32.grad.abs().max().item())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cross_entropy_nan_rows_match_pytorch(dtype):
    """A row with a NaN logit (or all NaN) gives a NaN loss and NaN gradients, as in PyTorch;
    the other rows are unaffected."""
    logits = _rand(2, 3, 1000, dtype=dtype, scale=3.0, seed=13)
    logits[0, 0] = float("nan")
    logits[1, 2, 5] = float("nan")
    target = torch.randint(0, 1000, (2, 3), device="cuda",
                           generator=torch.Generator(device="cuda").manual_seed(14))
    lk = logits.clone().requires_grad_()
    loss = fused_vocab_parallel_cross_entropy(lk, target, ParallelState.single(),
                                              ops.cross_entropy_stats, ops.cross_entropy_grad)
    loss.sum().backward()
    l32 = logits.float().requires_grad_()
    ref = F.cross_entropy(l32.view(-1, 1000), target.view(-1), reduction="none").view(2, 3)
    ref.sum().backward()
    assert torch.equal(loss.isnan(), ref.isnan()) and int(loss.isnan().sum()) == 2
    torch.testing.assert_close(loss[~ref.isnan()], ref.detach()[~ref.isnan()], rtol=1e-5,
                               atol=1e-5)
    assert torch.equal(lk.grad.isnan(), l32.grad.isnan())


def _run_all_kernels(dtype):
    x, mask, dy, scale = _softmax_case("masked", 2, 8, 333, 333, dtype)
    outs = []
    for fn in (lambda t: ops.causal_softmax(t, scale),
               lambda t: ops.masked_softmax(t, mask, scale)):
        t = x.clone().requires_grad_()
        y = fn(t)
        y.backward(dy)
        outs += [y, t.grad]
    h = _rand(2048, 1024, dtype=dtype, seed=11)
    w = torch.ones(1024, device="cuda", requires_grad=True)
    bias = torch.zeros(1024, device="cuda", requires_grad=True)
    t = h.clone().requires_grad_()
    y = ops.layer_norm(t, w, bias, 1e-5)
    y.backward(h)
    outs += [y, t.grad, w.grad, bias.grad]
    logits = _rand(512, 50304, dtype=dtype, seed=12).requires_grad_()
    target = torch.arange(512, device="cuda") * 97
    loss = fused_vocab_parallel_cross_entropy(logits, target, ParallelState.single(),
                                              ops.cross_entropy_stats, ops.cross_entropy_grad)
    loss.sum().backward()
    return outs + [loss, logits.grad]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_kernels_are_deterministic(dtype):
    first, second = _run_all_kernels(dtype), _run_all_kernels(dtype)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def _train(dtype: str, fused_on: bool, steps: int = 30, checkpoint: bool = False,
           dropout: float = 0.0):
    config = ModelConfig(
        num_layers=4, hidden_size=256, num_attention_heads=8, seq_length=257,
        max_position_embeddings=257, padded_vocab_size=1000, hidden_dropout=dropout,
        attention_dropout=dropout, params_dtype=dtype, checkpoint_activations=checkpoint,
        attention_backend="local", masked_softmax_fusion=fused_on, bias_gelu_fusion=fused_on,
        bias_dropout_fusion=fused_on, layernorm_fusion=fused_on,
        cross_entropy_loss_fusion=fused_on, seed=5)
    from app.mpu.random import model_parallel_seed

    model_parallel_seed(11)
    model = GPT2Model(config).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    zipf = 1.0 / torch.arange(1, 1001, dtype=torch.float64) ** 1.2  # a learnable unigram
    losses = []
    for _ in range(steps):
        tokens = torch.multinomial(zipf, 4 * 258, replacement=True, generator=gen)
        tokens = tokens.view(4, 258).cuda()
        loss = model(tokens[:, :-1], labels=tokens[:, 1:]).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, fused.selections()


@pytest.mark.parametrize("dtype,rtol", [("float32", 2e-3), ("bfloat16", 3e-2)])
def test_training_with_kernels_tracks_training_without(dtype, rtol):
    """30 AdamW steps of a small GPT-2 with every fusion on vs off (same init, data, no dropout):
    the loss curves agree to fp32 reordering (fp32) or bf16 rounding noise (bf16)."""
    on, chosen = _train(dtype, True)
    assert chosen["layer_norm"][0] == "CUDA kernel" and chosen["causal_softmax"][0] == "CUDA kernel"
    assert chosen["cross_entropy"][0] == "CUDA kernel"
    off, _ = _train(dtype, False)
    assert on[-1] < on[0] - 0.1  # it learns (the tokens' Zipf unigram distribution)
    for a, b in zip(on, off):
        assert abs(a - b) <= rtol * abs(b), (on, off)


def test_fused_dropout_is_reproduced_under_activation_checkpointing():
    """With bias+dropout+add fused (mask drawn outside the compiled code) and attention dropout,
    recomputation reproduces the masks: checkpointed and plain runs give the same losses."""
    plain, _ = _train("float32", True, steps=5, dropout=0.1)
    recomputed, chosen = _train("float32", True, steps=5, dropout=0.1, checkpoint=True)
    assert chosen["bias_dropout_add"][0] == "torch.compile"
    torch.testing.assert_close(torch.tensor(recomputed), torch.tensor(plain), rtol=1e-6, atol=0)
