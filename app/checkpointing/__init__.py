"""The checkpoint *format*, shared by training, conversion, inference and the tools: file names
and tags, the Megatron state dict and its `args`, checksum sidecars and safe (allow-listed) reads,
DeepSpeed's files read the same way, and saved layouts read from file names. No policy lives
here: when to save, what to resume and what to refuse are app.training.resilience's."""
