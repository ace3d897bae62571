"""Golden loss curves: bit for bit on a machine whose environment recorded them, within the
tolerance of the run's precision on any other, and the test says which (tests/harness/golden.py
says how they are made and recorded; tests/harness/numerics.py the environment key and the
tolerances)."""
import math
import os

import pytest

from tests.harness import golden, numerics
from tests.harness.golden import CONFIGS, ITERATIONS, VOCAB, run_config

REGENERATE = "OMP_NUM_THREADS=1 .venv/bin/python -m tests.harness.golden --write"
ADD = "OMP_NUM_THREADS=1 .venv/bin/python -m tests.harness.golden --add"
REQUIRED = "GOLDEN_CURVES_REQUIRED"
"""1 (CI sets it, in .ci/run): a configuration recorded in no environment fails instead of
skipping. exact: this machine's environment must be recorded too, so every comparison is bit
for bit (for the machine that records the curves, once it has recorded them)."""
WHERE = os.path.relpath(golden.GOLDEN_FILE, golden.ROOT)


def stored_curves(name, here=None):
    """(golden curves of configuration `name`, how to compare with them): this environment's
    bit for bit, else another environment's within the tolerance. None recorded: skip, or fail
    under GOLDEN_CURVES_REQUIRED, with the steps that record them. `here` fakes this machine's
    environment fields."""
    recorded = {key: curves[name] for key, curves in golden.load_golden().items()
                if name in curves}
    required = os.environ.get(REQUIRED, "")
    if not recorded:
        message = (f"{WHERE} has no curve {name!r} in any environment. To record it, on this "
                   f"machine, from the repository root: {REGENERATE} (trains the "
                   f"{len(CONFIGS)} configurations, {ITERATIONS} iterations each), then "
                   f"commit {WHERE}")
        if required:
            pytest.fail(f"{message}. ({REQUIRED}={required}: a missing curve fails)")
        pytest.skip(f"{message}. ({REQUIRED}=1 makes this a failure, as in CI)")
    key, comparison = numerics.comparison_for(
        list(recorded), golden.precision(name), here=here or golden.environment(),
        hint=f"to compare bit for bit on this machine, record it: {ADD}")
    if required == "exact" and not comparison.exact:
        pytest.fail(f"{REQUIRED}=exact but {comparison.reason}")
    return recorded[key], comparison


def _another_machine():
    return dict(golden.environment(), cpu="Another CPU", isa="avx2,amx_bf16")


def test_a_missing_configuration_says_how_to_record_it(monkeypatch):
    monkeypatch.setattr(golden, "load_golden", lambda: {})
    monkeypatch.delenv(REQUIRED, raising=False)
    with pytest.raises(pytest.skip.Exception) as skipped:
        stored_curves("native_fp32")
    assert REGENERATE in str(skipped.value)
    assert "commit tests/data/golden_loss_curves.json" in str(skipped.value)
    monkeypatch.setenv(REQUIRED, "1")
    with pytest.raises(pytest.fail.Exception, match="a missing curve fails"):
        stored_curves("native_fp32")


def test_another_environment_compares_within_the_precisions_tolerance_and_says_why(monkeypatch):
    """A machine whose key is not recorded (faked here: another CPU model and AMX) takes the
    tolerance path, naming what differs and how to record it; this machine's own key (once
    recorded) gives the exact path; a key of the older format is always another environment."""
    monkeypatch.delenv(REQUIRED, raising=False)
    here = numerics.key_of(golden.environment())
    fake = {here: {"native_fp32": "mine"}, "torch 2.13.0+cpu, cpu AVX512": {"native_bf16": "old"},
            "torch=x; build=y; cpu=z; kernels=AVX512; isa=none; onednn=1; mkl=1; threads=1; "
            "overrides=none": {"native_fp32": "other", "native_bf16": "other"}}
    monkeypatch.setattr(golden, "load_golden", lambda: fake)
    curves, comparison = stored_curves("native_fp32")
    assert curves == "mine" and comparison.exact
    curves, comparison = stored_curves("native_fp32", here=_another_machine())
    assert curves == "mine" and comparison.rel == numerics.TOLERANCE["fp32"] == 1e-6
    mine = golden.environment()
    assert f"cpu {mine['cpu']!r} there, 'Another CPU' here" in comparison.reason
    assert f"isa {mine['isa']!r} there, 'avx2,amx_bf16' here" in comparison.reason
    assert ADD in comparison.reason
    curves, comparison = stored_curves("native_bf16")
    assert comparison.rel == numerics.TOLERANCE["bf16"] == 2e-3 and curves == "other"
    monkeypatch.setitem(fake, here, {})
    curves, comparison = stored_curves("native_fp32")
    assert curves == "other" and not comparison.exact
    monkeypatch.setenv(REQUIRED, "exact")
    with pytest.raises(pytest.fail.Exception, match="recorded in another environment"):
        stored_curves("native_fp32")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_loss_curve_matches_the_golden_values(name, tmp_path):
    want, comparison = stored_curves(name)
    comparison.announce(f"golden curve {name}")
    got = run_config(name, str(tmp_path))
    assert len(got["lm_loss"]) == ITERATIONS and all(
        abs(x - math.log(VOCAB)) < 0.5 for x in got["lm_loss"])  # a fresh model on 257 ids
    for key in ("lm_loss", "grad_norm", "valid_lm_loss"):
        assert len(got[key]) == len(want[key]), (name, key)
        for i, (a, b) in enumerate(zip(got[key], want[key])):
            problem = comparison.mismatch(a, b)
            assert problem is None, (f"{name}: {key}[{i}] is {problem}; {comparison.describe()}."
                                     f" If the numerics changed on purpose: {REGENERATE}")
