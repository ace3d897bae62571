"""The native engine: our own gradient sync, precision wrapper, AdamW and Megatron checkpoints
(the legacy `--ckpt-format torch` files, or `torch_dist`, each rank writing its own shards; a
load reads whichever format the iteration directory holds).

Per iteration: micro-batch losses are scaled (fp16) and back-propagated (`backward`), which also
notes any non-finite loss; then `step` averages the accumulated gradients over the
data-parallel group (bucketed all-reduce; fp32 buffers when gradients accumulate in fp32), sums
the tied word-embedding gradient of the first and last pipeline stages, and lets the precision
wrapper (app.optim.mixed_precision) agree on non-finite values over the whole world, update the
loss scale, clip, step AdamW and copy the fp32 main weights back. The LR schedule advances only
when the update was applied.
"""
from __future__ import annotations

import logging
from typing import Any, Dict, Optional, Tuple

import torch

from app.config import RunConfig
from app.mpu.parallel_state import ParallelState
from app.mpu.grads import (allreduce_embedding_grad, allreduce_expert_grad_tensors,
                           allreduce_grad_tensors, is_expert)
from app.mpu import collectives
from app.mpu.random import rng_state_dict
from app.checkpoint import commit, names
from app.checkpoint.legacy import per_rank as ckpt
from app.checkpoint.mcore import state as mcore_state
from app.checkpoint.mcore.names import stacks_layers
from app.checkpoint.torch_dist import dcp_files
from app.checkpoint.torch_dist import per_rank as torch_dist
from app.checkpoint.saved_layout import refuse_unloadable
from app.checkpoint.snapshot import HostBuffers, host_copy
from app.checkpoint.model_args import checkpoint_args_namespace
from app.launch.distributed import world_group
from app.model import moe
from app.optim.distributed_optimizer import DistributedOptimizer
from app.training.engines.base import Engine, StepResult
from app.training.checkpointing.resume import CheckpointContents, ResumePlan, check_saved_args

logger = logging.getLogger(__name__)


