"""The loss scalers against hand-written tables of (overflow pattern -> scale, trackers)."""
import pytest
import torch

from app.optim.grad_scaler import ConstantLossScaler, DynamicLossScaler, build_loss_scaler

# initial 8, min 1, window 3, hysteresis 2; x = overflow, . = clean step.
# Each row: the step, then (scale, growth tracker, hysteresis tracker) after it.
DYNAMIC_TABLE = [
    (".", (8, 1, 2)),
    (".", (8, 2, 2)),
    (".", (16, 0, 2)),   # 3 clean steps: growth, trackers restart
    ("x", (16, 0, 1)),   # first overflow is absorbed by the hysteresis
    (".", (16, 1, 1)),   # a clean step does not refill the hysteresis
    ("x", (8, 0, 0)),    # second overflow since the last growth: back off
    ("x", (4, 0, -1)),   # every further overflow backs off too
    ("x", (2, 0, -2)),
    ("x", (1, 0, -3)),
    ("x", (1, 0, -4)),   # never below the minimum
    (".", (1, 1, -4)),
    (".", (1, 2, -4)),
    (".", (2, 0, 2)),    # growth refills the hysteresis
    ("x", (2, 0, 1)),
]


def test_dynamic_scaler_follows_the_table():
    scaler = DynamicLossScaler(initial_scale=8, min_scale=1, growth_interval=3, hysteresis=2)
    assert (scaler.scale, scaler.growth_tracker, scaler.hysteresis_tracker) == (8, 0, 2)
    for i, (step, expected) in enumerate(DYNAMIC_TABLE):
        scaler.update(step == "x")
        got = (scaler.scale, scaler.growth_tracker, scaler.hysteresis_tracker)
        assert got == expected, f"after step {i + 1} ({step}): {got} != {expected}"


def test_hysteresis_one_backs_off_at_every_overflow_and_state_round_trips():
    scaler = DynamicLossScaler(initial_scale=2.0 ** 16, min_scale=2.0 ** 14, growth_interval=2,
                               hysteresis=1)
    for _ in range(3):
        scaler.update(True)
    assert scaler.scale == 2.0 ** 14  # 16 -> 15 -> 14 -> floor
    scaler.update(False)
    state = scaler.state_dict()
    assert isinstance(state["scale"], torch.Tensor) and state["scale"].item() == 2.0 ** 14
    assert (state["growth_tracker"], state["hysteresis_tracker"]) == (1, -2)
    fresh = DynamicLossScaler(initial_scale=2.0 ** 20, min_scale=1, growth_interval=2, hysteresis=1)
    fresh.load_state_dict(state)
    fresh.update(False)
    scaler.update(False)
    assert fresh.scale == scaler.scale == 2.0 ** 15


def test_static_scale_never_changes():
    scaler = ConstantLossScaler(128.0)
    for overflow in (True, True, False, True, False, False):
        scaler.update(overflow)
        assert scaler.scale == 128.0
    assert scaler.state_dict() == {}


def test_builder_picks_by_precision_and_validates():
    assert build_loss_scaler(False, None, 2.0 ** 32, 1.0, 1000, 2) is None  # bf16 / fp32
    assert isinstance(build_loss_scaler(True, 64.0, 2.0 ** 32, 1.0, 1000, 2), ConstantLossScaler)
    dynamic = build_loss_scaler(True, None, 2.0 ** 32, 1.0, 1000, 2)
    assert isinstance(dynamic, DynamicLossScaler) and dynamic.scale == 2.0 ** 32
    from app.config import PrecisionConfig  # the flags are validated where the config is built
    with pytest.raises(ValueError, match="--min-loss-scale"):
        PrecisionConfig(fp16=True, initial_loss_scale=1.0, min_loss_scale=2.0)
    with pytest.raises(ValueError, match="--hysteresis"):
        PrecisionConfig(fp16=True, hysteresis=0)
