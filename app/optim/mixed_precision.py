"""Precision-aware optimizer wrappers of the native path: one interface for fp32, bf16 and fp16.

`Float32Optimizer` (fp32 weights) and `MixedPrecisionOptimizer` (fp16/bf16 weights, Megatron's
Float16OptimizerWithFloat16Params design) wrap the optimizer of --optimizer that
`build_inner_optimizer` makes (AdamW; SGD; Muon, whose Newton-Schulz thus sees unscaled fp32
main gradients, with AdamW for the scalar parameters). The engine drives either the same way,
per iteration:

    scale_loss(loss).backward() per micro-batch     (x loss scale for fp16)
    reduction_grads() -> all-reduce over data parallel; embedding_grad(p) -> tied-embedding sum
    step(...) -> StepOutcome

`MixedPrecisionOptimizer` keeps an fp32 *main* copy of every half-precision weight; the
optimizer steps the main copies, which are then cast back into the model. Gradients accumulate
over micro-batches either in the model dtype (`param.grad`) or, with --accumulate-allreduce-grads-in-fp32 (always for
bf16), in an fp32 `param.main_grad` buffer fed by a post-accumulate-grad hook; that buffer is what
gets all-reduced. `step`:

1. main gradients in fp32 (shared with `main_grad`, or cast from `param.grad`);
2. fp16: unscale by 1/scale;
3. any inf/nan in this rank's gradients, or a non-finite loss seen by the engine, is agreed over
   the whole world (max all-reduce), so every rank skips the same step;
4. the loss scaler advances (fp16);
5. skipped: gradients are dropped, nothing is updated; else clip the unscaled fp32 gradients
   (pre-clip norm reported), optimizer step, copy the main weights back into the model.

A skipped step "counts as non-finite" (for --max-consecutive-skipped-iterations) always in fp32
and bf16, and in fp16 only when the scale was already at --min-loss-scale (or static).

State dicts: fp32 is the torch optimizer's own (as before); mixed precision uses Megatron's keys
(`optimizer`, `grad_scaler`, `fp32_from_fp16_params`) plus `param_names` (the model parameter
name of every main weight, so the fp32 weights can be read back by name).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch
from torch import nn

from app.config import OptimizerConfig, PrecisionConfig
from app.mpu import collectives
from app.mpu.grads import clip_grad_norm
from app.optim.grad_buffers import PARALLEL_ATTRS
from app.optim.grad_scaler import LossScaler, build_loss_scaler
from app.optim.model_space import ModelSpaceState, from_torch_state, to_torch_state
from app.optim.muon import Orthogonalize, TensorParallelOrthogonalizer, matrix_specs
from app.optim.optimizer import build_inner_optimizer, optimizer_param_groups

logger = logging.getLogger(__name__)

_PARALLEL_ATTRS = PARALLEL_ATTRS


@dataclass
class StepOutcome:
    """What one optimizer step did."""

    skipped: bool
    grad_norm: Optional[float]
    """Pre-clip global norm of the unscaled fp32 gradients (None when skipped)."""
    nonfinite: bool
    """The step was skipped for non-finite values in a way that counts toward the limit."""
    loss_scale: Optional[float]
    """The loss scale this step's gradients carried (fp16), else None."""
    nonfinite_loss: bool = False
    """Some rank's loss was inf/nan (agreed over the world)."""


def _any_nonfinite(grads: List[torch.Tensor]) -> torch.Tensor:
    """A 0-d float tensor: 1.0 if any element of `grads` is inf or nan (max-abs propagates nan)."""
    if not grads:
        return torch.zeros(())
    norms = torch._foreach_norm(grads, float("inf"))
    return (~torch.isfinite(torch.stack([n.float() for n in norms]))).any().float()


