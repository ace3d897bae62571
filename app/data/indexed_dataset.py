"""Megatron-LM's memory-mapped indexed dataset (`.bin` tokens + `.idx` index), reader and writer.

Format (all little-endian), byte-compatible with Megatron-LM's `MMapIndexedDataset`:

`.idx`:
    9 bytes   magic  b"MMIDIDX\\x00\\x00"
    uint64    version = 1
    uint8     dtype code (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16)
    uint64    sequence count N
    uint64    document-index count D (= documents + 1)
    int32[N]  sequence lengths (tokens)
    int64[N]  byte offset of each sequence in the `.bin`
    int64[D]  document index: the sequence index where each document starts; starts with 0,
              ends with N
`.bin`: the token ids of all sequences, back to back, in the dtype above.

Without sentence splitting every document is one sequence. The reader validates everything it
can cheaply check at open and names the path and the fix in every error.
"""
from __future__ import annotations

import os
import struct
from typing import Dict, List, Optional, Sequence, Union

import numpy as np

from app.utils.fileio import atomic_open, tmp_path

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_SIZE = len(MAGIC) + 8 + 1 + 8 + 8  # 34 bytes
DTYPES: Dict[int, type] = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64,
                           6: np.float64, 7: np.float32, 8: np.uint16}
FIX_HINT = "re-run tools/preprocess_data.py to regenerate the .bin/.idx pair"


def dtype_code(dtype: Union[type, np.dtype]) -> int:
    """Format code of a numpy dtype (inverse of DTYPES)."""
    dt = np.dtype(dtype)
    for code, candidate in DTYPES.items():
        if np.dtype(candidate) == dt:
            return code
    raise ValueError(f"dtype {dt} cannot be stored in an indexed dataset; use one of "
                     f"{sorted(np.dtype(d).name for d in DTYPES.values())}")


def best_fitting_dtype(vocab_size: Optional[int]) -> type:
    """Token dtype for a vocabulary: uint16 below 65500 entries, else int32 (Megatron's rule)."""
    if vocab_size is not None and vocab_size < 65500:
        return np.uint16
    return np.int32


def data_file_path(prefix: str) -> str:
    return prefix + ".bin"


def index_file_path(prefix: str) -> str:
    return prefix + ".idx"


class DatasetFormatError(ValueError):
    """A .bin/.idx pair that is missing, truncated or inconsistent."""


class MMapIndexedDatasetBuilder:
    """Writes `.bin` while sequences are added and the `.idx` at `finalize(idx_path)`.

    Data goes to a temporary `fileio.tmp_path(bin_path)` first; `finalize` writes the index to a
    temporary name and renames both into place, the `.idx` last, so an interrupted run never
    leaves a valid-looking pair.
    """

    def __init__(self, bin_path: str, dtype: Union[type, np.dtype] = np.int32) -> None:
        self.bin_path = bin_path
        self.dtype = np.dtype(dtype)
        self._code = dtype_code(self.dtype)
        self._tmp_bin = tmp_path(bin_path)
        self._file = open(self._tmp_bin, "wb")
        self._lengths: List[np.ndarray] = []
        self._doc_starts: List[np.ndarray] = [np.zeros(1, dtype=np.int64)]
        self._num_sequences = 0

    def add_item(self, tokens: Union[Sequence[int], np.ndarray]) -> None:
        """Append one sequence (it belongs to the current document until end_document())."""
        arr = np.asarray(tokens, dtype=self.dtype)
        self._file.write(arr.tobytes(order="C"))
        self._lengths.append(np.array([arr.size], dtype=np.int32))
        self._num_sequences += 1

    def end_document(self) -> None:
        """Close the current document: the next add_item starts a new one."""
        self._doc_starts.append(np.array([self._num_sequences], dtype=np.int64))

    def add_documents(self, tokens: np.ndarray, sequence_lengths: np.ndarray,
                      sequences_per_document: np.ndarray) -> None:
        """Append many documents at once: concatenated tokens, their sequence lengths, and the
        number of sequences of each document (sum(sequence_lengths) == tokens.size)."""
        lengths = np.asarray(sequence_lengths, dtype=np.int32)
        per_doc = np.asarray(sequences_per_document, dtype=np.int64)
        assert int(lengths.sum(dtype=np.int64)) == tokens.size and int(per_doc.sum()) == lengths.size
        self._file.write(np.ascontiguousarray(tokens, dtype=self.dtype).tobytes())
        self._lengths.append(lengths)
        self._doc_starts.append(self._num_sequences + np.cumsum(per_doc))
        self._num_sequences += lengths.size

    def finalize(self, idx_path: str) -> None:
        """Write the index and move `.bin` and `.idx` into place (idx last)."""
        if self._doc_starts[-1][-1] != self._num_sequences:
            self.end_document()
        self._file.close()
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int32)
        doc_idx = np.concatenate(self._doc_starts)
        pointers = np.zeros(lengths.size, dtype=np.int64)
        np.cumsum(lengths[:-1], dtype=np.int64, out=pointers[1:])
        pointers *= self.dtype.itemsize
        with atomic_open(idx_path, "wb",  # the .bin is moved into place just before the .idx
                         before_replace=lambda _: os.replace(self._tmp_bin, self.bin_path)) as f:
            f.write(MAGIC)
            f.write(struct.pack("<QBQQ", VERSION, self._code, lengths.size, doc_idx.size))
            f.write(lengths.astype("<i4").tobytes())
            f.write(pointers.astype("<i8").tobytes())
            f.write(doc_idx.astype("<i8").tobytes())

    def abort(self) -> None:
        """Close and delete the temporary output (nothing is left behind)."""
        self._file.close()
        if os.path.exists(self._tmp_bin):
            os.remove(self._tmp_bin)


