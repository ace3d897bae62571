"""The DeepSpeed engine behind our Engine interface: the only module that imports deepspeed.

`deepspeed.initialize` receives our model, our parallel state as `mpu=` (so ZeRO partitions over
the data-parallel group and clips over the model-parallel group), and the very optimizer object
our LR schedule drives, unless the JSON defines its own `optimizer` (then DeepSpeed builds it and
our schedule is attached to it) or both `optimizer` and `scheduler` (then DeepSpeed's are used).

Per micro-batch, `backward` runs `engine.backward(loss, scale_wrt_gas=False)` (our schedule has
already divided by the number of micro-batches) followed by `engine.step()`, which DeepSpeed
turns into a real update only at the gradient-accumulation boundary; `step` then reports it.

Pipeline parallelism (PP > 1) runs our own 1F1B schedule with one DeepSpeed engine per stage,
the way DeepSpeed's PipelineEngine drives its engine: every backward runs with the accumulation
boundary held off, so ZeRO-1 keeps the accumulated gradients local; `step` then sums the tied
word-embedding gradient of the first and last stage, opens the boundary, reduces over data
parallel (`allreduce_gradients`) and steps. Stages other than the last backpropagate the
received output gradient through `engine.backward` too, as the scalar sum(output x gradient)
(divided by the loss scale, which `engine.backward` multiplies back), whose gradient with respect
to the output is exactly the received one. ZeRO-1 only (app.config says why); the last stage's
tied copy of the embeddings is marked `ds_pipe_replicated` so DeepSpeed's norm counts it once.

ZeRO-3 (`"stage": 3`) partitions the weights too. The model is built inside
`partitioned_construction` (deepspeed.zero.Init over the data-parallel group), so each module's
parameters are cut into pieces as soon as it is built, with the native path's initial values;
`engines.zero3` holds what needs no deepspeed import (the bytes a rank holds, its pieces, the
weights-only load, the repair of DeepSpeed's universal loader). Weights-only loads (--finetune,
--no-load-optim, a release) read the whole weights with the converter's safe reader
(app.checkpoint.deepspeed.read_rank: the fp32 master weights of ZeRO pieces of any stage and
data-parallel size), instead of DeepSpeed's module-only path.

Mixture of Experts (ZeRO-1/2, expert and data/context parallelism) runs DeepSpeed's way
(`prepare_moe`, engines.deepspeed_moe): DeepSpeed's expert groups, a marker per MoE layer that
is DeepSpeed's MoE layer, DeepSpeed's MoE param groups, and its per-expert checkpoint files.

DeepSpeed's checkpoint files go through `CheckedCheckpointEngine` (engines.deepspeed_io), which replaces the engine's
`checkpoint_engine` (DeepSpeed's hook for checkpoint I/O): every file is written crash-safely
with a SHA-256 sidecar (as our Megatron files are), and read back only after its checksum is
verified and with torch.load(weights_only=True) and an allow-list (`deepspeed_safe_globals`),
where DeepSpeed's own engine unpickles anything (weights_only=False), so a crafted checkpoint
could run code on --load. `app.checkpoint.deepspeed` holds the same safe read for
the converter and the tools. Saves go through the same two-phase commit as the native engine's
(app.checkpoint.commit): a save that fails on any rank (a full disk) is undone everywhere;
`latest` and our tracker are written only after every rank's files are complete.
"""
from __future__ import annotations

import datetime
import functools
import glob
import logging
import os
import re
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

from app.config import RunConfig
from app.mpu import collectives
from app.mpu import random as mpu_random
from app.mpu.parallel_state import ParallelState
from app.mpu.random import get_rng_tracker, rng_state_dict
from app.optim import OptimizerParamScheduler, get_param_groups
from app.optim.param_groups import split_decoupled
from app.checkpoint import CheckpointError, commit, names, saved_layout
from app.checkpoint import files as ckpt_files
from app.checkpoint.deepspeed import deepspeed_safe_globals, read_rank
from app.checkpoint.model_args import checkpoint_args_namespace
from app.config.deepspeed import offloads_optimizer, zero_stage
from app.launch.distributed import world_group
from app.launch import waits
from app.launch.ports import free_port
from app.model.moe import moe_layers, update_expert_bias
from app.training.engines import deepspeed_moe, zero3
from app.training.engines.deepspeed_io import CheckedCheckpointEngine
from app.training.engines.base import Engine, StepResult, optimizer_state_bytes, tensor_bytes
from app.training.checkpointing.resume import (CheckpointContents, ResumePlan, check_saved_args,
                                            deepspeed_problem)
