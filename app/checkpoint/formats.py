"""The registry of checkpoint formats: one name each, one `detect`, one reader and writer each.

Every tool that is given `--load DIR` (the converter, tools/generate.py, the server, the
lm-eval backend) calls `detect` and then `lookup(name).read`; the converter writes through
`lookup(name).write`. Formats, by their `--ckpt-format` names (app.checkpoint.names):

    hf          DIR/config.json (Hugging Face save_pretrained: GPT-2, Llama, Qwen3)  app.checkpoint.hf
    deepspeed   DIR/{tag}/mp_rank_XX_model_states.pt (ZeRO-3: zero_pp_rank_D_mp_rank_XX_model_states.pt),
                the tag named by DIR/latest (our runs: iter_0000100; DeepSpeed's own default:
                global_step100)                                             app.checkpoint.deepspeed
    torch       DIR/iter_0000100/mp_rank_XX[_YYY]/model_optim_rng.pt, the iteration named by
                DIR/latest_checkpointed_iteration.txt (Megatron-LM's legacy layout; ours; the
                converter's old name `megatron` is an alias)               app.checkpoint.megatron
    torch_dist  DIR/iter_0000100/{metadata.json, .metadata, __<rank>_0.distcp} (Megatron Core's
                --ckpt-format torch_dist; the small metadata.json names the backend)
                                                                          app.checkpoint.torch_dist

`detect` judges from file names (and torch_dist's small metadata.json); no checkpoint file is
opened. Reading a whole checkpoint gives a layout-free `ModelCheckpoint` (app.checkpoint.state);
writing takes one, so conversion is a read through one entry and a write through another.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

from app.checkpoint import CheckpointError, layouts, names
from app.checkpoint import deepspeed, hf, megatron, torch_dist
from app.checkpoint.names import DEEPSPEED, HF, TORCH, TORCH_DIST, canonical_format
from app.checkpoint.state import ModelCheckpoint

__all__ = ["Format", "REGISTRY", "detect", "detect_format", "lookup", "canonical_format",
           "TORCH", "TORCH_DIST", "DEEPSPEED", "HF"]


@dataclass(frozen=True)
class Format:
    """One checkpoint format: how to read it whole, describe its files, and (if we can) write it."""

    name: str
    read: Callable[..., ModelCheckpoint]
    """read(load, iteration=None, include_optimizer=False, make_vocab_size_divisible_by=128) ->
    the whole model under our names (the last argument matters only where the files do not
    fix the padded vocabulary: Hugging Face)."""
    describe: Callable[[str, Optional[names.Iteration]], List[str]]
    """describe(load, iteration) -> lines naming every stored key, shape and dtype."""
    write: Optional[Callable[[ModelCheckpoint, str, Any], str]] = None
    """write(source, directory, opts: app.checkpoint.convert.ConvertOptions) -> a phrase saying
    what was written; None: read only."""
    optimizer: bool = True
    """The format holds optimizer state (--include-optimizer can read or write it)."""


def _saved_vocabulary(read: Callable[..., ModelCheckpoint]) -> Callable[..., ModelCheckpoint]:
    """`read` as the registry calls it, for a format whose saved args fix the padded vocabulary."""
    def registry_read(load: str, iteration: Optional[names.Iteration] = None,
                      include_optimizer: bool = False,
                      make_vocab_size_divisible_by: int = 128) -> ModelCheckpoint:
        return read(load, iteration, include_optimizer)
    return registry_read


REGISTRY: Dict[str, Format] = {
    TORCH: Format(TORCH, _saved_vocabulary(megatron.read_megatron),
                  megatron.describe_megatron, megatron.write_converted),
    TORCH_DIST: Format(TORCH_DIST, _saved_vocabulary(torch_dist.read_torch_dist),
                       torch_dist.describe_torch_dist, torch_dist.write_converted),
    DEEPSPEED: Format(DEEPSPEED, _saved_vocabulary(deepspeed.read_deepspeed),
                      deepspeed.describe_deepspeed),
    HF: Format(HF, hf.read_converted, hf.describe_hf, hf.write_converted,
               optimizer=False),
}
READABLE = tuple(REGISTRY)
WRITABLE = tuple(name for name, entry in REGISTRY.items() if entry.write is not None)


def lookup(name: str, flag: str = "--input-format") -> Format:
    """The registry entry of format `name` (an alias such as `megatron` allowed)."""
    return REGISTRY[canonical_format(name, flag)]


def detect(load: str, iteration: Optional[names.Iteration] = None) -> Format:
    """The registry entry of the checkpoint in `load` (at `iteration` when given, else at the
    one its pointer file names). FileNotFoundError when `load` does not exist; CheckpointError,
    naming what the folder holds and what was looked for, otherwise."""
    return REGISTRY[detect_format(load, iteration)]


def detect_format(load: str, iteration: Optional[names.Iteration] = None) -> str:
    """'hf', 'deepspeed', 'torch' or 'torch_dist': the name of `detect(load, iteration)`."""
    if not os.path.isdir(load):
        raise FileNotFoundError(f"--load {load} does not exist (a checkpoint directory or a "
                                "Hugging Face model directory)")
    if os.path.isfile(os.path.join(load, "config.json")):
        return HF
    folder, _ = names.resolve_iteration(load, iteration)
    saved = layouts.inspect_directory(folder)  # the one file-name rule, shared with the engines
    if saved is not None:
        return saved.format
    entries = os.listdir(folder)
    raise CheckpointError(
        f"{folder} holds neither DeepSpeed's mp_rank_XX_model_states.pt, Megatron's "
        f"mp_rank_XX/model_optim_rng.pt nor a torch_dist checkpoint's metadata (it holds: "
        f"{_listing(entries)}): not a checkpoint this converter reads, or an unfinished save")


def _listing(entries: List[str], shown: int = 6) -> str:
    """The first `shown` names of a folder listing, sorted, for an error message."""
    entries = sorted(entries)
    if not entries:
        return "nothing"
    more = f" and {len(entries) - shown} more" if len(entries) > shown else ""
    return ", ".join(entries[:shown]) + more
