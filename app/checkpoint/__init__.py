"""Every checkpoint format, shared by training, conversion, inference and the tools.

By what a reader looks for:

    formats.py        the registry: one entry per --ckpt-format name (`torch`, `torch_dist`,
                      `deepspeed`, `hf`), each entry's whole-model read, describe and write;
                      `detect` once per load, its `SavedCheckpoint` passed down to the reader
    request.py        WriteRequest: what a writer is asked to write (layout, dtype, iteration,
                      optimizer, shard size, tokenizer), never a tool's options
    convert.py        the converter: its flags -> detect, read through one entry, write
                      through another
    legacy/           Megatron-LM's legacy format: per_rank (training), whole (conversion)
    torch_dist/       Megatron Core's distributed checkpoint: dcp_files, per_rank, whole
    deepspeed.py      DeepSpeed's files read safely, one rank whole, the whole model
    hf/               Hugging Face directories: one adapter per model family (families/),
                      the directory's files, the tokenizer, the model card
    mcore/            Megatron Core's names and common state (both Megatron formats)
    saved_layout.py   what a saved iteration holds, from file names (SavedLayout, detect);
                      whether a run can load it
    param_layout.py   where a full tensor's TP shards and PP stages lie; merging ranks
    names.py  files.py  commit.py  snapshot.py  sharding.py  model_args.py  state.py
                      file names and pointers; checksums and safe reads; the crash-safe
                      two-phase commit; host copies of a save; box arithmetic of global
                      tensors; `args` <-> ModelConfig; ModelCheckpoint

No policy lives here: when to save, what to resume and what to refuse are
app.training.checkpointing's.
"""


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved or loaded; the message names the file and the fix."""
