"""Megatron-LM's learning-rate schedule: linear warmup, then a decay to `min_lr`.

The arithmetic lives in the pure function `learning_rate_at`; `OptimizerParamScheduler` only
counts iterations, writes the value into the optimizer's param groups and (de)serialises its
state with Megatron's key names (`max_lr`, `min_lr`, `lr_warmup_steps`, `lr_decay_steps`,
`lr_decay_style`, `num_steps`), so checkpoints stay readable by Megatron tools.

Schedule, for iteration `t`, warmup `W`, decay iterations `D`, peak `lr`, floor `min_lr`:

- `t <= W` (and `W > 0`): `lr * t / W` (starts at 0, reaches `lr` at `t = W`);
- constant: `lr` after warmup;
- `t > D`: `min_lr` (linear and cosine are continuous there);
- otherwise with `r = (t - W) / (D - W)`:
  linear `min_lr + (lr - min_lr) (1 - r)`,
  cosine `min_lr + (lr - min_lr) (1 + cos(pi r)) / 2`,
  exponential `max(min_lr, lr * 2**(-r))`: the form of DeepSpeedExamples' Megatron
  (`lr * exp(-0.693 r)`, halving over the decay window, floored at `min_lr`); past `D` it holds
  its end value `max(min_lr, lr / 2)` so the curve has no jump.
"""
from __future__ import annotations

import math
from typing import Any, Dict, Optional

import torch

from app.config import OptimizerConfig
from app.optim.param_groups import DECOUPLED_GROUP

DECAY_STYLES = ("constant", "linear", "cosine", "exponential")


def learning_rate_at(iteration: int, *, lr: float, min_lr: float, warmup_iters: int,
                     decay_iters: int, decay_style: str) -> float:
    """LR at `iteration` under Megatron's warmup + decay rules (pure; see the module docstring)."""
    if decay_style not in DECAY_STYLES:
        raise ValueError(f"lr decay style must be one of {DECAY_STYLES}, got {decay_style!r}")
    if warmup_iters > 0 and iteration <= warmup_iters:
        return lr * float(iteration) / float(warmup_iters)
    if decay_style == "constant":
        return lr
    if decay_style == "exponential":
        span = decay_iters - warmup_iters
        ratio = 1.0 if span <= 0 else min(1.0, max(0.0, (iteration - warmup_iters) / span))
        return max(min_lr, lr * 2.0 ** (-ratio))
    if iteration > decay_iters:
        return min_lr
    # Here warmup_iters < iteration <= decay_iters, so the span is positive.
    ratio = float(iteration - warmup_iters) / float(decay_iters - warmup_iters)
    if decay_style == "linear":
        coeff = 1.0 - ratio
    else:  # cosine
        coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
    return min_lr + coeff * (lr - min_lr)


