"""Copies of checkpoint state in host memory, for saves written in the background.

`host_copy(state)` returns a deep copy of a checkpoint's state (nested dicts, lists, tuples,
argparse namespaces, tensors) that shares nothing with the live training state: CPU storages
are cloned, device storages copied into pinned host memory. Tensors that shared a storage share the
copy of it, views keep their offsets and strides, so `torch.save` of a copy of CPU state writes
the very bytes that saving the state itself would.

`HostBuffers` keeps the host memory of one save for the next: a fresh allocation is written
to page by page (page faults), which costs several times the copy itself; reused buffers cost
the copy only. The engines keep one per run and start each save with `HostBuffers.new_save`,
once the previous save's write has ended (at most one save is in flight).
"""
from __future__ import annotations

import copy
from typing import Any, Dict, Optional

import torch


class HostBuffers:
    """Host buffers that outlive a save, one per live storage copied (keyed by its address,
    device and size); those a save did not use are freed when the next one starts."""

    def __init__(self) -> None:
        self._kept: Dict[Any, torch.Tensor] = {}
        self._used: Dict[Any, torch.Tensor] = {}

    def new_save(self) -> None:
        """Start a save: the buffers of the previous one become free for reuse. Call only
        once the previous save's files are written (nothing reads its copy any more)."""
        self._kept, self._used = self._used, {}

    def take(self, key: Any, nbytes: int, pinned: bool) -> torch.Tensor:
        """A uint8 host buffer of `nbytes` for the storage `key` in this save."""
        buffer = self._used.get(key)
        if buffer is None:
            buffer = self._kept.pop(key, None)
            if buffer is None:
                buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
            self._used[key] = buffer
        return buffer


def host_copy(state: Any, buffers: Optional[HostBuffers] = None) -> Any:
    """A deep copy of `state` in host memory, safe to write while training goes on.

    Every tensor (a graph leaf or not, e.g. a view of ZeRO's flat buffers) becomes a view of a
    copy of its whole storage with the same offset, shape, strides, dtype, `requires_grad`
    and class (Parameter or Tensor); device (CUDA) storages are copied into pinned host memory
    asynchronously and awaited once, so the copy is complete on return. Everything else is
    `copy.deepcopy`'s. With `buffers` the storages are copied into buffers kept from the
    previous save (see HostBuffers).
    """
    memo: Dict[int, Any] = {}
    storages: Dict[Any, torch.Tensor] = {}
    on_device = False
    for tensor in _tensors(state, set()):
        on_device = on_device or tensor.device.type != "cpu"
        memo[id(tensor)] = _copy_of(tensor, storages, buffers)
    if on_device:
        torch.cuda.synchronize()
    return copy.deepcopy(state, memo)


def _copy_of(tensor: torch.Tensor, storages: Dict[Any, torch.Tensor],
             buffers: Optional[HostBuffers]) -> torch.Tensor:
    """`tensor` on the host: a view of a copy of its whole storage (one copy per storage)."""
    source = tensor.detach()
    storage = source.untyped_storage()
    key = (storage.data_ptr(), str(source.device), storage.nbytes())
    if key not in storages:
        device = source.device.type != "cpu"
        flat = (buffers.take(key, storage.nbytes(), device) if buffers is not None else
                torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=device))
        flat.copy_(torch.empty(0, dtype=torch.uint8, device=source.device).set_(storage),
                   non_blocking=device)
        storages[key] = flat
    host = torch.empty(0, dtype=source.dtype)
    host.set_(storages[key].untyped_storage(), source.storage_offset(), source.size(),
              source.stride())
    if isinstance(tensor, torch.nn.Parameter):
        return torch.nn.Parameter(host, requires_grad=tensor.requires_grad)
    return host.requires_grad_(tensor.requires_grad)


def _tensors(obj: Any, seen: set) -> list:
    """Every tensor reachable from `obj` through dicts, lists, tuples, sets and object
    attributes (an argparse namespace), each once."""
    if id(obj) in seen:
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        children = list(obj.keys()) + list(obj.values())
    elif isinstance(obj, (list, tuple, set, frozenset)):
        children = list(obj)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        children = list(vars(obj).values())
    else:
        return []
    found = []
    for child in children:
        found.extend(_tensors(child, seen))
    return found
