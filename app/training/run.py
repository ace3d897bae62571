"""Composition: build the parts of one training run from a RunConfig, in the one right order.

    parallel groups and seeds -> (DeepSpeed activation checkpointing) -> fused kernels
    -> model stage (app.model.stage.build_model_stage, as inference builds it; its layers
    compiled with --compile-layers) -> engine and its checkpointer -> Trainer

`build_run` is used by `app.training.pretrain` (real data) and by the test and benchmark
helper `tests/harness/synthetic.py`, so every run is put together the same way. This is the
only module that chooses between the engines.
"""
from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass
from typing import Any, Optional, Tuple

import torch

from app import kernels
from app.config import RunConfig
from app.config.deepspeed import zero_stage
from app.model.gpt2 import compile_transformer_layers
from app.model.stage import build_model_stage
from app.mpu.parallel_state import ParallelState, initialize_model_parallel
from app.mpu.random import model_parallel_seed
from app.optim import OptimizerParamScheduler, build_optimizer
from app.optim.distributed_optimizer import DistributedOptimizer
from app.optim.mixed_precision import build_precision_optimizer
from app.launch.distributed import world_group
from app.training.engines.base import Engine
from app.training.checkpointing.checkpointer import Checkpointer
from app.training.engines.native import NativeEngine
from app.training.loss import LossFunction
from app.training.state import RunState
from app.training.trainer import Trainer
from app.utils.rank_logging import ALL_RANKS

logger = logging.getLogger(__name__)


def build_parallel_state(cfg: RunConfig, world_size: int) -> ParallelState:
    """Tensor/pipeline/data groups for the layout; the one-process state for a world of one
    (DeepSpeed runs always get real groups: DeepSpeed needs a process group even for one rank)."""
    p = cfg.parallel
    timeout = datetime.timedelta(minutes=p.distributed_timeout_minutes)
    if cfg.deepspeed.enabled:
        from app.training.engines.deepspeed import ensure_distributed  # deferred: imports deepspeed
        ensure_distributed(p.distributed_backend, p.distributed_timeout_minutes)
    elif world_size == 1:
        return ParallelState.single()
    return initialize_model_parallel(p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                                     cfg.virtual_pipeline_model_parallel_size,
                                     timeout=timeout,
                                     context_parallel_size=p.context_parallel_size,
                                     cp_comm_type=p.cp_comm_type,
                                     expert_model_parallel_size=p.expert_model_parallel_size,
                                     expert_tensor_parallel_size=p.expert_tensor_parallel_size,
                                     experts=cfg.model.moe.enabled)


def set_seeds(seed: int, parallel_state: ParallelState) -> None:
    """Python, numpy and torch seeds (seed + 100 x pipeline stage, as Megatron) and the
    model-parallel RNG stream (seed + 2718 + tensor-parallel rank)."""
    model_parallel_seed(seed, parallel_state)


def prepare_kernels(cfg: RunConfig, device: torch.device) -> None:
    """Tell the kernel library how to build (--require-fused-kernels, --kernel-build-*); on a
    CUDA device with a csrc/ fusion on, obtain it now, so the build (local rank 0; the others
    wait) and any failure happen at start-up rather than inside the first forward. Then all
    ranks agree: if any rank lacks the kernels, every rank uses PyTorch (one all-reduce over
    the world; the build timeout keeps the builder within the process-group timeout)."""
    k, m = cfg.kernels, cfg.model
    kernels.configure(required=k.require_fused_kernels, build_root=k.build_dir,
                      timeout_s=k.build_timeout, local_rank=cfg.parallel.local_rank)
    if device.type == "cuda" and (m.masked_softmax_fusion or m.layernorm_fusion
                                  or m.cross_entropy_loss_fusion):
        kernels.status()
        kernels.agree_across_ranks(world_group(), device)


