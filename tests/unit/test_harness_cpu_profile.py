"""tests/harness/cpu_profile.py: the per-file sums of a recorded profile, against hand-computed
values."""
from tests.harness.cpu_profile import summarize


def test_the_profile_is_summed_by_file_most_cpu_first(tmp_path):
    profile = tmp_path / "p.tsv"
    profile.write_text("2.00\t3.00\ttests/a.py::test_one\n"
                       "1.00\t1.00\ttests/b.py::test_x[1]\n"
                       "4.00\t2.00\ttests/a.py::test_two\n"
                       "3.00\t6.00\ttests/b.py::test_x[2]\n")
    rows = summarize(str(profile)).splitlines()
    # b: 4 s wall, 7 s CPU over 2 tests; a: 6 s wall, 5 s CPU; total 10 s wall, 12 s CPU
    assert rows[1].split() == ["4.0", "7.0", "1.75", "2", "tests/b.py"]
    assert rows[2].split() == ["6.0", "5.0", "0.83", "2", "tests/a.py"]
    assert rows[3].split() == ["10.0", "12.0", "total"]