from app.training.engines.deepspeed_shm import unlink_shm_buffer
from app.utils.third_party import prepare_deepspeed_import, silence_deepspeed_deprecations

prepare_deepspeed_import()  # before any `import deepspeed` below (app/utils/third_party.py)
silence_deepspeed_deprecations()

logger = logging.getLogger(__name__)


def ensure_distributed(backend: str, timeout_minutes: float = 10.0) -> None:
    """Register DeepSpeed's communication backend, starting a process group if none exists.

    DeepSpeed needs a group even for one rank (then on a free port); under torchrun or our MPI
    discovery the group already exists and DeepSpeed adopts it. A group started here gets the
    `timeout_minutes` timeout. DeepSpeed may build or load an op here (its CPU communication op,
    through torch's extension builder), which waits without a word for a build lock that a
    killed build left behind: such stale locks are reported first (once per host), and a start
    slower than app.launch.waits.report_after_s() reports the build locks it may be waiting for.
    """
    import deepspeed
    import torch.distributed as dist
    if "RANK" not in os.environ and not dist.is_initialized():
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port("127.0.0.1")))
    elif "LOCAL_RANK" not in os.environ and dist.is_initialized():
        # a group started in this process without a launcher (DeepSpeed reads these variables)
        os.environ.update(RANK=str(dist.get_rank()), LOCAL_RANK=str(dist.get_rank()),
                          WORLD_SIZE=str(dist.get_world_size()))
    root = waits.extension_build_root()
    if os.environ.get("LOCAL_RANK", "0") == "0":
        waits.warn_stale_build_locks(root)
    with waits.WaitReport("deepspeed.init_distributed (it may build or load DeepSpeed's "
                          f"communication op under {root})",
                          lambda: waits.describe_build_locks(root)):
        deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False,
                                   timeout=datetime.timedelta(minutes=timeout_minutes))
    unlink_shm_buffer(getattr(deepspeed.comm.comm.cdb, "shm_comm_op", None) is not None)


