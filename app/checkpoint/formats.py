"""The registry of checkpoint formats: one name each, one detection, one reader and writer each.

Every tool that is given `--load DIR` (the converter, tools/generate.py, the server, the
lm-eval backend) calls `detect` once and hands what it found (a `SavedCheckpoint`:
format, iteration folder, iteration, saved layout) to `read`, which reads through that format's
entry; the converter writes through `lookup(name).write` with a typed `WriteRequest`
(app.checkpoint.request). Formats, by their `--ckpt-format` names (app.checkpoint.names):

    hf          DIR/config.json (Hugging Face save_pretrained: GPT-2, Llama, Qwen3, one adapter
                per model family)                                           app.checkpoint.hf
    deepspeed   DIR/{tag}/mp_rank_XX_model_states.pt (ZeRO-3: zero_pp_rank_D_mp_rank_XX_model_states.pt),
                the tag named by DIR/latest (our runs: iter_0000100; DeepSpeed's own default:
                global_step100)                                             app.checkpoint.deepspeed
    torch       DIR/iter_0000100/mp_rank_XX[_YYY]/model_optim_rng.pt, the iteration named by
                DIR/latest_checkpointed_iteration.txt (Megatron-LM's legacy layout; ours; the
                converter's old name `megatron` is an alias)               app.checkpoint.legacy
    torch_dist  DIR/iter_0000100/{metadata.json, .metadata, __<rank>_0.distcp} (Megatron Core's
                --ckpt-format torch_dist; the small metadata.json names the backend)
                                                                          app.checkpoint.torch_dist

Detection (app.checkpoint.saved_layout.detect) judges from file names (and torch_dist's small
metadata.json); no checkpoint file is opened. Reading a whole checkpoint gives a layout-free
`ModelCheckpoint` (app.checkpoint.state); writing takes one, so conversion is a read through
one entry and a write through another.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

from app.checkpoint import deepspeed, hf
from app.checkpoint.legacy import whole as legacy
from app.checkpoint.names import DEEPSPEED, HF, TORCH, TORCH_DIST, Iteration, canonical_format
from app.checkpoint.request import WriteRequest
from app.checkpoint.saved_layout import SavedCheckpoint
from app.checkpoint.saved_layout import detect as detect_checkpoint
from app.checkpoint.state import ModelCheckpoint
from app.checkpoint.torch_dist import whole as torch_dist

__all__ = ["Format", "REGISTRY", "SavedCheckpoint", "detect", "detect_format", "lookup", "read",
           "canonical_format", "TORCH", "TORCH_DIST", "DEEPSPEED", "HF"]


@dataclass(frozen=True)
class Format:
    """One checkpoint format: how to read it whole, describe its files, and (if we can) write it."""

    name: str
    read: Callable[..., ModelCheckpoint]
    """read(saved: SavedCheckpoint, include_optimizer=False, make_vocab_size_divisible_by=128)
    -> the whole model under our names (the last argument matters only where the files do not
    fix the padded vocabulary: Hugging Face)."""
    describe: Callable[[SavedCheckpoint], List[str]]
    """describe(saved) -> lines naming every stored key, shape and dtype."""
    write: Optional[Callable[[ModelCheckpoint, str, WriteRequest], str]] = None
    """write(source, directory, request) -> a phrase saying what was written; None: read
    only."""
    optimizer: bool = True
    """The format holds optimizer state (--include-optimizer can read or write it)."""
    placed: bool = False
    """The writer places its files at the request's TP x PP (the others load at any layout)."""


def _saved_vocabulary(read: Callable[..., ModelCheckpoint]) -> Callable[..., ModelCheckpoint]:
    """`read` as the registry calls it, for a format whose saved args fix the padded vocabulary."""
    def registry_read(saved: SavedCheckpoint, include_optimizer: bool = False,
                      make_vocab_size_divisible_by: int = 128) -> ModelCheckpoint:
        return read(saved, include_optimizer)
    return registry_read


REGISTRY: Dict[str, Format] = {
    TORCH: Format(TORCH, _saved_vocabulary(legacy.read_legacy), legacy.describe_legacy,
                  legacy.write_legacy, placed=True),
    TORCH_DIST: Format(TORCH_DIST, _saved_vocabulary(torch_dist.read_torch_dist),
                       torch_dist.describe_torch_dist, torch_dist.write_torch_dist),
    DEEPSPEED: Format(DEEPSPEED, _saved_vocabulary(deepspeed.read_deepspeed),
                      deepspeed.describe_deepspeed),
    HF: Format(HF, hf.read_hf, hf.describe_hf, hf.write_hf, optimizer=False),
}
READABLE = tuple(REGISTRY)
WRITABLE = tuple(name for name, entry in REGISTRY.items() if entry.write is not None)


def lookup(name: str, flag: str = "--input-format") -> Format:
    """The registry entry of format `name` (an alias such as `megatron` allowed)."""
    return REGISTRY[canonical_format(name, flag)]


def detect(load: str, iteration: Optional[Iteration] = None) -> SavedCheckpoint:
    """What `load` holds (at `iteration` when given, else at the one its pointer file names):
    app.checkpoint.saved_layout.detect, the one detection a load makes."""
    return detect_checkpoint(load, iteration)


def detect_format(load: str, iteration: Optional[Iteration] = None) -> str:
    """'hf', 'deepspeed', 'torch' or 'torch_dist': the format `detect(load, iteration)` found."""
    return detect(load, iteration).format


def read(saved: SavedCheckpoint, include_optimizer: bool = False,
         make_vocab_size_divisible_by: int = 128) -> ModelCheckpoint:
    """The whole checkpoint `saved` (what `detect` found), read by its format's entry."""
    return REGISTRY[saved.format].read(saved, include_optimizer, make_vocab_size_divisible_by)
