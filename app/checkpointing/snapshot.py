"""Copies of checkpoint state in host memory, for saves written in the background.

`host_copy(state)` returns a deep copy of a checkpoint's state (nested dicts, lists, tuples,
argparse namespaces, tensors) that shares nothing with the live training state: CPU tensors are
cloned, device tensors copied into pinned host memory. Tensors that shared a storage share the
copy of it, views keep their offsets and strides, so `torch.save` of a copy of CPU state writes
the very bytes that saving the state itself would.
"""
from __future__ import annotations

import copy
from typing import Any, Dict

import torch


def host_copy(state: Any) -> Any:
    """A deep copy of `state` in host memory, safe to write while training goes on.

    Device tensors (CUDA) become CPU tensors in pinned memory, copied asynchronously and then
    awaited once, so the copy is complete on return; everything else is `copy.deepcopy`'s.
    """
    memo: Dict[int, Any] = {}
    storages: Dict[Any, torch.Tensor] = {}
    device_tensors = [t for t in _tensors(state, set()) if t.device.type != "cpu"]
    for tensor in device_tensors:
        memo[id(tensor)] = _pinned_view(tensor, storages)
    if device_tensors:
        torch.cuda.synchronize()
    return copy.deepcopy(state, memo)


def _pinned_view(tensor: torch.Tensor, storages: Dict[Any, torch.Tensor]) -> torch.Tensor:
    """`tensor` on the host: a view of a pinned copy of its whole storage (one per storage)."""
    source = tensor.detach()
    storage = source.untyped_storage()
    key = (storage.data_ptr(), source.device)
    if key not in storages:
        flat = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=True)
        flat.copy_(torch.empty(0, dtype=torch.uint8, device=source.device).set_(storage),
                   non_blocking=True)
        storages[key] = flat
    host = torch.empty(0, dtype=source.dtype)
    host.set_(storages[key].untyped_storage(), source.storage_offset(), source.size(),
              source.stride())
    return host


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
