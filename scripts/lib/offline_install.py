"""Helpers of scripts/wheelhouse.sh and scripts/setup_env.sh for installs with no network.

Standard library only (pip's vendored `packaging` where markers are evaluated): `check-torch`
runs under a cluster's own Python before anything of ours is installed there.

    python scripts/lib/offline_install.py check-torch
    python scripts/lib/offline_install.py filter-requirements requirements.txt --drop torch
    python scripts/lib/offline_install.py platforms manylinux_2_28_x86_64
    python scripts/lib/offline_install.py wheel-deps deepspeed-0.19.8-py3-none-any.whl --python 3.12
    python scripts/lib/offline_install.py torch-deps --python 3.12
    python scripts/lib/offline_install.py omit-present DIR --present scripts/lib/gpu_image_packages.txt
    python scripts/lib/offline_install.py manifest DIR --requirements requirements.txt ...
    python scripts/lib/offline_install.py check-manifest DIR --requirements requirements.txt
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import sys
import time
import zipfile
from typing import Dict, Iterable, List, Optional, Sequence

MIN_TORCH = (2, 5)
"""The oldest torch the project runs on, and why (docs/gpu.md)."""
MIN_TORCH_WHY = ("it calls F.scaled_dot_product_attention(enable_gqa=...), "
                 "torch.serialization.safe_globals and get_unsafe_globals_in_checkpoint, "
                 "all new in torch 2.5")
CUDA_RUNTIME_PREFIXES = ("nvidia-", "triton", "cuda-", "pytorch-triton")
"""Distributions that come with a CUDA torch: the cluster's torch brings its own."""
TORCH_DEPS_FALLBACK = ["filelock", "typing-extensions>=4.10.0", "sympy>=1.13.3",
                       "networkx>=2.5.1", "jinja2", "fsspec>=0.8.5", "setuptools"]
"""torch's pure-Python dependencies, when no torch is installed where the wheelhouse is built."""
MANIFEST = "MANIFEST.json"
KEEP_SMALL_BYTES = 1 << 20
"""omit-present keeps a present distribution's pure-Python wheel below this size: cheap to
carry, and there if a requirement wants a newer version than the target's."""

_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")
_MANYLINUX = re.compile(r"^manylinux_(\d+)_(\d+)_(\w+)$")
_LEGACY = {"manylinux2014": 17, "manylinux2010": 12, "manylinux1": 5}


def normalize(name: str) -> str:
    """PEP 503 name: 'Typing_Extensions' -> 'typing-extensions'."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(line: str) -> Optional[str]:
    """The normalized project name of a requirement line; None for blanks, comments, options."""
    text = line.split("#", 1)[0].strip()
    if not text or text.startswith("-"):
        return None
    match = _NAME.match(text)
    return normalize(match.group(1)) if match else None


def filter_requirements(lines: Iterable[str], drop: Sequence[str]) -> List[str]:
    """`lines` without the requirements of the projects named in `drop` (comments kept)."""
    dropped = {normalize(d) for d in drop}
    return [line.rstrip("\n") for line in lines if requirement_name(line) not in dropped]


def expand_platforms(tags: Sequence[str]) -> List[str]:
    """pip matches platform tags exactly: manylinux_2_N_ARCH stands here for every manylinux
    tag a glibc 2.N machine of that architecture accepts (2_N down to 2_17, or 2_5 on x86),
    legacy aliases included; other tags pass through."""
    out: List[str] = []
    for tag in tags:
        match = _MANYLINUX.match(tag)
        if not match or match.group(1) != "2":
            out.append(tag)
            continue
        glibc, arch = int(match.group(2)), match.group(3)
        lowest = 5 if arch in ("x86_64", "i686") else 17
        for minor in range(glibc, lowest - 1, -1):
            out.append(f"manylinux_2_{minor}_{arch}")
            out.extend(f"{legacy}_{arch}" for legacy, m in _LEGACY.items()
                       if m == minor and (m == 17 or arch in ("x86_64", "i686")))
    return list(dict.fromkeys(out))


def target_environment(python: str, platform: str) -> Dict[str, str]:
    """PEP 508 marker variables of CPython `python` ('3.12') on a Linux `platform` tag."""
    match = re.match(r"^(?:manylinux_\d+_\d+|manylinux\d+|musllinux_\d+_\d+|linux)_(.+)$",
                     platform)
    machine = match.group(1) if match else "x86_64"
    return {"python_version": python, "python_full_version": python + ".0",
            "implementation_name": "cpython", "platform_python_implementation": "CPython",
            "sys_platform": "linux", "platform_system": "Linux", "os_name": "posix",
            "platform_machine": machine, "platform_release": "", "platform_version": "",
            "implementation_version": python + ".0", "extra": ""}


def _marker_holds(marker: str, env: Dict[str, str]) -> bool:
    try:
        from packaging.markers import Marker
    except ImportError:  # pip vendors it; the build Python always has pip
        from pip._vendor.packaging.markers import Marker
    return bool(Marker(marker).evaluate(env))


def runtime_requirements(requires: Iterable[str], env: Dict[str, str],
                         drop: Sequence[str] = ("torch",)) -> List[str]:
    """Requires-Dist entries that hold in `env` (no extras), without markers, without the
    projects in `drop` and without CUDA runtime packages."""
    dropped = {normalize(d) for d in drop}
    out = []
    for req in requires:
        spec, _, marker = req.partition(";")
        name = requirement_name(spec)
        if name is None or name in dropped or name.startswith(CUDA_RUNTIME_PREFIXES):
            continue
        if marker.strip() and not _marker_holds(marker.strip(), env):
            continue
        out.append(spec.strip())
    return out


def wheel_requires(wheel: str) -> List[str]:
    """The Requires-Dist lines of a wheel's METADATA."""
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        text = zf.read(name).decode("utf-8")
    return [line.split(":", 1)[1].strip() for line in text.splitlines()
            if line.startswith("Requires-Dist:")]


