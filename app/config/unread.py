"""Flags the run's chosen path does not read: one warning each, never silence. Part of
`app.config`.

Megatron-LM accepts these and ignores them; where it refuses, the config dataclasses refuse
too (their `__post_init__`), and where a flag contradicts the DeepSpeed JSON,
`app.config.deepspeed.reconcile_ds_config` refuses. What is left is a flag given for another
path than the one the run takes:

- a tokenizer file the --tokenizer-type in effect does not read (`--vocab-file` and
  `--merge-file` beside HuggingFaceTokenizer, `--tokenizer-model` beside GPT2BPETokenizer,
  `--vocab-size` beside a file-based type: app.config.data.tokenizer_flags_not_read);
- fp16's loss-scale flags with bf16 or fp32 weights, which need no loss scaling;
- `--ddp-bucket-size` without `--use-distributed-optimizer`, the only owner of gradient buckets;
- the settings of an optimizer the run does not use (`--sgd-momentum`, the `--muon-*` flags,
  Adam's betas and epsilon under SGD);
- `--deepspeed_config` without `--deepspeed` (the native path runs, the JSON unread);
- the `--moe-*` flags and `--expert-tensor-parallel-size` without `--num-experts` (a dense
  model), and `--moe-permute-fusion` / `--moe-router-fusion` (accepted for Megatron's scripts:
  the permutation and the router here are the same unfused PyTorch either way);
- Megatron's sub-options without their option: `--rope-scaling-factor` without
  `--use-rope-scaling`, `--decoupled-min-lr` without `--decoupled-lr`, `--grad-reduce-in-bf16`
  without bf16 weights, the TikTokenizer flags and `--trust-remote-code` with a tokenizer that
  does not read them; and `--use-mcore-models` (deprecated in Megatron-LM, ignored there too).
- and the flags Megatron-LM accepts that change nothing in this run (`no_effect`): where
  Megatron ignores them in the same situation, or has a kernel this project does not have (the
  flag only picks between two implementations of the same arithmetic):
  --sequence-parallel at tensor-parallel size 1 (Megatron turns it off with a warning); kernel
  switches for kernels we do not have (--no-rope-fusion, --no-gradient-accumulation-fusion);
  settings whose switch is off (FP8 without --fp8-format, the profiler's without --profile,
  manual GC's without --manual-gc, TensorBoard's without --tensorboard-dir);
  --reset-attention-mask with --no-create-attention-mask-in-dataloader; --recompute-modules
  without --recompute-granularity selective, or naming a module the model lacks (moe in a
  dense model); --split with
  --mock-data (Megatron divides the mock documents in thirds); --fp8-interval (deprecated by
  Transformer Engine 1.8); --empty-unused-memory-level on a device without the CUDA cache.

`unread_flags(cfg, device_type)` lists them; the run logs each once at start-up (rank 0) and
--dry-run reports them as warnings.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable, List, Optional

from app.config.data import TikTokenConfig, tokenizer_flags_not_read
from app.config.fp8 import Fp8Config
from app.config.logs import LogConfig
from app.config.moe import MoEConfig
from app.config.optimizer import OptimizerConfig
from app.config.recompute import idle_recompute_modules
from app.config.run import RunConfig

MUON_FLAGS = tuple(f.metadata["flag"].name for f in dataclasses.fields(OptimizerConfig)
                   if f.name.startswith("muon_") and "flag" in f.metadata)
"""Every --muon-* flag (read with --optimizer muon only)."""
ADAM_FLAGS = ("--adam-beta1", "--adam-beta2", "--adam-eps")
MOE_FLAGS = tuple(f.metadata["flag"].name for f in dataclasses.fields(MoEConfig)
                  if f.name != "num_experts" and "flag" in f.metadata)
"""Every --moe-* flag (read with --num-experts only)."""
MOE_FUSIONS = ("--moe-permute-fusion", "--moe-router-fusion")
TIKTOKEN_FLAGS = tuple(f.metadata["flag"].name for f in dataclasses.fields(TikTokenConfig))
"""Every TikTokenizer flag (read with --tokenizer-type TikTokenizer only)."""


def unread_flags(cfg: RunConfig, device_type: Optional[str] = None) -> List[str]:
    """One line per flag given (`cfg.explicit_flags`, or a value set) that the run's path does
    not read, or that changes nothing in it (`no_effect`): the flag, the path chosen and why
    (module docstring). `device_type` ("cuda", "cpu"): the run's device, when known."""
    d, p, o, given = cfg.data, cfg.precision, cfg.optimizer, cfg.explicit_flags
    notes = tokenizer_flags_not_read(d.tokenizer_type, d.vocab_file, d.merge_file,
                                     d.tokenizer_model, d.vocab_size)
    if not p.fp16:
        weights = "bf16" if p.bf16 else "fp32"
        notes += [f"{flag} is not read: {weights} weights need no loss scaling (the loss-scale "
                  "flags apply with --fp16 only); drop it" for flag in p.loss_scale_flags]
    if o.ddp_bucket_size is not None and not o.use_distributed_optimizer:
        path = ("the DeepSpeed path (ZeRO buckets by the JSON's reduce_bucket_size)"
                if cfg.deepspeed.enabled else "the data-parallel all-reduce without "
                "--use-distributed-optimizer")
        notes.append(f"--ddp-bucket-size {o.ddp_bucket_size} is not read by {path}: only "
                     "--use-distributed-optimizer buckets gradients by it; drop it")
    unused = {"sgd": [f for f in (*MUON_FLAGS, *ADAM_FLAGS) if f in given],
              "adam": [f for f in (*MUON_FLAGS, "--sgd-momentum") if f in given],
              "muon": [f for f in ("--sgd-momentum",) if f in given]}[o.optimizer]
    notes += [f"{flag} is not read: --optimizer {o.optimizer} does not use it; drop it"
              for flag in unused]
    if cfg.deepspeed.config_path and not cfg.deepspeed.enabled:
        notes.append(f"--deepspeed_config {cfg.deepspeed.config_path} is not read: without "
                     "--deepspeed the run takes the native path; add --deepspeed to train "
                     "through DeepSpeed with it")
    return (notes + _moe_flags_not_read(cfg) + _megatron_flags_not_read(cfg)
            + no_effect(cfg, device_type))


