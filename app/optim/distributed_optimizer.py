"""The distributed optimizer (--use-distributed-optimizer): Megatron-LM's ZeRO-1 on the native path.

A sibling of `Float32Optimizer` and `MixedPrecisionOptimizer` with their interface, so the
engine drives it the same way. The model's parameters become views of one contiguous buffer,
and their gradients accumulate (post-accumulate-grad hook) into a contiguous gradient buffer of
the same layout (fp32, or the half dtype without --accumulate-allreduce-grads-in-fp32). Both are
cut into buckets of whole parameters, in reverse order (roughly the order backward produces
them), each padded to a multiple of the data-parallel size DP and split into DP equal shards:

    bucket b = [shard of DP rank 0 | shard of rank 1 | ... ]       (flat, elements)
    this rank owns its shard of every bucket: fp32 main weights (for fp32 models, a view of the
    weight buffer itself), the fp32 gradient shard, and the optimizer's states for those elements

`step`: each bucket's gradients are reduce-scattered over DP (summed, then divided by DP, as the
all-reduce of the plain path does), fp16 gradients unscaled, non-finite values agreed over the
world, the norm summed from the shards over the world (each parameter counted once, as
app.mpu.grads does), gradients clipped, the optimizer (AdamW, SGD or Muon) steps the main shards,
the weights are cast back and all-gathered over DP. `reduction_grads()` is empty: the engine's
all-reduce has nothing to do.

Muon: the momentum is element-wise, so it stays sharded like AdamW's moments; Newton-Schulz
needs whole matrices, so the shards' updates are all-gathered over DP (one all-gather of the
buffer's size per step) and each rank orthogonalises only the matrices its shard overlaps (the
work splits over DP; a matrix on a shard boundary is done by both ranks, identically), keeping
its elements. Tensor-parallel peers share the bucket layout, so they meet the same matrices in
the same order for --muon-tp-mode's collectives.

Overlap (gloo and NCCL alike, both run the async collectives in the background):
- --overlap-grad-reduce: a bucket's reduce-scatter starts from the gradient hook as soon as every
  parameter in it has received its last micro-batch's gradient, while backward goes on; `step`
  waits. The bucket holding the tied word embeddings (PP > 1, first and last stage) waits for
  `step`, since the engine first sums that gradient over the two stages (`embedding_grad`).
- --overlap-param-gather: the all-gathers of the updated weights are left in flight; each module
  waits for the buckets of its own weights in a forward pre-hook (and before any state_dict).

Mixture of Experts: expert parameters (marked `allreduce = False`) get buffers of their own,
sharded over the expert-data-parallel group and divided by the data x context size after the
sum (app.optim.grad_buffers: Megatron Core keeps a separate optimizer for them the same way);
the norm counts their shards once over the world like the dense ones.

Checkpoints are gathered and layout-independent: `state_dict()` returns exactly what the plain
wrapper of this precision returns for the same model (the torch optimizer's state dict, in
`optimizer_param_groups` order; mixed precision adds Megatron's `fp32_from_fp16_params` and
`param_names`), so a run resumes at another data-parallel size, or without the flag, and back.
All ranks must call it (it all-gathers); only data-parallel rank 0 writes the files.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
from torch import nn

from app.config import OptimizerConfig, PrecisionConfig
from app.mpu import collectives
from app.mpu.grads import counts_toward_norm, is_expert, norm_power
from app.optim.grad_buffers import Bucket, ShardedBuffers
from app.optim.grad_scaler import build_loss_scaler
from app.optim.mixed_precision import (StepOutcome, _bytes, _PrecisionOptimizer, _state_bytes,
                                       check_saved_groups, is_mixed_state)
from app.optim.model_space import (MAIN, ModelSpaceState, ParamState, common_step,
                                   hyperparameters, state_keys)
from app.optim.muon import TensorParallelOrthogonalizer, matrix_specs
from app.optim.optimizer import build_inner_optimizer, optimizer_param_groups

DEFAULT_BUCKET_ELEMENTS = 40_000_000
STATE_TENSORS = ("exp_avg", "exp_avg_sq", "momentum_buffer")
"""Per-element optimizer states (AdamW's moments; SGD's and Muon's momentum), sharded like the
weights; AdamW's `step` is one count for all."""


class DistributedOptimizer(_PrecisionOptimizer):
    """fp32 main weights and optimizer states sharded over data parallel; see the module
    docstring."""

    def __init__(self, model: nn.Module, config: OptimizerConfig, precision: PrecisionConfig,
                 parallel_state: Any, num_micro_batches: int) -> None:
        super().__init__(model)
        self.ps = parallel_state
        self.group = parallel_state.data_parallel_group
        self.dp = parallel_state.data_parallel_size
        self.num_micro_batches = num_micro_batches
        self.overlap_grad_reduce = config.overlap_grad_reduce
        self.overlap_param_gather = config.overlap_param_gather
        self.half = precision.fp16 or precision.bf16
        self.scaler = (build_loss_scaler(precision.fp16, precision.loss_scale,
                                         *precision.dynamic_scaler_settings())
                       if self.half else None)
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) != 1:
            raise ValueError(f"the distributed optimizer needs one parameter dtype, got {dtypes}")
        self.param_dtype = dtypes.pop()
        self.grad_dtype = (torch.float32 if not self.half or precision.grads_accumulate_in_fp32
                           else self.param_dtype)
        self.name_of = {id(p): n for n, p in self.named_params}
        bucket_size = config.ddp_bucket_size or max(DEFAULT_BUCKET_ELEMENTS, 1_000_000 * self.dp)
        tied = model.shared_embedding_weight()  # None: untied, PP 1, a middle stage
        self.domains = self._build_domains(bucket_size, tied)
        self.domain_of = {id(p): d for d in self.domains for p in d.params}
        self.pieces = [piece for d in self.domains for piece in d.shards(self.name_of)]
        self.groups_of_params = [g["params"] for g in optimizer_param_groups(model, config)]
        piece_of = {id(piece.param): piece for piece in self.pieces}
        self.piece_of_main = {id(piece.main): piece for piece in self.pieces}
        groups = []
        for group in optimizer_param_groups(model, config):
            mains = [piece_of[id(p)].main for p in group["params"] if id(p) in piece_of]
            groups.append({**group, "params": mains})
        muon = config.optimizer == "muon"
        self.specs = matrix_specs(model) if muon else {}
        self.orthogonalizer = TensorParallelOrthogonalizer(
            config, parallel_state.tensor_model_parallel_group,
            parallel_state.expert_tensor_parallel_group) if muon else None
        self.inner = build_inner_optimizer(groups, config,
                                           self._orthogonalize_pieces if muon else None)
        self.counts: Dict[int, int] = {}
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]
        self._install_gather_waits(model, tied)

    # ------------------------------------------------------------------ layout

    def _build_domains(self, bucket_size: int, tied: Optional[nn.Parameter]
                       ) -> List[ShardedBuffers]:
        """The dense parameters' buffers over data x context ranks and, with experts, the
        experts' over the expert-data-parallel group (app.optim.grad_buffers)."""
        ps = self.ps
        dense = [p for p in self.params if not is_expert(p)]
        experts = [p for p in self.params if is_expert(p)]
        domains = [ShardedBuffers(dense, self.group, self.dp, ps.data_parallel_rank, self.dp)]
        if experts:
            domains.append(ShardedBuffers(experts, ps.expert_data_parallel_group,
                                          ps.expert_data_parallel_size,
                                          ps.expert_data_parallel_rank, self.dp))
        domains = [d for d in domains if d.params]
        for domain in domains:
            domain.build(self.param_dtype, self.grad_dtype, bucket_size, tied)
        return domains

    @property
    def _device(self) -> torch.device:
        return self.domains[0].param_buffer.device

    @property
    def buckets(self) -> List[Bucket]:
        return [b for d in self.domains for b in d.buckets]

    # ------------------------------------------------------------------ gradients

    def zero_grad(self) -> None:
        for domain in self.domains:
            domain.zero()
        self.counts.clear()
        for p in self.params:
            p.grad = None

    def _on_grad(self, param: torch.Tensor) -> None:
        """Post-accumulate-grad hook: add the gradient into the buffer; with overlap, start the
        bucket's reduce-scatter once every parameter in it has its last micro-batch's gradient."""
        param.main_grad.add_(param.grad)
        param.grad = None
        if not self.overlap_grad_reduce:
            return
        count = self.counts.get(id(param), 0) + 1
        self.counts[id(param)] = count
        if count == self.num_micro_batches:
            domain = self.domain_of[id(param)]
            bucket = domain.bucket_of[id(param)]
            bucket.ready += 1
            if bucket.ready == len(bucket.params) and not bucket.deferred:
                domain.launch_reduce(bucket, async_op=True)

    def reduction_grads(self) -> List[torch.Tensor]:
        """Nothing for the engine to all-reduce: `step` reduce-scatters the buckets itself."""
        return []

    def embedding_grad(self, param: torch.Tensor) -> torch.Tensor:
        """The tied embedding's accumulated, not yet reduced gradient (its bucket waits)."""
        return param.main_grad

    # ------------------------------------------------------------------ the step

    def step(self, parallel_state: Any, clip_grad: float, world_group: Any,
             nonfinite_loss: Optional[torch.Tensor] = None) -> StepOutcome:
        grads = [g for d in self.domains for g in d.reduced_grads()]
        self.last_grad_bytes = _bytes([d.grad_buffer for d in self.domains] + [
            g for b, g in zip(self.buckets, grads) if g is not b.reduced])
        scale = self.loss_scale  # the scale this step's gradients carry
        skipped = self._unscale_or_skip(grads, nonfinite_loss, world_group)
        if skipped is not None:
            return skipped
        norm = self._clip(clip_grad, world_group)
        self.inner.step()
        for domain in self.domains:
            domain.gather_weights(self.overlap_param_gather)
        return StepOutcome(False, norm, False, scale)

    def _clip(self, max_norm: float, world_group: Any) -> float:
        """Pre-clip global norm from the shards (summed over the world: the shards of the data-
        parallel ranks make up one replica, the model-parallel ranks the whole model; expert
        shards likewise over expert-data-parallel ranks); gradients scaled by
        min(1, max_norm / norm) exactly as app.mpu.grads.clip_grad_norm does."""
        tp_rank, etp_rank = (self.ps.tensor_model_parallel_rank,
                             self.ps.expert_tensor_parallel_rank)
        device = self.domains[0].grad_buffer.device
        total = torch.zeros(1, dtype=torch.float32, device=device)
        for piece in self.pieces:
            if counts_toward_norm(piece.main, tp_rank, etp_rank):
                total += norm_power(piece.param, piece.main.grad, 2.0, flat_start=piece.lo)
        collectives.all_reduce(total, world_group)
        norm = float(total.item()) ** 0.5
        if max_norm > 0:
            coeff = max_norm / (norm + 1e-6)
            if coeff < 1.0:
                for piece in self.pieces:
                    piece.main.grad.detach().mul_(coeff)
        return norm

    def _install_gather_waits(self, model: nn.Module, tied: Optional[nn.Parameter]) -> None:
        """Forward and state_dict pre-hooks: a module waits for its weights' buckets. The last
        stage's tied copy of the embeddings feeds the logits without its module running, so the
        whole model's forward waits for that bucket."""
        bucket_of = {k: b for d in self.domains for k, b in d.bucket_of.items()}
        if tied is not None:
            bucket = [bucket_of[id(tied)]]
            model.register_forward_pre_hook(lambda _m, _a, b=bucket: self._wait_gather(b))
        for module in model.modules():
            own = [p for p in module.parameters(recurse=False) if id(p) in bucket_of]
            if not own:
                continue
            buckets = list({id(b): b for b in (bucket_of[id(p)] for p in own)}.values())
            module.register_forward_pre_hook(lambda _m, _a, b=buckets: self._wait_gather(b))
            module.register_state_dict_pre_hook(
                lambda *_a, b=buckets, **_k: self._wait_gather(b))

    def _wait_gather(self, buckets: List[Bucket]) -> None:
        for bucket in buckets:
            if bucket.param_request is not None:
                bucket.param_request.wait()
                bucket.param_request = None

    def finish_param_gather(self) -> None:
        """Wait for every weight all-gather still in flight."""
        self._wait_gather(self.buckets)

    # ------------------------------------------------------------------ state

    def _full(self, per_piece: Dict[int, torch.Tensor],
              params: Optional[List[nn.Parameter]] = None) -> Dict[int, torch.Tensor]:
        """{id(param): full fp32 tensor} for `params` (default: all) from this rank's pieces (by
        id of their main weight; zeros where none is given), all-gathered over each parameter's
        replica group."""
        wanted = self.params if params is None else params
        full: Dict[int, torch.Tensor] = {}
        for domain in self.domains:
            full.update(domain.full(self.pieces, per_piece, wanted))
        return full

    def _orthogonalize_pieces(self, mains: List[torch.Tensor], updates: List[torch.Tensor]
                              ) -> List[torch.Tensor]:
        """Muon's `orthogonalize` for this rank's pieces (every DP rank calls it once per step):
        the updates are all-gathered into whole matrices, each matrix with a piece here is
        orthogonalised (over TP as --muon-tp-mode says) and the piece's elements kept."""
        pieces = [self.piece_of_main[id(main)] for main in mains]
        whole = self._full({id(m): u.reshape(-1) for m, u in zip(mains, updates)},
                           [piece.param for piece in pieces])
        result = []
        for piece in pieces:
            done = self.orthogonalizer(whole[id(piece.param)], self.specs[id(piece.param)])
            result.append(done.reshape(-1)[piece.lo:piece.hi])
        return result

    def state_dict(self) -> Dict[str, Any]:
        """What the plain wrapper of this precision would save for this model (all ranks call)."""
        self.finish_param_gather()
        states = {id(piece.main): self.inner.state.get(piece.main, {}) for piece in self.pieces}
        kinds = {k for group in self.inner.param_groups for k in state_keys(group, self.inner)}
        full = {k: self._full({i: s[k] for i, s in states.items() if k in s})
                for k in STATE_TENSORS if k in kinds}
        steps = [float(s["step"]) for s in states.values() if "step" in s]
        stepped = [max(steps, default=-1.0), float(any(states.values()))]
        step_max, any_state = collectives.agree(stepped, self.group, self._device)
        state, groups, index = {}, [], 0
        for params, group in zip(self.groups_of_params, self.inner.param_groups):
            ids = list(range(index, index + len(params)))
            keys = state_keys(group, self.inner)
            for i, p in zip(ids, params):
                if not any_state:
                    continue
                state[i] = {k: full[k][id(p)] for k in keys}
                if step_max >= 0 and "exp_avg" in keys:  # AdamW's count, the same for all
                    state[i] = {"step": torch.tensor(step_max, dtype=torch.float32), **state[i]}
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
            index += len(params)
        inner = {"state": state, "param_groups": groups}
        if not self.half:
            return inner
        mains = self._full({id(piece.main): piece.main.detach() for piece in self.pieces})
        return {"optimizer": inner,
                "grad_scaler": None if self.scaler is None else self.scaler.state_dict(),
                "fp32_from_fp16_params": [[mains[id(p)] for p in g] for g in self.groups_of_params],
                "param_names": [[self.name_of[id(p)] for p in g] for g in self.groups_of_params]}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Take this rank's shard of a gathered state: from a distributed or a plain run of any
        data-parallel size (fp32 optimizer state, or a mixed-precision one)."""
        saved_state = state["optimizer"] if is_mixed_state(state) else state
        saved_groups = saved_state["param_groups"]
        check_saved_groups(saved_groups, self.inner.param_groups)
        if [len(g["params"]) for g in saved_groups] != [len(g) for g in self.groups_of_params]:
            raise ValueError(f"checkpoint optimizer has parameter groups of "
                             f"{[len(g['params']) for g in saved_groups]}, this model has "
                             f"{[len(g) for g in self.groups_of_params]}")
        by_param: Dict[int, Dict[str, Any]] = {}
        for params, saved, group in zip(self.groups_of_params, saved_groups,
                                        self.inner.param_groups):
            group.update({k: v for k, v in saved.items() if k != "params"})
            entries = saved_state["state"]
            for p, index in zip(params, saved["params"]):
                if index in entries or str(index) in entries:
                    by_param[id(p)] = entries.get(index, entries.get(str(index)))
        for piece in self.pieces:
            saved = by_param.get(id(piece.param))
            if saved is None:
                self.inner.state.pop(piece.main, None)
                continue
            entry = {}
            if "step" in saved:
                entry["step"] = torch.as_tensor(saved["step"], dtype=torch.float32).clone()
            for key in STATE_TENSORS:
                if key in saved:
                    entry[key] = saved[key].reshape(-1)[piece.lo:piece.hi].to(
                        piece.main.device, torch.float32).clone()
            self.inner.state[piece.main] = entry
        if is_mixed_state(state):
            if self.scaler is not None and state.get("grad_scaler"):
                self.scaler.load_state_dict(state["grad_scaler"])
            names = [n for g in state["param_names"] for n in g]
            values = [v for g in state["fp32_from_fp16_params"] for v in g]
            self.set_main_weights(dict(zip(names, values)))

    def model_space_state(self) -> ModelSpaceState:
        """This rank's pieces of the optimizer state and of the fp32 main weights by model
        parameter (app.optim.model_space); the step count is agreed over the data-parallel
        group, so every data-parallel rank must call it."""
        self.finish_param_gather()
        group_of = {id(m): g for g in self.inner.param_groups for m in g["params"]}
        params = []
        for piece in self.pieces:
            keys = state_keys(group_of[id(piece.main)], self.inner)
            saved = self.inner.state.get(piece.main, {})
            tensors = {k: saved[k] for k in keys if k in saved}
            tensors[MAIN] = piece.main.detach()
            params.append(ParamState(piece.name, (piece.lo, piece.hi), tensors, keys))
        step = common_step(list(self.inner.state.values()))
        agreed = collectives.agree([-1.0 if step is None else step], self.group,
                                   self._device)[0]
        return ModelSpaceState(params, hyperparameters(self.inner.param_groups),
                               None if agreed < 0 else agreed,
                               None if self.scaler is None else self.scaler.state_dict())

    def load_model_space_state(self, state: ModelSpaceState) -> None:
        """Take this rank's pieces from a model-space state (`state.params` holds exactly the
        pieces of `model_space_state()`); the main weights are set by `set_main_weights`."""
        check_saved_groups(state.param_groups, self.inner.param_groups)
        for group, saved in zip(self.inner.param_groups, state.param_groups):
            group.update(saved)
        by_name = {p.name: p for p in state.params}
        for piece in self.pieces:
            found = by_name.get(piece.name)
            tensors = {k: v for k, v in (found.tensors if found else {}).items() if k != MAIN}
            if not tensors:
                self.inner.state.pop(piece.main, None)
                continue
            entry = {k: v.reshape(-1).to(piece.main.device, torch.float32).clone()
                     for k, v in tensors.items()}
            if state.step is not None and "exp_avg" in tensors:
                entry["step"] = torch.tensor(state.step, dtype=torch.float32)
            self.inner.state[piece.main] = entry
        if self.scaler is not None and state.grad_scaler:
            self.scaler.load_state_dict(state.grad_scaler)

    def set_main_weights(self, named_fp32: Dict[str, torch.Tensor]) -> None:
        """Set this rank's fp32 main shards from full fp32 weights by parameter name."""
        with torch.no_grad():
            for piece in self.pieces:
                piece.main.copy_(named_fp32[piece.name].reshape(-1)[piece.lo:piece.hi])

    def state_bytes(self) -> Dict[str, int]:
        """Weights; the gradient buffer and shards; optimizer states and separate main shards."""
        separate = ([] if self.param_dtype == torch.float32
                    else [b.main for b in self.buckets])
        return {"params": _bytes([d.param_buffer for d in self.domains]),
                "grads": self.last_grad_bytes,
                "optimizer": _state_bytes(self.inner) + _bytes(separate)}
