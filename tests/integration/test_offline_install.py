"""Offline install onto a machine's own Python and torch (docs/gpu.md), end to end.

scripts/wheelhouse.sh builds the wheelhouse for this Python and platform (from the package
index; cached under ~/.cache/gpt2-megatron/wheelhouse/, keyed by the requirements and the build
scripts; skipped when the index cannot be reached). A fresh venv plays the cluster's Python: it
sees torch and torch's own dependencies, and nothing else, through a .pth file naming a folder
of links into this environment - as a cluster's Python sees its own torch. Then
`scripts/setup_env.sh --wheelhouse DIR --no-venv` installs everything else with pip --no-index,
in a network namespace without network where `unshare -n` works, and the project runs there.
"""
import hashlib
import os
import shutil
import subprocess
import re
import sys
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from tests.harness.corpus import tiny_gpt_args

ROOT = Path(__file__).resolve().parents[2]
KEYED_ON = ["requirements.txt", "scripts/wheelhouse.sh", "scripts/lib/offline_install.py"]
PLATFORM = f"manylinux_2_28_{os.uname().machine}"
PY_VERSION = "%d.%d" % sys.version_info[:2]
UNREACHABLE = ("from versions: none", "Failed to establish a new connection",
               "Temporary failure in name resolution", "Network is unreachable",
               "Could not fetch URL", "timed out")


def _clean_env(**extra):
    """This environment without pip settings (no index, no find-links of this machine) and
    without PYTHONPATH, so only what the install put in place is found."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PIP_") and k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PIP_CONFIG_FILE=os.devnull, OMP_NUM_THREADS="1", **extra)
    return env


def _run(cmd, timeout=600, **kw):
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True,
                          timeout=timeout, **kw)


@pytest.fixture(scope="module")
def wheelhouse():
    """The cached wheelhouse for this Python and platform (built on first use)."""
    key = hashlib.sha256(b"".join((ROOT / p).read_bytes() for p in KEYED_ON)).hexdigest()[:16]
    cache = (Path.home() / ".cache" / "gpt2-megatron" / "wheelhouse"
             / f"cp{PY_VERSION.replace('.', '')}-{PLATFORM}-{key}")
    if (cache / "MANIFEST.json").is_file():
        return cache
    partial = cache.with_name(cache.name + f".tmp-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    proc = _run(["bash", ROOT / "scripts/wheelhouse.sh", "--output", partial,
                 "--build-python", sys.executable, "--platform", PLATFORM], timeout=900,
                env=dict(os.environ, PIP_DEFAULT_TIMEOUT="30", PIP_RETRIES="1"))
    if proc.returncode != 0:
        shutil.rmtree(partial, ignore_errors=True)
        if any(sign in proc.stderr for sign in UNREACHABLE):
            pytest.skip("the package index cannot be reached to build the wheelhouse: "
                        + proc.stderr.strip().splitlines()[-1])
        pytest.fail(f"wheelhouse.sh failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    shutil.rmtree(cache, ignore_errors=True)
    partial.rename(cache)
    return cache


def _closure(name):
    """torch's distribution and those it requires here (markers evaluated, no extras)."""
    seen, todo = {}, [name]
    while todo:
        dist = metadata.distribution(todo.pop())
        key = re.sub(r"[-_.]+", "-", dist.metadata["Name"]).lower()
        if key in seen:
            continue
        seen[key] = dist
        for spec in dist.requires or []:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen.values()


def _link_torch_site(folder: Path) -> Path:
    """A folder of links to torch and its requirements' files in this environment."""
    folder.mkdir()
    for dist in _closure("torch"):
        site = Path(dist.locate_file(""))
        tops = {Path(f).parts[0] for f in dist.files or []}
        for top in tops - {"..", "__pycache__"}:
            if (site / top).exists() and not (folder / top).exists():
                (folder / top).symlink_to(site / top)
    return folder


