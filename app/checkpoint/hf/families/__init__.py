"""The Hugging Face model families we read and write: one module each, found here.

Every module in this folder is one family's adapter (app.checkpoint.hf.adapter.FamilyAdapter)
and defines `ADAPTER`; `ADAPTERS` holds them all in export order. Adding a family is adding
one module here: nothing else lists the families.
"""
from __future__ import annotations

import importlib
import pkgutil
from typing import Tuple

from app.checkpoint.hf.adapter import FamilyAdapter


def _discover() -> Tuple[FamilyAdapter, ...]:
    """The `ADAPTER` of every module of this package, by `export_order`; a module without one,
    or two families claiming one config.json model_type, is a programming error named here."""
    found = []
    for module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
        adapter = getattr(importlib.import_module(f"{__name__}.{module}"), "ADAPTER", None)
        if not isinstance(adapter, FamilyAdapter):
            raise TypeError(f"{__name__}.{module} defines no ADAPTER (a FamilyAdapter)")
        found.append(adapter)
    claimed = {}
    for adapter in found:
        for model_type in adapter.model_types:
            if model_type in claimed:
                raise TypeError(f"config.json model_type {model_type!r} is claimed by both "
                                f"{claimed[model_type].family} and {adapter.family}")
            claimed[model_type] = adapter
    return tuple(sorted(found, key=lambda a: a.export_order))


ADAPTERS: Tuple[FamilyAdapter, ...] = _discover()