class _PrecisionOptimizer:
    """Shared bookkeeping: the named model parameters and the agreement on non-finite steps."""

    inner: torch.optim.Optimizer
    scaler: Optional[LossScaler] = None

    def __init__(self, model: nn.Module) -> None:
        self.named_params: List[Tuple[str, nn.Parameter]] = [
            (n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in self.named_params]
        self.last_grad_bytes = 0

    @property
    def param_groups(self) -> List[Dict[str, Any]]:
        """The inner optimizer's groups: the LR schedule writes the LR here."""
        return self.inner.param_groups

    @property
    def state(self) -> Any:
        return self.inner.state

    @property
    def loss_scale(self) -> Optional[float]:
        return None if self.scaler is None else self.scaler.scale

    def set_main_weights(self, named_fp32: Dict[str, torch.Tensor]) -> None:
        """Set separate fp32 main weights by parameter name (none here: the weights are them)."""

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """loss x the current loss scale (fp16); the loss itself otherwise."""
        return loss if self.scaler is None else loss * self.scaler.scale

    def _agree_nonfinite(self, grads: List[torch.Tensor], nonfinite_loss: Optional[torch.Tensor],
                         world_group: Any) -> Tuple[bool, bool]:
        """(found inf/nan in any rank's gradients or loss, in any rank's loss): one max
        all-reduce over the world, so every rank decides alike."""
        device = grads[0].device if grads else torch.device("cpu")
        loss_bad = (torch.zeros(()) if nonfinite_loss is None
                    else (nonfinite_loss.detach().float() > 0).float())
        flags = collectives.agree([_any_nonfinite(grads), loss_bad], world_group, device)
        grad_bad, loss_bad_any = (v > 0 for v in flags)
        return grad_bad or loss_bad_any, loss_bad_any

    def _unscale_or_skip(self, grads: List[torch.Tensor], nonfinite_loss: Optional[torch.Tensor],
                         world_group: Any) -> Optional[StepOutcome]:
        """Unscale the fp32 `grads` (fp16), agree on non-finite values, advance the scaler; the
        skipped step's outcome (gradients dropped), or None when the update goes ahead."""
        scale = self.loss_scale
        if scale is not None and scale != 1.0:
            torch._foreach_mul_(grads, 1.0 / scale)
        found_inf, bad_loss = self._agree_nonfinite(grads, nonfinite_loss, world_group)
        if self.scaler is not None:
            self.scaler.update(found_inf)
        if not found_inf:
            return None
        self.zero_grad()
        return StepOutcome(True, None, self._counts_as_nonfinite(found_inf, scale), scale,
                           nonfinite_loss=bad_loss)

    def _counts_as_nonfinite(self, found_inf: bool, scale_before: Optional[float]) -> bool:
        if not found_inf:
            return False
        if self.scaler is None:
            return True
        return scale_before is not None and scale_before <= self.scaler.min_scale


def muon_orthogonalizer(model: nn.Module, config: OptimizerConfig, parallel_state: Any,
                        main_of: Optional[Dict[int, nn.Parameter]] = None
                        ) -> Optional[Orthogonalize]:
    """Muon's orthogonalisation over the tensor-parallel group of `parallel_state` (None: one
    process) for the model parameters, or for their main copies `main_of` (by id of the model
    parameter); None unless --optimizer muon."""
    if config.optimizer != "muon":
        return None
    specs = matrix_specs(model)
    if main_of is not None:
        specs = {id(main_of[key]): spec for key, spec in specs.items() if key in main_of}
    group = None if parallel_state is None else parallel_state.tensor_model_parallel_group
    experts = None if parallel_state is None else parallel_state.expert_tensor_parallel_group
    return TensorParallelOrthogonalizer(config, group, experts).for_params(specs)


class Float32Optimizer(_PrecisionOptimizer):
    """fp32 weights and gradients: the optimizer of --optimizer on the model parameters,
    non-finite steps skipped. `parallel_state` gives Muon its tensor-parallel group."""

    def __init__(self, model: nn.Module, config: OptimizerConfig,
                 parallel_state: Any = None) -> None:
        super().__init__(model)
        self.inner = build_inner_optimizer(optimizer_param_groups(model, config), config,
                                           muon_orthogonalizer(model, config, parallel_state))

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def reduction_grads(self) -> List[torch.Tensor]:
        """Every parameter's gradient (zeros for one unused on this stage): what DP averages."""
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        return [p.grad for p in self.params]

    def embedding_grad(self, param: torch.Tensor) -> torch.Tensor:
        return param.grad

    def step(self, parallel_state: Any, clip_grad: float, world_group: Any,
             nonfinite_loss: Optional[torch.Tensor] = None) -> StepOutcome:
        grads = self.reduction_grads()
        self.last_grad_bytes = sum(g.numel() * g.element_size() for g in grads)
        found_inf, bad_loss = self._agree_nonfinite(grads, nonfinite_loss, world_group)
        if found_inf:
            self.zero_grad()
            return StepOutcome(skipped=True, grad_norm=None, nonfinite=True, loss_scale=None,
                               nonfinite_loss=bad_loss)
        norm = clip_grad_norm(self.params, clip_grad, parallel_state)
        self.inner.step()
        return StepOutcome(skipped=False, grad_norm=norm, nonfinite=False, loss_scale=None)

    def state_dict(self) -> Dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Load AdamW's state; a mixed-precision checkpoint's `optimizer` entry is accepted too
        (its fp32 main weights are loaded into the model by the engine)."""
        inner = state["optimizer"] if is_mixed_state(state) else state
        check_saved_groups(inner["param_groups"], self.inner.param_groups)
        self.inner.load_state_dict(inner)

    def model_space_state(self) -> ModelSpaceState:
        """This rank's optimizer state by model parameter (app.optim.model_space)."""
        return from_torch_state(self.inner, self._inner_names())

    def load_model_space_state(self, state: ModelSpaceState) -> None:
        """Restore the optimizer from a model-space state of this rank's parameters."""
        check_saved_groups(state.param_groups, self.inner.param_groups)
        self.inner.load_state_dict(to_torch_state(self.inner, self._inner_names(), state))

    def _inner_names(self) -> List[str]:
        names = {id(p): n for n, p in self.named_params}
        return [names[id(p)] for g in self.inner.param_groups for p in g["params"]]

    def state_bytes(self) -> Dict[str, int]:
        return {"params": _bytes(self.params), "grads": self.last_grad_bytes,
                "optimizer": _state_bytes(self.inner)}


class MixedPrecisionOptimizer(_PrecisionOptimizer):
    """fp16/bf16 model weights with fp32 main weights, fp32 optimizer states and a loss scaler.
    `parallel_state` gives Muon its tensor-parallel group."""

    def __init__(self, model: nn.Module, config: OptimizerConfig, precision: PrecisionConfig,
                 parallel_state: Any = None) -> None:
        super().__init__(model)
        self.accumulate_in_fp32 = precision.grads_accumulate_in_fp32
        self.scaler = build_loss_scaler(precision.fp16, precision.loss_scale,
                                        *precision.dynamic_scaler_settings())
        self.main_of: Dict[int, nn.Parameter] = {}
        groups = []
        for group in optimizer_param_groups(model, config):
            mains = [self._main_copy(p) for p in group["params"]]
            groups.append({**group, "params": mains})
        self.inner = build_inner_optimizer(
            groups, config, muon_orthogonalizer(model, config, parallel_state, self.main_of))
        self._hooks = []
        if self.accumulate_in_fp32:
            for p in self.params:
                p.main_grad = torch.zeros_like(p, dtype=torch.float32)
                self._hooks.append(p.register_post_accumulate_grad_hook(_accumulate_main_grad))

    def _main_copy(self, param: nn.Parameter) -> nn.Parameter:
        main = nn.Parameter(param.detach().clone().float())
        for attr in _PARALLEL_ATTRS:
            if hasattr(param, attr):
                setattr(main, attr, getattr(param, attr))
        self.main_of[id(param)] = main
        return main

    @property
    def main_params(self) -> List[nn.Parameter]:
        return [self.main_of[id(p)] for p in self.params]

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
            if self.accumulate_in_fp32:
                p.main_grad.zero_()
        for main in self.main_params:
            main.grad = None

    def reduction_grads(self) -> List[torch.Tensor]:
        """The accumulated gradients DP averages: the fp32 `main_grad` buffers, or the model
        dtype `.grad` (zeros for a parameter unused on this stage)."""
        if self.accumulate_in_fp32:
            return [p.main_grad for p in self.params]
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        return [p.grad for p in self.params]

    def embedding_grad(self, param: torch.Tensor) -> torch.Tensor:
        return param.main_grad if self.accumulate_in_fp32 else param.grad

    def _main_grads(self) -> List[torch.Tensor]:
        """Point every main weight's .grad at the fp32 gradient: the shared `main_grad` buffer,
        or an fp32 cast of the half gradient, which is then freed (as Megatron does)."""
        grads = []
        for p, main in zip(self.params, self.main_params):
            if self.accumulate_in_fp32:
                main.grad = p.main_grad
            else:
                main.grad = (p.grad if p.grad is not None else torch.zeros_like(p)).float()
                p.grad = None
            grads.append(main.grad)
        return grads

    def step(self, parallel_state: Any, clip_grad: float, world_group: Any,
             nonfinite_loss: Optional[torch.Tensor] = None) -> StepOutcome:
        grads = self._main_grads()
        self.last_grad_bytes = _bytes(grads)  # fp32; the half gradients are gone by now
        scale = self.loss_scale  # the scale this step's gradients carry
        skipped = self._unscale_or_skip(grads, nonfinite_loss, world_group)
        if skipped is not None:
            return skipped
        norm = clip_grad_norm(self.main_params, clip_grad, parallel_state)
        self.inner.step()
        with torch.no_grad():
            for p, main in zip(self.params, self.main_params):
                p.copy_(main)
        return StepOutcome(False, norm, False, scale)

    # ------------------------------------------------------------------ state

    def state_dict(self) -> Dict[str, Any]:
        names = {id(p): n for n, p in self.named_params}
        model_of = {id(self.main_of[id(p)]): p for p in self.params}
        groups = [g["params"] for g in self.inner.param_groups]
        return {
            "optimizer": self.inner.state_dict(),
            "grad_scaler": None if self.scaler is None else self.scaler.state_dict(),
            "fp32_from_fp16_params": [[m.detach().clone() for m in g] for g in groups],
            "param_names": [[names[id(model_of[id(m)])] for m in g] for g in groups],
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore AdamW, the scaler and the fp32 main weights.

        A plain AdamW state (from an fp32 run) loads the AdamW moments only: the main weights
        must then be set from the checkpoint's fp32 weights (`set_main_weights`). A scaler state
        from another precision (bf16 <-> fp16) is ignored: the scale restarts.
        """
        inner = state["optimizer"] if is_mixed_state(state) else state
        check_saved_groups(inner["param_groups"], self.inner.param_groups)
        self.inner.load_state_dict(inner)
        if not is_mixed_state(state):
            return
        saved_scaler = state.get("grad_scaler")
        if self.scaler is not None and saved_scaler:
            self.scaler.load_state_dict(saved_scaler)
        groups = [g["params"] for g in self.inner.param_groups]
        saved = state["fp32_from_fp16_params"]
        if [len(g) for g in saved] != [len(g) for g in groups]:
            raise ValueError(f"checkpoint holds fp32 main weights in groups of "
                             f"{[len(g) for g in saved]}, this model has {[len(g) for g in groups]}")
        with torch.no_grad():
            for mains, values in zip(groups, saved):
                for main, value in zip(mains, values):
                    main.copy_(value)

    def _inner_names(self) -> List[str]:
        names = {id(self.main_of[id(p)]): n for n, p in self.named_params}
        return [names[id(m)] for g in self.inner.param_groups for m in g["params"]]

    def model_space_state(self) -> ModelSpaceState:
        """This rank's optimizer state by model parameter, with the fp32 main weights
        (app.optim.model_space) and the loss scaler's state."""
        mains = {n: self.main_of[id(p)].detach() for n, p in self.named_params}
        state = from_torch_state(self.inner, self._inner_names(), mains)
        state.grad_scaler = None if self.scaler is None else self.scaler.state_dict()
        return state

    def load_model_space_state(self, state: ModelSpaceState) -> None:
        """Restore the optimizer and the loss scaler (the main weights are set by
        `set_main_weights`; a scaler state of another precision is ignored)."""
        check_saved_groups(state.param_groups, self.inner.param_groups)
        self.inner.load_state_dict(to_torch_state(self.inner, self._inner_names(), state))
        if self.scaler is not None and state.grad_scaler:
            self.scaler.load_state_dict(state.grad_scaler)

    def set_main_weights(self, named_fp32: Dict[str, torch.Tensor]) -> None:
        """Set the fp32 main weights from fp32 tensors by model parameter name (exact)."""
        with torch.no_grad():
            for name, p in self.named_params:
                self.main_of[id(p)].copy_(named_fp32[name])

    def state_bytes(self) -> Dict[str, int]:
        """Model weights; gradients at the last step; AdamW states plus the fp32 main weights."""
        return {"params": _bytes(self.params), "grads": self.last_grad_bytes,
                "optimizer": _state_bytes(self.inner) + _bytes(self.main_params)}


def _accumulate_main_grad(param: torch.Tensor) -> None:
    """Post-accumulate-grad hook: add this micro-batch's gradient into the fp32 buffer."""
    param.main_grad.add_(param.grad)
    param.grad = None


def check_saved_groups(saved_groups: List[Dict[str, Any]], groups: List[Dict[str, Any]]) -> None:
    """Refuse an optimizer state whose param groups (by name: muon, decay, no_decay, and by
    kind) are not this optimizer's, i.e. one saved with another --optimizer; unnamed (older)
    groups pass."""
    def kinds(found: List[Dict[str, Any]]) -> List[Any]:  # AdamW groups have betas, SGD's not
        return [(g.get("name"), "betas" in g) for g in found]
    saved, own = kinds(saved_groups), kinds(groups)
    if all(name is not None for name, _ in saved) and saved != own:
        raise ValueError(f"the checkpoint's optimizer has param groups (name, AdamW?) {saved}, "
                         f"this run's --optimizer has {own}: it was saved with another "
                         "optimizer; resume with the same --optimizer, or pass --no-load-optim "
                         "to start the optimizer afresh")


def is_mixed_state(state: Dict[str, Any]) -> bool:
    """True for a MixedPrecisionOptimizer (Megatron Float16Optimizer) state dict."""
    return isinstance(state, dict) and "fp32_from_fp16_params" in state


def _bytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    total = 0
    for state in optimizer.state.values():
        total += sum(_bytes([v]) for v in state.values()
                     if isinstance(v, torch.Tensor) and v.dim() > 0)
    return total


def build_precision_optimizer(model: nn.Module, config: OptimizerConfig,
                              precision: PrecisionConfig,
                              parallel_state: Any = None) -> _PrecisionOptimizer:
    """The native path's optimizer for this precision: fp32, or mixed (fp16/bf16);
    `parallel_state` (None: one process) gives Muon its tensor-parallel group."""
    if precision.fp16 or precision.bf16:
        return MixedPrecisionOptimizer(model, config, precision, parallel_state)
    return Float32Optimizer(model, config, parallel_state)
