"""Which datasets each split builds, and for how many samples: Megatron-LM's rules
(`BlendedMegatronDatasetBuilder`), decided once from the run's `DataBlends` and the datasets'
index files, before anything is built. The dataset builder, `--dry-run` and
tools/prepare_cache.py all work from this plan, so they cannot disagree.

For each split with `n` samples needed (`app.config.samples_per_split`):

- one prefix without weights (--data-path p, or a per-split blend of one prefix, weighted or
  not): one dataset of `n` samples over the split's documents;
- weight/prefix pairs with normalised weights `w_d`: dataset d is built for
  `ceil(ceil(n * w_d) * (1 + 0.005))` samples (Megatron's mid-level surplus) and the split is
  a blend of `sum_d ceil(n * w_d)` samples in proportion to the weights;
- prefixes without weights: each dataset is built for exactly one epoch (no repeats) and the
  split is a blend of `min(n, total)` samples weighted by the datasets' sample counts.

With --data-path / --data-args-path every prefix's documents are divided by --split
(`split_document_ranges`: Megatron's split matrix); with per-split blends each dataset is used
whole. A document is a sequence of the .idx, as Megatron's GPTDataset counts them (the same
thing unless the data was preprocessed with --split-sentences). Weights are normalised in
float64 as Megatron normalises them (`index_builder.normalize`), so the sample counts are
Megatron's to the sample. A split with no samples needed, or no documents, is None; a dataset
of a blend whose part of the split is empty is left out of that blend (named in
`SplitPlan.left_out`; Megatron fails there).

`order_record` condenses a plan into what decides the order of each split's samples (the
checkpoint keeps it; app.training.checkpointing.data_order compares it on resume).

A plan is made for a sample order (`app.data.index_builder.SampleOrder`, Megatron Core's by
default): the order of this trainer's releases before 0.5.0 (app.data.legacy_order) counts
documents, splits them and normalises weights by its own rules, and a checkpoint of those
releases resumes on a plan made by them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from app.config.blends import SPLIT_NAMES, Blend, DataBlends
from app.data.index_builder import (MEGATRON_ORDER, SampleOrder, compute_num_epochs,
                                    separate_last_epoch)
from app.data.indexed_dataset import MMapIndexedDataset, data_file_path

ORDER_VERSION = MEGATRON_ORDER.version
"""The data-order record's version of new runs: 1 was this trainer's own order (one PCG64
permutation per epoch, its own blend interleaving: app.data.legacy_order), 2 is Megatron
Core's (app.data.index_builder)."""
MID_LEVEL_SURPLUS = 0.005
"""Megatron's default --mid-level-dataset-surplus: extra samples each blended dataset builds."""


@dataclass(frozen=True)
class PartPlan:
    """One dataset of a split: documents [start, end) of `prefix`, holding `tokens` tokens, with
    indices built for `num_samples` samples of `seq_length + 1` tokens."""

    prefix: str
    split: str
    documents: Tuple[int, int]
    tokens: int
    num_samples: int
    weight: Optional[float] = None
    """Its normalised blend weight; None when the blend weighs datasets by their size."""

    def epochs(self, seq_length: int) -> int:
        """Passes over the documents its indices hold (app.data.index_builder)."""
        return compute_num_epochs(self.tokens, seq_length, self.num_samples)

    def separate_last_epoch(self, seq_length: int) -> bool:
        return separate_last_epoch(self.tokens, seq_length, self.num_samples,
                                   self.epochs(seq_length))


@dataclass(frozen=True)
class SplitPlan:
    """One split: a single dataset (`blended` False, one part) or a blend of `size` samples
    over `parts` (weights from the parts, or their sample counts when `by_size`)."""

    name: str
    parts: Tuple[PartPlan, ...]
    size: int
    blended: bool
    by_size: bool = False
    left_out: Tuple[str, ...] = field(default_factory=tuple)
    """Prefixes of the blend whose part of this split has no documents or no weight."""
    order: SampleOrder = MEGATRON_ORDER

    def blend_inputs(self) -> List[float]:
        """The weights Megatron's BlendedDataset is given: the parts' normalised weights, or
        their sample counts when `by_size` (it normalises them again)."""
        return [float(p.num_samples) if self.by_size else float(p.weight or 0.0)
                for p in self.parts]

    def blend_weights(self) -> List[float]:
        """The weights the blend interleaves by: `blend_inputs` normalised (in float64, by the
        order's rule)."""
        return self.order.normalize(self.blend_inputs())


@dataclass
class DataPlan:
    """Every split's plan (None where a split builds nothing) and the datasets opened for it."""

    splits: Tuple[Optional[SplitPlan], Optional[SplitPlan], Optional[SplitPlan]]
    datasets: Dict[str, MMapIndexedDataset]
    blends: DataBlends
    seq_length: int
    order: SampleOrder = MEGATRON_ORDER


class _Opened(Dict[str, MMapIndexedDataset]):
    """The datasets a plan opened, by prefix, and how their .bin files are read."""

    def __init__(self, mmap_bin_files: bool) -> None:
        super().__init__()
        self.mmap_bin_files = mmap_bin_files


def _open(prefix: str, opened: Dict[str, MMapIndexedDataset]) -> MMapIndexedDataset:
    if prefix not in opened:
        indexed = MMapIndexedDataset(prefix, mmap=getattr(opened, "mmap_bin_files", True))
        if indexed.num_documents == 0 or len(indexed) == 0:
            raise ValueError(f"{data_file_path(prefix)} holds no documents (an empty input was "
                             "preprocessed?); re-run tools/preprocess_data.py on a non-empty "
                             "input or leave this prefix out of the data flags")
        opened[prefix] = indexed
    return opened[prefix]