def torch_requires() -> List[str]:
    """Requires-Dist of the torch installed where this runs (the fallback list without one)."""
    from importlib import metadata
    try:
        return list(metadata.requires("torch") or [])
    except metadata.PackageNotFoundError:
        return list(TORCH_DEPS_FALLBACK)


def parse_version(text: str) -> tuple:
    """(major, minor) of a torch version: '2.6.0a0+ecf3bae.nv25.01' -> (2, 6)."""
    match = re.match(r"(\d+)\.(\d+)", text)
    if not match:
        raise ValueError(f"unreadable torch version {text!r}")
    return int(match.group(1)), int(match.group(2))


def check_torch() -> int:
    """Exit status 0 when this Python's torch is new enough; otherwise say why and how to fix."""
    want = "%d.%d" % MIN_TORCH
    try:
        import torch
    except ImportError as exc:
        print(f"setup: {sys.executable} cannot import torch ({exc}). The offline install keeps "
              "the machine's own torch and brings none: load the module or environment that "
              "provides torch, or pass --python with the Python that has it.", file=sys.stderr)
        return 1
    version = getattr(torch, "__version__", "?")
    try:
        too_old = parse_version(version) < MIN_TORCH
    except ValueError as exc:
        print(f"setup: {exc} at {getattr(torch, '__file__', '?')}", file=sys.stderr)
        return 1
    if too_old:
        print(f"setup: torch {version} at {os.path.dirname(torch.__file__)} is older than "
              f"{want}, the oldest this project supports ({MIN_TORCH_WHY}). Use a Python whose "
              f"torch is {want} or newer.", file=sys.stderr)
        return 1
    cuda = getattr(getattr(torch, "version", None), "cuda", None)
    print(f"setup: torch {version} (CUDA {cuda or 'none'}) at {os.path.dirname(torch.__file__)}; "
          f"the oldest supported is {want}")
    return 0


def file_sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def read_names(path: str) -> List[str]:
    """The normalized distribution names of a file with one per line (# comments allowed)."""
    with open(path) as f:
        return [n for n in (requirement_name(line) for line in f) if n]


def omit_present(folder: str, present: Iterable[str],
                 keep_under: int = KEEP_SMALL_BYTES) -> List[str]:
    """Delete from wheelhouse `folder` the wheels of the distributions in `present` (the
    target already has them), except pure-Python wheels smaller than `keep_under` bytes;
    returns the deleted file names. Offline pip then finds those requirements satisfied by
    the target's own versions (no requirement of ours pins a version that rules them out)."""
    present = {normalize(name) for name in present}
    removed = []
    for wheel in sorted(os.listdir(folder)):
        if not wheel.endswith(".whl") or normalize(wheel.split("-", 1)[0]) not in present:
            continue
        path = os.path.join(folder, wheel)
        if wheel.endswith("-none-any.whl") and os.path.getsize(path) < keep_under:
            continue
        os.remove(path)
        removed.append(wheel)
    return removed


