"""The checkpoint an inference tool runs: one declaration of --load, the tokenizer files and the
layout, shared by tools/generate.py, tools/evaluate.py, tools/run_text_generation_server.py (as
flags) and the lm-evaluation-harness backend (as --model_args keys, the same names as the dests).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional, Tuple

from app.config.options import PathOption, option


LOAD = PathOption("dir", "a checkpoint directory (a run's --save) or a Hugging Face "
                          "save_pretrained directory")
VOCAB = PathOption("file", "the GPT-2 BPE vocab.json (with --merge-file its merges.txt)")
MERGES = PathOption("file", "the GPT-2 BPE merges.txt (with --vocab-file its vocab.json)")
TOKENIZER_MODEL = PathOption("any", "the directory holding tokenizer.json, a Hub name in the "
                                    "local cache, or the SentencePiece .model file",
                             hub=True)
"""What the tools' tokenizer and checkpoint path flags must name (app.config.options.check_path)."""


@dataclass(kw_only=True)
class InferenceLoadConfig:
    """A checkpoint to run (ours at any TP/PP, a DeepSpeed one or a Hugging Face directory), its
    tokenizer (GPT-2 BPE files, or a tokenizer.json directory / SentencePiece model), and the
    layout to run it at."""

    FLAG_GROUP: ClassVar[Tuple[str, str]] = (
        "checkpoint", "the model to load, its tokenizer and the layout to run it at")

    load: str = option("--load", required=True, path=LOAD,
                       help="checkpoint directory or Hugging Face directory")
    vocab_file: Optional[str] = option("--vocab-file", default=None, path=VOCAB,
                                       help="GPT-2 vocab.json (default: the HF directory's)")
    merge_file: Optional[str] = option("--merge-file", default=None, path=MERGES,
                                       help="GPT-2 merges.txt (default: the HF directory's)")
    tokenizer_model: Optional[str] = option(
        "--tokenizer-model", default=None, path=TOKENIZER_MODEL,
        help="a directory with tokenizer.json (or a SentencePiece .model file) to use instead of "
             "the tokenizer the checkpoint names (default: the checkpoint's, or the HF "
             "directory's own files)")
    tensor_model_parallel_size: Optional[int] = option(
        "--tensor-model-parallel-size", default=None,
        help="TP degree to run at (default: the checkpoint's when the world is its TP x PP, "
             "else 1)")
    pipeline_model_parallel_size: Optional[int] = option(
        "--pipeline-model-parallel-size", default=None,
        help="PP degree to run at (default: the checkpoint's when the world is its TP x PP, "
             "else 1)")
