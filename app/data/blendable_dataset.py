"""Weighted, deterministic blend of several datasets in Megatron Core's order (BlendedDataset), or
in the order of this trainer's releases before 0.5.0 (app.data.legacy_order)."""
from __future__ import annotations

import os
from typing import Callable, Dict, Optional, Sequence

import numpy as np

from app.data.index_builder import MEGATRON_ORDER, SampleOrder
from app.data.index_cache import IndexCache, load_or_build

BLEND_KINDS = ("dataset_index", "dataset_sample_index")


class BlendableDataset:
    """`size` samples drawn from `datasets` in proportion to `weights`, in `order`'s
    interleaving (Megatron's: app.data.index_builder.blend_indices; `size` None: exactly
    `weights[d]` samples of dataset d, the weights then being sample counts,
    `exhaustive_blend_indices`).

    Sample i is `datasets[dataset_index[i]][dataset_sample_index[i]]`; after any prefix of the
    samples each dataset's share equals its weight to within one sample. With `cache_dir` the
    interleaving is cached there (app.data.index_cache; the datasets must carry their own
    `cache`, whose files the entry's key names) and `built` says whether this call built it.
    """

    def __init__(self, datasets: Sequence, weights: Sequence[float], size: Optional[int],
                 name: str = "blend", cache_dir: Optional[str] = None, is_builder: bool = True,
                 barrier: Callable[[], None] = lambda: None,
                 order: SampleOrder = MEGATRON_ORDER) -> None:
        if len(datasets) != len(weights) or not datasets:
            raise ValueError(f"need one weight per dataset, got {len(weights)} weights for "
                             f"{len(datasets)} datasets")
        if len(datasets) > np.iinfo(np.int16).max:
            raise ValueError(f"at most {np.iinfo(np.int16).max} datasets can be blended")
        self.datasets = list(datasets)
        if size is None:
            self.weights = [int(w) for w in weights]
            self.size = sum(self.weights)
        else:
            self.weights = order.normalize(weights)
            self.size = int(size)
        build = lambda: order.blend(weights, size)  # noqa: E731
        self.built = True
        if cache_dir is None:
            self.dataset_index, self.dataset_sample_index = build()
        else:
            desc = {"version": order.blend_version, "split": name, "size": self.size,
                    "weights": list(self.weights), "exhaustive": size is None,
                    "datasets": [os.path.basename(ds.cache.description_file)
                                 for ds in self.datasets]}
            self.cache = IndexCache(cache_dir, f"blend_{name}", desc, BLEND_KINDS)
            (self.dataset_index, self.dataset_sample_index), self.built = load_or_build(
                self.cache, build, is_builder, barrier,
                f"{name} blend of {len(self.datasets)} datasets ({self.size} samples)")
        # dataset d's samples are taken in order 0, 1, ...: it needs as many as it is picked
        needed = np.bincount(self.dataset_index, minlength=len(self.datasets))
        for d, ds in enumerate(self.datasets):
            if int(needed[d]) > len(ds):
                raise ValueError(f"blended dataset {d} needs {int(needed[d])} samples but "
                                 f"has {len(ds)}")

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> Dict[str, np.ndarray]:
        d = int(self.dataset_index[idx])
        return self.datasets[d][int(self.dataset_sample_index[idx])]