def _megatron_flags_not_read(cfg: RunConfig) -> List[str]:
    """Megatron's model, optimizer and tokenizer sub-options given without what reads them."""
    m, given = cfg.model, cfg.explicit_flags
    unread = [
        ("--rope-scaling-factor", not m.use_rope_scaling, "without --use-rope-scaling the RoPE "
         "frequencies are unscaled"),
        ("--decoupled-min-lr", cfg.optimizer.decoupled_lr is None, "without --decoupled-lr "
         "every parameter follows --lr / --min-lr"),
        ("--grad-reduce-in-bf16", not cfg.precision.bf16, "it applies to bf16 gradients "
         "(--bf16)"),
        ("--use-mcore-models", True, "deprecated in Megatron-LM and ignored there too: this "
         "project has one model")]
    if cfg.data.tokenizer_type != "HuggingFaceTokenizer":
        unread.append(("--trust-remote-code", True, f"--tokenizer-type {cfg.data.tokenizer_type} "
                       "runs no Hugging Face tokenizer code"))
    if cfg.data.tokenizer_type != "TikTokenizer":
        unread += [(flag, True, f"--tokenizer-type {cfg.data.tokenizer_type} does not use it")
                   for flag in TIKTOKEN_FLAGS]
    return [f"{flag} is not read: {why}; drop it" for flag, off, why in unread
            if off and flag in given]



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


def _without(switch: str, on: bool, settings: Iterable[str], given: Iterable[str],
             does: str) -> Optional[str]:
    """A line for the `settings` given while `switch` is off."""
    named = [flag for flag in settings if flag in given]
    if on or not named:
        return None
    return f"{', '.join(named)} {'has' if len(named) == 1 else 'have'} no effect without {switch} ({does})"


def no_effect(cfg: RunConfig, device_type: Optional[str] = None) -> List[str]:
    """One line per flag Megatron-LM accepts that changes nothing in this run, and why (module
    docstring). `device_type`: the device the run uses ("cuda", "cpu"), when known."""
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
    notes += _recompute_modules_idle(cfg)
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


def _moe_flags_not_read(cfg: RunConfig) -> List[str]:
    """The MoE flags of a dense model, and Megatron's MoE fusion switches."""
    given = cfg.explicit_flags
    if not cfg.model.moe.enabled:
        return [f"{flag} is not read: without --num-experts the model is dense; drop it or add "
                "--num-experts" for flag in (*MOE_FLAGS, "--expert-tensor-parallel-size")
                if flag in given]
    return [f"{flag} is not read: the token permutation and the router run the same unfused "
            "PyTorch either way (accepted for Megatron's scripts)" for flag in MOE_FUSIONS
            if flag in given]


def _recompute_modules_idle(cfg: RunConfig) -> List[str]:
    """--recompute-modules without selective recompute (Megatron ignores them too), and the
    named modules the model does not have (mlp without dense layers, moe without experts)."""
    m, given = cfg.model, cfg.explicit_flags
    if "--recompute-modules" in given and m.recompute_granularity != "selective":
        return [f"--recompute-modules {' '.join(m.recompute_modules)} is not read: it applies "
                "with --recompute-granularity selective (Megatron ignores it too)"]
    if not {"--recompute-modules", "--moe-layer-recompute"} & set(given):
        return []
    return [f"--recompute-modules {name} has no effect: the model has no {what}"
            for name in idle_recompute_modules(m)
            for what in [{"mlp": "dense layer", "moe": "MoE layer",
                          "shared_experts": "shared expert outside a recomputed MoE layer"
                          }.get(name, name)]]
