"""A fresh environment that installed requirements.txt (and not the project) runs the tools, the
benchmarks and pretrain_gpt2.py from the repository root and from any other directory: each
entry script puts its own checkout on sys.path. The fresh venv borrows this venv's packages
through a .pth file, so nothing is downloaded."""
import os
import subprocess
import sys
import sysconfig

from tests.harness.launch import ROOT


def _bare_venv(tmp_path):
    """A venv without the project, whose site-packages points at this interpreter's packages."""
    venv = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    python = venv / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    shared = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    with open(os.path.join(site, "shared-venv.pth"), "w", encoding="utf-8") as f:
        f.writelines(path + "\n" for path in sorted(shared))
    return python


def _run(python, args, cwd):
    clean = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"),
             "OMP_NUM_THREADS": "1"}  # no PYTHONPATH: only what the venv holds
    return subprocess.run([str(python), *args], cwd=cwd, env=clean, capture_output=True,
                          text=True, timeout=300)


def test_tools_run_after_installing_requirements_only(tmp_path):
    python = _bare_venv(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    installed = _run(python, ["-m", "pip", "install", "--no-index", "--no-deps", "-q",
                              "--disable-pip-version-check", "-r", "requirements.txt"], ROOT)
    assert installed.returncode == 0, installed.stderr[-3000:]
    probe = _run(python, ["-c", "import app"], elsewhere)
    assert probe.returncode != 0 and "No module named 'app'" in probe.stderr, \
        "the fresh venv must not hold the project itself"
    for script in ("tools/preprocess_data.py", "pretrain_gpt2.py", "bench/bench_index.py",
                   "tools/convert_checkpoint.py"):
        for cwd, path in ((ROOT, script), (elsewhere, os.path.join(ROOT, script))):
            done = _run(python, [path, "--help"], cwd)
            assert done.returncode == 0 and "usage:" in done.stdout, \
                f"{script} --help from {cwd}: {done.stderr[-3000:]}"
