"""What a whole-model writer is asked to write: a typed request, never a tool's command line.

Every format's writer (app.checkpoint.formats: `Format.write(source, directory, request)`)
takes a `WriteRequest`; whoever parses flags builds one (the converter from its
ConvertOptions, app.checkpoint.convert; a test or a benchmark directly). A writer reads the
fields that apply to its format and ignores the others: the layout only places the legacy
format's files (torch_dist and DeepSpeed reshard on load, a Hugging Face directory has none),
the shard size and the tokenizer only shape a Hugging Face directory.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from app.checkpoint.state import Iteration, ModelCheckpoint


@dataclass(frozen=True)
class TokenizerSource:
    """The tokenizer a Hugging Face export carries, when not the source's own
    (app.checkpoint.hf.tokenizer.pick_tokenizer): GPT-2 BPE files (`vocab_file` with
    `merge_file`), or `tokenizer_model` (a Hugging Face tokenizer directory or cached Hub name,
    or a SentencePiece .model file). All None: the source directory's files, else the
    tokenizer the checkpoint's args name."""

    vocab_file: Optional[str] = None
    merge_file: Optional[str] = None
    tokenizer_model: Optional[str] = None


@dataclass(frozen=True)
class WriteRequest:
    """What to write of a whole `ModelCheckpoint` (app.checkpoint.state)."""

    tensor_model_parallel_size: int = 1
    """Tensor-parallel size of the written files (legacy format only)."""
    pipeline_model_parallel_size: int = 1
    """Pipeline stages of the written files (legacy format only)."""
    expert_model_parallel_size: int = 1
    """Expert-parallel size of the written files (legacy format only; an MoE model's)."""
    expert_tensor_parallel_size: Optional[int] = None
    """Expert tensor-parallel size (legacy format only: None or the tensor-parallel size)."""
    params_dtype: Optional[str] = None
    """'fp32', 'fp16' or 'bf16': the dtype of the written weights; None keeps the source's."""
    iteration: Optional[Iteration] = None
    """The iteration written (an int or 'release'); None: 'release' for weights only, the
    source's own iteration with `include_optimizer`."""
    include_optimizer: bool = False
    """Also write the optimizer state, LR schedule and RNG states (formats that hold them)."""
    max_shard_size: str = "2GB"
    """Largest safetensors file of a Hugging Face directory ('2GB', '500MiB', bytes)."""
    tokenizer: TokenizerSource = field(default_factory=TokenizerSource)
    """The tokenizer a Hugging Face directory carries."""
    metrics_file: Optional[str] = None
    """A run's --metrics-file JSONL: the Hugging Face model card reports its last validation
    loss."""
    model_path: Optional[str] = None
    """The path the Hugging Face model card's examples load (default: the written directory)."""

    def iteration_written(self, source: ModelCheckpoint) -> Iteration:
        """The iteration the written checkpoint carries (see `iteration`)."""
        if self.iteration is not None:
            return self.iteration
        return source.iteration if self.include_optimizer else "release"
