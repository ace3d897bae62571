"""Golden loss curves compared exactly (see tests/harness/golden.py for how they are made
and the command that regenerates them when a change of the numbers is intended)."""
import math
import os

import pytest

from tests.harness import golden
from tests.harness.golden import CONFIGS, ITERATIONS, VOCAB, load_golden, run_config

REGENERATE = "OMP_NUM_THREADS=1 .venv/bin/python -m tests.harness.golden --write"
REQUIRED = "GOLDEN_CURVES_REQUIRED"
"""Set to 1 (CI does, in .ci/run) to fail instead of skip when this environment has no curves."""


def stored_curves(name):
    """This environment's golden curves of configuration `name`. Without them: skip, or fail
    under GOLDEN_CURVES_REQUIRED=1, with the steps that record them."""
    env = golden.environment()
    recorded = load_golden()
    if name in recorded.get(env, {}):
        return recorded[env][name]
    where = os.path.relpath(golden.GOLDEN_FILE, golden.ROOT)
    message = (f"{where} has no curve {name!r} for this environment, {env!r} (recorded: "
               f"{sorted(recorded) or 'none'}). To record it, on this machine, from the "
               f"repository root: {REGENERATE} (trains the {len(CONFIGS)} configurations, "
               f"{ITERATIONS} iterations each, and stores their curves under {env!r}, leaving "
               f"the other environments as they are); then commit {where}")
    if os.environ.get(REQUIRED) == "1":
        pytest.fail(f"{message}. ({REQUIRED}=1: a missing environment fails)")
    pytest.skip(f"{message}. ({REQUIRED}=1 makes this a failure, as in CI)")


def test_an_unrecorded_environment_says_how_to_record_it(monkeypatch):
    monkeypatch.setattr(golden, "environment", lambda: "torch 0.0, cpu NONE")
    monkeypatch.delenv(REQUIRED, raising=False)
    with pytest.raises(pytest.skip.Exception) as skipped:
        stored_curves("native_fp32")
    text = str(skipped.value)
    assert REGENERATE in text and "'torch 0.0, cpu NONE'" in text
    assert "commit tests/data/golden_loss_curves.json" in text
    monkeypatch.setenv(REQUIRED, "1")
    with pytest.raises(pytest.fail.Exception, match="a missing environment fails"):
        stored_curves("native_fp32")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_loss_curve_equals_the_golden_values(name, tmp_path):
    want = stored_curves(name)
    got = run_config(name, str(tmp_path))
    assert len(got["lm_loss"]) == ITERATIONS and all(
        abs(x - math.log(VOCAB)) < 0.5 for x in got["lm_loss"])  # a fresh model on 257 ids
    for key in ("lm_loss", "grad_norm", "valid_lm_loss"):
        for i, (a, b) in enumerate(zip(got[key], want[key])):
            assert a == b, (f"{name}: {key}[{i}] is {a!r}, golden {b!r} (the numerics changed; "
                            f"if that is intended, regenerate: {REGENERATE})")
        assert len(got[key]) == len(want[key]), (name, key)
