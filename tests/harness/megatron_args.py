"""The `args` Namespaces Megatron-LM's own parse_args + validate_args made (tests/data/megatron_args/record.py wrote them):
`load(version, flag_set)` reads one back.

Type tags (record.encode): `__dtype__` -> torch.dtype; `__tuple__` -> tuple; `__dict__` -> dict;
`__float__` -> nan/inf; `__enum__` -> the Megatron enum member when `enums` is true (Megatron
Core must import), else a `RecordedEnum` (its class path and name: what our reader sees of a
Megatron class); `__repr__` -> a RecordedObject (the repr, for an object JSON cannot hold).
"""
import argparse
import importlib
import json
import os
from typing import Any, NamedTuple

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.join(ROOT, "tests", "data", "megatron_args")
"""Where record.py wrote the fixtures."""
VERSIONS = ("core_v0.16.1", "HEAD")
"""Recorded Megatron-LM versions: the oldest we read and today's main."""
FLAG_SETS = ("gpt2", "gpt2_legacy", "gqa", "rope_untied", "swiglu_rmsnorm", "qwen3_moe",
             "moe_options")


class RecordedEnum(NamedTuple):
    cls: str
    name: str


class RecordedObject(NamedTuple):
    type: str
    repr: str


def _decode(value: Any, enums: bool) -> Any:
    if isinstance(value, list):
        return [_decode(v, enums) for v in value]
    if not isinstance(value, dict):
        return value
    if "__dtype__" in value:
        return getattr(torch, value["__dtype__"])
    if "__tuple__" in value:
        return tuple(_decode(v, enums) for v in value["__tuple__"])
    if "__dict__" in value:
        return {_decode(k, enums): _decode(v, enums) for k, v in value["__dict__"]}
    if "__float__" in value:
        return float(value["__float__"])
    if "__enum__" in value:
        if not enums:
            return RecordedEnum(value["__enum__"], value["name"])
        module, _, cls = value["__enum__"].rpartition(".")
        return getattr(getattr(importlib.import_module(module), cls), value["name"])
    return RecordedObject(value["type"], value["__repr__"])


def record(version: str, flag_set: str) -> dict:
    """The whole fixture: megatron (version), commit, argv and the encoded args."""
    with open(os.path.join(HERE, version, f"{flag_set}.json")) as f:
        return json.load(f)


def load(version: str, flag_set: str, *, enums: bool = False, **overrides: Any
         ) -> argparse.Namespace:
    """Megatron's args for `flag_set` at `version`, with `overrides` set on top (what training
    changes before a save: iteration, consumed_train_samples, ...). vocab_file and merge_file
    are made absolute (this checkout's tests/data files)."""
    args = {k: _decode(v, enums) for k, v in record(version, flag_set)["args"].items()}
    for key in ("vocab_file", "merge_file"):
        if args.get(key):
            args[key] = os.path.join(ROOT, args[key])
    args.update(overrides)
    return argparse.Namespace(**args)