def write_manifest(folder: str, requirements: str, python: str, platforms: Sequence[str],
                   omitted: Sequence[str] = ()) -> Dict:
    """MANIFEST.json of a wheelhouse: target, the requirements it was built from, its wheels
    and the distributions left out for the target's own (`omitted`); fails when a torch or
    CUDA runtime wheel slipped in (the cluster's own torch must stay)."""
    wheels = sorted(n for n in os.listdir(folder) if n.endswith(".whl"))
    bad = [w for w in wheels if requirement_name(w.split("-", 1)[0]) == "torch"
           or requirement_name(w.split("-", 1)[0]).startswith(CUDA_RUNTIME_PREFIXES)]
    if bad:
        raise SystemExit(f"wheelhouse: {', '.join(bad)} must not be in it (the cluster brings "
                         "its own torch and CUDA)")
    manifest = {"python": python, "platforms": list(platforms),
                "built": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "requirements_sha256": file_sha256(requirements), "wheels": wheels,
                "omitted_present": sorted(omitted)}
    with open(os.path.join(folder, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)
    return manifest


def check_manifest(folder: str, requirements: str) -> int:
    """0 when `folder` is a wheelhouse (a warning when built from other requirements), else 1."""
    path = os.path.join(folder, MANIFEST)
    if not os.path.isfile(path):
        print(f"setup: {folder} is not a wheelhouse (no {MANIFEST}); build one with "
              "scripts/wheelhouse.sh --output DIR", file=sys.stderr)
        return 1
    with open(path) as f:
        manifest = json.load(f)
    if manifest.get("requirements_sha256") != file_sha256(requirements):
        print(f"setup: warning: {folder} was built from another requirements.txt; a missing "
              "package will stop the install (rebuild it with scripts/wheelhouse.sh)",
              file=sys.stderr)
    here = "%d.%d" % sys.version_info[:2]
    if manifest.get("python") != here:
        print(f"setup: warning: {folder} was built for Python {manifest.get('python')}, this is "
              f"{here}", file=sys.stderr)
    if manifest.get("omitted_present"):
        print(f"setup: {folder} leaves out {len(manifest['omitted_present'])} distributions this "
              f"machine is expected to have ({', '.join(manifest['omitted_present'][:8])}"
              f"{', ...' if len(manifest['omitted_present']) > 8 else ''}); pip stops and names "
              "any that is missing")
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("check-torch", help="is this Python's torch new enough?")
    p = sub.add_parser("filter-requirements", help="print a requirements file without some")
    p.add_argument("file")
    p.add_argument("--drop", nargs="+", default=["torch"])
    p = sub.add_parser("platforms", help="expand manylinux tags for pip download")
    p.add_argument("tags", nargs="+")
    for name in ("wheel-deps", "torch-deps"):
        p = sub.add_parser(name, help="runtime requirements for the target, torch excluded")
        if name == "wheel-deps":
            p.add_argument("wheel")
        p.add_argument("--python", required=True, help="target CPython version, e.g. 3.12")
        p.add_argument("--platform", default="manylinux_2_28_x86_64")
    p = sub.add_parser("omit-present", help="delete the wheels of distributions the target has")
    p.add_argument("folder")
    p.add_argument("--present", required=True, help="a file naming them, one per line")
    p = sub.add_parser("manifest", help="write MANIFEST.json into a wheelhouse")
    p.add_argument("folder")
    p.add_argument("--requirements", required=True)
    p.add_argument("--python", required=True)
    p.add_argument("--platform", nargs="+", required=True)
    p.add_argument("--omitted", nargs="*", default=[],
                   help="distributions left out for the target's own (omit-present)")
    p = sub.add_parser("check-manifest", help="is DIR a wheelhouse for these requirements?")
    p.add_argument("folder")
    p.add_argument("--requirements", required=True)
    args = parser.parse_args(argv)

    if args.command == "check-torch":
        return check_torch()
    if args.command == "filter-requirements":
        with open(args.file) as f:
            print("\n".join(filter_requirements(f, args.drop)))
    elif args.command == "platforms":
        print("\n".join(expand_platforms(args.tags)))
    elif args.command in ("wheel-deps", "torch-deps"):
        env = target_environment(args.python, args.platform)
        requires = wheel_requires(args.wheel) if args.command == "wheel-deps" else torch_requires()
        print("\n".join(runtime_requirements(requires, env)))
    elif args.command == "omit-present":
        print("\n".join(omit_present(args.folder, read_names(args.present))))
    elif args.command == "manifest":
        write_manifest(args.folder, args.requirements, args.python, args.platform, args.omitted)
    elif args.command == "check-manifest":
        return check_manifest(args.folder, args.requirements)
    return 0


if __name__ == "__main__":
    sys.exit(main())