class OptimizerParamScheduler:
    """Megatron's LR scheduler: `step(n)` advances n steps and writes the LR into param groups.

    A step is an iteration, or with `config.lr_in_samples` (--train-samples or a batch-size
    schedule) a sample: warmup and decay are then `lr_warmup_samples` / `lr_decay_samples` and
    each update advances by the iteration's global batch (`increment`, which the engine sets
    before the iteration; `step()` without an argument uses it, as DeepSpeed calls it), as
    Megatron's `opt_param_scheduler.step(increment=batch)`.

    The constructor writes `get_lr(0)` (0 when warming up), matching Megatron, whose first
    optimizer step therefore runs at the step-0 LR. Groups carrying an `lr_mult` key get
    `lr * lr_mult`. With --decoupled-lr the group named `decoupled` (app.optim.param_groups)
    follows the same warm-up and decay between its own peak and floor (`decoupled_lr`,
    `decoupled_min_lr`: Megatron's per-group max_lr / min_lr); the state dict then records
    them too, and a resume checks them like the other settings.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, config: OptimizerConfig) -> None:
        self.in_samples = bool(config.lr_in_samples)
        self.increment = 1
        """Steps one update advances: 1, or the iteration's global batch in samples."""
        if self.in_samples:
            self._setup(optimizer, config, int(config.lr_warmup_samples),
                        int(config.lr_decay_samples))
            return
        decay_iters = config.lr_decay_iters
        if decay_iters is None:
            if config.lr_decay_style != "constant":
                raise ValueError(
                    f"lr_decay_iters is None with lr_decay_style {config.lr_decay_style!r}; "
                    "pass --lr-decay-iters (the command line defaults it to --train-iters)")
            decay_iters = max(1, config.lr_warmup_iters)
        if decay_iters <= 0:
            raise ValueError(f"lr_decay_iters must be positive, got {decay_iters}")
        self._setup(optimizer, config, int(config.lr_warmup_iters), int(decay_iters))

    def _setup(self, optimizer: torch.optim.Optimizer, config: OptimizerConfig,
               warmup_steps: int, decay_steps: int) -> None:
        self.optimizer = optimizer
        self.max_lr = float(config.lr)
        self.min_lr = float(config.min_lr)
        self.lr_warmup_steps = warmup_steps
        self.lr_decay_steps = decay_steps
        self.lr_decay_style = config.lr_decay_style
        self.decoupled = config.decoupled_lr_range
        """(peak, floor) LR of the `decoupled` group (--decoupled-lr), or None."""
        self.override = bool(config.override_opt_param_scheduler)
        self.use_checkpoint = bool(config.use_checkpoint_opt_param_scheduler)
        self.num_steps = 0
        self.step(0)

    def get_lr(self, iteration: int, group: Optional[Dict[str, Any]] = None) -> float:
        """LR at `iteration` with this scheduler's settings (pure: does not change any state):
        of the ordinary groups, or of param group `group` (the decoupled one has its own peak
        and floor)."""
        peak, floor = self.max_lr, self.min_lr
        if group is not None and group.get("name") == DECOUPLED_GROUP and self.decoupled:
            peak, floor = self.decoupled
        return learning_rate_at(iteration, lr=peak, min_lr=floor,
                                warmup_iters=self.lr_warmup_steps,
                                decay_iters=self.lr_decay_steps, decay_style=self.lr_decay_style)

    def get_last_lr(self) -> float:
        """LR for the current iteration count (the one last written into the optimizer)."""
        return self.get_lr(self.num_steps)

    def step(self, increment: Optional[int] = None) -> float:
        """Advance the step count by `increment` (default: `self.increment`, one update's worth);
        write the new LR into every param group."""
        self.num_steps += int(self.increment if increment is None else increment)
        for group in self.optimizer.param_groups:
            group["lr"] = self.get_lr(self.num_steps, group) * group.get("lr_mult", 1.0)
        return self.get_lr(self.num_steps)

    def state_dict(self) -> Dict[str, Any]:
        """Megatron-named settings plus the iteration count (and the decoupled peak and floor
        with --decoupled-lr)."""
        state = {"max_lr": self.max_lr, "min_lr": self.min_lr,
                 "lr_warmup_steps": self.lr_warmup_steps, "lr_decay_steps": self.lr_decay_steps,
                 "lr_decay_style": self.lr_decay_style, "num_steps": self.num_steps}
        if self.decoupled:
            state["decoupled_lr"], state["decoupled_min_lr"] = self.decoupled
        return state

    def load_state_dict(self, state_dict: Dict[str, Any], *, override: Optional[bool] = None
                        ) -> None:
        """Restore the iteration count; the settings must match the config, unless overridden.

        Megatron's two ways out (from OptimizerConfig, so they also apply when DeepSpeed calls
        this): `override` (--override-opt_param-scheduler) keeps the config's settings;
        `use_checkpoint` (--use-checkpoint-opt_param-scheduler) adopts the checkpoint's.
        Otherwise a differing setting raises a ValueError naming both values and both flags.
        Older Megatron key names (`start_lr`, `warmup_iter`, `end_iter`, `decay_style`,
        `num_iters`) are accepted.
        """
        override = self.override if override is None else override
        aliases = {"max_lr": "start_lr", "lr_warmup_steps": "warmup_iter",
                   "lr_decay_steps": "end_iter", "lr_decay_style": "decay_style",
                   "num_steps": "num_iters"}
        def read(key: str) -> Any:
            if key in state_dict:
                return state_dict[key]
            return state_dict.get(aliases.get(key, key))
        settings = ("max_lr", "min_lr", "lr_warmup_steps", "lr_decay_steps", "lr_decay_style")
        saved_decoupled = ((state_dict["decoupled_lr"], state_dict["decoupled_min_lr"])
                           if "decoupled_lr" in state_dict else None)
        if self.use_checkpoint and not override:
            for key in settings:
                if read(key) is not None:
                    setattr(self, key, read(key))
            if self.decoupled and saved_decoupled:
                self.decoupled = saved_decoupled
        elif not override:
            for key in settings:
                saved, ours = read(key), getattr(self, key)
                if saved is not None and saved != ours:
                    raise ValueError(
                        f"LR scheduler {key}: checkpoint has {saved!r}, this run has {ours!r} "
                        "(e.g. a longer --train-iters sets a longer decay); pass "
                        "--override-opt_param-scheduler to use this run's settings or "
                        "--use-checkpoint-opt_param-scheduler to keep the checkpoint's")
            if (self.decoupled and saved_decoupled
                    and tuple(saved_decoupled) != tuple(self.decoupled)):
                raise ValueError(
                    f"LR scheduler --decoupled-lr/--decoupled-min-lr (or --min-lr): checkpoint "
                    f"has {tuple(saved_decoupled)}, this run has {self.decoupled}; pass "
                    "--override-opt_param-scheduler to use this run's or "
                    "--use-checkpoint-opt_param-scheduler to keep the checkpoint's")
        num_steps = read("num_steps")
        if num_steps is None:
            raise ValueError(f"LR scheduler state has no 'num_steps'; keys: {sorted(state_dict)}")
        self.num_steps = 0
        self.step(int(num_steps))
