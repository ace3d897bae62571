"""MMapIndexedDataset / Builder: round trip, compatibility with an independent implementation of
the published format, and fix-it errors for damaged files."""
import os
import struct

import numpy as np
import pytest

from app.data.indexed_dataset import (DatasetFormatError, MMapIndexedDataset,
                                      MMapIndexedDatasetBuilder, best_fitting_dtype)

# --- independent implementation, written from the format description only -------------------
CODES = {1: "<u1", 2: "<i1", 3: "<i2", 4: "<i4", 5: "<i8", 6: "<f8", 7: "<f4", 8: "<u2"}


def reference_write(prefix, documents, code):
    """documents: list of documents, each a list of sequences (lists of ints)."""
    fmt = CODES[code]
    seqs = [s for doc in documents for s in doc]
    lengths, pointers, offset = [], [], 0
    with open(prefix + ".bin", "wb") as f:
        for s in seqs:
            data = np.array(s, dtype=fmt).tobytes()
            f.write(data)
            lengths.append(len(s))
            pointers.append(offset)
            offset += len(data)
    doc_index = [0]
    for doc in documents:
        doc_index.append(doc_index[-1] + len(doc))
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", code))
        f.write(struct.pack("<Q", len(seqs)))
        f.write(struct.pack("<Q", len(doc_index)))
        f.write(struct.pack(f"<{len(lengths)}i", *lengths))
        f.write(struct.pack(f"<{len(pointers)}q", *pointers))
        f.write(struct.pack(f"<{len(doc_index)}q", *doc_index))


def reference_read(prefix):
    """-> (list of sequences as lists of ints, document index list)."""
    with open(prefix + ".idx", "rb") as f:
        assert f.read(9) == b"MMIDIDX\x00\x00"
        (version,) = struct.unpack("<Q", f.read(8))
        assert version == 1
        (code,) = struct.unpack("<B", f.read(1))
        n, d = struct.unpack("<QQ", f.read(16))
        lengths = struct.unpack(f"<{n}i", f.read(4 * n))
        pointers = struct.unpack(f"<{n}q", f.read(8 * n))
        doc_index = list(struct.unpack(f"<{d}q", f.read(8 * d)))
    itemsize = np.dtype(CODES[code]).itemsize
    with open(prefix + ".bin", "rb") as f:
        blob = f.read()
    seqs = [np.frombuffer(blob[p:p + ln * itemsize], dtype=CODES[code]).tolist()
            for ln, p in zip(lengths, pointers)]
    return seqs, doc_index


DOCS = [[[5, 6, 7]], [[1], [2, 3], [4, 4, 4, 4]], [[9, 8]], [[65000, 0, 1]]]


def _write_ours(prefix, documents, dtype):
    builder = MMapIndexedDatasetBuilder(prefix + ".bin", dtype)
    for doc in documents:
        for seq in doc:
            builder.add_item(seq)
        builder.end_document()
    builder.finalize(prefix + ".idx")


@pytest.mark.parametrize("dtype,code", [(np.uint16, 8), (np.int32, 4), (np.int64, 5)])
def test_round_trip_and_independent_reader(tmp_path, dtype, code):
    prefix = str(tmp_path / "ds")
    _write_ours(prefix, DOCS, dtype)
    with open(prefix + ".idx", "rb") as f:
        assert f.read(18)[-1] == code
    seqs, doc_index = reference_read(prefix)
    assert seqs == [s for d in DOCS for s in d]
    assert doc_index == [0, 1, 4, 5, 6]
    ds = MMapIndexedDataset(prefix)
    assert len(ds) == 6 and ds.num_documents == 4 and ds.dtype == np.dtype(dtype)
    assert [ds[i].tolist() for i in range(len(ds))] == seqs
    assert ds.get(3, offset=1, length=2).tolist() == [4, 4]
    assert ds.document_token_ranges().tolist() == [[0, 3], [3, 7], [10, 2], [12, 3]]
    assert ds.token_id_range() == (0, 65000)
    assert sorted(os.listdir(tmp_path)) == ["ds.bin", "ds.idx"]  # no temporary left behind


