"""Golden loss curves compared exactly (see tests/integration/golden.py for how they are made
and the command that regenerates them when a change of the numbers is intended)."""
import math

import pytest

from tests.integration.golden import (CONFIGS, GOLDEN_FILE, ITERATIONS, VOCAB, environment,
                                      load_golden, run_config)

REGENERATE = "OMP_NUM_THREADS=1 .venv/bin/python -m tests.integration.golden --write"


@pytest.mark.parametrize("name", list(CONFIGS))
def test_loss_curve_equals_the_golden_values(name, tmp_path):
    stored = load_golden().get(environment())
    if stored is None or name not in stored:
        pytest.skip(f"{GOLDEN_FILE} has no curve {name!r} for {environment()}; record this "
                    f"environment's with: {REGENERATE}")
    got, want = run_config(name, str(tmp_path)), stored[name]
    assert len(got["lm_loss"]) == ITERATIONS and all(
        abs(x - math.log(VOCAB)) < 0.5 for x in got["lm_loss"])  # a fresh model on 257 ids
    for key in ("lm_loss", "grad_norm", "valid_lm_loss"):
        for i, (a, b) in enumerate(zip(got[key], want[key])):
            assert a == b, (f"{name}: {key}[{i}] is {a!r}, golden {b!r} (the numerics changed; "
                            f"if that is intended, regenerate: {REGENERATE})")
        assert len(got[key]) == len(want[key]), (name, key)
