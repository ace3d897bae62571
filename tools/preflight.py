#!/usr/bin/env python
"""Check a training run without training: the same flags as pretrain_gpt2.py, one report.

    python tools/preflight.py --num-layers 24 --hidden-size 1024 ... --data-path data/corpus \\
        [--dry-run-world-size 8] [--dry-run-device-memory 80]

Equivalent to `python pretrain_gpt2.py <flags> --dry-run` (see docs/reliability.md): the flags
and the DeepSpeed JSON, the tokenizer and data files, the run's start-up decisions for --save
and --load (made by the functions the run itself calls, without writing anything) and a
per-rank memory estimate are checked in seconds, without a process group; the exit code is 0
when nothing is wrong and 2 when the report holds an error, as the real run's start-up would.
"""
from __future__ import annotations

import os
import sys
from typing import List, Optional

# this checkout's `app`, whether or not the project is pip-installed
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import pretrain_gpt2


def main(argv: Optional[List[str]] = None) -> int:
    """Run the preflight report for pretrain_gpt2.py's flags; return the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--dry-run" not in argv:
        argv.append("--dry-run")
    return pretrain_gpt2.main(argv)


if __name__ == "__main__":
    sys.exit(main())
