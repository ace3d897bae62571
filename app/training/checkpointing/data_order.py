"""No silent change of data order on resume.

A checkpoint keeps the run's data-order record (`app.data.plan.order_record`: seed, sequence
length and, for the training and validation splits, every dataset's prefix, blend weight,
documents, tokens, epochs and last-epoch shuffle). A resumed run continues from the saved
consumed-sample counts, which only mean the same samples when that record is unchanged:
`check_data_order` compares the saved record with this run's and refuses the resume, naming
what changed, unless --allow-data-order-change says the change is intended.

A dataset is known by its file name (as the sample-index cache knows it), documents and
tokens, not by the folder it is read from: the same files named by a relative instead of an
absolute path, or copied to another disk, keep the order (a note names the new place).

Which order a resume reads (`resume_order`) is the checkpoint's: the version its record names
(1: this trainer's order before 0.5.0, read by app.data.legacy_order; 2: Megatron Core's), or,
for a checkpoint of this trainer's releases before 0.5.0 that records none (0.1.0 to 0.3.0,
and 0.4.0's torch_dist checkpoints), the order of those releases (1), recognised by the marks
of their args (app.checkpoint.model_args.checkpoint_writer). A checkpoint of another trainer
(Megatron-LM) continues in Megatron Core's order, and new runs start in it. Only
--allow-data-order-change switches a resumed run to Megatron Core's order (from the saved
sample counts on); the log says which order a resume reads and why.

A changed sample count alone (a longer --train-iters, another --eval-interval, a batch-size
schedule, a data-parallel size) is accepted when every dataset keeps its epochs: the first
samples of a dataset and of a blend do not depend on how many are built beyond them. It is
named in a note.
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Tuple

from app.checkpoint import CheckpointError
from app.checkpoint.model_args import CheckpointWriter
from app.data.legacy_order import sample_order
from app.data.plan import ORDER_VERSION

ALLOW_FLAG = "--allow-data-order-change"
_WHY = {
    "prefixes": "the data flags (--data-path, --*-data-path, --data-args-path, "
                "--per-split-data-args-path)",
    "weight": "the blend weights",
    "documents": "--split, or the dataset's document count",
    "tokens": "the dataset's content (rewritten by tools/preprocess_data.py?)",
    "epochs": "the sample count, which needs another number of epochs of it (--train-iters, "
              "--global-batch-size or the batch-size schedule, --eval-interval, --eval-iters)",
    "separate_last_epoch": "the sample count, which changes how its last epoch is shuffled",
}


_VERSIONS = {2: "Megatron Core's order: GPTDataset's document, sample and shuffle indices, "
                "BlendedDataset's interleaving, Megatron's split matrix",
             1: "this trainer's order before 0.5.0"}


def _name(version: int) -> str:
    try:
        return sample_order(version).name
    except ValueError:
        return f"data-order version {version} (unknown to this code)"


def resume_order(saved: Optional[Dict[str, Any]], writer: CheckpointWriter,
                 allow_change: bool) -> Tuple[int, str]:
    """(the data-order version a resume reads, why, for the log) for a checkpoint whose record
    is `saved` (None: it has none) and whose writer is `writer` (module docstring)."""
    new = ORDER_VERSION
    if saved is not None:
        version = int(saved.get("version", 1))
        source = f"the checkpoint records data-order version {version}"
    elif writer.ours and writer.before in ("0.4.0", "0.5.0"):
        version, source = 1, (f"the checkpoint records no data order; its writer, "
                              f"{writer.describe()}, read that order")
    else:
        return new, (f"{_name(new)} (the checkpoint records no data order and was not written "
                     "by this trainer before 0.5.0)")
    if version == new:
        return version, f"{_name(version)} ({source})"
    if allow_change:
        return new, f"{_name(new)}, by {ALLOW_FLAG} ({source}: {_name(version)})"
    return version, (f"{_name(version)} ({source}; {ALLOW_FLAG} would continue in {_name(new)} "
                     "from the saved sample counts on)")


def _dataset_name(prefix: str) -> str:
    """A dataset's name: its prefix without the folder (`/a/b/x_text_document` -> x_text_document)."""
    return os.path.basename(os.path.normpath(prefix))


