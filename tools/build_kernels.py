#!/usr/bin/env python
"""Prebuild the csrc/ fused kernels into the build cache, and print what was built (or why not).

    python tools/build_kernels.py                       # for this machine's GPU
    python tools/build_kernels.py --arch 8.0 9.0        # for other architectures (no GPU needed)
    python tools/build_kernels.py --build-dir /shared/kernels --timeout 1800

Training runs find the library there on first use (same torch, CUDA, arch and sources) instead
of compiling; pass the same --build-dir as --kernel-build-dir (or set $APP_KERNELS_BUILD_DIR).
Without --arch and without a GPU it says so and exits 1. Exit status 0 only if every requested
architecture built and (for this machine's GPU) loaded.
"""
from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path
from dataclasses import dataclass
from typing import ClassVar, List, Optional, Tuple

import torch

# this checkout's `app`, whether or not the project is pip-installed
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from app.config.cli import parse_config
from app.config.options import option
from app.kernels import build


@dataclass(kw_only=True)
class BuildKernelsOptions:
    """tools/build_kernels.py's command line: the architectures, the cache, the time limit."""

    FLAG_GROUP: ClassVar[Tuple[str, str]] = ("kernels", "what to build and where")

    arch: Optional[List[str]] = option(
        "--arch", default=None, nargs="*",
        help="compute capabilities such as 8.0 9.0 (default: this GPU's)")
    build_dir: Optional[str] = option(
        "--build-dir", default=None,
        help=f"cache root (default ${build.BUILD_DIR_ENV} or ~/.cache/app_kernels)")
    timeout: float = option("--timeout", default=1800.0, help="seconds per build")


def _build_one(arch: str, root: Path, timeout: float, cuda_home: str) -> bool:
    start = time.time()
    try:
        library = build.ensure_built(build.kernel_spec(arch), root, local_rank=0,
                                     timeout_s=timeout, cuda_home=cuda_home)
    except build.BuildError as err:
        print(f"sm_{arch.replace('.', '')}: FAILED: {err}")
        return False
    print(f"sm_{arch.replace('.', '')}: {library} ({time.time() - start:.0f} s)")
    return True


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_config(BuildKernelsOptions, argv, __doc__.splitlines()[0])
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cuda_home = build.find_cuda_home()
    if cuda_home is None:
        print("no CUDA toolkit: nvcc not found (install one matching torch's CUDA "
              f"{torch.version.cuda}, or set CUDA_HOME)")
        return 1
    archs = args.arch
    if not archs:
        if not torch.cuda.is_available():
            print("no CUDA device here: name the architectures with --arch (e.g. --arch 9.0)")
            return 1
        archs = ["%d.%d" % torch.cuda.get_device_capability()]
    root = Path(args.build_dir) if args.build_dir else build.default_build_root()
    print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), nvcc "
          f"{build.nvcc_version(cuda_home)} at {cuda_home}, cache {root}")
    ok = all([_build_one(arch, root, args.timeout, cuda_home) for arch in archs])
    if ok and torch.cuda.is_available() and not args.arch:
        from app.kernels import library

        library.configure(build_root=str(root), timeout_s=args.timeout)
        status = library.status()
        print(("loaded: " if status.available else "NOT loaded: ") + status.reason)
        ok = status.available
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
