"""The old-checkpoint fixtures of tests/data/old_checkpoints: per set (a release, or the code at a
commit) the checkpoints its writer wrote, their command lines, and the rows the writer logged
after them, per environment (tests/harness/numerics.py)."""
import json
import os
from typing import Dict, List, Optional, Tuple

from tests.harness import numerics
from tests.harness.corpus import read_metrics
from tests.harness.launch import ROOT

FIXTURES = os.path.join(ROOT, "tests", "data", "old_checkpoints")
RECORD = ("OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python tests/data/old_checkpoints/"
          "make_fixtures.py --writer <checkout of the set's commit> --set {set} --record-only")
"""How to record this machine's rows of a set (make_fixtures.py says more)."""
CROSS_PATH = ("a DeepSpeed run's rows, resumed on the native path: DeepSpeed's AdamW and "
              "gradient norm round apart from ours in the last bits")


def _load(name):
    with open(os.path.join(FIXTURES, name)) as f:
        return json.load(f)


COMMANDS, EXPECTED = _load("commands.json"), _load("expected.json")


def fixtures() -> List[Tuple[str, str]]:
    """Every (set, checkpoint) of the compatibility set, oldest set first."""
    return [(s, name) for s, spec in COMMANDS["sets"].items() for name in spec["checkpoints"]]


def folder(set_name: str, name: str) -> str:
    """The committed checkpoint directory (its --save)."""
    return os.path.join(FIXTURES, set_name, name)


def source(name: str) -> str:
    """The checkpoint whose run `name` continues (itself, or the one it was converted from)."""
    return COMMANDS["converted"].get(name, {}).get("source", name)


def command(name, work):
    """pretrain_gpt2.py's arguments for checkpoint `name`, as its writer ran them (a converted
    one: its source's, on the native path, without the DeepSpeed flags)."""
    args = COMMANDS["common"] + COMMANDS["checkpoints"][source(name)]
    if source(name) != name and "--deepspeed" in args:
        at = args.index("--deepspeed")
        args = args[:at] + args[at + 3:]  # --deepspeed --deepspeed_config <json>
    return [a.replace("{fixtures}", FIXTURES).replace("{work}", str(work)) for a in args]


def native_command(name, work):
    """The checkpoint's command line on the native path (a DeepSpeed run's flags dropped)."""
    args = command(name, work)
    if "--deepspeed" in args:
        at = args.index("--deepspeed")
        args = args[:at] + args[at + 3:]
    return args


def recorded(set_name: str, name: str, across_paths: bool = False,
             here: Optional[Dict[str, str]] = None) -> Tuple[Dict, numerics.Comparison]:
    """(the rows recorded for checkpoint `name` of the set, how to compare with them): bit for
    bit under this machine's environment key (the children run with one thread), else within
    the tolerance of the run's precision; always within it `across_paths` (a DeepSpeed
    checkpoint resumed on the native path). `here` fakes this machine's environment fields."""
    environments = {key: entry["rows"][name]
                    for key, entry in EXPECTED["sets"][set_name].items() if name in entry["rows"]}
    precision = numerics.precision_of(COMMANDS["checkpoints"][source(name)])
    key, comparison = numerics.comparison_for(
        list(environments), precision, here=here or numerics.environment(threads=1),
        hint=f"to compare bit for bit on this machine: {RECORD.format(set=set_name)}")
    if across_paths:
        comparison = numerics.Comparison(numerics.TOLERANCE[precision],
                                         f"{CROSS_PATH}; {comparison.reason}")
    return environments[key], comparison


def mismatches(rows_file, want: Dict, comparison: numerics.Comparison) -> List[str]:
    """What differs between the train rows of the metrics file `rows_file` and the recorded
    `want` ({iteration: {key: value}}): iterations, every integer and string exactly, losses
    and gradient norms as `comparison` says, loss scales and learning rates exactly."""
    rows = {str(r["iteration"]): r for r in read_metrics(rows_file) if r["kind"] == "train"}
    if sorted(rows) != sorted(want):
        return [f"iterations {sorted(rows)}, recorded {sorted(want)}"]
    problems = []
    for it, values in want.items():
        for key, value in values.items():
            problem = comparison.mismatch(rows[it].get(key), value,
                                          kernel_dependent=key in ("lm_loss", "grad_norm"))
            if problem:
                problems.append(f"iteration {it} {key}: {problem}")
    return problems
