"""scripts/lib/offline_install.py: the pure parts of the wheelhouse build and offline setup."""
import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("offline_install",
                                               ROOT / "scripts/lib/offline_install.py")
oi = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(oi)


def test_filter_requirements_drops_only_the_named_projects():
    lines = ["# torch first\n", "torch==2.13.0\n", "torchvision>=0.1\n", "deepspeed>=0.19,<0.20\n",
             "Typing_Extensions ; python_version < '3.12'\n", "-r other.txt\n", "\n"]
    assert oi.filter_requirements(lines, ["torch"]) == [
        "# torch first", "torchvision>=0.1", "deepspeed>=0.19,<0.20",
        "Typing_Extensions ; python_version < '3.12'", "-r other.txt", ""]
    kept = oi.filter_requirements(lines, ["torch", "deepspeed", "typing-extensions"])
    assert [oi.requirement_name(x) for x in kept] == [None, "torchvision", None, None]


def test_manylinux_tags_expand_to_every_older_glibc():
    x86 = oi.expand_platforms(["manylinux_2_28_x86_64"])
    assert x86[0] == "manylinux_2_28_x86_64" and x86[-1] == "manylinux1_x86_64"
    assert {"manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux2010_x86_64"} <= set(x86)
    arm = oi.expand_platforms(["manylinux_2_28_aarch64", "manylinux_2_17_aarch64"])
    assert arm[-1] == "manylinux2014_aarch64" and len(arm) == len(set(arm)) == 13
    assert oi.expand_platforms(["win_amd64"]) == ["win_amd64"]


def test_runtime_requirements_follow_the_target_and_leave_torch_and_cuda_out():
    requires = ["filelock", "setuptools; python_version >= '3.12'", "torch>=2.0.0",
                "nvidia-cublas-cu12==12.8; platform_system == 'Linux'", "triton==3.5",
                "pytest; extra == 'dev'", "pywin32; sys_platform == 'win32'"]
    env312 = oi.target_environment("3.12", "manylinux_2_28_x86_64")
    assert oi.runtime_requirements(requires, env312) == ["filelock", "setuptools"]
    env311 = oi.target_environment("3.11", "manylinux2014_aarch64")
    assert env311["platform_machine"] == "aarch64"
    assert oi.runtime_requirements(requires, env311) == ["filelock"]


def test_torch_versions_from_releases_and_vendor_builds():
    assert oi.parse_version("2.13.0+cpu") == (2, 13)
    assert oi.parse_version("2.6.0a0+ecf3bae40a.nv25.01") == (2, 6)
    assert oi.parse_version("2.4.1") < oi.MIN_TORCH <= oi.parse_version("2.5.0")
    with pytest.raises(ValueError):
        oi.parse_version("unknown")


def test_manifest_round_trip_and_refusal_of_torch_wheels(tmp_path, capsys):
    reqs = tmp_path / "requirements.txt"
    reqs.write_text("numpy\n")
    house = tmp_path / "house"
    house.mkdir()
    (house / "numpy-2.0-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"")
    py = "%d.%d" % sys.version_info[:2]
    written = oi.write_manifest(str(house), str(reqs), py, ["manylinux_2_28_x86_64"])
    assert json.loads((house / oi.MANIFEST).read_text()) == written
    assert oi.check_manifest(str(house), str(reqs)) == 0 and capsys.readouterr().err == ""
    reqs.write_text("numpy\nscipy\n")
    assert oi.check_manifest(str(house), str(reqs)) == 0
    assert "built from another requirements.txt" in capsys.readouterr().err
    assert oi.check_manifest(str(tmp_path), str(reqs)) == 1
    assert "scripts/wheelhouse.sh" in capsys.readouterr().err
    (house / "nvidia_cudnn_cu12-9.1-py3-none-manylinux_2_28_x86_64.whl").write_bytes(b"")
    with pytest.raises(SystemExit, match="nvidia_cudnn"):
        oi.write_manifest(str(house), str(reqs), py, ["manylinux_2_28_x86_64"])


def test_omit_present_leaves_out_what_the_target_has_but_small_pure_python_wheels(tmp_path,
                                                                                  capsys):
    house = tmp_path / "house"
    house.mkdir()
    wheels = {"numpy-2.5.5-cp312-cp312-manylinux_2_28_x86_64.whl": 10,  # compiled: out
              "transformers-5.24.0-py3-none-any.whl": oi.KEEP_SMALL_BYTES,  # large: out
              "typing_extensions-4.15.0-py3-none-any.whl": 1000,  # small pure Python: stays
              "deepspeed-0.19.8-py3-none-any.whl": oi.KEEP_SMALL_BYTES * 2}  # not present
    for name, size in wheels.items():
        (house / name).write_bytes(b"x" * size)
    present = tmp_path / "present.txt"
    present.write_text("# the image's distributions\nNumPy\ntransformers\ntyping-extensions\n")
    assert oi.read_names(str(present)) == ["numpy", "transformers", "typing-extensions"]
    removed = oi.omit_present(str(house), oi.read_names(str(present)))
    assert removed == ["numpy-2.5.5-cp312-cp312-manylinux_2_28_x86_64.whl",
                       "transformers-5.24.0-py3-none-any.whl"]
    assert sorted(p.name for p in house.iterdir()) == [
        "deepspeed-0.19.8-py3-none-any.whl", "typing_extensions-4.15.0-py3-none-any.whl"]
    reqs = tmp_path / "requirements.txt"
    reqs.write_text("numpy\ndeepspeed\n")
    py = "%d.%d" % sys.version_info[:2]
    manifest = oi.write_manifest(str(house), str(reqs), py, ["manylinux_2_28_x86_64"],
                                 omitted=["transformers", "numpy"])
    assert manifest["omitted_present"] == ["numpy", "transformers"]
    assert oi.check_manifest(str(house), str(reqs)) == 0
    assert "leaves out 2 distributions this machine is expected to have (numpy, " \
           "transformers)" in capsys.readouterr().out
