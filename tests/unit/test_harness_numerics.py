"""tests.harness.numerics: the environment key that tells processors apart, and the choice between
comparing recorded numbers bit for bit and within the precision's tolerance."""
import warnings

import pytest

from tests.harness import numerics

OLD_KEY = "torch 2.13.0+cpu, cpu AVX512"


def test_the_key_names_torch_the_processor_its_kernel_isa_the_libraries_and_threads(monkeypatch):
    for name in numerics.KERNEL_OVERRIDES:
        monkeypatch.delenv(name, raising=False)
    fields = numerics.environment(threads=3)
    assert list(fields) == list(numerics.FIELDS)
    import torch
    assert fields["torch"] == torch.__version__ and fields["threads"] == "3"
    assert fields["kernels"] == torch.backends.cpu.get_cpu_capability()
    assert fields["overrides"] == "none" and fields["cpu"]
    assert set(fields["isa"].split(",")) <= set(numerics.KERNEL_ISA) | {"none"}
    assert fields["onednn"][0].isdigit() and fields["mkl"][0].isdigit()  # the x86 CPU build
    key = numerics.key_of(fields)
    assert numerics.fields_of(key) == fields and numerics.this_environment(3) == key
    monkeypatch.setenv("MKL_CBWR", "AVX2")
    assert numerics.environment(threads=3)["overrides"] == "MKL_CBWR=AVX2"
    assert numerics.environment(threads=1) != fields


def test_a_key_of_the_older_format_or_a_damaged_one_has_no_fields():
    assert numerics.fields_of(OLD_KEY) is None
    key = numerics.this_environment(1)
    assert numerics.fields_of(key.replace("; mkl=", "; MKL=")) is None
    assert numerics.fields_of(key + "; extra=1") is None


def test_exact_only_under_this_machines_full_key():
    here = numerics.environment(threads=1)
    key = numerics.key_of(here)
    chosen, comparison = numerics.comparison_for([OLD_KEY, key], "fp32", here=here)
    assert chosen == key and comparison.exact and comparison.rel == 0.0
    # the same torch and vector width, another processor model: the older key matched it
    other = dict(here, cpu="Intel(R) Xeon(R) Platinum 8480+", isa="amx_bf16,avx512_bf16,avx512f")
    chosen, comparison = numerics.comparison_for([OLD_KEY, key], "bf16", here=other, hint="rec")
    assert chosen == key and comparison.rel == 2e-3
    assert "cpu" in comparison.reason and "isa" in comparison.reason and "rec" in comparison.reason
    assert "torch" not in comparison.reason.split("(")[1]  # only the fields that differ
    chosen, comparison = numerics.comparison_for([OLD_KEY], "fp32", here=here)
    assert chosen == OLD_KEY and comparison.rel == 1e-6 and "older format" in comparison.reason
    with pytest.raises(ValueError):
        numerics.comparison_for([], "fp32", here=here)


def test_the_tolerance_path_passes_kernel_noise_only_in_kernel_computed_floats():
    loose = numerics.Comparison(1e-6, "another machine")
    exact = numerics.Comparison(0.0, "this machine")
    assert loose.mismatch(5.7005934715271, 5.700593948364258) is None  # 8e-8 apart
    assert exact.mismatch(5.7005934715271, 5.700593948364258) is not None
    assert "relative gap" in loose.mismatch(1.0000021, 1.0)  # e.g. a changed --adam-eps
    assert loose.mismatch(32768.0, 32768.0) is None
    assert loose.mismatch(0.00055, 0.0005500000001, kernel_dependent=False) is not None
    assert loose.mismatch(None, 1.0) is not None and loose.mismatch(3, 3) is None
    assert numerics.precision_of(["--fp16"]) == "fp16"
    assert numerics.precision_of(["--bf16", "--x"]) == "bf16"
    assert numerics.precision_of([]) == "fp32"


def test_a_test_says_which_comparison_it_made():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        numerics.Comparison(0.0, "recorded in this environment").announce("curve a")
        numerics.Comparison(2e-3, "recorded in another environment (cpu ...)").announce("curve b")
    assert [str(w.message) for w in caught] == [
        "curve b: compared within a relative 0.002: recorded in another environment (cpu ...)"]
    assert all(w.category is numerics.ComparisonWarning for w in caught)
