"""The layout-free checkpoint every reader produces and every writer consumes, plus the
progress report and the write-to-temporary-then-rename discipline of the converter."""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, TextIO, Tuple, Union

import torch

from app.utils.fileio import tmp_path
from app.utils.progress import progress

logger = logging.getLogger(__name__)

Iteration = Union[int, str]


@dataclass
class OptimizerState:
    """Optimizer state of the whole model, unsharded: per parameter name its per-element states
    (full shape, fp32: AdamW's `exp_avg` and `exp_avg_sq`, or the `momentum_buffer` of SGD and
    of Muon's matrices) and AdamW's `step`; the hyper-parameters of the param groups ('decay',
    'no_decay', and 'muon' first for Muon) as the torch optimizer stores them, without their
    'params'; and the loss scaler's state when the source trained in fp16/bf16."""

    per_param: Dict[str, Dict[str, torch.Tensor]]
    group_hparams: Dict[str, Dict[str, Any]]
    grad_scaler: Optional[Dict[str, Any]] = None
    """The loss scaler's state of a mixed-precision run (kept for a half-precision target)."""


@dataclass
class ModelCheckpoint:
    """A whole GPT-2 checkpoint, independent of how it was sharded.

    `weights`: full tensors under our flat names (embeddings, layers, final LayerNorm; no tied
    head copy); the word embeddings keep the padded rows they were stored with. `args`: Megatron's
    args Namespace (model shape, `vocab_size` = tokenizer size when known, data position).
    `rng_states`: the source's per-rank RNG states keyed by (tp_rank, pp_rank), when it had them.
    """

    args: argparse.Namespace
    weights: Dict[str, torch.Tensor]
    iteration: Iteration = "release"
    optimizer: Optional[OptimizerState] = None
    lr_scheduler: Optional[Dict[str, Any]] = None
    rng_states: Dict[Tuple[int, int], Any] = field(default_factory=dict)
    source_layout: Tuple[int, int] = (1, 1)
    tokenizer_files: Dict[str, str] = field(default_factory=dict)
    """Tokenizer files that travel with the model ({'vocab.json': path, 'merges.txt': path})."""

    @property
    def num_layers(self) -> int:
        return int(self.args.num_layers)


class Progress:
    """Tensors converted, on stderr through app.utils.progress: the count (of `total` when
    known) with rate and ETA, plus MiB and MiB/s; `report(final=True)` prints the last line."""

    def __init__(self, what: str, total: Optional[int] = None,
                 stream: Optional[TextIO] = None) -> None:
        self.bytes = 0
        self.start = time.perf_counter()
        self.bar = progress(total=total, desc=f"[convert] {what}", unit=" tensors", stream=stream)

    def add(self, tensor: torch.Tensor) -> None:
        self.bytes += tensor.numel() * tensor.element_size()
        mib, elapsed = self.bytes / 2**20, max(time.perf_counter() - self.start, 1e-9)
        self.bar.set_postfix_str(f"{mib:.1f} MiB, {mib / elapsed:.1f} MiB/s", refresh=False)
        self.bar.update(1)

    def report(self, final: bool = False) -> None:
        if final:
            self.bar.close()
        else:
            self.bar.refresh()


@contextlib.contextmanager
def staged_directory(target: str) -> Iterator[str]:
    """Yield a temporary sibling of `target` (`.<name>` under `fileio.tmp_path`'s scheme) to
    write into; rename it to `target` on success.

    A failure removes the temporary directory, so `target` is never left half written. An
    existing non-empty `target` is refused (nothing is overwritten).
    """
    target = os.path.abspath(target)
    if os.path.isdir(target) and os.listdir(target):
        raise FileExistsError(f"--save {target} exists and is not empty; choose a new directory "
                              "or remove it first")
    if os.path.exists(target) and not os.path.isdir(target):
        raise FileExistsError(f"--save {target} exists and is a file")
    parent = os.path.dirname(target)
    os.makedirs(parent, exist_ok=True)
    tmp = tmp_path(os.path.join(parent, "." + os.path.basename(target)))
    shutil.rmtree(tmp, ignore_errors=True)  # a dead process's with our pid
    os.makedirs(tmp)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if os.path.isdir(target):
        os.rmdir(target)  # empty (checked above)
    os.replace(tmp, target)


def cast_weights(weights: Dict[str, torch.Tensor], dtype: Optional[torch.dtype]
                 ) -> Dict[str, torch.Tensor]:
    """`weights` with floating tensors cast to `dtype` (None keeps them)."""
    if dtype is None:
        return weights
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in weights.items()}


def describe(obj: Any, indent: int = 0, out: Optional[List[str]] = None) -> List[str]:
    """Lines describing a nested checkpoint object: keys, tensor shapes/dtypes, scalars."""
    out = [] if out is None else out
    pad = "  " * indent
    if isinstance(obj, dict):
        for key, value in obj.items():
            if isinstance(value, (dict, list, tuple)) and value and not _is_leaf_list(value):
                out.append(f"{pad}{key}:")
                describe(value, indent + 1, out)
            else:
                out.append(f"{pad}{key}: {_leaf(value)}")
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            if isinstance(value, (dict, list, tuple)) and value and not _is_leaf_list(value):
                out.append(f"{pad}[{i}]:")
                describe(value, indent + 1, out)
            else:
                out.append(f"{pad}[{i}]: {_leaf(value)}")
    else:
        out.append(f"{pad}{_leaf(obj)}")
    return out


def _is_leaf_list(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and all(
        isinstance(v, (int, float, str, bool)) for v in value)


def _leaf(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor {list(value.shape)} {str(value.dtype).replace('torch.', '')}"
    if isinstance(value, argparse.Namespace):
        return "Namespace(" + ", ".join(f"{k}={v!r}" for k, v in sorted(vars(value).items())) + ")"
    text = repr(value)
    return text if len(text) <= 200 else text[:200] + "..."