def _read_index(idx_path: str):
    """(dtype, sizes, pointers, doc_idx) memory-mapped from `idx_path`, header validated."""
    if not os.path.isfile(idx_path):
        raise DatasetFormatError(f"index file {idx_path} does not exist; check --data-path "
                                 f"(it takes the prefix without .bin/.idx) or {FIX_HINT}")
    file_size = os.path.getsize(idx_path)
    with open(idx_path, "rb") as f:
        header = f.read(HEADER_SIZE)
    if len(header) < HEADER_SIZE or header[:len(MAGIC)] != MAGIC:
        raise DatasetFormatError(f"{idx_path} is not a Megatron mmap index (bad magic "
                                 f"{header[:len(MAGIC)]!r}, want {MAGIC!r}); {FIX_HINT}")
    version, code, n_seq, n_doc = struct.unpack("<QBQQ", header[len(MAGIC):])
    if version != VERSION:
        raise DatasetFormatError(f"{idx_path} has index version {version}, this reader supports "
                                 f"{VERSION}; {FIX_HINT}")
    if code not in DTYPES:
        raise DatasetFormatError(f"{idx_path} has unknown dtype code {code}; {FIX_HINT}")
    expected = HEADER_SIZE + n_seq * (4 + 8) + n_doc * 8
    if file_size != expected:
        raise DatasetFormatError(f"{idx_path} is {file_size} bytes but its header ({n_seq} sequences, "
                                 f"{n_doc} document-index entries) implies {expected}; {FIX_HINT}")
    buf = np.memmap(idx_path, mode="r", dtype=np.uint8)
    sizes = np.frombuffer(buf, dtype="<i4", count=n_seq, offset=HEADER_SIZE)
    pointers = np.frombuffer(buf, dtype="<i8", count=n_seq, offset=HEADER_SIZE + 4 * n_seq)
    doc_idx = np.frombuffer(buf, dtype="<i8", count=n_doc, offset=HEADER_SIZE + 12 * n_seq)
    return np.dtype(DTYPES[code]), sizes, pointers, doc_idx


def _check_consistency(prefix: str, dtype: np.dtype, sizes: np.ndarray, pointers: np.ndarray,
                       doc_idx: np.ndarray) -> None:
    """Document index bounds/order, pointer layout and .bin size; raises DatasetFormatError."""
    idx_path, bin_path = index_file_path(prefix), data_file_path(prefix)
    n_seq = sizes.size
    if doc_idx.size == 0 or doc_idx[0] != 0 or doc_idx[-1] != n_seq or np.any(np.diff(doc_idx) < 0):
        first = int(doc_idx[0]) if doc_idx.size else None
        last = int(doc_idx[-1]) if doc_idx.size else None
        raise DatasetFormatError(
            f"{idx_path}: document index is inconsistent with the {n_seq} sequences (must start "
            f"at 0, end at {n_seq}, never decrease; got first={first}, last={last}); {FIX_HINT}")
    if np.any(sizes < 0):
        raise DatasetFormatError(f"{idx_path}: negative sequence length; {FIX_HINT}")
    expected_pointers = np.zeros(n_seq, dtype=np.int64)
    np.cumsum(sizes[:-1], dtype=np.int64, out=expected_pointers[1:])
    expected_pointers *= dtype.itemsize
    if not np.array_equal(expected_pointers, pointers):
        raise DatasetFormatError(f"{idx_path}: sequence byte offsets do not match the sequence "
                                 f"lengths (sequences must be stored back to back); {FIX_HINT}")
    if not os.path.isfile(bin_path):
        raise DatasetFormatError(f"data file {bin_path} does not exist (its index {idx_path} "
                                 f"does); {FIX_HINT}")
    total_bytes = int(sizes.sum(dtype=np.int64)) * dtype.itemsize
    bin_size = os.path.getsize(bin_path)
    if bin_size != total_bytes:
        raise DatasetFormatError(f"{bin_path} is {bin_size} bytes but {idx_path} describes "
                                 f"{total_bytes} bytes of {dtype.name} tokens (truncated or "
                                 f"mismatched pair); {FIX_HINT}")