class DeepSpeedEngineAdapter(Engine):
    """Engine implemented by a `deepspeed.DeepSpeedEngine` (ZeRO-0/1/2/3, offload, fp16/bf16)."""

    def __init__(self, cfg: RunConfig, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 lr_scheduler: Any, parallel_state: ParallelState) -> None:
        """`cfg.deepspeed.config` is the reconciled JSON; the process group (ensure_distributed)
        must exist already."""
        import deepspeed
        self.cfg, self.ps = cfg, parallel_state
        self.zero_ps = parallel_state.gradient_state()  # ZeRO partitions over data x context
        ds, path = cfg.deepspeed.config, cfg.deepspeed.config_path
        if ds is None:
            raise ValueError("the DeepSpeed engine needs cfg.deepspeed.config (the reconciled "
                             "JSON that arguments.build_run_config reads)")
        if cfg.checkpoint.no_save_optim:
            raise ValueError("--no-save-optim is not available with --deepspeed: DeepSpeed always "
                             "writes the (ZeRO-partitioned) optimizer states; drop the flag, or "
                             "convert to weights only with tools/convert_checkpoint.py "
                             "--input-format deepspeed")
        from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO
        # saved with every checkpoint, so that ds_to_universal.py can merge the TP slices
        setattr(model, UNIVERSAL_CHECKPOINT_INFO,
                universal_checkpoint_info(model, cfg.raw_vocab_size or cfg.model.padded_vocab_size))
        self.pipelined = parallel_state.pipeline_model_parallel_size > 1
        self._micro, self._grad_bytes = 0, 0
        self._bad_loss = torch.zeros(())  # micro-batches with a non-finite loss this iteration
        for param in model.parameters():  # DeepSpeed's mark for a pipeline-replicated weight
            if getattr(param, "shared", False):
                param.ds_pipe_replicated = True
        kwargs: Dict[str, Any] = dict(model=model, mpu=parallel_state, config=ds)
        if "optimizer" in ds:
            kwargs["model_parameters"] = split_decoupled(  # --decoupled-lr's group, if any
                get_param_groups(model), model, cfg.optimizer.decoupled_lr_range)
            if "scheduler" not in ds:
                kwargs["lr_scheduler"] = lambda opt: OptimizerParamScheduler(opt, cfg.optimizer)
        else:
            if offloads_optimizer(ds):
                raise ValueError(f"{path}: ZeRO optimizer offload needs DeepSpeedCPUAdam; add an "
                                 "\"optimizer\" block (type AdamW) to the JSON")
            kwargs.update(optimizer=optimizer, lr_scheduler=lr_scheduler)
        self.moe = bool(moe_layers(model))
        if self.moe:  # DeepSpeed's MoE: its expert groups, markers, param groups split by it
            prepare_moe(model, kwargs.get("model_parameters") or optimizer.param_groups, cfg,
                        parallel_state)
        engine, ds_optimizer, _, scheduler = deepspeed.initialize(**kwargs)
        self.partitioned = engine.zero_optimization_partition_weights()  # ZeRO-3
        self.files = self._check_files(engine)
        self.ds = engine
        self.module = engine
        self.optimizer = ds_optimizer
        self.lr_scheduler = scheduler
        self._micro = 0
        self._lr_used = self._current_lr()
        logger.info("DeepSpeed engine: ZeRO stage %s, gradient accumulation %s, micro-batch %s, "
                    "dtype %s", engine.zero_optimization_stage(),
                    engine.gradient_accumulation_steps(), engine.train_micro_batch_size_per_gpu(),
                    next(model.parameters()).dtype)

    @staticmethod
    def _check_files(engine: Any) -> Optional[CheckedCheckpointEngine]:
        """Route the engine's checkpoint I/O through CheckedCheckpointEngine (DeepSpeed's
        default Torch engine only; another engine chosen in the JSON is left alone, warned)."""
        from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine
        inner = getattr(engine, "checkpoint_engine", None)
        if type(inner) is not TorchCheckpointEngine:
            logger.warning("DeepSpeed checkpoint engine %s: its files get no checksum sidecars and "
                           "are read by DeepSpeed itself, which unpickles anything; load only "
                           "checkpoints you trust", type(inner).__name__)
            return None
        engine.checkpoint_engine = CheckedCheckpointEngine(inner)
        return engine.checkpoint_engine

    def zero_grad(self) -> None:
        self._micro = 0  # DeepSpeed clears gradients itself after each boundary step
        self._grad_bytes = 0
        self._bad_loss = torch.zeros(())

    def _current_lr(self) -> float:
        lrs = self.ds.get_lr()
        return float(lrs[0]) if lrs else float("nan")

    def backward(self, loss: torch.Tensor) -> None:
        self._bad_loss = self._bad_loss + (~torch.isfinite(loss.detach())).any().float().cpu()
        self._backward(loss)

    def backward_output(self, output: torch.Tensor, output_grad: torch.Tensor) -> None:
        """engine.backward of sum(output x output_grad) / loss scale: gradients exactly those of
        autograd.backward(output, output_grad), with DeepSpeed's bookkeeping around them."""
        scale = self.loss_scale or 1.0
        surrogate = (output.float() * output_grad.float()).sum() / scale  # scalar
        self._backward(surrogate)

    def _backward(self, loss: torch.Tensor) -> None:
        if self.pipelined:
            self.ds.set_gradient_accumulation_boundary(False)
        self.ds.backward(loss, scale_wrt_gas=False)
        self._lr_used = self._current_lr()  # the boundary step advances the schedule
        # peak over the accumulation: ZeRO-1 holds full gradients between boundaries, ZeRO-2 only
        # its partition; the boundary step frees them (ZeRO-3: a fixed buffer, state_bytes)
        if not self.partitioned:
            self._grad_bytes = max(self._grad_bytes, self._gradient_bytes())
        self._micro += 1
        if not self.pipelined:
            if self.moe and self._micro == self.ds.gradient_accumulation_steps():
                update_expert_bias(self.ds.module)  # --moe-router-enable-expert-bias
            self.ds.step()  # an update only at the accumulation boundary
        elif self._micro < self.ds.gradient_accumulation_steps():
            self.ds.step()  # counts the micro-step; the boundary waits for step()

    def _pipeline_boundary_step(self) -> None:
        """Sum the tied embedding gradient over the first and last stage, then reduce over data
        parallel and step (DeepSpeed's PipelineEngine order: tied, data-parallel, optimizer)."""
        ps = self.ps
        weight = self.ds.module.shared_embedding_weight()  # None with untied embeddings
        if weight is not None:
            opt = self.ds.optimizer
            grad = (opt.get_gradient_for_reduction(weight)
                    if hasattr(opt, "get_gradient_for_reduction") else weight.grad)
            if grad is not None:
                collectives.all_reduce(grad, ps.embedding_group)
        self.ds.set_gradient_accumulation_boundary(True)
        self.ds.allreduce_gradients()
        self.ds.step()

    def step(self) -> StepResult:
        gas = self.ds.gradient_accumulation_steps()
        if self._micro != gas:
            raise RuntimeError(f"DeepSpeed engine saw {self._micro} micro-batches in an "
                               f"iteration; gradient_accumulation_steps is {gas}")
        if self.pipelined:
            self._pipeline_boundary_step()
        norm = self.ds.get_global_grad_norm()
        norm = float(norm) if norm is not None else None
        skipped = not self.ds.was_step_applied()
        # DeepSpeed skips fp16 overflows itself; a non-finite loss in any precision is agreed
        # over the world for the non-finite policy (app.training.resilience.nonfinite)
        device = next(self.ds.module.parameters()).device
        bad_loss = collectives.agree([self._bad_loss], world_group(), device)[0] > 0
        return StepResult(grad_norm=norm, skipped=skipped, lr=self._lr_used,
                          loss_scale=self.loss_scale, nonfinite=bad_loss, nonfinite_loss=bad_loss)

    def _gradient_bytes(self) -> int:
        """Gradients held now: module .grad tensors plus ZeRO's partitioned gradient buffers."""
        total = sum(tensor_bytes(p.grad) for p in self.ds.module.parameters() if p.grad is not None)
        for value in getattr(self.ds.optimizer, "averaged_gradients", {}).values():
            parts = value if isinstance(value, (list, tuple)) else [value]
            total += sum(tensor_bytes(t) for t in parts)
        return total

    def state_bytes(self) -> Dict[str, int]:
        """Parameters; peak gradients of the last iteration; optimizer states including ZeRO's fp32
        master partition (the 12/DP bytes per parameter of the ZeRO paper's mixed-precision model).
        At ZeRO-3 this rank's pieces, and what it offloads to the host (engines.zero3)."""
        opt = self.ds.optimizer
        if self.partitioned:
            return zero3.state_bytes(self.ds.module, opt)
        base = getattr(opt, "optimizer", opt)
        masters = sum(tensor_bytes(t) for t in getattr(opt, "single_partition_of_fp32_groups", []))
        return {"params": sum(tensor_bytes(p) for p in self.ds.module.parameters()),
                "grads": self._grad_bytes,
                "optimizer": optimizer_state_bytes(base) + masters}

    def local_parameters(self) -> Iterator[Tuple[str, torch.Tensor]]:
        """The module's parameters; at ZeRO-3 this rank's pieces of them."""
        module = self.ds.module
        return zero3.local_pieces(module) if self.partitioned else module.named_parameters()

    @property
    def loss_scale(self) -> Optional[float]:
        if not self.ds.fp16_enabled():
            return None
        opt = self.ds.optimizer  # fp16 optimizer: loss_scale_config.cur_scale; ZeRO: cur_scale
        config = getattr(opt, "loss_scale_config", None)
        scale = config.cur_scale if config is not None else getattr(opt, "cur_scale", None)
        return float(scale) if scale is not None else None

    # ------------------------------------------------------------------ checkpoints

    def start_save(self, save_dir: str, iteration: int, client_state: Dict[str, Any],
                   asynchronous: bool) -> commit.PendingSave:
        """engine.save_checkpoint under tag iter_XXXXXXX as the write step of the two-phase
        commit (app.checkpoint.commit): once every rank's files are complete, rank 0 writes
        `latest` and our tracker and rotates; a failed save on any rank is undone on every rank
        (CheckpointSaveError). With `asynchronous`, engine.save_checkpoint runs here but its
        files are host copies written later in the background (DeepSpeed's default Torch
        checkpoint engine only; another one writes synchronously)."""
        tag = names.iteration_tag(iteration)
        state = dict(client_state)
        if hasattr(self.lr_scheduler, "num_steps"):  # for --no-load-optim resumes
            state["scheduler_steps"] = {"num_steps": int(self.lr_scheduler.num_steps)}
        state["args"] = checkpoint_args_namespace(  # lets converters write Megatron's layout
            self.cfg, client_state["consumed_train_samples"],
            client_state["consumed_valid_samples"], iteration, client_state.get("data_order"))
        if not self.cfg.checkpoint.no_save_rng:
            state["rng_state"] = rng_state_dict()
        files, directory = self.files, names.checkpoint_dir(save_dir, iteration)
        deferred = asynchronous and files is not None

        def save() -> None:  # DeepSpeed's own barriers run here, in the calling thread
            if files is not None:
                files.begin(deferred)
            self.ds.save_checkpoint(save_dir, tag=tag, client_state=state, save_latest=False)

        def write() -> Optional[Tuple[str, OSError]]:
            if deferred:
                return files.write_deferred()
            save()
            return files.errors[0] if files is not None and files.errors else None

        def undo() -> None:
            if files is not None:
                files.undo(directory)

        device = next(self.ds.module.parameters()).device
        return commit.start_save(save_dir, iteration, write=write, undo=undo,
                                 agree=commit.world_agreement(device),
                                 is_tracker_writer=self.ps.rank == 0,
                                 keep_last_n=self.cfg.checkpoint.keep_last_n_checkpoints,
                                 deepspeed_latest=True, capture=save if deferred else None,
                                 background=deferred)

    def local_state(self) -> Dict[str, Any]:
        """This rank's module, (ZeRO-1/2 partition of the) optimizer, LR schedule and
        DeepSpeed's step counters, as DeepSpeed's own checkpoint holds them."""
        ds = self.ds
        return {"module": ds.module_state_dict(),
                "optimizer": ds.optimizer.state_dict() if ds.optimizer is not None else None,
                "lr_scheduler": self.lr_scheduler.state_dict(),
                "counters": {"global_steps": ds.global_steps, "global_samples": ds.global_samples,
                             "skipped_steps": ds.skipped_steps}}

    def local_safe_globals(self) -> List[Any]:
        """DeepSpeed's loss scalers and ZeRO enums, pickled in its optimizer state."""
        return deepspeed_safe_globals()

    def load_local_state(self, state: Dict[str, Any], where: str) -> None:
        """Restore `local_state` as DeepSpeed's load_checkpoint would (ZeRO-1/2: this rank's
        partition with its fp32 weights, so the resume is exact)."""
        ds = self.ds
        try:
            ds.load_module_state_dict(checkpoint={"module": state["module"]}, strict=True)
            if state["optimizer"] is not None and ds.zero_optimization():
                ds.optimizer.load_state_dict([state["optimizer"]] * self.ps.data_parallel_size,
                                             load_optimizer_states=True,
                                             load_from_fp32_weights=True)
            elif state["optimizer"] is not None:
                ds.optimizer.load_state_dict(state["optimizer"])
        except (RuntimeError, ValueError, KeyError) as exc:
            raise CheckpointError(f"local checkpoint {where} does not fit this run: "
                                  f"{str(exc).splitlines()[0][:400]}") from exc
        self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        for name, value in state["counters"].items():
            setattr(ds, name, value)

    def _check_loadable(self, load_dir: str, plan: ResumePlan, where: str) -> None:
        """Refuse what DeepSpeed would fail on with a raw error: another format or layout, ZeRO-3
        pieces at another stage (or ZeRO-0/1/2 optimizer states at stage 3), and ZeRO
        partitions over another number of data x context ranks (after the model shape, the more
        basic mismatch, which DeepSpeed would otherwise report first), or of experts over
        another number of expert-parallel ranks."""
        layout = plan.layout  # detected once by the resume policy
        saved_layout.refuse_unloadable(
            layout, load_dir, deepspeed=True,
            tensor_model_parallel_size=self.ps.tensor_model_parallel_size,
            pipeline_model_parallel_size=self.ps.pipeline_model_parallel_size,
            data_parallel_size=self.zero_ps.data_parallel_size, load_optimizer=False)
        state: Dict[str, Any] = {}
        if layout is not None:  # the file names give TP x PP ranks, the args their split
            state = saved_layout.read_saved_state(layout)
            if state.get("args") is not None:
                check_saved_args(plan, state["args"], self.cfg, where)
        problem = deepspeed_problem(layout, state.get("args"), self.cfg, self.partitioned, plan)
        if not problem and self.moe and plan.load_optimizer:
            problem = deepspeed_moe.expert_split_problem(self.ds.module,
                                                         state.get("param_shapes"), where)
        if problem:
            raise CheckpointError(problem)

    def read_checkpoint(self, load_dir: str, plan: ResumePlan) -> CheckpointContents:
        """engine.load_checkpoint of the plan's tag: the module always, optimizer and LR-scheduler
        states when the plan says so; our client state carries the position, args and RNG.

        With --universal-checkpoint the tag is the one `latest_universal` names (written by
        DeepSpeed's ds_to_universal.py); DeepSpeed then slices every parameter and Adam moment
        for this run's DP and TP sizes, so the saved layout need not match this run's.
        """
        universal = self.cfg.deepspeed.universal_checkpoint
        tag = (saved_layout.universal_tag(load_dir) if universal
               else names.iteration_tag(plan.iteration))
        where = os.path.join(load_dir, tag)
        if universal:  # re-sliced for any layout (args checked below); DeepSpeed reads the
            # fragments itself with weights_only=False: scan them for unsafe globals first
            for fragment in sorted(glob.glob(os.path.join(where, "zero", "**", "*.pt"),
                                             recursive=True)):
                ckpt_files.check_pickled_globals(fragment, deepspeed_safe_globals())
        else:
            self._check_loadable(load_dir, plan, where)
            if self.partitioned and not plan.load_optimizer:
                return self._read_weights_zero3(where, plan)
            if self.partitioned:
                self._check_own_files(where)
        # this run's param-group settings, which DeepSpeed's ZeRO-3 universal loader overwrites
        groups = [{k: v for k, v in g.items() if k not in ("params", "lr")}
                  for g in self.ds.optimizer.param_groups] if universal and self.partitioned else []
        try:
            path, client = self.ds.load_checkpoint(
                load_dir, tag=tag, load_optimizer_states=plan.load_optimizer,
                load_lr_scheduler_states=plan.load_optimizer,
                load_module_only=plan.weights_only)
            if groups:
                zero3.repair_universal_load(self.ds.optimizer, groups)
        except CheckpointError:
            raise  # a corrupt or unsafe file, refused by CheckedCheckpointEngine
        except RuntimeError as exc:  # state-dict names or shapes that do not fit this model
            raise CheckpointError(f"DeepSpeed checkpoint {where} does not fit this model: "
                                  f"{str(exc).splitlines()[0][:400]}") from exc
        if path is None:
            raise CheckpointError(f"DeepSpeed could not load {where}; is it a DeepSpeed "
                                  "checkpoint (mp_rank_XX_model_states.pt) of this model?")
        client = client or {}
        args, rng = client.get("args"), client.get("rng_state")
        if args is not None and universal:  # any layout: compare the model shape only
            args, rng = self._universal_adjust(args, rng)
        if args is not None:
            check_saved_args(plan, args, self.cfg, where)
        return CheckpointContents(path=path, iteration=plan.iteration, args=args,
                                  client_state=client, rng_state=rng,
                                  scheduler_state=client.get("scheduler_steps"))

    def _check_own_files(self, where: str) -> None:
        """ZeRO-3: each rank reads files no other rank reads; a damaged or unsafe one is found
        before DeepSpeed's load, on every rank or none (engines.zero3.check_own_files)."""
        zero3.check_own_files(where, self.zero_ps.data_parallel_rank,
                              self.ps.tensor_model_parallel_rank,
                              next(self.ds.module.parameters()).device)

    def _read_weights_zero3(self, where: str, plan: ResumePlan) -> CheckpointContents:
        """A ZeRO-3 run's weights-only load (--finetune, --no-load-optim, a release): this TP
        rank's whole fp32 master weights read as the converter reads them
        (app.checkpoint.deepspeed.read_rank: ZeRO pieces of any stage and data-parallel size; a
        ZeRO-0 module file's weights), then cast to the module's dtype and cut into this run's
        pieces. DeepSpeed's own path here would read the tag `latest` names,
        unpickle with weights_only=False and merge every model-parallel rank as one."""
        import deepspeed
        saved = read_rank(where, self.ps.tensor_model_parallel_rank)
        client = saved.client
        zero3.load_whole_weights(  # data-parallel rank 0's copy is cut into pieces
            self.ds.module, saved.weights,
            lambda p: deepspeed.zero.GatheredParameters([p], modifier_rank=0),
            self.zero_ps.data_parallel_rank == 0, self.ds.optimizer)
        return CheckpointContents(path=where, iteration=plan.iteration, args=client.get("args"),
                                  client_state=client, rng_state=client.get("rng_state"),
                                  scheduler_state=client.get("scheduler_steps"))

    def _universal_adjust(self, args: Any, rng: Any) -> Tuple[Any, Any]:
        """The saved args with this run's layout (DeepSpeed re-slices the tensors), and the
        saved RNG states with this run's model-parallel dropout stream when the TP size changed
        (each TP rank needs its own stream; the saved ones belong to the old ranks)."""
        import copy
        saved_tp = int(getattr(args, "tensor_model_parallel_size", 1))
        args = copy.copy(args)
        args.tensor_model_parallel_size = self.ps.tensor_model_parallel_size
        args.pipeline_model_parallel_size = self.ps.pipeline_model_parallel_size
        args.padded_vocab_size = self.cfg.model.padded_vocab_size
        if rng is not None and saved_tp != self.ps.tensor_model_parallel_size:
            rng = dict(rng[0] if isinstance(rng, (list, tuple)) else rng)
            rng["rng_tracker_states"] = get_rng_tracker().get_states()
            logger.info("universal checkpoint saved at TP %d, loaded at TP %d: the model-parallel "
                        "dropout streams restart from this run's seed", saved_tp,
                        self.ps.tensor_model_parallel_size)
        return args, rng