def _part_changes(split: str, old: Dict[str, Any], new: Dict[str, Any]) -> List[str]:
    changes = []
    for key in ("weight", "documents", "tokens", "epochs", "separate_last_epoch"):
        if old.get(key) != new.get(key):
            changes.append(f"{split} data {new['prefix']}: {key} {old.get(key)} -> "
                           f"{new.get(key)} ({_WHY[key]})")
    return changes


def _split_changes(name: str, old: Optional[Dict[str, Any]], new: Optional[Dict[str, Any]]
                   ) -> Tuple[List[str], List[str]]:
    """(changes of the order, notes) of one split present in both records."""
    old_prefixes = [p["prefix"] for p in old["parts"]]
    new_prefixes = [p["prefix"] for p in new["parts"]]
    if ([_dataset_name(p) for p in old_prefixes] != [_dataset_name(p) for p in new_prefixes]
            or old.get("blended") != new.get("blended")):
        return [f"{name} data: {' '.join(old_prefixes)} -> {' '.join(new_prefixes)} "
                f"({_WHY['prefixes']})"], []
    changes = [c for o, n in zip(old["parts"], new["parts"]) for c in _part_changes(name, o, n)]
    notes = []
    if old_prefixes != new_prefixes and not changes:
        notes.append(f"{name} data read from {' '.join(new_prefixes)}, saved as "
                     f"{' '.join(old_prefixes)}: the same file names, documents and tokens, so "
                     "the order of the samples is unchanged")
    if old.get("samples") != new.get("samples") and not changes:
        notes.append(f"{name} samples {old.get('samples')} -> {new.get('samples')}: the order "
                     "of the samples is unchanged (every dataset keeps its epochs)")
    return changes, notes


def order_changes(saved: Dict[str, Any], current: Dict[str, Any],
                  consumed: Dict[str, int]) -> Tuple[List[str], List[str]]:
    """(what changes the order of the samples, notes on what changed without changing it)
    between two data-order records (pure). Only a split the saved run has read from
    (`consumed[name]` > 0) and this run reads has an order to keep."""
    changes: List[str] = []
    if saved.get("version", 1) != current.get("version", 1) and any(
            consumed.get(name, 0) > 0 for name in ("train", "valid")):
        changes.append(
            f"the data-order rules, version {saved.get('version', 1)} -> "
            f"{current.get('version', 1)} ({_VERSIONS.get(current.get('version'), 'newer')}; "
            "the same consumed-sample counts name other samples, docs/data.md)")
    for key, flag in (("mock_data", "--mock-data"), ("seed", "--seed"),
                      ("seq_length", "--seq-length")):
        if saved.get(key) != current.get(key):
            keep = (f"{'pass' if saved.get(key) else 'drop'} {flag}" if key == "mock_data"
                    else f"pass {flag} {saved.get(key)}")
            changes.append(f"{flag} {saved.get(key)} -> {current.get(key)} ({keep} to keep it)")
    notes: List[str] = []
    for name in ("train", "valid"):
        old = saved.get("splits", {}).get(name)
        new = current.get("splits", {}).get(name)
        if old is None or new is None or consumed.get(name, 0) <= 0:
            continue
        c, n = _split_changes(name, old, new)
        changes += c
        notes += n
    return changes, notes


def check_data_order(saved: Optional[Dict[str, Any]], current: Dict[str, Any], where: str,
                     consumed: Dict[str, int], allow_change: bool) -> List[str]:
    """Refuse (CheckpointError) a resume whose data order differs from the checkpoint's at
    `where`, which has read `consumed` {"train": n, "valid": m} samples, unless
    `allow_change`; returns the lines to log (notes, or the accepted changes). A checkpoint
    without a record (older, or Megatron-LM's) cannot be checked: a note says so."""
    if saved is None:
        return [f"{where} records no data order (saved by this trainer before 0.5.0 or by "
                "another trainer): the data order of this resume cannot be checked"]
    changes, notes = order_changes(saved, current, consumed)
    if changes and not allow_change:
        raise CheckpointError(
            f"resuming from {where} would change the order of the data it continues "
            f"(consumed samples count positions in that order): {'; '.join(changes)}. Resume "
            f"with the checkpoint's data settings, or pass {ALLOW_FLAG} if the change is "
            "intended (the run then reads the new order from the saved sample counts on)")
    if changes:
        return [f"{ALLOW_FLAG}: the data order changes on resume: {'; '.join(changes)}"] + notes
    return notes
