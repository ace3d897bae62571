"""Every checkpoint format, shared by training, conversion, inference and the tools.

`formats` is the registry (one entry per format under its --ckpt-format name: `torch` the
legacy Megatron layout, `torch_dist`, `deepspeed`, `hf`; one `detect`; each entry's whole-model
read, describe and write) and `convert` reads through one entry and writes through another.
Each format is one module that reads and writes it per rank and whole: `megatron` (legacy),
`torch_dist` (Megatron Core's distributed checkpoint), `deepspeed` (DeepSpeed's files, read
safely: one model-parallel rank whole for the engine's ZeRO-3 weights-only load and the
converter alike, and the whole model) and `hf` (Hugging Face: `hf_gpt2` and `hf_llama` map the
weights, `hf_files` reads and writes the directory). They share: `names` (where every file
lives, the format names, the one iteration resolver, the pointer files), `layouts` (a saved
layout from file names), `files` (checksums, safe reads), `commit` (crash-safe writes; a save
becomes the latest on every rank or on none), `layout` (a full tensor's TP shards and PP
stages, the model's optimizer groups, merging ranks), `sharding` (boxes of global tensors: the
one rule of where a TP shard lies), `mcore_names`, `mcore_state`, `dcp_files`, `model_args`
(`args` <-> ModelConfig) and `state` (ModelCheckpoint). No policy lives here: when to save,
what to resume and what to refuse are app.training.resilience's.
"""


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved or loaded; the message names the file and the fix."""
