"""FLOPs and peaks for MFU and HFU: Megatron-LM's FLOP count, a datasheet table of GPU peaks,
and a stable, cached, measured peak for CPUs.

Model FLOPs are Megatron-LM's `num_floating_point_operations` (megatron/training/training.py,
`transformer_flops`), term for term, for the models this project builds: forward + backward =
3 x forward, 2 FLOPs per multiply-add, per token (tokens = global batch x sequence length)

    MLP      3 * 2 * h * (f * e * L_dense + (f_moe * k * e + f_shared * e) * L_moe)
    attention (projections)   3 * 2 * (h * (q + 2 kv) + q * h) * L
    attention (core)          3 * 2 * q / 2 * 2 * s * L     (QK^T and AV, halved: causal mask)
    logits   3 * 2 * h * V

with e = 3 for SwiGLU (gate, up and down projections) else 2, q = heads x kv-channels,
kv = query groups x kv-channels (kv = q without --group-query-attention), V the padded
vocabulary, s the sequence length; MoE layers (--num-experts, --moe-layer-freq) run k =
--moe-router-topk experts of width f_moe = --moe-ffn-hidden-size (default f) and the shared
expert f_shared. `num_floating_point_operations(m, batch_size)` is Megatron's per-iteration
number; tests/data/megatron_scripts holds Megatron's own values for its launch scripts.

Hardware FLOPs add what activation recompute runs again (Megatron has no HFU): with full
recompute each recomputed layer's forward (a third of its forward + backward) runs twice (the
logits are not recomputed); with selective recompute the forward of each --recompute-modules
module runs twice (core_attn: the attention core; mlp: the dense MLPs; moe: the MoE layers'
routed and shared experts; shared_experts: the shared expert).

MFU = model FLOP/s per rank / peak; HFU = hardware FLOP/s per rank / peak (equal without
recompute). Peaks: on CUDA the datasheet's dense tensor-core peak for the run's dtype (fp32 runs
use the TF32 peak when torch allows TF32 matmuls, else plain FP32; FP8 runs are still measured
against the bf16 peak, docs/fp8.md), or an "unknown GPU: pass --peak-flops" answer; on the CPU
the best n x n matmul throughput measured at the run's dtype and thread count, cached per
machine in a small JSON file so every run and rank uses the same number
(`tools/measure_peak_flops.py --force` re-measures, keeping the best measurement).
`--peak-flops` overrides both.
"""
from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Set, Tuple

import torch

from app.config import ModelConfig
from app.utils.dtypes import dtype_name
from app.utils.fileio import atomic_write_bytes

RECOMPUTE_MODES = ("none", "selective", "full")
CACHE_ENV = "GPT2_PEAK_FLOPS_CACHE"
"""Environment variable naming the CPU peak cache file (default under ~/.cache)."""
FWD_BWD = 3
"""Each GEMM runs three times: forward, backward data gradient, backward weight gradient."""
FMA = 2
"""FLOPs per multiply-add."""


# ---------------------------------------------------------------------------- FLOP counts

@dataclass(frozen=True)
class TokenFlops:
    """Forward + backward FLOPs per token of one model, by term (Megatron's transformer_flops
    divided by the tokens of a batch)."""

    mlp: float
    """Every layer's MLP (dense layers, and MoE layers' routed and shared experts)."""
    attention: float
    """Every layer's QKV and output projections."""
    core: float
    """Every layer's attention core (QK^T and AV, halved for the causal mask)."""
    logits: float
    """The output layer."""

    @property
    def layers(self) -> float:
        """The transformer layers' FLOPs (all but the logits)."""
        return self.mlp + self.attention + self.core

    @property
    def total(self) -> float:
        return self.layers + self.logits


def _mlp_layers(m: ModelConfig) -> Tuple[int, int, int]:
    """(dense layers, MoE layers, the FFN width a token goes through in an MoE layer: k x
    --moe-ffn-hidden-size + the shared expert): every layer dense unless ModelConfig.moe (the
    Mixture-of-Experts options) has experts."""
    moe = getattr(m, "moe", None)  # ModelConfig.moe: the Mixture-of-Experts options
    if moe is None or not moe.enabled:
        return m.num_layers, 0, 0
    moe_layers = moe.num_moe_layers(m.num_layers)
    return m.num_layers - moe_layers, moe_layers, moe.active_ffn_width()


def token_flops(m: ModelConfig) -> TokenFlops:
    """Megatron's model FLOPs per token of `m`, by term (the module docstring's formula)."""
    h, s = m.hidden_size, m.seq_length
    dense_layers, moe_layers, active_width = _mlp_layers(m)
    ffn_expansion = 3 if m.swiglu else 2  # SwiGLU: h -> 2f and f -> h; else h -> f and f -> h
    q = m.head_dim * m.num_attention_heads
    kv = m.head_dim * m.num_kv_heads
    mlp = FWD_BWD * FMA * h * ffn_expansion * (m.ffn_hidden_size * dense_layers
                                               + active_width * moe_layers)
    attention = FWD_BWD * FMA * (h * (q + kv + kv) + q * h) * m.num_layers
    core = FWD_BWD * FMA * q / 2 * 2 * s * m.num_layers  # causal mask halves QK^T and AV
    logits = FWD_BWD * FMA * h * m.padded_vocab_size
    return TokenFlops(mlp=mlp, attention=attention, core=core, logits=logits)


def model_flops_per_token(m: ModelConfig) -> float:
    """Megatron's model FLOPs per token (fwd + bwd, no recompute): `token_flops(m).total`."""
    return token_flops(m).total


def num_floating_point_operations(m: ModelConfig, batch_size: int) -> float:
    """Megatron-LM's num_floating_point_operations(args, batch_size): the model FLOPs of one
    iteration of `batch_size` samples of m.seq_length tokens."""
    return batch_size * m.seq_length * model_flops_per_token(m)


def hardware_flops_per_token(m: ModelConfig, recompute: str = "none",
                             recomputed_layers: Optional[int] = None) -> float:
    """FLOPs per token the hardware runs, recompute included (see the module docstring).

    `recomputed_layers` (full recompute only) is how many of the L layers run their forward
    twice; None means all of them.
    """
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}, got {recompute!r}")
    terms = token_flops(m)
    if recompute == "full":  # each recomputed layer's forward (a third of its fwd+bwd) again
        layers = m.num_layers if recomputed_layers is None else min(recomputed_layers,
                                                                    m.num_layers)
        return terms.total + terms.layers * layers / m.num_layers / FWD_BWD
    if recompute == "selective":  # the --recompute-modules' forwards again
        modules = set(getattr(m, "recompute_modules", ("core_attn",)))
        again = (terms.core if "core_attn" in modules else 0.0) + _recomputed_mlps(m, modules)
        return terms.total + again / FWD_BWD
    return terms.total


def _recomputed_mlps(m: ModelConfig, modules: Set[str]) -> float:
    """Forward + backward FLOPs per token of the MLPs selective recompute reruns: the dense
    layers' (mlp), the MoE layers' routed and shared experts (moe) or shared expert alone
    (shared_experts); the router is not counted, as in Megatron's formula."""
    dense_layers, moe_layers, active_width = _mlp_layers(m)
    width = m.ffn_hidden_size * dense_layers if "mlp" in modules else 0
    if "moe" in modules:
        width += active_width * moe_layers
    elif "shared_experts" in modules and moe_layers:
        width += m.moe.shared_expert_size * moe_layers
    return FWD_BWD * FMA * m.hidden_size * (3 if m.swiglu else 2) * width


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
