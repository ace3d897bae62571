#!/usr/bin/env python
"""Build the default loose-JSON corpus from the Python standard library installed here.

    python tools/build_stdlib_corpus.py --output data/stdlib.jsonl [--max-bytes 50000000]

One line per `.py` file: {"content": <source>, "path": <path relative to the stdlib dir>}, in
sorted path order (deterministic), like CodeParrot. site-packages/dist-packages are left out.
Files that are not valid UTF-8 are skipped and counted. --max-bytes stops before the UTF-8
size of the collected sources would pass the limit.
"""
from __future__ import annotations

import json
import os
import sys
import sysconfig
from dataclasses import dataclass
from typing import ClassVar, Dict, Iterator, List, Optional, Tuple

# this checkout's `app`, whether or not the project is pip-installed
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from app.config.cli import parse_config
from app.config.options import PathOption, option
from app.utils.fileio import atomic_open

EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_python_files(root: str) -> Iterator[str]:
    """Paths of the .py files under root, relative to it, in sorted order (dirs sorted too)."""
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS)
        for name in sorted(filenames):
            if name.endswith(".py"):
                yield os.path.relpath(os.path.join(dirpath, name), root)


def build_corpus(root: str, output: str, max_bytes: Optional[int] = None) -> Dict[str, int]:
    """Write the corpus of `root` to `output` (atomically); return counts (files, bytes, skipped)."""
    counts = {"files": 0, "bytes": 0, "skipped_non_utf8": 0}
    with atomic_open(output, "w", encoding="utf-8") as out:
        for rel in stdlib_python_files(root):
            with open(os.path.join(root, rel), "rb") as f:
                raw = f.read()
            try:
                content = raw.decode("utf-8")
            except UnicodeDecodeError:
                counts["skipped_non_utf8"] += 1
                continue
            if max_bytes is not None and counts["bytes"] + len(raw) > max_bytes:
                break
            out.write(json.dumps({"content": content, "path": rel.replace(os.sep, "/")}) + "\n")
            counts["files"] += 1
            counts["bytes"] += len(raw)
    return counts


@dataclass(kw_only=True)
class StdlibCorpusOptions:
    """tools/build_stdlib_corpus.py's command line: the output, a size limit, the stdlib."""

    FLAG_GROUP: ClassVar[Tuple[str, str]] = ("corpus", "where to write it and what to read")

    output: str = option("--output", required=True, help="output .jsonl path")
    max_bytes: Optional[int] = option("--max-bytes", default=None,
                                      help="stop before this many source bytes")
    stdlib_dir: str = option("--stdlib-dir",
                             path=PathOption("dir", "a Python standard library directory"),
                             default_factory=lambda: sysconfig.get_paths()["stdlib"],
                             help="default: the running Python's standard library")


def main(argv: Optional[List[str]] = None) -> Dict[str, int]:
    args = parse_config(StdlibCorpusOptions, argv, __doc__.splitlines()[0])
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    counts = build_corpus(args.stdlib_dir, args.output, args.max_bytes)
    print(f"wrote {args.output}: {counts['files']} files, {counts['bytes']} bytes from "
          f"{args.stdlib_dir}; skipped {counts['skipped_non_utf8']} files that are not valid UTF-8",
          file=sys.stderr)
    return counts


if __name__ == "__main__":
    main()
