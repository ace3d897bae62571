"""What the recorders of Megatron-LM's own verdicts share (tests/data/megatron_args/record.py,
tests/data/megatron_scripts/record.py): Megatron-LM main imported from an extracted tree on
this machine's Python, JSON encoding of its `args` values, and the stand-ins for a GPU.

Only the environment is stood in for, never Megatron's arithmetic or rules:
- the modules that compile Triton GPU kernels at import (triton is not installed on a CPU
  machine) are replaced by stubs whose functions raise if called (argument parsing calls none);
- on Python 3.11, today's main imports `typing.override` (3.12), taken from typing_extensions
  (the same decorator);
- `fake_h100()`: "a device large enough" for the launch scripts' verdicts, an H100 (compute
  capability 9.0, 80 GiB), which validate_args asks torch.cuda about (--moe-grouped-gemm, and
  the device architecture whenever TP or CP > 1).
"""
import enum
import importlib.abc
import importlib.machinery
import os
import re
import sys
import types

MIRROR = os.environ.get("MEGATRON_MIRROR", "/work/.mirror/NVIDIA+Megatron-LM/repo")
"""The Megatron-LM git mirror (a bare repository) the recorders archive a version from."""


def encode(value):
    """A JSON value for one arg: plain JSON values as they are, others tagged by type."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        finite = value == value and abs(value) != float("inf")
        return value if finite else {"__float__": repr(value)}
    if isinstance(value, enum.Enum):
        return {"__enum__": f"{type(value).__module__}.{type(value).__qualname__}",
                "name": value.name}
    if isinstance(value, (list, tuple)):
        items = [encode(v) for v in value]
        return items if isinstance(value, list) else {"__tuple__": items}
    if isinstance(value, dict):
        return {"__dict__": [[encode(k), encode(v)] for k, v in value.items()]}
    if type(value).__module__ == "torch" and type(value).__name__ == "dtype":
        return {"__dtype__": str(value).replace("torch.", "")}
    return {"__repr__": repr(value), "type": f"{type(value).__module__}.{type(value).__qualname__}"}


class _KernelStubs(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Stands in for Megatron modules that import triton: every function raises if called."""

    def __init__(self, names):
        self.names = set(names)

    def find_spec(self, name, path, target=None):
        return importlib.machinery.ModuleSpec(name, self) if name in self.names else None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)

        def attribute(attr):
            if attr.startswith("__"):
                raise AttributeError(attr)

            def unavailable(*args, **kwargs):
                raise NotImplementedError(f"{spec.name}.{attr} is a Triton kernel (stubbed)")
            return unavailable
        module.__getattr__ = attribute
        return module

    def exec_module(self, module):
        pass


def triton_modules(tree):
    """Dotted names of the modules under `tree`/megatron that import triton at top level."""
    found = {"megatron.core.transformer.custom_layers.batch_invariant_kernels"}
    for folder, _, files in os.walk(os.path.join(tree, "megatron")):
        for name in files:
            path = os.path.join(folder, name)
            if name.endswith(".py") and re.search(r"^(import|from) triton\b",
                                                  open(path, encoding="utf-8").read(), re.M):
                found.add(os.path.relpath(path, tree)[:-3].replace(os.sep, "."))
    return found


def import_megatron_from(tree):
    """Make `import megatron` load the extracted Megatron-LM `tree` (ahead of the installed
    megatron-core), with the Triton modules stubbed and `typing.override` on Python 3.11."""
    import typing
    if not hasattr(typing, "override"):  # Python 3.12's; typing_extensions has the same one
        import typing_extensions
        typing.override = typing_extensions.override
    sys.path.insert(0, tree)
    sys.meta_path.insert(0, _KernelStubs(triton_modules(tree)))


def fake_h100():
    """torch.cuda answers as one H100 would (the only device facts validate_args reads)."""
    import torch
    torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
    torch.cuda.get_device_properties = lambda *a, **k: types.SimpleNamespace(
        major=9, minor=0, name="NVIDIA H100 80GB HBM3", total_memory=80 * 2 ** 30)