def _part(indexed: MMapIndexedDataset, prefix: str, split: str, documents: Tuple[int, int],
          num_samples: Optional[int], seq_length: int, weight: Optional[float],
          order: SampleOrder) -> Optional[PartPlan]:
    """The part, or None when its documents hold no sample. `num_samples` None: one epoch."""
    start, end = documents
    if end <= start:
        return None
    tokens = int(order.documents(indexed)[1][start:end].sum(dtype=np.int64))
    samples = (tokens - 1) // seq_length if num_samples is None else num_samples
    if samples <= 0 or tokens <= 0:
        return None
    return PartPlan(prefix, split, documents, tokens, samples, weight)


def _plan_split(blend: Blend, name: str, needed: int, ranges: Callable[[str], Tuple[int, int]],
                opened: Dict[str, MMapIndexedDataset], seq_length: int,
                single_when_one: bool, order: SampleOrder) -> Optional[SplitPlan]:
    """One split's plan by the rules of the module docstring (None when nothing is built)."""
    if needed <= 0:
        return None
    weights = order.blend_weights(blend)
    if len(blend.prefixes) == 1 and (weights is None or single_when_one):
        prefix = blend.prefixes[0]
        part = _part(_open(prefix, opened), prefix, name, ranges(prefix), needed, seq_length,
                     None, order)
        return None if part is None else SplitPlan(name, (part,), needed, blended=False,
                                                   order=order)
    parts, left_out = [], []
    for d, prefix in enumerate(blend.prefixes):
        weight = None if weights is None else weights[d]
        count = (None if weight is None else
                 int(math.ceil(math.ceil(needed * weight) * (1 + MID_LEVEL_SURPLUS))))
        part = (None if count == 0 else
                _part(_open(prefix, opened), prefix, name, ranges(prefix), count, seq_length,
                      weight, order))
        if part is None:
            left_out.append(prefix)
        else:
            parts.append(part)
    if not parts:
        return None
    if weights is None:
        size = min(needed, sum(p.num_samples for p in parts))
    else:
        size = sum(int(math.ceil(needed * w)) for w in weights)
    return SplitPlan(name, tuple(parts), size, blended=True, by_size=weights is None,
                     left_out=tuple(left_out), order=order)


def plan_datasets(blends: DataBlends, split: str, num_samples: Sequence[int],
                  seq_length: int, mmap_bin_files: bool = True,
                  order: SampleOrder = MEGATRON_ORDER) -> DataPlan:
    """The plan of every split for `num_samples` (train, valid, test) samples in `order`;
    opens (and so validates) every dataset of the blends, reading their .bin files through
    memory maps or, with `mmap_bin_files` False (--no-mmap-bin-files), file reads. Raises
    ValueError naming a bad file."""
    opened: Dict[str, MMapIndexedDataset] = _Opened(mmap_bin_files)
    plans: List[Optional[SplitPlan]] = []

    def count(prefix: str) -> int:
        return int(order.documents(_open(prefix, opened))[1].size)

    if blends.per_split is None:
        assert blends.blend is not None
        for i, name in enumerate(SPLIT_NAMES):
            def ranges(prefix: str, i: int = i) -> Tuple[int, int]:
                bounds = order.split_ranges(count(prefix), split)[i]
                return (0, 0) if bounds is None else bounds
            plans.append(_plan_split(blends.blend, name, num_samples[i], ranges, opened,
                                     seq_length, False, order))
    else:
        for i, name in enumerate(SPLIT_NAMES):
            blend = blends.per_split[i]
            whole = lambda prefix: (0, count(prefix))  # noqa: E731
            plans.append(None if blend is None else _plan_split(
                blend, name, num_samples[i], whole, opened, seq_length, True, order))
    return DataPlan(tuple(plans), opened, blends, seq_length, order)  # type: ignore[arg-type]


def order_record(plan: DataPlan, seed: int) -> Dict[str, Any]:
    """What decides the order of the training and validation samples, as plain values (saved
    in checkpoints): the version of the ordering rules (the plan's order: 2 is Megatron Core's,
    1 this trainer's before 0.5.0), the seed, the sequence length, and per split each dataset's
    prefix, blend weight, documents, tokens, epochs and whether its last epoch is shuffled
    apart, plus (not deciding the order) the split's sample count. Within a dataset and a blend the first k
    samples do not depend on how many are built beyond them, so only these matter."""
    s = plan.seq_length
    splits: Dict[str, Any] = {}
    for split_plan in plan.splits[:2]:
        if split_plan is None:
            continue
        weights = split_plan.blend_weights() if split_plan.blended else [None]
        splits[split_plan.name] = {
            "samples": split_plan.size, "blended": split_plan.blended,
            "parts": [{"prefix": p.prefix, "weight": w, "documents": list(p.documents),
                       "tokens": p.tokens, "epochs": p.epochs(s),
                       "separate_last_epoch": p.separate_last_epoch(s)}
                      for p, w in zip(split_plan.parts, weights)]}
    return {"version": plan.order.version, "order": plan.order.index_version, "seed": int(seed),
            "seq_length": int(s), "source": plan.blends.source, "splits": splits}