def prepare_moe(model: torch.nn.Module, param_groups: List[Dict[str, Any]], cfg: RunConfig,
                ps: ParallelState) -> None:
    """DeepSpeed's MoE wiring, before deepspeed.initialize (engines.deepspeed_moe): DeepSpeed's
    expert and expert-data-parallel groups `ep_size_{EP}` (its own construction, checked against
    our expert grid), a marker in every MoE layer, and `param_groups` (the client optimizer's,
    or those a JSON optimizer is built from) split in place by DeepSpeed's own split: every
    expert parameter in a group `{'moe': True, 'name': 'ep_size_{EP}'}` (ZeRO reduces and
    partitions such a group over that name's expert-data-parallel group)."""
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
    from deepspeed.utils import groups
    ep = ps.expert_model_parallel_size
    name = f"ep_size_{ep}"
    groups.mpu = ps
    if name not in groups._get_expert_parallel_group_dict():  # one set per process
        groups._create_expert_and_data_parallel(ep)
    deepspeed_moe.check_expert_groups(ps, groups._get_expert_parallel_group_ranks(name),
                                      groups._get_expert_data_parallel_group_ranks(name))
    deepspeed_moe.attach_markers(model, _marker_class(), cfg.model.moe.num_experts, ep)
    plain = [{k: v for k, v in g.items() if k != "moe"} for g in param_groups]
    param_groups[:] = [g for g in split_params_into_different_moe_groups_for_optimizer(plain)
                       if g["params"]]


