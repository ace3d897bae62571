"""FLOPs and peaks for MFU and HFU: Megatron's FLOP formulas, a datasheet table of GPU peaks,
and a stable, cached, measured peak for CPUs.

Model FLOPs per token (Narayanan et al. 2021, appendix A, divided by the B*s tokens of a batch;
forward + backward = 3 x forward, 2 FLOPs per multiply-add, attention not halved for the causal
mask), for L layers of width h, MLP width f, sequence s and padded vocabulary V::

    L (24 h^2 + 12 h f + 12 s h) + 6 h V   =   72 L h^2 (1 + s/(6h) + V/(12 L h))  when f = 4h

With Mixture of Experts an MoE layer's f is the width a token goes through (k experts of
--moe-ffn-hidden-size, plus the shared expert): MFU counts active FLOPs, as Megatron does.

Hardware FLOPs add what activation recompute runs again: with full recompute every layer's
forward runs twice (the logits are not recomputed), so the transformer term grows by 4/3
(96 L h^2 (1 + s/(6h)) + 6 h V for f = 4h); with selective recompute (the attention core only)
the attention-core term 12 s h doubles, Korthikanti et al.'s 72 L h^2 (1 + s/(3h) + V/(12 L h)).
(--recompute-method block recomputes only L_r of the L layers: the model FLOPs plus a third of
those layers' fwd+bwd, 24 L_r h^2 (1 + s/(6h)) for f = 4h).

MFU = model FLOP/s per rank / peak; HFU = hardware FLOP/s per rank / peak (equal without
recompute). Peaks: on CUDA the datasheet's dense tensor-core peak for the run's dtype (fp32 runs
use the TF32 peak when torch allows TF32 matmuls, else plain FP32), or an "unknown GPU: pass
--peak-flops" answer; on the CPU the best n x n matmul throughput measured at the run's dtype and
thread count, cached per machine in a small JSON file so every run and rank uses the same number
(`tools/measure_peak_flops.py --force` re-measures, keeping the best measurement). `--peak-flops` overrides both.
"""
from __future__ import annotations

import json
import os
import platform
import time
from typing import Dict, Optional, Sequence, Tuple

import torch

from app.config import ModelConfig
from app.utils.dtypes import dtype_name
from app.utils.fileio import atomic_write_bytes

RECOMPUTE_MODES = ("none", "selective", "full")
CACHE_ENV = "GPT2_PEAK_FLOPS_CACHE"
"""Environment variable naming the CPU peak cache file (default under ~/.cache)."""


# ---------------------------------------------------------------------------- FLOP counts

def _layer_terms(m: ModelConfig) -> tuple:
    """Per-token fwd+bwd FLOPs of all L layers: (GEMMs: L x 24 h q + 12 h g (sum over the
    layers of the MLP width a token goes through), attention cores: L x 12 s q), q = heads x
    kv-channels (= h by default), g = 3/2 with --swiglu (Megatron's gated-linear factor: the
    gate and up projections and the down projection), else 1. A dense layer's MLP width is f;
    an MoE layer's is the active one, k x --moe-ffn-hidden-size + the shared expert (Megatron's
    num_floating_point_operations: the router is not counted, nor dropped or padded rows)."""
    h, s = m.hidden_size, m.seq_length
    q = m.num_attention_heads * m.head_dim
    gated = 1.5 if m.swiglu else 1.0
    widths = [m.moe.active_ffn_width() if is_moe else m.ffn_hidden_size
              for is_moe in m.moe.layer_pattern(m.num_layers)]
    return (m.num_layers * 24.0 * h * q + 12.0 * h * gated * sum(widths),
            m.num_layers * 12.0 * s * q)


def model_flops_per_token(m: ModelConfig) -> float:
    """Megatron's model FLOPs per token (fwd+bwd, no recompute): L (24 h^2 + 12 h f + 12 s h)
    + 6 h V, which is 72 L h^2 (1 + s/(6h) + V/(12 L h)) for the usual f = 4h (see
    `_layer_terms` for --swiglu, --kv-channels and MoE layers' active FLOPs)."""
    dense, core = _layer_terms(m)
    return dense + core + 6.0 * m.hidden_size * m.padded_vocab_size


