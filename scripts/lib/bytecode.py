"""Compile the Python files under some folders to bytecode on every core.

    python scripts/lib/bytecode.py FOLDER...

What pip does at install time, one file after another on one core, done in parallel after
`pip install --no-compile` (scripts/setup_env.sh). A file whose bytecode is current is skipped
(compileall's own check of the source's mtime and size), so a second pass costs a second; a file
that does not compile (a Python 2 sample some packages ship) is skipped without a word, as pip
skips it. `python -m compileall -j 0` does the same, but sends the worker processes one file at a
time: ~15 s of overhead for 20,000 files even when there is nothing to compile.
"""
import compileall
import os
import sys
from collections.abc import Iterator
from multiprocessing import Pool


def sources(folders: list[str]) -> Iterator[str]:
    """Every .py file under the folders (not under __pycache__)."""
    for folder in folders:
        for root, dirs, files in os.walk(folder):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            yield from (os.path.join(root, name) for name in files if name.endswith(".py"))


def _compile(path: str) -> bool:
    return bool(compileall.compile_file(path, quiet=2))


def main(folders: list[str]) -> int:
    files = list(sources(folders))
    with Pool(os.cpu_count() or 1) as pool:
        compiled = sum(pool.imap_unordered(_compile, files, chunksize=128))
    print(f"bytecode: {compiled} of {len(files)} files compiled or current")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
