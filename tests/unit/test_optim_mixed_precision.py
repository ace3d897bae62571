"""The native precision wrappers in one process: the mixed-precision step against an fp32 AdamW
reference, loss scaling and unscaling, overflow skips, state round trips; the non-finite policy."""
import copy

import pytest
import torch
from torch import nn

from app.config import OptimizerConfig, PrecisionConfig
from app.mpu.parallel_state import ParallelState
from app.optim.mixed_precision import (Float32Optimizer, MixedPrecisionOptimizer,
                                       build_precision_optimizer)
from app.optim.optimizer import build_adamw
from app.optim.param_groups import get_param_groups
from app.training.resilience.nonfinite import NonFinitePolicy, TrainingAborted

OPT = OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad=0.0, lr_decay_iters=10)
PS = ParallelState.single()


def tiny_model(dtype):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))
    return model.to(dtype)


def loss_of(model, x):
    return model(x.to(next(model.parameters()).dtype)).float().pow(2).mean()


def backward_micro_batches(model, wrapper, batches):
    for x in batches:
        wrapper.scale_loss(loss_of(model, x) / len(batches)).backward()


def test_bf16_step_equals_fp32_adamw_on_the_main_weights():
    model = tiny_model(torch.bfloat16)
    wrapper = MixedPrecisionOptimizer(model, OPT, PrecisionConfig(bf16=True))
    assert wrapper.accumulate_in_fp32 and wrapper.loss_scale is None
    reference = [p.detach().float().clone().requires_grad_() for p in model.parameters()]
    assert all(torch.equal(r, m) for r, m in zip(reference, wrapper.main_params))
    batches = [torch.randn(4, 8, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    backward_micro_batches(model, wrapper, batches)
    grads = [p.main_grad.clone() for p in model.parameters()]  # fp32 accumulation buffers
    assert all(p.grad is None for p in model.parameters())     # moved into them by the hook
    wrapper.reduction_grads()
    outcome = wrapper.step(PS, 0.0, None)
    assert not outcome.skipped and outcome.grad_norm == pytest.approx(
        torch.cat([g.flatten() for g in grads]).norm().item(), rel=1e-6)
    ref_model = copy.deepcopy(model).float()
    for p, r in zip(ref_model.parameters(), reference):
        p.data.copy_(r)
    ref_opt = build_adamw(get_param_groups(ref_model, OPT.weight_decay), OPT)
    for p, g in zip(ref_model.parameters(), grads):
        p.grad = g.clone()
    ref_opt.step()
    for main, ref, p in zip(wrapper.main_params, ref_model.parameters(), model.parameters()):
        assert torch.equal(main, ref)                     # AdamW on fp32 main weights
        assert torch.equal(p, main.to(torch.bfloat16))    # copied back into the model


def test_fp16_gradients_are_unscaled_and_overflow_skips_with_backoff():
    model = tiny_model(torch.float16)
    precision = PrecisionConfig(fp16=True, initial_loss_scale=1024.0, hysteresis=1)
    wrapper = build_precision_optimizer(model, OPT, precision)
    ref = tiny_model(torch.float16).float()  # same seed: same fp16-rounded weights, in fp32
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(7))
    backward_micro_batches(model, wrapper, [x])
    loss_of(ref, x).backward()
    main_grads = wrapper._main_grads()
    for g, p in zip(main_grads, ref.parameters()):
        torch.testing.assert_close(g / 1024.0, p.grad, rtol=2e-2, atol=1e-4)  # fp16 backward
    wrapper.zero_grad()
    backward_micro_batches(model, wrapper, [x])
    before = [p.detach().clone() for p in model.parameters()]
    mains = [m.detach().clone() for m in wrapper.main_params]
    next(iter(model.parameters())).grad[0, 0] = float("inf")
    outcome = wrapper.step(PS, 1.0, None)
    assert outcome.skipped and outcome.grad_norm is None and outcome.loss_scale == 1024.0
    assert not outcome.nonfinite  # above the minimum scale: an ordinary fp16 overflow
    assert wrapper.loss_scale == 512.0 and len(wrapper.inner.state) == 0
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert all(torch.equal(a, m) for a, m in zip(mains, wrapper.main_params))


def test_fp32_wrapper_skips_a_non_finite_loss_and_counts_it():
    model = tiny_model(torch.float32)
    wrapper = build_precision_optimizer(model, OPT, PrecisionConfig())
    assert isinstance(wrapper, Float32Optimizer)
    backward_micro_batches(model, wrapper, [torch.randn(4, 8)])
    before = [p.detach().clone() for p in model.parameters()]
    outcome = wrapper.step(PS, 1.0, None, nonfinite_loss=torch.tensor(1.0))
    assert outcome.skipped and outcome.nonfinite and outcome.nonfinite_loss
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_mixed_state_round_trips_and_reads_an_fp32_state():
    model = tiny_model(torch.float16)
    precision = PrecisionConfig(fp16=True, initial_loss_scale=256.0)
    wrapper = MixedPrecisionOptimizer(model, OPT, precision)
    for i in range(3):
        wrapper.zero_grad()
        backward_micro_batches(model, wrapper, [torch.randn(4, 8)])
        wrapper.step(PS, 1.0, None)
    state = wrapper.state_dict()
    assert set(state) == {"optimizer", "grad_scaler", "fp32_from_fp16_params", "param_names"}
    names = [n for group in state["param_names"] for n in group]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())
    other = MixedPrecisionOptimizer(tiny_model(torch.float16), OPT, precision)
    other.load_state_dict(state)
    assert other.scaler.state_dict()["growth_tracker"] == 3
    for a, b in zip(other.main_params, wrapper.main_params):
        assert torch.equal(a, b)
    for sa, sb in zip(other.inner.state.values(), wrapper.inner.state.values()):
        assert all(torch.equal(sa[k], sb[k]) for k in ("exp_avg", "exp_avg_sq"))
    fp32 = Float32Optimizer(tiny_model(torch.float32), OPT)
    fp32.load_state_dict(state)  # a mixed checkpoint's AdamW moments into an fp32 run
    assert len(fp32.inner.state) == len(wrapper.inner.state)


def test_state_bytes_follow_the_mixed_precision_model():
    model = tiny_model(torch.bfloat16)
    n = sum(p.numel() for p in model.parameters())
    wrapper = MixedPrecisionOptimizer(model, OPT, PrecisionConfig(bf16=True))
    backward_micro_batches(model, wrapper, [torch.randn(4, 8)])
    wrapper.step(PS, 1.0, None)
    b = wrapper.state_bytes()
    assert (b["params"], b["grads"], b["optimizer"]) == (2 * n, 4 * n, (8 + 4) * n)


def test_non_finite_policy():
    policy = NonFinitePolicy(max_consecutive=3)
    for it, (nonfinite, skipped) in enumerate([(True, True), (True, True), (False, False),
                                               (True, True), (False, True), (True, True)], 1):
        policy.observe(it, nonfinite, False, skipped)  # an fp16 skip above min does not reset
    assert policy.streak == 2 and policy.in_streak
    with pytest.raises(TrainingAborted, match="iteration 7: 3 consecutive"):
        policy.observe(7, True, False, True)
    NonFinitePolicy(max_consecutive=0).observe(1, True, True, True)  # 0 disables
    with pytest.raises(TrainingAborted, match="non-finite loss"):
        NonFinitePolicy(check_for_nan=True).observe(5, False, True, True)