@functools.lru_cache(maxsize=None)
def _marker_class() -> type:
    """deepspeed_moe.MoEMarker made an instance of DeepSpeed's MoE layer (one class)."""
    from deepspeed.moe.layer import MoE
    return type("DeepSpeedMoEMarker", (deepspeed_moe.MoEMarker, MoE),
                {"__doc__": deepspeed_moe.MoEMarker.__doc__})


def partitioned_construction(cfg: RunConfig, parallel_state: ParallelState) -> Any:
    """deepspeed.zero.Init for a ZeRO-3 run: the context to build its model in.

    Under zero.Init each module's parameters are split over the data-parallel group as soon as
    that module's __init__ returns, so no rank ever holds the whole model: at most one
    parameter's full tensor while our init draws it. DeepSpeed's tensor-constructor overrides
    (which would cast the fp32 values our `param_seed` init draws to the run's dtype before
    drawing, changing them) and its F.linear replacement are off: the initial weights are the
    native path's, bit for bit, and the module's forward is ours.
    """
    import deepspeed
    assert zero_stage(cfg.deepspeed.config) == 3
    partitions = parallel_state.gradient_state().data_parallel_group  # data x context
    return deepspeed.zero.Init(data_parallel_group=partitions,
                               mpu=parallel_state, config_dict_or_path=cfg.deepspeed.config,
                               mem_efficient_linear=False, tensor_overrides=[])


