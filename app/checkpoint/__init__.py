"""The checkpoint *format*, shared by training, conversion, inference and the tools.

`names` says where every file of a checkpoint lives and reads and writes the pointer files
(our tracker, DeepSpeed's `latest`); `files` checksums and reads files safely; `commit` writes
them crash-safely and makes a save the latest one on every rank or on none; `megatron` is the
Megatron state dict; `model_args` its `args` <-> ModelConfig; `layouts` reads a saved layout
from file names; `deepspeed_files` reads DeepSpeed's files the same safe way. `torch_dist` is
Megatron Core's distributed checkpoint (`--ckpt-format torch_dist`), built on `mcore_names` (our
names <-> Megatron Core's keys), `sharding` (boxes of global tensors), `dcp_files` (PyTorch DCP
files) and `mcore_state` (Megatron's common state). No policy lives
here: when to save, what to resume and what to refuse are app.training.resilience's.
"""


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved or loaded; the message names the file and the fix."""