def build_engine(cfg: RunConfig, model: torch.nn.Module, parallel_state: ParallelState) -> Engine:
    """The engine this run asks for: DeepSpeed's with --deepspeed, else the native one.

    DeepSpeed is imported only when asked for, inside app.training.engines.deepspeed.
    """
    if cfg.deepspeed.enabled:  # DeepSpeed brings its own fp16/bf16 optimizer wrapping ours
        from app.training.engines.deepspeed import DeepSpeedEngineAdapter  # deferred: imports deepspeed
        optimizer = build_optimizer(model, cfg.optimizer)
        scheduler = OptimizerParamScheduler(optimizer, cfg.optimizer)
        return DeepSpeedEngineAdapter(cfg, model, optimizer, scheduler, parallel_state)
    if cfg.optimizer.use_distributed_optimizer:  # a sibling wrapper with the same interface
        wrapper = DistributedOptimizer(  # sharded over data x context ranks (Megatron Core)
            model, cfg.optimizer, cfg.precision, parallel_state.gradient_state(),
            cfg.training.num_micro_batches(parallel_state.data_parallel_size))
    else:
        wrapper = build_precision_optimizer(model, cfg.optimizer, cfg.precision, parallel_state)
    scheduler = OptimizerParamScheduler(wrapper, cfg.optimizer)
    return NativeEngine(cfg, model, wrapper, scheduler, parallel_state)


@dataclass
class Run:
    """The built parts of one run; `trainer` is None until datasets are attached."""

    cfg: RunConfig
    ps: ParallelState
    model: torch.nn.Module
    engine: Engine
    device: torch.device
    checkpointer: Checkpointer
    """Every save and load of the run (app.training.checkpointing): the start-up load goes
    through it, then the trainer's saves."""
    trainer: Optional[Trainer] = None

    def attach_trainer(self, datasets: Tuple[Any, Any, Any], eod: int,
                       state: Optional[RunState] = None,
                       loss_function: Optional[LossFunction] = None,
                       return_logits: bool = False, **guards: Any) -> Trainer:
        """Create the Trainer over (train, valid, test) datasets starting at `state`, with the
        training loss `loss_function` (default: Megatron's LM loss; app.training.loss) and the
        run's checkpointer; `guards` are its optional `signals` (ExitSignalHandler), `watchdog`
        (Watchdog) and `inprocess` (InProcessRestart)."""
        self.trainer = Trainer(self.cfg, self.engine, self.ps, datasets, eod, self.device,
                               state=state, loss_function=loss_function,
                               return_logits=return_logits, checkpointer=self.checkpointer,
                               **guards)
        return self.trainer


def build_run(cfg: RunConfig, world_size: int, device: torch.device) -> Run:
    """Parallel state, seeds, the model stage on `device` and its engine for `cfg`.

    torch.distributed must already be initialised when `world_size` > 1.
    """
    ps = build_parallel_state(cfg, world_size)
    logger.info("> initialized tensor model parallel with size %d", ps.tensor_model_parallel_size)
    logger.info("> initialized pipeline model parallel with size %d",
                ps.pipeline_model_parallel_size)
    set_seeds(cfg.training.seed, ps)
    if cfg.deepspeed.enabled and cfg.deepspeed.activation_checkpointing:
        from app.training.engines.deepspeed import configure_activation_checkpointing  # deferred: imports deepspeed
        configure_activation_checkpointing(cfg, ps)
        logger.info("activation checkpointing through deepspeed.checkpointing (settings from "
                    "the JSON's activation_checkpointing block)")
    prepare_kernels(cfg, device)
    vp = cfg.virtual_pipeline_model_parallel_size
    if cfg.deepspeed.enabled and zero_stage(cfg.deepspeed.config) == 3:
        from app.training.engines.deepspeed import partitioned_construction  # deferred: imports deepspeed
        with partitioned_construction(cfg, ps):  # each module partitioned once built, on device
            model = build_model_stage(cfg.model, ps, vp)
    else:
        model = build_model_stage(cfg.model, ps, vp).to(device)
    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    if ps.data_parallel_rank == 0 and ps.context_parallel_rank == 0:  # Megatron's line and ranks
        logger.info(" > number of parameters on (tensor, pipeline) model parallel rank (%d, %d): "
                    "%d", ps.tensor_model_parallel_rank, ps.pipeline_model_parallel_rank,
                    n_params, extra=ALL_RANKS)
    if cfg.kernels.compile_layers:
        logger.info("--compile-layers: %d transformer layers compiled with torch.compile (the "
                    "first iteration compiles them)", compile_transformer_layers(model))
    engine = build_engine(cfg, model, ps)
    return Run(cfg=cfg, ps=ps, model=model, engine=engine, device=device,
               checkpointer=Checkpointer(cfg.checkpoint, engine, ps, device,
                                         cfg.training.train_iters))