def universal_checkpoint_info(model: torch.nn.Module, vocab_size: int) -> Dict[str, Any]:
    """What DeepSpeed's ds_to_universal.py needs to merge and re-slice our parameters: which
    are replicated across TP ranks, which are split by columns (row-parallel layers), and which
    hold the padded vocabulary (trimmed to the tokenizer's `vocab_size` in the universal files,
    padded with zeros for the loading run's TP size), which are --swiglu's [gate_r; up_r] rows
    (two sub-parameters, each split by rows); everything else is split by rows. Read from the
    parameters' own `tensor_model_parallel` / `partition_dim` / `glu_halves` marks, one
    exact-name pattern each."""
    from deepspeed.checkpoint import constants as c
    replicated, by_columns, vocabulary, gated = [], [], [], []
    for name, param in model.named_parameters():
        pattern = re.escape(name) + "$"
        if not getattr(param, "tensor_model_parallel", False):
            replicated.append(pattern)
        elif getattr(param, "partition_dim", 0) == 1:
            by_columns.append(pattern)
        if name.endswith("word_embeddings.weight"):
            vocabulary.append(pattern)
        if getattr(param, "glu_halves", False):
            gated.append(pattern)
    return {c.UNIVERSAL_CHECKPOINT_VERSION_KEY: c.UNIVERSAL_CHECKPOINT_VERSION_VALUE,
            c.TP_REPLICATED_PARAMETER_PATTERNS: replicated,
            c.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS: by_columns,
            c.VOCABULARY_PARAMETER_PATTERNS: vocabulary,
            c.PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0: gated,
            c.PIPELINE_REPLICATED_PARAMETER_PATTERNS: [],
            c.PARAMETER_TO_AVERAGE_PATTERNS: [], "original_vocab_size": int(vocab_size)}