@pytest.fixture(scope="module")
def cluster_python(tmp_path_factory):
    """A fresh venv that sees only torch (and torch's own requirements) of this environment."""
    tmp = tmp_path_factory.mktemp("offline")
    venv = tmp / "venv"
    base = getattr(sys, "_base_executable", sys.executable)
    proc = _run([base, "-m", "venv", venv])
    assert proc.returncode == 0, proc.stderr
    site = Path(_run([venv / "bin/python", "-c",
                      "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    (site / "cluster_torch.pth").write_text(str(_link_torch_site(tmp / "torch_site")) + "\n")
    return venv / "bin/python", site


def _offline_prefix():
    """`unshare -n` (a network namespace with no network) where this machine allows it."""
    try:
        ok = _run(["unshare", "-n", "true"], timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    return ["unshare", "-n"] if ok else []


def test_offline_install_keeps_torch_and_runs(wheelhouse, cluster_python, tiny_corpus, tmp_path):
    python, site = cluster_python
    proc = _run([*_offline_prefix(), "bash", ROOT / "scripts/setup_env.sh", "--wheelhouse",
                 wheelhouse, "--python", python, "--no-venv"], env=_clean_env())
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert "setup: torch " in proc.stdout and "the oldest supported is 2.5" in proc.stdout
    assert not (site / "torch").exists(), "the install must keep the Python's own torch"

    env = _clean_env()
    where = _run([python, "-c", "import deepspeed, app, arguments, torch; "
                  "print(torch.__file__); print(deepspeed.__file__); print(app.__file__)"],
                 env=env, cwd=tmp_path)
    assert where.returncode == 0, where.stderr[-3000:]
    torch_file, ds_file, app_file = where.stdout.split()[-3:]  # after DeepSpeed's banner
    assert "torch_site" in torch_file and ds_file.startswith(str(site)), where.stdout
    assert app_file.startswith(str(ROOT)), where.stdout  # the checkout, editable

    helped = _run([python, ROOT / "tools/preprocess_data.py", "--help"], env=env, cwd=tmp_path)
    assert helped.returncode == 0 and "--output-prefix" in helped.stdout, helped.stderr[-2000:]
    dry = _run([python, ROOT / "pretrain_gpt2.py",
                *tiny_gpt_args(tiny_corpus, tmp_path, "--train-iters", "10", "--dry-run")],
               env=env, cwd=tmp_path)
    assert dry.returncode == 0 and "preflight passed" in dry.stdout, dry.stdout[-3000:]
    check = _run([python, "-m", "pip", "check"], env=env)
    assert check.returncode == 0, check.stdout + check.stderr


def test_setup_refuses_an_old_or_missing_torch(wheelhouse, cluster_python, tmp_path):
    python, _ = cluster_python
    old = tmp_path / "old" / "torch"
    old.mkdir(parents=True)
    (old / "__init__.py").write_text("__version__ = '2.4.1'\n")
    setup = ["bash", ROOT / "scripts/setup_env.sh", "--wheelhouse", wheelhouse,
             "--python", python, "--no-venv"]
    proc = _run(setup, env=_clean_env(PYTHONPATH=str(old.parent)))
    assert proc.returncode == 1 and "torch 2.4.1" in proc.stderr, proc.stderr[-2000:]
    assert "older than 2.5, the oldest this project supports" in proc.stderr

    missing = tmp_path / "missing" / "torch"
    missing.mkdir(parents=True)
    (missing / "__init__.py").write_text("raise ImportError('No module named torch')\n")
    proc = _run(setup, env=_clean_env(PYTHONPATH=str(missing.parent)))
    assert proc.returncode == 1 and "cannot import torch" in proc.stderr, proc.stderr[-2000:]

    # a venv on top of a Python that is itself a venv does not see that venv's torch
    proc = _run(["bash", ROOT / "scripts/setup_env.sh", "--wheelhouse", wheelhouse,
                 "--python", python, "--venv", tmp_path / "on_top"], env=_clean_env())
    assert proc.returncode == 1 and "does not see" in proc.stderr, proc.stderr[-2000:]
    assert "--no-venv" in proc.stderr
