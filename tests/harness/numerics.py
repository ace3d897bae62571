"""Numbers recorded on one machine, and how a test compares with them: bit for bit where they were
recorded, within a stated tolerance anywhere else, saying which and why.

A loss curve is bitwise reproducible only by the same kernels on the same processor: torch's CPU
kernels (ATen's vector width), oneDNN's and MKL's (each picks its code from the instruction sets
the processor has: AVX-512, its BF16/FP16/VNNI extensions, AMX) reduce in different orders, and so
does the number of threads. The environment key names all of that:

    torch=2.13.0+cpu; build=cf30153c4c13; cpu=AMD EPYC; kernels=AVX2;
    isa=avx2,f16c,fma; onednn=3.12.0; mkl=2024.2; threads=1; overrides=none

(`environment`; `overrides` lists the variables that force another kernel choice, e.g.
ATEN_CPU_CAPABILITY or MKL_CBWR, when set). Values recorded under exactly this machine's key are
compared exactly (a change of the last bit is a change of the numerics). Values recorded under
any other key, including the keys of the older format `torch 2.13.0+cpu, cpu AVX512` (torch and
ATen's vector width only, which two different processors can share), are compared within the
tolerance of the run's precision (`TOLERANCE`), and the test says so in a warning naming the key
that differs.

The tolerances, relative, for losses and gradient norms:

- fp32 1e-6. Measured between processors: at most 1.2e-7 over the 10 iterations of the golden fp32
  curves (this AMD EPYC, AVX2, against the Intel AVX-512 machine that recorded them) and 8e-8 on an
  Intel machine with AMX; kernels differ in the last bits and ten steps of training carry that
  forward. A real change is larger: --adam-eps 1e-8 -> 1e-9 moves fp32 gradient norms by 2e-6,
  --norm-epsilon 1e-5 -> 1e-6 by 5e-3 (losses by 2e-5).
- bf16 and fp16 2e-3. Weights are rounded to 8 (bf16) or 11 (fp16) significant bits after every
  step, so a last-bit difference of an fp32 sum can move a weight by a whole step: measured
  between the same two processors, 2.8e-5 on bf16 losses and 3.2e-4 on bf16 gradient norms; 4e-7
  on the fp16 old checkpoints. A changed --norm-epsilon (1e-5 -> 1e-6 or 2e-5) moves bf16
  gradient norms by 5e-3.

Integers, loss scales, learning rates and skipped-iteration counts are exact everywhere (they are
powers of two and Python arithmetic, not kernels).
"""
from __future__ import annotations

import os
import platform
import re
import warnings
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

KERNEL_ISA = ("avx2", "fma", "f16c", "avx512f", "avx512dq", "avx512bw", "avx512vl",
              "avx512_vnni", "avx512_bf16", "avx512_fp16", "avx_vnni", "amx_tile", "amx_bf16",
              "amx_int8", "amx_fp16")
"""The processor flags (as /proc/cpuinfo names them) that change which kernel ATen, oneDNN or MKL
runs for a matmul, a reduction or an elementwise op."""

KERNEL_OVERRIDES = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "MKL_CBWR",
                    "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
"""Variables that make the libraries pick other kernels than the processor's best."""

FIELDS = ("torch", "build", "cpu", "kernels", "isa", "onednn", "mkl", "threads", "overrides")

TOLERANCE = {"fp32": 1e-6, "bf16": 2e-3, "fp16": 2e-3}
"""Relative tolerance, by the run's precision, for a loss or gradient norm recorded in another
environment (the module docstring says where each comes from)."""

class ComparisonWarning(UserWarning):
    """A recorded number was compared within a tolerance, not bit for bit (another environment)."""


def _cpuinfo() -> Tuple[str, List[str]]:
    """(model name, flags) of the first processor in /proc/cpuinfo (empty where there is none)."""
    name, flags = "", []
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip().lower()
                if key == "model name" and not name:
                    name = value.strip()
                elif key == "flags" and not flags:
                    flags = value.split()
                if name and flags:
                    break
    except OSError:
        pass
    return name or platform.processor() or platform.machine(), flags


def _library_versions() -> Tuple[str, str]:
    """(oneDNN, MKL) versions torch was built with, from torch.__config__.show()."""
    config = torch.__config__.show()
    onednn = re.search(r"MKL-DNN v(\S+)", config)
    mkl = re.search(r"Math Kernel Library Version (\S+?)(?:-|\s)", config)
    return onednn.group(1) if onednn else "none", mkl.group(1) if mkl else "none"