def configure_activation_checkpointing(cfg: RunConfig, parallel_state: ParallelState) -> None:
    """Route the model's activation checkpointing and RNG tracker through deepspeed.checkpointing.

    Must run before the model's first forward: DeepSpeed is configured with our mpu and the
    JSON's `activation_checkpointing` block (partition_activations, contiguous_memory_optimization,
    cpu_checkpointing, number_checkpoints, synchronize_checkpoint_boundary, profile), its
    tracker is seeded like ours (seed + 2718 + tp_rank for the model-parallel stream), and
    app.mpu.random then hands the model DeepSpeed's checkpoint function and tracker.
    """
    import deepspeed
    ds = cfg.deepspeed.config
    given = ds.get("activation_checkpointing", {}).get("number_checkpoints")
    chunks = cfg.recompute_plan().checkpointed_regions  # what DeepSpeed sizes its buffers by
    deepspeed.checkpointing.configure(parallel_state, deepspeed_config=ds,
                                      num_checkpoints=None if given else chunks)
    deepspeed.checkpointing.model_parallel_cuda_manual_seed(cfg.training.seed)
    mpu_random.set_checkpoint_implementation(_leaf_safe(deepspeed.checkpointing.checkpoint),
                                             deepspeed.checkpointing.get_cuda_rng_tracker)


def _leaf_safe(checkpoint: Any) -> Any:
    """DeepSpeed's checkpoint, handed a view of any leaf tensor that requires grad.

    With partition_activations DeepSpeed swaps each input's storage for its flat partition; on a
    pipeline stage after the first, the first chunk's input is the received activation, a leaf
    whose gradient the schedule sends back, so its own storage must stay [b, s, h].
    """
    def run(function: Any, *args: Any) -> Any:
        args = tuple(a.view_as(a) if isinstance(a, torch.Tensor) and a.is_leaf and a.requires_grad
                     else a for a in args)
        return checkpoint(function, *args)
    return run
