"""Indexed datasets made for tests: documents whose tokens say where they came from."""
import numpy as np

from app.data import MMapIndexedDatasetBuilder


def write_dataset(prefix, doc_lengths, first_token=0):
    """Documents whose tokens are consecutive integers: token value = global token position."""
    builder = MMapIndexedDatasetBuilder(prefix + ".bin", np.int32)
    pos = first_token
    for n in doc_lengths:
        builder.add_item(np.arange(pos, pos + n))
        builder.end_document()
        pos += n
    builder.finalize(prefix + ".idx")
    return prefix


class IndexSamples:
    """A map-style dataset of 64 samples whose text is its index, five times."""
    def __len__(self):
        return 64

    def __getitem__(self, index):
        return {"text": [index] * 5}
