"""This code's release: the version pyproject.toml and CHANGELOG.md name (a unit test keeps the
three equal), recorded in every checkpoint it writes (app.checkpoint.model_args.writer_record)
and printed when a checkpoint is resumed."""

PROJECT = "gpt2-megatron-deepspeed"
"""pyproject.toml's project name."""
VERSION = "0.6.0"
"""One minor version per landed wave: 0.1.0 the first, 0.6.0 the sixth (CHANGELOG.md)."""
