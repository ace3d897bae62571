"""Flags Megatron-LM accepts that change nothing in this run: one line each, never silence.
Part of `app.config`.

Megatron-LM accepts these and, in the same situation, ignores them too (or has a kernel this
project does not have, where the flag only picks between two implementations of the same
arithmetic). Where Megatron refuses, the config dataclasses refuse. The lines say what the
flag would do and why it does not here:

- --sequence-parallel at tensor-parallel size 1 (Megatron turns it off with a warning);
- kernel switches for kernels this project does not have (--no-rope-fusion,
  --no-gradient-accumulation-fusion): both settings run the same PyTorch code;
- a flag whose switch is off: the FP8 settings without --fp8-format, the profiler settings
  without --profile, the manual-GC settings without --manual-gc, the TensorBoard settings
  without --tensorboard-dir;
- --reset-attention-mask with --no-create-attention-mask-in-dataloader (no mask is built);
- --split with --mock-data (Megatron divides the mock documents in thirds);
- --fp8-interval (deprecated by Transformer Engine 1.8, ignored by Megatron);
- --empty-unused-memory-level on a device without the CUDA caching allocator.

`no_effect(cfg, device_type)` lists them; the run logs each at start-up (rank 0) and --dry-run
reports them as notes.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable, List, Optional

from app.config.fp8 import Fp8Config
from app.config.logs import LogConfig
from app.config.run import RunConfig
from app.config.runtime import RuntimeConfig


def _flags_of(cls: type, *leave_out: str) -> List[str]:
    """The first spelling of every option field of `cls`, except `leave_out`."""
    return [f.metadata["flag"].name for f in dataclasses.fields(cls)
            if "flag" in f.metadata and f.metadata["flag"].name not in leave_out]


FP8_SETTINGS = _flags_of(Fp8Config, "--fp8-format")
PROFILE_SETTINGS = ["--profile-step-start", "--profile-step-end", "--profile-ranks",
                    "--use-pytorch-profiler", "--pytorch-profiler-collect-shapes",
                    "--pytorch-profiler-collect-callstack", "--record-shapes"]
GC_SETTINGS = ["--manual-gc-interval", "--no-manual-gc-eval"]
TENSORBOARD_SETTINGS = _flags_of(LogConfig, "--log-throughput")
assert set(PROFILE_SETTINGS + GC_SETTINGS) < set(_flags_of(RuntimeConfig))


def _without(switch: str, on: bool, settings: Iterable[str], given: Iterable[str],
             does: str) -> Optional[str]:
    """A line for the `settings` given while `switch` is off."""
    named = [flag for flag in settings if flag in given]
    if on or not named:
        return None
    return f"{', '.join(named)} {'has' if len(named) == 1 else 'have'} no effect without {switch} ({does})"


def no_effect(cfg: RunConfig, device_type: Optional[str] = None) -> List[str]:
    """One line per flag of `cfg` (given on the command line: `cfg.explicit_flags`) that
    changes nothing in this run, and why (module docstring). `device_type`: the device the run
    uses ("cuda", "cpu"), when known."""
    given, m, d = cfg.explicit_flags, cfg.model, cfg.data
    notes: List[Optional[str]] = []
    if "--sequence-parallel" in given and cfg.parallel.tensor_model_parallel_size == 1:
        notes.append("--sequence-parallel is turned off: the tensor-parallel size is 1 "
                     "(Megatron-LM: \"Disabling sequence parallelism because tensor model "
                     "parallelism is disabled\")")
    if not m.apply_rope_fusion:
        notes.append("--no-rope-fusion changes nothing here: this project has no fused RoPE "
                     "kernel, RoPE runs in PyTorch with or without it")
    if not cfg.kernels.gradient_accumulation_fusion:
        notes.append("--no-gradient-accumulation-fusion changes nothing here: autograd "
                     "accumulates the weight gradients (there is no fused accumulation to turn "
                     "off)")
    if d.reset_attention_mask and not d.create_attention_mask_in_dataloader:
        notes.append("--reset-attention-mask has no effect with "
                     "--no-create-attention-mask-in-dataloader: no mask is built, attention is "
                     "plain causal (as in Megatron-LM); positions and loss masks still follow "
                     "their flags")
    if d.mock_data and "--split" in given:
        notes.append(f"--split {d.split} is not read with --mock-data: Megatron-LM divides its "
                     "mock documents in thirds (1,1,1)")
    if "--fp8-interval" in given:
        notes.append("--fp8-interval is ignored (deprecated since Transformer Engine 1.8, "
                     "ignored by Megatron-LM)")
    notes.append(_without("--fp8-format", cfg.fp8.enabled, FP8_SETTINGS, given,
                          "FP8 is off"))
    notes.append(_without("--profile", cfg.runtime.profile, PROFILE_SETTINGS, given,
                          "nothing is profiled"))
    notes.append(_without("--manual-gc", cfg.runtime.manual_gc, GC_SETTINGS, given,
                          "Python's automatic garbage collector runs"))
    notes.append(_without("--tensorboard-dir", bool(cfg.training.tensorboard_dir),
                          TENSORBOARD_SETTINGS, given, "no TensorBoard is written"))
    if cfg.runtime.empty_unused_memory_level and device_type not in (None, "cuda"):
        notes.append(f"--empty-unused-memory-level {cfg.runtime.empty_unused_memory_level} has "
                     f"no effect on the {device_type}: it empties the CUDA caching allocator")
    return [note for note in notes if note]