class FileTokens:
    """The tokens of a `.bin` file read with file reads instead of a memory map (Megatron's
    --no-mmap-bin-files, its _FileBinReader): `tokens[a:b]` and `tokens[i]` as a memmap gives
    them, each read opening the file (safe in forked data-loader workers)."""

    def __init__(self, path: str, dtype: np.dtype, count: int) -> None:
        self.path, self.dtype, self.size = path, np.dtype(dtype), int(count)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, key: Union[int, slice]) -> Union[np.ndarray, np.generic]:
        if isinstance(key, slice):
            start, stop, step = key.indices(self.size)
            if step != 1:
                raise IndexError("FileTokens reads contiguous ranges only")
            count = max(0, stop - start)
            with open(self.path, "rb") as f:
                f.seek(start * self.dtype.itemsize)
                data = f.read(count * self.dtype.itemsize)
            return np.frombuffer(data, dtype=self.dtype, count=count)
        index = int(key) + (self.size if int(key) < 0 else 0)
        if not 0 <= index < self.size:
            raise IndexError(f"token {key} outside {self.path} ({self.size} tokens)")
        return self[index:index + 1][0]


class MMapIndexedDataset:
    """Read-only view of a `.bin`/`.idx` pair: `ds[i]` is sequence i as a numpy array (no copy).

    Attributes: `sizes` (int32 [N] tokens per sequence), `pointers` (int64 [N] byte offsets),
    `doc_idx` (int64 [D], document -> first sequence), `dtype`, `tokens` (memmap of all tokens,
    or with `mmap` False a FileTokens reading the same values with file reads).
    Validated at open; every failure raises DatasetFormatError naming the path and the fix.
    """

    def __init__(self, prefix: str, mmap: bool = True) -> None:
        self.prefix = prefix
        self.dtype, self.sizes, self.pointers, self.doc_idx = _read_index(index_file_path(prefix))
        _check_consistency(prefix, self.dtype, self.sizes, self.pointers, self.doc_idx)
        total = int(self.sizes.sum(dtype=np.int64)) if self.sizes.size else 0
        if total > 0 and not mmap:
            self.tokens = FileTokens(data_file_path(prefix), self.dtype, total)
        elif total > 0:
            self.tokens = np.memmap(data_file_path(prefix), mode="r", dtype=self.dtype)
        else:  # np.memmap refuses empty files
            self.tokens = np.zeros(0, dtype=self.dtype)

    def __len__(self) -> int:
        """Number of sequences."""
        return int(self.sizes.size)

    @property
    def num_documents(self) -> int:
        return int(self.doc_idx.size - 1)

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None) -> np.ndarray:
        """Tokens [offset, offset + length) of sequence idx (length None = to its end)."""
        size = int(self.sizes[idx])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"range [{offset}, {offset + length}) outside sequence {idx} of "
                             f"{size} tokens in {self.prefix}")
        start = int(self.pointers[idx]) // self.dtype.itemsize + offset
        return self.tokens[start:start + length]

    def __getitem__(self, idx: int) -> np.ndarray:
        return self.get(idx)

    def sequence_starts(self) -> np.ndarray:
        """int64 [num_sequences]: the first token of each sequence in `tokens` (computed once)."""
        if getattr(self, "_sequence_starts", None) is None:
            self._sequence_starts = np.asarray(self.pointers, dtype=np.int64) // self.dtype.itemsize
        return self._sequence_starts

    def document_token_ranges(self) -> np.ndarray:
        """int64 [num_documents, 2]: (first token, token count) of each document in `tokens`.

        Valid because the reader checked that sequences are stored back to back."""
        cum = np.zeros(self.sizes.size + 1, dtype=np.int64)
        np.cumsum(self.sizes, dtype=np.int64, out=cum[1:])
        starts = cum[self.doc_idx[:-1]]
        return np.stack([starts, cum[self.doc_idx[1:]] - starts], axis=1)

    def token_id_range(self, chunk_tokens: int = 1 << 24) -> tuple:
        """(min, max) token id in the `.bin` ((0, -1) if empty), scanned in chunks."""
        lo: Optional[int] = None
        hi: Optional[int] = None
        for start in range(0, self.tokens.size, chunk_tokens):
            chunk = self.tokens[start:start + chunk_tokens]
            c_lo, c_hi = int(chunk.min()), int(chunk.max())
            lo = c_lo if lo is None else min(lo, c_lo)
            hi = c_hi if hi is None else max(hi, c_hi)
        return (0, -1) if lo is None else (lo, hi)
