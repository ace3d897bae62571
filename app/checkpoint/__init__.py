"""Every checkpoint format, shared by training, conversion, inference and the tools.

`formats` is the registry (one entry per format under its --ckpt-format name: `torch` the
legacy Megatron layout, `torch_dist`, `deepspeed`, `hf`; one `detect`; each entry's whole-model
read, describe and write) and `convert` reads through one entry and writes through another.
`names` says where every file lives, the format names, the one iteration resolver and the
pointer files; `files` checksums and reads files safely; `commit` writes them crash-safely and
makes a save the latest one on every rank or on none; `megatron` is the legacy per-rank state
dict, `model_args` its `args` <-> ModelConfig; `layouts` reads a saved layout from file names;
`deepspeed_files` and `zero3` read DeepSpeed's files. `torch_dist` is Megatron Core's
distributed checkpoint per rank, built on `mcore_names`, `sharding` (boxes of global tensors:
the one rule of where a TP shard lies), `dcp_files` and `mcore_state`. Whole models:
`megatron_whole`, `torch_dist_whole`, `deepspeed_whole`, `hf` (Hugging Face: `hf_gpt2`,
`hf_llama`, their files `hf_files`), with `layout` (a full
tensor's TP shards and PP stages, the model's optimizer groups) and `state` (ModelCheckpoint).
No policy lives here: when to save, what to resume and what to refuse are
app.training.resilience's.
"""


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved or loaded; the message names the file and the fix."""