def test_file_reads_give_the_memory_mapped_tokens(tmp_path):
    """--no-mmap-bin-files: the same sequences, slices and single tokens through file reads."""
    prefix = str(tmp_path / "ds")
    _write_ours(prefix, DOCS, np.int32)
    mapped, read = MMapIndexedDataset(prefix), MMapIndexedDataset(prefix, mmap=False)
    assert not isinstance(read.tokens, np.memmap) and read.tokens.size == mapped.tokens.size
    assert [read[i].tolist() for i in range(len(read))] == [mapped[i].tolist()
                                                            for i in range(len(mapped))]
    assert read.tokens[2:9].tolist() == mapped.tokens[2:9].tolist()
    assert int(read.tokens[5]) == int(mapped.tokens[5]) and read.token_id_range() == (0, 65000)
    with pytest.raises(IndexError):
        read.tokens[mapped.tokens.size]


def test_add_documents_equals_add_item(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    _write_ours(a, DOCS, np.uint16)
    builder = MMapIndexedDatasetBuilder(b + ".bin", np.uint16)
    flat = [t for d in DOCS for s in d for t in s]
    builder.add_documents(np.array(flat[:3]), np.array([3]), np.array([1]))
    builder.add_documents(np.array(flat[3:]), np.array([1, 2, 4, 2, 3]), np.array([3, 1, 1]))
    builder.finalize(b + ".idx")
    for ext in (".bin", ".idx"):
        assert open(a + ext, "rb").read() == open(b + ext, "rb").read()


@pytest.mark.parametrize("code", [1, 3, 4, 8])
def test_reads_independently_written_files(tmp_path, code):
    prefix = str(tmp_path / "ref")
    docs = [[[1, 2, 3], [4]], [[5]], [[6, 7, 8, 9, 10]]]
    reference_write(prefix, docs, code)
    ds = MMapIndexedDataset(prefix)
    assert [ds[i].tolist() for i in range(len(ds))] == [[1, 2, 3], [4], [5], [6, 7, 8, 9, 10]]
    assert ds.doc_idx.tolist() == [0, 2, 3, 4]


def test_best_fitting_dtype():
    assert best_fitting_dtype(50257) == np.uint16
    assert best_fitting_dtype(65500) == np.int32


def _patch(path, offset, data):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


@pytest.mark.parametrize("damage,pattern", [
    ("no_bin", r"\.bin does not exist"),
    ("no_idx", r"\.idx does not exist"),
    ("magic", "bad magic"),
    ("version", "version 2"),
    ("dtype", "unknown dtype code 42"),
    ("short_bin", "truncated"),
    ("doc_count", "document index is inconsistent"),
    ("idx_size", "implies"),
])
def test_damaged_files_fail_with_path_and_fix(tmp_path, damage, pattern):
    prefix = str(tmp_path / "bad")
    reference_write(prefix, DOCS, 4)
    idx, bin_ = prefix + ".idx", prefix + ".bin"
    if damage == "no_bin":
        os.remove(bin_)
    elif damage == "no_idx":
        os.remove(idx)
    elif damage == "magic":
        _patch(idx, 0, b"XXIDIDX")
    elif damage == "version":
        _patch(idx, 9, struct.pack("<Q", 2))
    elif damage == "dtype":
        _patch(idx, 17, b"\x2a")
    elif damage == "short_bin":
        with open(bin_, "r+b") as f:
            f.truncate(os.path.getsize(bin_) - 4)
    elif damage == "doc_count":  # last document-index entry no longer equals the sequence count
        _patch(idx, os.path.getsize(idx) - 8, struct.pack("<q", 5))
    elif damage == "idx_size":
        with open(idx, "ab") as f:
            f.write(b"\0" * 8)
    with pytest.raises(DatasetFormatError, match=pattern) as info:
        MMapIndexedDataset(prefix)
    message = str(info.value)
    assert prefix in message and "preprocess_data.py" in message