class NativeEngine(Engine):
    """Engine for the native path: TP/PP/DP through app.mpu, fp32/bf16/fp16 through a precision
    wrapper around AdamW (`optimizer`, from app.optim.mixed_precision)."""

    def __init__(self, cfg: RunConfig, model: torch.nn.Module, optimizer: Any,
                 lr_scheduler: Any, parallel_state: ParallelState) -> None:
        self.cfg = cfg
        self.module = model
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.ps = parallel_state
        self._nonfinite_loss: Optional[torch.Tensor] = None
        self._host_buffers = HostBuffers()  # --async-save's copies, reused save after save

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()
        self._nonfinite_loss = None

    def backward(self, loss: torch.Tensor) -> None:
        bad = (~torch.isfinite(loss.detach())).any().float()  # no host sync; agreed in step()
        self._nonfinite_loss = bad if self._nonfinite_loss is None else self._nonfinite_loss + bad
        self.optimizer.scale_loss(loss).backward()

    def _sync_gradients(self) -> None:
        grads = self.optimizer.reduction_grads()  # every parameter's, zeros where unused
        experts = [is_expert(p) for p in self.optimizer.params] if grads else []
        replicas = self.ps.gradient_state()  # data x context ranks hold the same weights
        if replicas.data_parallel_size > 1:
            allreduce_grad_tensors([g for g, e in zip(grads, experts) if not e],
                                   replicas.data_parallel_group)
        if any(experts):  # the expert-data-parallel group lies within this stage
            allreduce_expert_grad_tensors([g for g, e in zip(grads, experts) if e], self.ps)
        if self.ps.pipeline_model_parallel_size > 1:
            tied = self.module.shared_embedding_weight()  # None without a tie to keep
            allreduce_embedding_grad(None if tied is None else self.optimizer.embedding_grad(tied),
                                     self.ps)

    def set_global_batch(self, global_batch_size: int, num_micro_batches: int) -> None:
        super().set_global_batch(global_batch_size, num_micro_batches)
        if hasattr(self.optimizer, "num_micro_batches"):  # the distributed optimizer's buckets
            self.optimizer.num_micro_batches = num_micro_batches

    def step(self) -> StepResult:
        moe.update_expert_bias(self.module)  # --moe-router-enable-expert-bias (Megatron's order)
        self._sync_gradients()
        lr = self.optimizer.param_groups[0]["lr"]
        outcome = self.optimizer.step(self.ps, self.cfg.optimizer.clip_grad, world_group(),
                                      self._nonfinite_loss)
        if not outcome.skipped:
            self.lr_scheduler.step()  # one update: an iteration, or its batch in samples
        return StepResult(grad_norm=outcome.grad_norm, skipped=outcome.skipped, lr=lr,
                          loss_scale=self.optimizer.loss_scale, nonfinite=outcome.nonfinite,
                          nonfinite_loss=outcome.nonfinite_loss)

    @property
    def loss_scale(self) -> Optional[float]:
        return self.optimizer.loss_scale

    def state_bytes(self) -> Dict[str, int]:
        """Model weights; gradients as they were at the last step; optimizer states (AdamW's,
        plus the fp32 main weights of a mixed-precision run)."""
        return self.optimizer.state_bytes()

    # ------------------------------------------------------------------ checkpoints

    def _rank_kwargs(self) -> Dict[str, int]:
        return dict(tp_rank=self.ps.tensor_model_parallel_rank,
                    pp_rank=self.ps.pipeline_model_parallel_rank,
                    pp_size=self.ps.pipeline_model_parallel_size,
                    ep_rank=self.ps.expert_model_parallel_rank,
                    ep_size=self.ps.expert_model_parallel_size)

    def start_save(self, save_dir: str, iteration: int, client_state: Dict[str, Any],
                   asynchronous: bool) -> commit.PendingSave:
        """This rank's part of a checkpoint in --ckpt-format: torch (data-parallel rank 0 of
        each model-parallel rank writes its Megatron file; the others only agree) or
        torch_dist (every rank writes its own shards); asynchronously from a host copy."""
        if self.cfg.checkpoint.ckpt_format == torch_dist.FORMAT:
            return self._start_torch_dist_save(save_dir, iteration, client_state, asynchronous)
        c = self.cfg.checkpoint
        args_ns = checkpoint_args_namespace(
            self.cfg, client_state["consumed_train_samples"],
            client_state["consumed_valid_samples"], iteration, client_state.get("data_order"))
        rng = None if c.no_save_rng else rng_state_dict()
        # one replica writes (data and context rank 0; with experts, expert-data rank 0: one
        # writer per tensor x pipeline x expert-parallel file); the others follow it
        writer = (self.ps.expert_data_parallel_rank if self.cfg.model.moe.enabled
                  else self.ps.gradient_state().data_parallel_rank) == 0
        state = ckpt.build_checkpoint_dict(
            iteration, self.module.state_dict(),
            None if c.no_save_optim else self.optimizer.state_dict(),
            None if c.no_save_optim else self.lr_scheduler.state_dict(),
            rng, args_ns)
        if asynchronous and writer:  # the previous save is committed: its buffers are free
            self._host_buffers.new_save()
            state = host_copy(state, self._host_buffers)
        agree = commit.world_agreement(next(self.module.parameters()).device)
        if not writer:
            return commit.start_save(save_dir, iteration, write=lambda: None, undo=lambda: None,
                                     agree=agree, is_tracker_writer=False)
        return ckpt.start_save(save_dir, iteration, state, agree=agree,
                               is_tracker_writer=self.ps.rank == 0,
                               keep_last_n=c.keep_last_n_checkpoints, background=asynchronous,
                               **self._rank_kwargs())

    def local_state(self) -> Dict[str, Any]:
        """Weights, optimizer state (with the fp32 main weights and the loss scale) and LR
        schedule of this rank, whatever --ckpt-format says (a distributed optimizer gathers)."""
        return {"model": self.module.state_dict(), "optimizer": self.optimizer.state_dict(),
                "lr_scheduler": self.lr_scheduler.state_dict()}

    def load_local_state(self, state: Dict[str, Any], where: str) -> None:
        """Restore `local_state`'s weights, optimizer state and LR schedule."""
        try:
            self.module.load_state_dict(state["model"], strict=True)
            self.optimizer.load_state_dict(state["optimizer"])
        except (RuntimeError, ValueError) as exc:
            raise ckpt.CheckpointError(f"local checkpoint {where} does not fit this run: "
                                       f"{str(exc).splitlines()[0][:400]}") from exc
        self.lr_scheduler.load_state_dict(state["lr_scheduler"])

    def _layout(self) -> torch_dist.RankLayout:
        # weights are not split by context: data x context ranks are the replicas
        m = self.cfg.model
        return torch_dist.RankLayout.of(self.ps.gradient_state(), m.num_layers,
                                        stacks_layers(m.moe.moe_layer_freq, m.moe.num_experts))

    def _start_torch_dist_save(self, save_dir: str, iteration: int,
                               client_state: Dict[str, Any], asynchronous: bool
                               ) -> commit.PendingSave:
        """Every rank writes its share of the model and optimizer boxes (torch_dist)."""
        c = self.cfg.checkpoint
        optimizer = None if c.no_save_optim else self.optimizer.model_space_state()
        common = None
        if self.ps.rank == 0:
            distributed = isinstance(self.optimizer, DistributedOptimizer)
            common = mcore_state.build_common(
                checkpoint_args_namespace(self.cfg, client_state["consumed_train_samples"],
                                          client_state["consumed_valid_samples"], iteration,
                                          client_state.get("data_order")),
                iteration, distributed_optimizer=distributed,
                scheduler=None if c.no_save_optim else self.lr_scheduler.state_dict(),
                optimizer=None if optimizer is None else
                mcore_state.optimizer_part(optimizer, distributed=distributed))
        entries = torch_dist.save_entries(dict(self.module.state_dict(keep_vars=True)),
                                          self._layout(), optimizer, common,
                                          None if c.no_save_rng else rng_state_dict())
        if asynchronous:  # the previous save is committed: its buffers are free
            self._host_buffers.new_save()
            copies = host_copy([e.tensor for e in entries], self._host_buffers)
            for entry, copy in zip(entries, copies):
                entry.tensor = copy
        device = next(self.module.parameters()).device
        return torch_dist.start_save(
            save_dir, iteration, entries, rank=self.ps.rank,
            gather=lambda record: collectives.gather_object(record, 0, world_group()),
            agree=commit.world_agreement(device), keep_last_n=c.keep_last_n_checkpoints,
            background=asynchronous)

    def _read_torch_dist(self, load_dir: str, plan: ResumePlan) -> CheckpointContents:
        """Read this rank's boxes of a torch_dist checkpoint, saved at any layout."""
        template = self.optimizer.model_space_state() if plan.load_optimizer else None
        where = names.checkpoint_dir(load_dir, plan.iteration)
        reader = dcp_files.Reader(where)
        common = torch_dist.read_common(reader)
        mcore_state.check_checkpoint_version(common, where)
        args = common.get("args")
        check_saved_args(plan, args, self.cfg, where, reshardable=True)
        layout = self._layout()
        state = torch_dist.read_rank_state(where, dict(self.module.state_dict(keep_vars=True)),
                                           layout, template, common, reader)
        self._load_weights(state.weights, state.mains, where)
        scheduler = mcore_state.scheduler_state(common)
        if plan.load_optimizer:
            if scheduler is None:
                raise ckpt.CheckpointError(f"checkpoint in {where} has no opt_param_scheduler; "
                                           "pass --no-load-optim (or --finetune)")
            try:
                self.optimizer.load_model_space_state(state.optimizer)
            except ValueError as exc:
                raise ckpt.CheckpointError(f"optimizer state in {where}: {exc}") from exc
            self.lr_scheduler.load_state_dict(scheduler)
        saved = (getattr(args, "tensor_model_parallel_size", 1),
                 getattr(args, "pipeline_model_parallel_size", 1))
        ours = (layout.tp_size, layout.pp_size)
        note = "" if saved == ours else (
            f"the checkpoint was saved at TP x PP {saved[0]} x {saved[1]} and this run is "
            f"{ours[0]} x {ours[1]}: its RNG states are not restored (as Megatron-LM)")
        return CheckpointContents(path=where, iteration=plan.iteration, args=args,
                                  client_state=mcore_state.position(common, plan.iteration),
                                  rng_state=None if note else state.rng_state,
                                  scheduler_state=scheduler, rng_note=note)

    def _saved_weights(self, state: Dict[str, Any], load_dir: str, iteration: Any,
                       plan: ResumePlan) -> Tuple[Dict[str, Any], Optional[Dict[str, Any]]]:
        """(weights, fp32 main weights or None) of this rank: from its own file, or from every
        stage's file by global name when the checkpoint's model chunks differ from ours
        (interleaved vs not, or another V)."""
        saved_vp = ckpt.saved_virtual_pipeline_size(state.get("args"))
        ours = self.cfg.virtual_pipeline_model_parallel_size
        if saved_vp == ours:
            return ckpt.from_megatron_model(state["model"]), ckpt.fp32_main_weights(state)
        if plan.load_optimizer:
            raise ckpt.CheckpointError(
                f"checkpoint in {load_dir} was saved with {saved_vp} model chunks per pipeline "
                f"stage (--num-layers-per-virtual-pipeline-stage) and this run uses {ours}: the "
                "weights load by their global names, but optimizer states are per rank; pass "
                "--no-load-optim (the LR schedule continues) or --finetune")
        return ckpt.load_weights_by_name(load_dir, iteration, list(self.module.state_dict()),
                                         tp_rank=self.ps.tensor_model_parallel_rank,
                                         pp_size=self.ps.pipeline_model_parallel_size)

    def read_checkpoint(self, load_dir: str, plan: ResumePlan) -> CheckpointContents:
        """Read this rank's part of the checkpoint (torch_dist, or its legacy Megatron-layout
        file, by the format its files show); load the weights and, when the plan says so, the
        optimizer and LR-scheduler states."""
        readers = {names.TORCH_DIST: self._read_torch_dist}
        return readers.get(plan.layout and plan.layout.format, self._read_legacy)(load_dir, plan)

    def _read_legacy(self, load_dir: str, plan: ResumePlan) -> CheckpointContents:
        """Read this rank's legacy Megatron-layout file (`--ckpt-format torch`); at another
        expert-parallel size the weights of the expert-parallel files of this tensor x
        pipeline rank; any other layout is refused with the conversion command
        (saved_layout.loadable_problem)."""
        layout = plan.layout  # detected once by the resume policy
        refuse_unloadable(layout, load_dir, deepspeed=False,
                          tensor_model_parallel_size=self.ps.tensor_model_parallel_size,
                          pipeline_model_parallel_size=self.ps.pipeline_model_parallel_size,
                          data_parallel_size=self.ps.data_parallel_size,
                          load_optimizer=plan.load_optimizer,
                          expert_model_parallel_size=self.ps.expert_model_parallel_size)
        saved_ep = layout.expert_model_parallel_size if layout else 1
        rank = self._rank_kwargs()
        if saved_ep != rank["ep_size"]:  # the expert-parallel rank 0 file, then the experts
            rank.update(ep_rank=0, ep_size=saved_ep)
        state, iteration = ckpt.load_checkpoint_dict(
            load_dir, iteration=plan.iteration, tp_size=self.ps.tensor_model_parallel_size,
            **rank)
        where = names.checkpoint_dir(load_dir, iteration)
        mcore_state.check_checkpoint_version(state, where)
        args = state.get("args")
        check_saved_args(plan, args, self.cfg, where)
        if saved_ep != self.ps.expert_model_parallel_size:
            experts = [n for n, p in self.module.named_parameters() if hasattr(p, "expert_axis")]
            self._load_weights(*ckpt.load_weights_across_experts(
                load_dir, iteration, state, experts, tp_rank=rank["tp_rank"],
                pp_rank=rank["pp_rank"], pp_size=rank["pp_size"], saved_ep=saved_ep,
                ep_rank=self.ps.expert_model_parallel_rank,
                ep_size=self.ps.expert_model_parallel_size), where)
        else:
            self._load_weights(*self._saved_weights(state, load_dir, iteration, plan), where)
        if plan.load_optimizer:
            if state.get("optimizer") is None or state.get("lr_scheduler") is None:
                raise ckpt.CheckpointError(
                    f"checkpoint in {load_dir} has no optimizer state (saved with "
                    "--no-save-optim); pass --no-load-optim (or --finetune) to start the "
                    "optimizer fresh")
            self.optimizer.load_state_dict(state["optimizer"])
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        position = {"iteration": iteration if iteration == "release" else int(iteration)}
        for key in ("consumed_train_samples", "consumed_valid_samples"):
            position[key] = int(getattr(args, key, 0) or 0)
        position["data_order"] = getattr(args, "data_order", None)
        return CheckpointContents(path=where, iteration=iteration, args=args,
                                  client_state=position, rng_state=state.get("rng_state"),
                                  scheduler_state=state.get("lr_scheduler"))

    def _load_weights(self, weights: Dict[str, Any], main: Optional[Dict[str, Any]],
                      where: str) -> None:
        """Model weights from the checkpoint, converted to this run's precision.

        The most exact fp32 weights are used: a mixed-precision checkpoint's fp32 main copies
        `main` (by parameter name), else the saved `weights`. The model gets them cast to its
        dtype; a half-precision run also sets its fp32 main weights from them.
        """
        saved_dtype = next((v.dtype for v in weights.values() if v.is_floating_point()), None)
        run_dtype = next(self.module.parameters()).dtype
        fp32 = {**{k: v.float() for k, v in weights.items()}, **(main or {})}
        try:
            self.module.load_state_dict(fp32, strict=True)  # cast to the run's dtype
        except RuntimeError as exc:  # names or shapes that do not match this model
            raise ckpt.CheckpointError(f"weights in {where} do not fit this model: "
                                       f"{str(exc).splitlines()[0][:400]}") from exc
        self.optimizer.set_main_weights(fp32)  # a no-op where the weights are the main ones
        if saved_dtype is not None and saved_dtype != run_dtype:
            source = "its fp32 main weights" if main else f"its {saved_dtype} weights"
            logger.info("converted checkpoint %s from %s to this run's %s (fp32 weights taken "
                        "from %s)", where, saved_dtype, run_dtype, source)
