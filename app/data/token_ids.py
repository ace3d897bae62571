"""Token-id lists as the flat arrays the indexed-dataset writer takes (every tokenizer's
`encode_flat`)."""
from __future__ import annotations

from typing import Sequence, Tuple

import numpy as np


def flatten_ids(ids: Sequence[Sequence[int]]) -> Tuple[np.ndarray, np.ndarray]:
    """(tokens uint32 [total], lengths int64 [len(ids)]) of token-id lists, back to back."""
    lengths = np.fromiter((len(x) for x in ids), dtype=np.int64, count=len(ids))
    flat = np.fromiter((t for x in ids for t in x), dtype=np.uint32, count=int(lengths.sum()))
    return flat, lengths
