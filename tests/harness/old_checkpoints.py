"""The old-checkpoint fixtures of tests/data/old_checkpoints: their command lines and the rows
their writers logged."""
import json
import os

import pytest
import torch

from tests.harness.corpus import read_metrics
from tests.harness.launch import ROOT

FIXTURES = os.path.join(ROOT, "tests", "data", "old_checkpoints")


def _load(name):
    with open(os.path.join(FIXTURES, name)) as f:
        return json.load(f)


COMMANDS, EXPECTED = _load("commands.json"), _load("expected.json")


def command(name, work):
    """pretrain_gpt2.py's arguments for checkpoint `name`, as make_fixtures.py ran them."""
    args = COMMANDS["common"] + COMMANDS["checkpoints"][name]
    return [a.replace("{fixtures}", FIXTURES).replace("{work}", str(work)) for a in args]


def same_environment():
    """Whether this is the environment expected.json was recorded in."""
    return EXPECTED["environment"] == (f"torch {torch.__version__}, cpu "
                                       f"{torch.backends.cpu.get_cpu_capability()}")


def assert_like_recorded(name, metrics, exact_floats, rel=1e-3):
    """The train rows of the metrics file `metrics` are those recorded for checkpoint `name`:
    the same iterations, every integer and string equal, every float equal when `exact_floats`
    (the recording environment), else within `rel`."""
    rows = {str(r["iteration"]): r for r in read_metrics(metrics) if r["kind"] == "train"}
    want = EXPECTED["checkpoints"][name]
    assert sorted(rows) == sorted(want), (name, sorted(rows))
    for it, values in want.items():
        for key, value in values.items():
            got = rows[it][key]
            if exact_floats or not isinstance(value, float):
                assert got == value, f"{name} iteration {it} {key}: {got!r}, recorded {value!r}"
            else:
                assert got == pytest.approx(value, rel=rel), (name, it, key, got, value)
