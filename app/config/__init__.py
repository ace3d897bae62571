"""Configuration dataclasses: the only way configuration reaches library code.

Each command-line option is declared once, as a field of one of these dataclasses that carries
its flag spellings, default, choices and help (`app.config.options.option`); `arguments.py`
builds the parser and the `RunConfig` from those fields, computing only the derived values
(warm-up from a fraction, global batch, precision and optimizer from the DeepSpeed JSON, the
padded vocabulary, the recompute aliases). Nothing under `app/` reads argparse or a global args
object.

Every rule is checked here, once, when a config is built: each dataclass checks its own fields
in `__post_init__`, and `RunConfig.__post_init__` checks the rules that span several (the
global batch against the data-parallel size, heads against the tensor-parallel size, ...).
Messages name the command-line flag, the values and the fix. Nothing rewrites a config after
it is built; derived values are properties or are computed where they are used.

Modules: options (the field-to-flag mapping), model, moe (Mixture of Experts), recompute, parallel (layout and
precision), optimizer, training (and rollback), data, checkpoint, kernels, deepspeed (and the
DeepSpeed JSON rules), wandb, runtime (garbage collection, CUDA cache, profiler), logs (the
log line's and TensorBoard's extras), fp8 (Transformer Engine FP8, accepted and counted),
preflight (--dry-run), run (RunConfig), rules (shared checks),
cli (argparse parsers from the fields, for arguments.py and the tools), inference (the
checkpoint an inference tool runs: InferenceLoadConfig).
"""
from __future__ import annotations

from app.config.checkpoint import CKPT_FORMATS, CheckpointConfig
from app.config.data import DataConfig
from app.config.deepspeed import DeepSpeedConfig
from app.config.fp8 import Fp8Config
from app.config.kernels import KernelConfig, default_kernel_build_timeout
from app.config.logs import LogConfig
from app.config.model import (ATTENTION_BACKENDS, POSITION_EMBEDDING_TYPES,
                              RECOMPUTE_GRANULARITIES, RECOMPUTE_METHODS, ModelConfig)
from app.config.moe import MoEConfig
from app.config.optimizer import (LR_DECAY_STYLES, MUON_COEFFICIENT_TYPES,
                                  MUON_MATMUL_PRECISIONS, MUON_SCALAR_OPTIMIZERS, MUON_SCALE_MODES,
                                  MUON_TP_MODES, OPTIMIZERS, OptimizerConfig, check_muon_layout)
from app.config.parallel import DISTRIBUTED_BACKENDS, ParallelConfig, PrecisionConfig
from app.config.preflight import DryRunConfig, PrepareCacheConfig
from app.config.recompute import RecomputePlan, recompute_plan, resolve_recompute_flags
from app.config.runtime import RuntimeConfig
from app.config.rules import divisible, positive, split_weights
from app.config.run import RunConfig, samples_per_split
from app.config.training import InProcessRestartConfig, RollbackConfig, TrainingConfig
from app.config.wandb import WandbConfig

__all__ = [
    "ATTENTION_BACKENDS", "CKPT_FORMATS", "DISTRIBUTED_BACKENDS", "LR_DECAY_STYLES", "POSITION_EMBEDDING_TYPES",
    "RECOMPUTE_GRANULARITIES", "RECOMPUTE_METHODS", "CheckpointConfig", "DataConfig",
    "DeepSpeedConfig", "DryRunConfig", "Fp8Config", "KernelConfig", "LogConfig", "MUON_COEFFICIENT_TYPES",
    "MUON_MATMUL_PRECISIONS", "MUON_SCALAR_OPTIMIZERS", "MUON_SCALE_MODES", "MUON_TP_MODES",
    "ModelConfig", "MoEConfig", "OPTIMIZERS", "OptimizerConfig", "ParallelConfig", "PrecisionConfig",
    "InProcessRestartConfig", "PrepareCacheConfig",
    "RecomputePlan", "RollbackConfig", "RunConfig", "RuntimeConfig", "TrainingConfig", "WandbConfig",
    "check_muon_layout", "default_kernel_build_timeout", "divisible", "positive",
    "recompute_plan", "resolve_recompute_flags", "samples_per_split", "split_weights"]
