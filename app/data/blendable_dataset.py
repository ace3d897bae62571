"""Weighted, deterministic blend of several datasets (Megatron's BlendableDataset semantics)."""
from __future__ import annotations

from typing import Dict, Sequence

import numpy as np

from app.data.index_builder import blend_indices


class BlendableDataset:
    """`size` samples drawn from `datasets` in proportion to `weights`, in a fixed interleaving.

    Sample i is `datasets[dataset_index[i]][dataset_sample_index[i]]`; after any prefix of the
    samples each dataset's share equals its weight to within one sample.
    """

    def __init__(self, datasets: Sequence, weights: Sequence[float], size: int) -> None:
        if len(datasets) != len(weights) or not datasets:
            raise ValueError(f"need one weight per dataset, got {len(weights)} weights for "
                             f"{len(datasets)} datasets")
        if len(datasets) > np.iinfo(np.int16).max:
            raise ValueError(f"at most {np.iinfo(np.int16).max} datasets can be blended")
        self.datasets = list(datasets)
        self.weights = np.asarray(weights, dtype=np.float64) / float(np.sum(weights))
        self.size = int(size)
        self.dataset_index, self.dataset_sample_index = blend_indices(self.weights, self.size)
        for d, ds in enumerate(self.datasets):
            used = self.dataset_sample_index[self.dataset_index == d]
            if used.size and int(used.max()) >= len(ds):
                raise ValueError(f"blended dataset {d} needs {int(used.max()) + 1} samples but "
                                 f"has {len(ds)}")

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, idx: int) -> Dict[str, np.ndarray]:
        d = int(self.dataset_index[idx])
        return self.datasets[d][int(self.dataset_sample_index[idx])]