def hardware_flops_per_token(m: ModelConfig, recompute: str = "none",
                             recomputed_layers: Optional[int] = None) -> float:
    """FLOPs per token the hardware runs, recompute included (see the module docstring).

    `recomputed_layers` (full recompute only) is how many of the L layers run their forward
    twice; None means all of them.
    """
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}, got {recompute!r}")
    dense, core = _layer_terms(m)
    logits = 6.0 * m.hidden_size * m.padded_vocab_size
    if recompute == "full":  # each recomputed layer's forward (a third of its fwd+bwd) runs again
        layers = m.num_layers if recomputed_layers is None else min(recomputed_layers,
                                                                    m.num_layers)
        return dense + core + layers / m.num_layers * (dense + core) / 3.0 + logits
    if recompute == "selective":  # Korthikanti et al.: the attention-core term doubles
        return dense + 2.0 * core + logits
    return model_flops_per_token(m)


# ---------------------------------------------------------------------------- GPU table

# Dense (no sparsity) peak FLOP/s per GPU from the vendor datasheets, by (name fragment, kind).
# The first fragment found in the device name wins, so the more specific names come first.
GPU_PEAKS: Tuple[Tuple[str, Dict[str, float]], ...] = (
    ("H100 PCIe", {"bf16": 756.5e12, "fp16": 756.5e12, "tf32": 378.0e12, "fp32": 51.2e12}),
    ("H100 NVL", {"bf16": 835.5e12, "fp16": 835.5e12, "tf32": 417.5e12, "fp32": 60.0e12}),
    ("H200 NVL", {"bf16": 835.5e12, "fp16": 835.5e12, "tf32": 417.5e12, "fp32": 60.0e12}),
    ("H200", {"bf16": 989.4e12, "fp16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12}),
    ("H100", {"bf16": 989.4e12, "fp16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12}),
    ("A100", {"bf16": 312.0e12, "fp16": 312.0e12, "tf32": 156.0e12, "fp32": 19.5e12}),
    ("L40S", {"bf16": 362.05e12, "fp16": 362.05e12, "tf32": 183.0e12, "fp32": 91.6e12}),
    ("L40", {"bf16": 181.05e12, "fp16": 181.05e12, "tf32": 90.5e12, "fp32": 90.5e12}),
    ("A10G", {"bf16": 70.0e12, "fp16": 70.0e12, "tf32": 35.0e12, "fp32": 31.2e12}),
    ("A10", {"bf16": 125.0e12, "fp16": 125.0e12, "tf32": 62.5e12, "fp32": 31.2e12}),
    ("L4", {"bf16": 121.0e12, "fp16": 121.0e12, "tf32": 60.0e12, "fp32": 30.3e12}),
    ("V100 PCIe", {"fp16": 112.0e12, "fp32": 14.0e12}),
    ("V100", {"fp16": 125.0e12, "fp32": 15.7e12}),
)


def precision_kind(dtype: torch.dtype, allow_tf32: bool) -> str:
    """Which datasheet column a run's matmuls use: bf16, fp16, tf32 or fp32."""
    if dtype == torch.bfloat16:
        return "bf16"
    if dtype == torch.float16:
        return "fp16"
    return "tf32" if allow_tf32 else "fp32"


def _normalize(name: str) -> str:
    """'Tesla V100-PCIE-16GB' -> 'tesla v100 pcie 16gb' (spellings of device names vary)."""
    return " ".join(name.lower().replace("-", " ").replace("_", " ").split())


def gpu_peak_from_table(device_name: str, dtype: torch.dtype,
                        allow_tf32: Optional[bool] = None) -> Optional[Tuple[float, str]]:
    """(dense peak FLOP/s, description) for a known GPU name and dtype, else None.

    `allow_tf32` None reads torch.backends.cuda.matmul.allow_tf32 (fp32 runs then use TF32).
    """
    if allow_tf32 is None:
        allow_tf32 = bool(torch.backends.cuda.matmul.allow_tf32)
    kind = precision_kind(dtype, allow_tf32)
    name = _normalize(device_name)
    for fragment, peaks in GPU_PEAKS:
        if _normalize(fragment) in name and kind in peaks:
            return peaks[kind], f"{device_name} {kind} dense peak (datasheet)"
    return None


# ---------------------------------------------------------------------------- CPU measurement

def matmul_flops_by_size(device: torch.device, dtype: torch.dtype,
                         sizes: Sequence[int] = (256, 512, 1024, 1536, 2048), repeats: int = 8,
                         seconds_per_size: float = 1.0) -> Dict[int, float]:
    """{n: best FLOP/s of an n x n @ n x n matmul} on `device` at `dtype`.

    Each size is warmed up, then timed up to `repeats` times or `seconds_per_size`, keeping the
    best (a busy moment can only lower a timing, so best-of is robust). Sizes after one whose
    single matmul takes longer than `seconds_per_size` are skipped (slow dtypes on CPUs).
    """
    device = torch.device(device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    gen = torch.Generator().manual_seed(0)  # measuring must not move the seeded streams
    by_n: Dict[int, float] = {}
    for n in sizes:
        a = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
        b = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
        out = torch.empty(n, n, device=device, dtype=dtype)
        torch.matmul(a, b, out=out)  # warm-up: allocation, kernel choice, thread pool
        sync()
        best, spent = float("inf"), 0.0
        for _ in range(repeats):
            start = time.perf_counter()
            torch.matmul(a, b, out=out)
            sync()
            took = time.perf_counter() - start
            best, spent = min(best, took), spent + took
            if spent > seconds_per_size:
                break
        by_n[n] = 2.0 * n ** 3 / best
        if best > seconds_per_size:
            break
    return by_n


def measure_matmul_peak(device: torch.device, dtype: torch.dtype,
                        sizes: Sequence[int] = (256, 512, 1024, 1536, 2048),
                        repeats: int = 8) -> float:
    """Best matmul FLOP/s over `sizes` (see matmul_flops_by_size)."""
    return max(matmul_flops_by_size(device, dtype, sizes, repeats).values())


def cpu_model_name() -> str:
    """The CPU's model name (from /proc/cpuinfo where there is one)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_peak_cache_path() -> str:
    """The CPU peak cache file: $GPT2_PEAK_FLOPS_CACHE, else ~/.cache/gpt2-megatron/peak_flops.json."""
    default = os.path.join(os.path.expanduser("~"), ".cache", "gpt2-megatron", "peak_flops.json")
    return os.environ.get(CACHE_ENV) or default


def cpu_peak_key(dtype: torch.dtype, threads: int) -> str:
    """Cache key: CPU model, thread count, dtype and torch version."""
    return f"{cpu_model_name()} | {threads} threads | {dtype_name(dtype)} | torch {torch.__version__}"


def _read_cache(path: str) -> Dict[str, float]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        return {str(k): float(v) for k, v in data.items()} if isinstance(data, dict) else {}
    except (OSError, ValueError, TypeError):
        return {}


def cached_cpu_peak(dtype: torch.dtype, threads: Optional[int] = None, remeasure: bool = False,
                    cache_path: Optional[str] = None, reset: bool = False) -> Tuple[float, str]:
    """(CPU peak FLOP/s at `dtype` and `threads`, description): read from the cache, or measured
    (with `threads` torch threads) and written to it.

    The cache keeps the best measurement ever taken for its key: other work on the machine can
    only slow a matmul down, so a lower re-measurement (`remeasure`) never replaces a higher
    one, and one measurement taken on a busy machine cannot pin MFU above 100 % for good (the
    description names the load average when it was above 0.5). `reset` drops the cached value
    first (after a hardware or BIOS change that really lowered the peak).
    """
    threads = threads or torch.get_num_threads()
    path = cache_path or cpu_peak_cache_path()
    key = cpu_peak_key(dtype, threads)
    cache = _read_cache(path)
    if key in cache and not (remeasure or reset):
        return cache[key], f"cached CPU {dtype_name(dtype)} matmul peak ({key}; {path})"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        value = measure_matmul_peak(torch.device("cpu"), dtype)
    finally:
        torch.set_num_threads(before)
    cache = _read_cache(path)  # another process may have written meanwhile
    if reset:
        cache.pop(key, None)
    kept = cache.get(key, 0.0)
    best = max(kept, value)
    note = ""
    if kept > value:
        note = (f"; this measurement gave {value / 1e12:.4f} TFLOP/s, below the "
                f"{kept / 1e12:.4f} cached (kept: the best measurement is the peak)")
    if load > 0.5:
        note += (f"; measured while the 1-minute load average was {load:.1f}, so it may be low: "
                 "re-measure on an idle machine with tools/measure_peak_flops.py --force")
    cache[key] = best
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        atomic_write_bytes(path, json.dumps(cache, indent=1, sort_keys=True).encode())
        where = f"written to {path}"
    except OSError as exc:
        where = f"not cached: {exc}"
    return best, f"measured CPU {dtype_name(dtype)} matmul peak ({key}; {where}{note})"


def peak_flops(device: torch.device, dtype: torch.dtype,
               override: Optional[float] = None) -> Tuple[float, str]:
    """(peak FLOP/s per rank, description) for MFU; NaN with the reason when it is unknown.

    `override` (--peak-flops) wins; CUDA devices use the datasheet table; the CPU its cached
    measured peak at this process's thread count.
    """
    if override:
        return float(override), "--peak-flops"
    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        known = gpu_peak_from_table(name, dtype)
        if known is not None:
            return known
        return float("nan"), f"unknown GPU {name!r}: pass --peak-flops <dense FLOP/s per GPU>"
    return cached_cpu_peak(dtype)
