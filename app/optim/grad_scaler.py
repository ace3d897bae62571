"""Loss scalers for fp16 training: Megatron's static and dynamic state machines (pure Python).

The dynamic scaler, per optimizer step, given whether any gradient was inf/nan:

- overflow: the growth tracker restarts at 0 and the hysteresis tracker drops by one; once it
  reaches 0 the scale is multiplied by `backoff_factor` (0.5), never below `min_scale`. The
  hysteresis tracker is *not* refilled by clean steps, only by a growth, so with hysteresis 2
  the second overflow since the last growth backs the scale off, and every one after it too.
- clean step: the growth tracker counts up; after `growth_interval` (--loss-scale-window)
  consecutive clean steps the scale is multiplied by `growth_factor` (2), and both trackers
  restart (hysteresis tracker back to `hysteresis`).

State dicts use Megatron's keys (`scale` as a one-element float tensor, `growth_tracker`,
`hysteresis_tracker`), so Megatron's tools read them; a static scaler saves no state.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Union

import torch


class ConstantLossScaler:
    """A fixed loss scale (--loss-scale S): overflowing steps are skipped, the scale stays."""

    def __init__(self, scale: float) -> None:
        assert scale > 0, scale  # PrecisionConfig validates the flag
        self.scale = float(scale)
        self.min_scale = float(scale)

    def update(self, found_inf: bool) -> None:
        """Nothing changes: a static scale."""

    def state_dict(self) -> Dict[str, Any]:
        return {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """A static scale restores nothing (the flag decides it)."""


class DynamicLossScaler:
    """Megatron's dynamic loss scale with hysteresis (see the module docstring)."""

    def __init__(self, initial_scale: float = 2.0 ** 32, min_scale: float = 1.0,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 1000, hysteresis: int = 2) -> None:
        # internal invariants: PrecisionConfig validates the flags, naming them
        assert 0 < min_scale <= initial_scale, (min_scale, initial_scale)
        assert growth_factor > 1.0 and 0.0 < backoff_factor < 1.0, (growth_factor, backoff_factor)
        assert growth_interval >= 1 and hysteresis >= 1, (growth_interval, hysteresis)
        self.scale = float(initial_scale)
        self.min_scale = float(min_scale)
        self.growth_factor, self.backoff_factor = float(growth_factor), float(backoff_factor)
        self.growth_interval, self.hysteresis = int(growth_interval), int(hysteresis)
        self.growth_tracker = 0
        self.hysteresis_tracker = self.hysteresis

    def update(self, found_inf: bool) -> None:
        """Advance the state machine by one step (found_inf: some gradient was inf/nan)."""
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            self.growth_tracker = 0
            self.hysteresis_tracker = self.hysteresis
            self.scale = self.scale * self.growth_factor

    def state_dict(self) -> Dict[str, Any]:
        return {"scale": torch.tensor([self.scale], dtype=torch.float32),
                "growth_tracker": self.growth_tracker,
                "hysteresis_tracker": self.hysteresis_tracker}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        scale = state["scale"]
        self.scale = float(scale.item() if isinstance(scale, torch.Tensor) else scale)
        self.growth_tracker = int(state["growth_tracker"])
        self.hysteresis_tracker = int(state["hysteresis_tracker"])


LossScaler = Union[ConstantLossScaler, DynamicLossScaler]


def build_loss_scaler(fp16: bool, loss_scale: Optional[float], initial_scale: float,
                      min_scale: float, window: int, hysteresis: int) -> Optional[LossScaler]:
    """The scaler an fp16 run uses: static with --loss-scale, else dynamic; None otherwise
    (fp32 and bf16 need no loss scaling)."""
    if not fp16:
        return None
    if loss_scale:
        return ConstantLossScaler(loss_scale)
    return DynamicLossScaler(initial_scale=initial_scale, min_scale=min_scale,
                             growth_interval=window, hysteresis=hysteresis)