def environment(threads: Optional[int] = None) -> Dict[str, str]:
    """The fields of this machine's environment key (module docstring), for computations run
    with `threads` torch threads (default: torch's current count)."""
    name, flags = _cpuinfo()
    onednn, mkl = _library_versions()
    overrides = [f"{v}={os.environ[v]}" for v in KERNEL_OVERRIDES if os.environ.get(v)]
    return {"torch": torch.__version__, "build": (torch.version.git_version or "unknown")[:12],
            "cpu": " ".join(name.split()), "kernels": torch.backends.cpu.get_cpu_capability(),
            "isa": ",".join(sorted(f for f in KERNEL_ISA if f in flags)) or "none",
            "onednn": onednn, "mkl": mkl,
            "threads": str(threads if threads is not None else torch.get_num_threads()),
            "overrides": ",".join(overrides) or "none"}


def key_of(fields: Dict[str, str]) -> str:
    """The key text of `fields`: `name=value` pairs in FIELDS order, joined by '; '."""
    return "; ".join(f"{name}={fields[name]}" for name in FIELDS)


def fields_of(key: str) -> Optional[Dict[str, str]]:
    """The fields of a key written by `key_of`; None for a key of another (older) format."""
    pairs = [part.partition("=") for part in key.split("; ")]
    fields = {name: value for name, sep, value in pairs if sep}
    return fields if list(fields) == list(FIELDS) and len(pairs) == len(FIELDS) else None


def this_environment(threads: Optional[int] = None) -> str:
    """This machine's environment key."""
    return key_of(environment(threads))


def precision_of(argv: Sequence[str]) -> str:
    """fp16, bf16 or fp32: the precision a pretrain_gpt2.py command line trains in (a DeepSpeed
    JSON's precision is not read: the recorded DeepSpeed runs are fp32)."""
    return "fp16" if "--fp16" in argv else "bf16" if "--bf16" in argv else "fp32"


@dataclass(frozen=True)
class Comparison:
    """How recorded floats are compared: exactly (`rel` 0) or within `rel`, and why."""

    rel: float
    reason: str

    @property
    def exact(self) -> bool:
        return self.rel == 0.0

    def describe(self) -> str:
        how = "bit for bit" if self.exact else f"within a relative {self.rel:g}"
        return f"compared {how}: {self.reason}"

    def mismatch(self, got: object, want: object, kernel_dependent: bool = True
                 ) -> Optional[str]:
        """None when `got` passes for the recorded `want`; else what is wrong. Only a float
        that kernels compute (`kernel_dependent`: a loss, a gradient norm) may differ by the
        tolerance; anything else (an iteration, a loss scale, a learning rate) must be equal."""
        if (kernel_dependent and not self.exact and isinstance(want, float)
                and isinstance(got, (int, float))):
            gap = abs(got - want) / max(abs(want), 1e-30)
            return None if gap <= self.rel else (f"{got!r}, recorded {want!r} (relative gap "
                                                 f"{gap:.1e} > {self.rel:g})")
        return None if got == want else f"{got!r}, recorded {want!r}"

    def announce(self, what: str) -> None:
        """Print the comparison (shown with the test's output); warn when it is not exact, so
        the run's summary says which tests compared within a tolerance."""
        print(f"{what}: {self.describe()}")
        if not self.exact:
            warnings.warn(f"{what}: {self.describe()}", ComparisonWarning, stacklevel=2)


def _differences(recorded: str, here: Dict[str, str]) -> str:
    fields = fields_of(recorded)
    if fields is None:
        return (f"recorded under {recorded!r}, a key of the older format (torch version and "
                "ATen's vector width only, which other processors share)")
    changed = [f"{k} {fields[k]!r} there, {here[k]!r} here" for k in FIELDS if fields[k] != here[k]]
    return f"recorded in another environment ({'; '.join(changed)})"


def comparison_for(recorded: Sequence[str], precision: str, threads: Optional[int] = None,
                   here: Optional[Dict[str, str]] = None, hint: str = "") -> Tuple[str, Comparison]:
    """(the recorded key to compare with, how): this machine's key when `recorded` holds it
    (exact), else the recorded key sharing most fields with it (within TOLERANCE[precision],
    the reason naming the fields that differ and `hint`, how to record this machine).
    `here` replaces this machine's fields (tests fake another machine with it)."""
    if not recorded:
        raise ValueError("nothing recorded to compare with")
    here = here if here is not None else environment(threads)
    key = key_of(here)
    if key in recorded:
        return key, Comparison(0.0, "recorded in this environment")

    def shared(other: str) -> int:
        fields = fields_of(other) or {}
        return sum(fields.get(k) == here[k] for k in FIELDS)

    closest = max(recorded, key=shared)
    reason = f"{_differences(closest, here)}; tolerance for {precision}"
    return closest, Comparison(TOLERANCE[precision], reason + (f"; {hint}" if hint else ""))
