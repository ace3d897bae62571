"""Checkpoint files on disk: SHA-256 sidecars and safe (weights-only, allow-listed) reads.

A checksummed file `f` has a sidecar in sha256sum format: `f.sha256` beside our Megatron files,
a hidden `.f.sha256` beside DeepSpeed's (`sidecar_path`). `verify_checksum` compares a file
with its sidecar before anything unpickles it; `safe_torch_load` unpickles with
weights_only=True and an allow-list (`allowed_globals` plus the caller's), and
`check_pickled_globals` scans a file that another library will unpickle itself;
`megatron_args_globals` lets Megatron-LM's pickled args through with its own classes as inert
`ForeignObject`s (both Megatron formats read them). Errors name the file and the fix. The
crash-safe writer using these is app.checkpoint.commit.
"""
from __future__ import annotations

import argparse
import hashlib
import io
import os
import pathlib
import pickle
import re
import signal
import types
from typing import Any, List, Optional, Sequence, Union

import numpy as np
import torch

from app.checkpoint import CheckpointError
from app.utils.fileio import atomic_write_bytes

CHECKSUM_SUFFIX = ".sha256"


class UnsafeCheckpointError(CheckpointError, pickle.UnpicklingError):
    """The file pickles a class outside the allow-list; refused under weights_only=True."""


# ---------------------------------------------------------------------------- checksums

def sha256_file(path: str) -> str:
    """Hex SHA-256 of the file at `path`, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def sidecar_path(path: str, hidden: Optional[bool] = None) -> str:
    """The SHA-256 sidecar of `path`: `<path>.sha256` (Megatron files), or the hidden
    `<dir>/.<name>.sha256` (DeepSpeed files: DeepSpeed's own tools pick up every file whose name
    starts like theirs, `mp_rank_...`, and would try to unpickle a visible sidecar). `hidden`
    None returns whichever exists (the visible one when neither does)."""
    directory, name = os.path.split(path)
    visible, concealed = path + CHECKSUM_SUFFIX, os.path.join(directory, f".{name}{CHECKSUM_SUFFIX}")
    if hidden is None:
        hidden = not os.path.exists(visible) and os.path.exists(concealed)
    return concealed if hidden else visible


def read_checksums(sidecar: str) -> List[str]:
    """The digests listed in a sha256sum-format sidecar ([] when it is missing or unreadable)."""
    try:
        with open(sidecar, "r", encoding="ascii", errors="replace") as f:
            return [line.split()[0] for line in f if line.strip()]
    except OSError:
        return []


def write_checksums(sidecar: str, name: str, digests: List[str]) -> None:
    """Replace `sidecar` atomically and durably with one sha256sum line per digest for `name`."""
    text = "".join(f"{d}  {name}\n" for d in digests).encode("ascii")
    atomic_write_bytes(sidecar, text, durable=True)


# ---------------------------------------------------------------------------- safe reads

def allowed_globals() -> List[Any]:
    """Classes our checkpoints pickle besides tensors: Namespace and numpy's RNG-state array."""
    core = getattr(np, "_core", None) or np.core
    reconstruct = core.multiarray._reconstruct
    extra: List[Any] = [argparse.Namespace, reconstruct, np.ndarray, np.dtype,
                        type(np.dtype(np.uint32))]
    return extra


def verify_checksum(path: str) -> None:
    """CheckpointError when `path`'s SHA-256 is not in its `.sha256` sidecar (no sidecar: no
    check, e.g. files written by Megatron-LM itself)."""
    sidecar = sidecar_path(path)
    expected = read_checksums(sidecar)
    if not expected:
        return
    actual = sha256_file(path)
    if actual not in expected:
        raise CheckpointError(
            f"checkpoint file {path} is corrupt: its SHA-256 {actual[:16]}... does not match "
            f"{sidecar}; restore the file or point the tracker at an earlier "
            "complete iteration")


def safe_torch_load(path: str, map_location: Any = "cpu",
                    extra_safe_globals: Sequence[Any] = (), mmap: bool = False) -> Any:
    """torch.load with weights_only=True: tensors, plain containers and an allow-list of
    classes (`allowed_globals()` plus `extra_safe_globals`); `mmap` maps the tensors instead of
    reading them (zip-format files only). A file that pickles anything else
    (an object whose unpickling would run code) raises UnsafeCheckpointError naming the file
    and the refused global; a damaged file raises CheckpointError."""
    try:
        with torch.serialization.safe_globals(allowed_globals() + list(extra_safe_globals)):
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        if "Weights only load failed" in str(exc):
            refused = re.search(r"(?:unsupported|Unsupported global:) GLOBAL ([\w.]+)", str(exc))
            what = f" ({refused.group(1)})" if refused else ""
            raise UnsafeCheckpointError(
                f"checkpoint file {path} pickles a class or function outside the allow-list"
                f"{what} and was refused: unpickling it could run arbitrary code. Load only "
                "checkpoints you trust; if this one is yours and was written by another "
                "version, convert it in a trusted environment") from exc
        raise CheckpointError(f"checkpoint file {path} is garbled and cannot be unpickled "
                              f"({exc}); restore it or use an earlier iteration") from exc
    except Exception as exc:  # torch raises RuntimeError/EOFError/... for damaged archives
        raise CheckpointError(f"checkpoint file {path} cannot be read (truncated or corrupt?): "
                              f"{type(exc).__name__}: {str(exc)[:300]}") from exc


def check_pickled_globals(path: str, extra_safe_globals: Sequence[Any] = ()) -> None:
    """Refuse (UnsafeCheckpointError) a file that pickles anything outside the allow-list,
    without loading its tensors: for files another library unpickles itself. Zip-format files
    are scanned; others are loaded once with `safe_torch_load`."""
    allowed = allowed_globals() + list(extra_safe_globals)
    try:
        with torch.serialization.safe_globals(allowed):
            refused = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:  # noqa: BLE001 - not a zip archive: the full safe load decides
        safe_torch_load(path, "cpu", extra_safe_globals)
        return
    if refused:
        raise UnsafeCheckpointError(
            f"checkpoint file {path} pickles a class or function outside the allow-list "
            f"({', '.join(sorted(refused)[:3])}) and was refused: unpickling it could run "
            "arbitrary code. Load only checkpoints you trust")


# ---------------------------------------------------------------------------- Megatron's args

class ForeignObject:
    """An instance of a class this code does not load (Megatron's enums and dataclasses in its
    checkpoints): its constructor arguments and state are kept, nothing of it runs."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args, self.kwargs = args, kwargs

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"ForeignObject{self.args or ''}"


def megatron_args_globals(source: Union[bytes, str]) -> List[Any]:
    """What Megatron-LM's pickled args need beyond the checkpoint allow-list: SimpleNamespace,
    PosixPath, Signals, Namespace, and (ForeignObject, name) for every `megatron.*` global that
    the torch.save blob (bytes) or file (path) `source` pickles."""
    extra: List[Any] = [types.SimpleNamespace, pathlib.PosixPath, signal.Signals,
                        argparse.Namespace]
    try:
        found = torch.serialization.get_unsafe_globals_in_checkpoint(
            io.BytesIO(source) if isinstance(source, bytes) else source)
    except Exception:  # noqa: BLE001 - not a zip archive: the load itself reports it
        return extra
    return extra + [(ForeignObject, name) for name in found if name.split(".")[0] == "megatron"]
