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
- `--deepspeed_config` without `--deepspeed` (the native path runs, the JSON unread).

`unread_flags(cfg)` lists them; the run logs each once at start-up (rank 0) and --dry-run
reports them as warnings.
"""
from __future__ import annotations

import dataclasses
from typing import List

from app.config.data import tokenizer_flags_not_read
from app.config.optimizer import OptimizerConfig
from app.config.run import RunConfig

MUON_FLAGS = tuple(f.metadata["flag"].name for f in dataclasses.fields(OptimizerConfig)
                   if f.name.startswith("muon_") and "flag" in f.metadata)
"""Every --muon-* flag (read with --optimizer muon only)."""
ADAM_FLAGS = ("--adam-beta1", "--adam-beta2", "--adam-eps")


def unread_flags(cfg: RunConfig) -> List[str]:
    """One line per flag given (`cfg.explicit_flags`, or a value set) that the run's path does
    not read: the flag, the path chosen and why it is not read (module docstring)."""
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
    return notes
