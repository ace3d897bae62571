"""The native engine: our own gradient sync, clipping, AdamW step and Megatron-layout checkpoints.

Per iteration: gradients accumulate over micro-batches (`backward`), then `step` averages them
over the data-parallel group (bucketed all-reduce), sums the tied word-embedding gradient of the
first and last pipeline stages, computes the global norm over the model-parallel group (each
replicated parameter counted once), clips, skips the update if the norm is not finite, steps
the optimizer and advances the LR schedule.
"""
from __future__ import annotations

from typing import Any, Dict

import torch

from app.config import RunConfig
from app.mpu.grads import allreduce_embedding_grads, allreduce_gradients, clip_grad_norm
from app.mpu.random import rng_state_dict
from app.training import checkpoint as ckpt
from app.training.distributed import all_ranks_ok
from app.training.engine import Engine, StepResult, grad_norm_is_finite
from app.training.resume import CheckpointContents, ResumePlan, check_saved_args


class NativeEngine(Engine):
    """Engine for the native path: TP/PP/DP through app.mpu, fp32 weights and AdamW."""

    def __init__(self, cfg: RunConfig, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 lr_scheduler: Any, parallel_state: Any) -> None:
        self.cfg = cfg
        self.module = model
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.ps = parallel_state
        self._params = [p for p in model.parameters() if p.requires_grad]

    def zero_grad(self) -> None:
        for p in self._params:
            p.grad = None

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def _sync_gradients(self) -> None:
        for p in self._params:  # a parameter unused on this stage still takes part in the sums
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.ps.data_parallel_size > 1:
            allreduce_gradients(self._params, self.ps.data_parallel_group)
        if self.ps.pipeline_model_parallel_size > 1:
            stage_has_embedding = (self.ps.is_pipeline_first_stage()
                                   or self.ps.is_pipeline_last_stage())
            tied = self.module.word_embeddings_weight() if stage_has_embedding else None
            allreduce_embedding_grads(tied, self.ps)

    def step(self) -> StepResult:
        self._sync_gradients()
        self.last_state_bytes = Engine.state_bytes(self)  # gradients exist only until the next zero_grad
        max_norm = self.cfg.optimizer.clip_grad
        norm = clip_grad_norm(self._params, max_norm, self.ps)
        lr = self.optimizer.param_groups[0]["lr"]
        if not grad_norm_is_finite(norm):
            self.zero_grad()
            return StepResult(grad_norm=norm, skipped=True, lr=lr)
        self.optimizer.step()
        self.lr_scheduler.step(1)
        return StepResult(grad_norm=norm, skipped=False, lr=lr)

    def state_bytes(self) -> Dict[str, int]:
        """Parameters and optimizer states now; gradients as they were at the last step."""
        now = Engine.state_bytes(self)
        now["grads"] = getattr(self, "last_state_bytes", now)["grads"]
        return now

    # ------------------------------------------------------------------ checkpoints

    def _rank_kwargs(self) -> Dict[str, int]:
        return dict(tp_rank=self.ps.tensor_model_parallel_rank,
                    pp_rank=self.ps.pipeline_model_parallel_rank,
                    pp_size=self.ps.pipeline_model_parallel_size)

    def save_checkpoint(self, save_dir: str, iteration: int, client_state: Dict[str, Any]) -> str:
        c = self.cfg.checkpoint
        args_ns = ckpt.checkpoint_args_namespace(
            self.cfg, client_state["consumed_train_samples"],
            client_state["consumed_valid_samples"], iteration)
        rng = None if c.no_save_rng else rng_state_dict()
        state = ckpt.build_checkpoint_dict(
            iteration, self.module.state_dict(),
            None if c.no_save_optim else self.optimizer.state_dict(),
            None if c.no_save_optim else self.lr_scheduler.state_dict(),
            rng, args_ns)
        device = next(self.module.parameters()).device
        agree = lambda ok: all_ranks_ok(ok, device)  # noqa: E731
        if self.ps.data_parallel_rank != 0:  # one replica writes; the others follow its outcome
            for _ in range(2):
                if not agree(True):
                    raise ckpt.save_failure(save_dir, iteration, None)
            return ckpt.checkpoint_dir(save_dir, iteration)
        return ckpt.save_checkpoint(save_dir, iteration, state, agree=agree,
                                    is_tracker_writer=self.ps.rank == 0,
                                    keep_last_n=c.keep_last_n_checkpoints, **self._rank_kwargs())

    def read_checkpoint(self, load_dir: str, plan: ResumePlan) -> CheckpointContents:
        """Read this rank's Megatron-layout file; load the weights and, when the plan says so,
        the optimizer and LR-scheduler states."""
        state, iteration = ckpt.load_checkpoint_dict(
            load_dir, iteration=plan.iteration, tp_size=self.ps.tensor_model_parallel_size,
            **self._rank_kwargs())
        where = ckpt.checkpoint_dir(load_dir, iteration)
        ckpt.check_checkpoint_version(state, where)
        args = state.get("args")
        check_saved_args(plan, args, self.cfg, where)
        try:
            self.module.load_state_dict(ckpt.from_megatron_model(state["model"]), strict=True)
        except RuntimeError as exc:  # names or shapes that do not match this model
            raise ckpt.CheckpointError(f"weights in {where} do not fit this model: "
                                       f"{str(exc).splitlines()[0][:400]}") from exc
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
        return CheckpointContents(path=where, iteration=iteration, args=args,
                                  client_state=position, rng_state=state.get("rng_state"),
                                  scheduler_state=state.get("lr_scheduler"))
