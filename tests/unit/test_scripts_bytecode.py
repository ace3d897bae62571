"""scripts/lib/bytecode.py, which scripts/setup_env.sh runs after `pip install --no-compile`:
every Python 3 file gets the bytecode CPython itself would load, with PYTHONDONTWRITEBYTECODE set
too; a current file is left alone, a changed one is compiled again, one that is not Python 3 is
skipped without failing the set-up."""
import importlib.util
import marshal
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(*folders):
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    return subprocess.run([sys.executable, str(ROOT / "scripts/lib/bytecode.py"),
                           *map(str, folders)], check=False, capture_output=True, text=True,
                          env=env, timeout=120)


def _value(source: Path):
    """VALUE as the bytecode file next to `source` defines it (its code object run afresh)."""
    data = Path(importlib.util.cache_from_source(str(source))).read_bytes()
    assert int.from_bytes(data[8:12], "little") == int(source.stat().st_mtime)  # CPython's check
    assert int.from_bytes(data[12:16], "little") == source.stat().st_size
    scope = {}
    exec(marshal.loads(data[16:]), scope)  # noqa: S102 - the compiled bytecode itself, run
    return scope["VALUE"]


def test_compiles_python3_files_skips_the_rest_and_recompiles_only_changes(tmp_path):
    site = tmp_path / "site"
    (site / "pkg" / "sub").mkdir(parents=True)
    first, second = site / "pkg" / "first.py", site / "pkg" / "sub" / "second.py"
    first.write_text("VALUE = 1\n")
    second.write_text("VALUE = 'two'\n")
    (site / "pkg" / "python2.py").write_text('print "a Python 2 sample"\n')
    done = _run(site)
    assert done.returncode == 0, done.stderr
    assert "2 of 3 files compiled or current" in done.stdout
    assert _value(first) == 1 and _value(second) == "two"
    assert not Path(importlib.util.cache_from_source(str(site / "pkg" / "python2.py"))).exists()

    kept = Path(importlib.util.cache_from_source(str(second))).stat().st_mtime_ns
    first.write_text("VALUE = 1000\n")  # another size: the old bytecode no longer matches
    os.utime(first, (first.stat().st_atime + 10, first.stat().st_mtime + 10))
    assert _run(site).returncode == 0
    assert _value(first) == 1000
    assert Path(importlib.util.cache_from_source(str(second))).stat().st_mtime_ns == kept
