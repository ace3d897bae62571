"""Third-party start-up noise that says nothing to our users, silenced where it comes from, once.

- DeepSpeed warns at every import on a machine without a GPU that it "set the accelerator to
  CPU". Naming the CPU accelerator ourselves (DS_ACCELERATOR=cpu, unless the user chose one)
  before importing it gives the same accelerator without the warning; our launch scripts do
  the same for the `deepspeed` launcher process (scripts/lib/gpt2_args.sh).
- DeepSpeed's ZeRO calls `torch.distributed.all_gather_into_tensor`, which torch 2.13 marks
  deprecated with a FutureWarning on every rank; the call is DeepSpeed's, not the user's, so
  the engine that imports DeepSpeed silences exactly that message.
"""
from __future__ import annotations

import os
import warnings

DEEPSPEED_DEPRECATIONS = (r"`torch\.distributed\.all_gather_into_tensor` is deprecated",
                          r"`torch\.distributed\.reduce_scatter_tensor` is deprecated")
"""Messages of torch FutureWarnings raised by DeepSpeed's own calls."""


def prepare_deepspeed_import() -> None:
    """Call before `import deepspeed`: DS_ACCELERATOR=cpu when CUDA is not available and the
    user has not set DS_ACCELERATOR (the accelerator DeepSpeed would pick, without its warning)."""
    if "DS_ACCELERATOR" in os.environ:
        return
    import torch

    if not torch.cuda.is_available():
        os.environ["DS_ACCELERATOR"] = "cpu"


def silence_deepspeed_deprecations() -> None:
    """Ignore the torch FutureWarnings that DeepSpeed's calls raise (DEEPSPEED_DEPRECATIONS)."""
    for message in DEEPSPEED_DEPRECATIONS:
        warnings.filterwarnings("ignore", message=message, category=FutureWarning)
