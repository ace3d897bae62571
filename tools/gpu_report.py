#!/usr/bin/env python
"""Read the step folders scripts/gpu_check.sh wrote and write its report (JSON and markdown).

    python tools/gpu_report.py --out runs/gpu_check [--mode gpu|cpu-dry-run] [--quiet]

The plan (`OUT/plan.tsv`: step, time limit, value, what; `OUT/budget`) lists the steps in the
order they run; each step folder `OUT/steps/NAME/` holds `command`, `log`, `limit`, `rc` and
`seconds` (or `skipped`, with the reason), and what the step wrote: `metrics.jsonl`
(pretrain_gpt2.py --metrics-file) or `bench.json` (bench/*.py --json). A planned step without a
folder has not run (the check was cut short, or is still running: the script rewrites the
report after every step). The figures of every step are parsed here; a step that failed, or
whose output does not parse, is recorded as such and the others still count. The machine's
description (GPU, driver, torch, CUDA) is read once into OUT/environment.json. Writes
OUT/report.json and OUT/report.md, prints the markdown unless --quiet, and exits 1 when a step
failed. Standard library and this checkout's app.config only (torch only to describe the
environment), so it runs anywhere.
"""
from __future__ import annotations

import json
import math
import os
import platform
import re
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Dict, List, Optional, Tuple

# this checkout's `app` (its configs import the standard library only)
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from app.config.cli import parse_config  # noqa: E402
from app.config.options import option  # noqa: E402

MFU_GOALS = {"124M": 0.45, "350M": 0.50}
"""MFU goals on one H100 (bf16, seq 1024): ahead of llm.c's ~41% and ~46% (docs/gpu.md)."""
NANO_RATIO_GOAL = 1.0
MEMORY_TOLERANCE = 0.10
"""The --dry-run estimate must be within 10% of torch.cuda.max_memory_allocated."""
CPU_GPU_TOLERANCE = 1e-3
"""Relative loss gap allowed between the fp32 CPU and GPU runs (TF32 / cuBLAS rounding)."""
KERNEL_TOLERANCE = {"bf16": 1.6e-2, "fp16": 2e-3, "fp32": 1e-5}
"""Largest relative error of a csrc/ kernel against eager PyTorch: about 4 units in the last
place of bf16's 8-bit mantissa, 2 of fp16's 11 bits."""
FUSION_NOISE = 0.01
"""A fusion whose removal changes the step's speed by less than this is neutral, not slower
(the masked-softmax fusion, for one, does not act on causal attention through SDPA)."""
KERNEL_IMPLS = ("kernel", "local+kernel")
"""bench_kernels.py's names of the csrc/ implementations."""
SIZES = ("124M", "350M")


# ---------------------------------------------------------------------------- parsers

def read_jsonl(path: str) -> List[Dict[str, Any]]:
    """One JSON object per non-empty line."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _median(values: List[Optional[float]]) -> Optional[float]:
    finite = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    return statistics.median(finite) if finite else None


def skip_pattern(train: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Which logged iterations were skipped (the running total grew), the first that stepped,
    and how many skips came after it: a dynamic loss scale from 2^32 skips the first
    iterations, and a healthy run then skips none."""
    skipped, before, first_stepped = [], 0, None
    for row in train:
        total = row.get("total_skipped_iterations") or 0
        if total > before:
            skipped.append(row["iteration"])
        elif first_stepped is None:
            first_stepped = row["iteration"]
        before = total
    late = [it for it in skipped if first_stepped is not None and it > first_stepped]
    return {"skipped_at": skipped, "first_stepped_iteration": first_stepped,
            "skipped_after_start": len(late)}


def train_run_figures(rows: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Figures of a pretrain_gpt2.py run from its metrics rows: throughput medians over the log
    intervals after the first (start-up, compilation and allocator warm-up), losses, the fp16
    loss scale and skipped iterations, peak memory."""
    train = [r for r in rows if r.get("kind") == "train"]
    if not train:
        raise ValueError("no train rows in the metrics file")
    timed = train[1:] if len(train) > 1 else train
    scales = [r["loss_scale"] for r in train if r.get("loss_scale") is not None]
    cuda_peaks = [r["mem_cuda_max_allocated_mb"] for r in train
                  if r.get("mem_cuda_max_allocated_mb") is not None]
    return {
        "iterations": train[-1]["iteration"], "log_intervals": len(train),
        "tokens_per_s": _median([r.get("tokens_per_s") for r in timed]),
        "mfu": _median([r.get("mfu") for r in timed]),
        "tflops_per_rank": _median([r.get("tflops_per_rank") for r in timed]),
        "ms_per_iteration": _median([r.get("ms_per_iteration") for r in timed]),
        "lm_loss_first": train[0].get("lm_loss"), "lm_loss_last": train[-1].get("lm_loss"),
        "loss_scale_last": scales[-1] if scales else None,
        "loss_scale_min": min(scales) if scales else None,
        "skipped_iterations": train[-1].get("total_skipped_iterations"),
        **skip_pattern(train),
        "max_cuda_allocated_mb": max(cuda_peaks) if cuda_peaks else None,
        "peak_rss_mb": max((r.get("mem_peak_rss_mb") or 0) for r in train) or None,
    }


def curve(rows: List[Dict[str, Any]]) -> Dict[int, tuple]:
    """{iteration: (lm_loss, grad_norm)} of the train rows."""
    return {r["iteration"]: (r.get("lm_loss"), r.get("grad_norm"))
            for r in rows if r.get("kind") == "train"}


def compare_exact(straight: Dict[int, tuple], resumed: Dict[int, tuple]) -> Dict[str, Any]:
    """Bit-exact comparison of an uninterrupted run's curve with an interrupted + resumed one."""
    mismatches = [it for it in sorted(straight) if resumed.get(it) != straight[it]]
    missing = sorted(set(straight) ^ set(resumed))
    first = mismatches[0] if mismatches else None
    return {"iterations_compared": len(straight), "exact": not mismatches and not missing,
            "mismatched_iterations": len(mismatches), "missing_iterations": missing,
            "first_mismatch": None if first is None else
            {"iteration": first, "straight": straight[first], "resumed": resumed.get(first)}}


def max_relative_gap(a: Dict[int, tuple], b: Dict[int, tuple]) -> Optional[float]:
    """Largest |a - b| / |b| over the losses of the iterations both curves have."""
    gaps = [abs(a[it][0] - b[it][0]) / max(abs(b[it][0]), 1e-12) for it in sorted(set(a) & set(b))
            if a[it][0] is not None and b[it][0] is not None]
    return max(gaps) if gaps else None


_MEMORY = re.compile(r"activations [\d.]+ [GM]iB \(micro-batch (\d+)\) = ([\d.]+) (GiB|MiB)")


def memory_estimate(log: str) -> Dict[str, Any]:
    """The --dry-run report's per-rank total: {'estimate_gib', 'micro_batch_size'}."""
    match = _MEMORY.search(log)
    if not match:
        raise ValueError("no memory estimate line in the --dry-run report")
    value = float(match.group(2)) / (1024.0 if match.group(3) == "MiB" else 1.0)
    return {"estimate_gib": value, "micro_batch_size": int(match.group(1)),
            "passed": "preflight passed" in log}


def kernels_summary(bench: Dict[str, Any]) -> Dict[str, Any]:
    """bench_kernels.py --json: per model, every timing keyed 'op / implementation', and the
    largest relative error of a csrc/ kernel against eager PyTorch."""
    models = {model: {f"{r['op']} / {r['implementation']}":
                      {k: r.get(k) for k in ("ms", "gb_s", "vs_eager", "max_rel_err")}
                      for r in records}
              for model, records in bench.get("models", {}).items()}
    errors = [r["max_rel_err"] for records in bench.get("models", {}).values() for r in records
              if r["implementation"] in KERNEL_IMPLS and r.get("max_rel_err") is not None]
    return {"dtype": bench.get("dtype"), "kernels_loaded": bench.get("kernels"),
            "kernels_reason": bench.get("kernels_reason"), "models": models,
            "kernel_max_rel_err": max(errors) if errors else None}


def fusions_summary(bench: Dict[str, Any]) -> Dict[str, Any]:
    """bench_train.py --json: tokens/s and MFU per variant, and ours / variant tokens/s: what
    each fusion is worth (ours / ours-no-X > 1: the fusion helps), all of them (ours /
    ours-nofuse), and compiled layers against the default (ours / ours-compiled < 1: compiling
    is faster)."""
    rows = {r["impl"]: r for r in bench.get("rows", [])}
    ours = rows.get("ours", {}).get("tokens_per_s")
    gains = {name: ours / r["tokens_per_s"] for name, r in rows.items()
             if ours and name != "ours" and r["tokens_per_s"]}
    return {"impls": {name: {"tokens_per_s": r["tokens_per_s"], "mfu": r["mfu"],
                             "ms_step": r["ms_step"]} for name, r in rows.items()},
            "ours_speedup_over": gains}


# ---------------------------------------------------------------------------- steps

def _read(path: str) -> Optional[str]:
    if not os.path.isfile(path):
        return None
    with open(path, errors="replace") as f:
        return f.read()


def _json(folder: str) -> Dict[str, Any]:
    with open(os.path.join(folder, "bench.json")) as f:
        return json.load(f)


def _step_figures(name: str, folder: str, log: str) -> Dict[str, Any]:
    """The figures of step `name` from what it left in `folder`."""
    if name.startswith(("train_", "ds_zero2_", "fp32_")):
        return train_run_figures(read_jsonl(os.path.join(folder, "metrics.jsonl")))
    if name.startswith("nanogpt_"):
        data = _json(folder)
        return {k: data.get(k) for k in ("tokens_per_s", "mfu", "ms_per_step", "compiled",
                                         "precision", "micro_batch_size", "model",
                                         "max_memory_allocated_mb", "peak_source")}
    if name.startswith("bench_kernels"):
        return kernels_summary(_json(folder))
    if name.startswith("bench_train"):
        return fusions_summary(_json(folder))
    if name.startswith("memory_"):
        return memory_estimate(log)
    if name == "build_kernels":
        return {"libraries": re.findall(r"^(sm_\d+: .*)$", log, re.M)}
    return {}


_ERROR_LINE = re.compile(r"^(\w[\w.]*(Error|Exception)\b|.*\berror: |ERROR\b|FAILED\b)")


def failure_line(log: str) -> str:
    """The line that says why a step failed: the last exception or error line, else the last."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    errors = [line for line in lines if _ERROR_LINE.match(line)]
    return (errors or lines or [""])[-1]


def read_step(steps_dir: str, name: str) -> Dict[str, Any]:
    """Status, limit, duration, command, log path and figures of one step."""
    folder = os.path.join(steps_dir, name)
    skipped = _read(os.path.join(folder, "skipped"))
    if skipped is not None:
        return {"status": "skipped", "reason": skipped.strip()}
    if not os.path.isdir(folder):
        return {"status": "not run", "reason": "the check ended before this step"}
    limit = (_read(os.path.join(folder, "limit")) or "").strip()
    rc = _read(os.path.join(folder, "rc"))
    if rc is None:
        return {"status": "running", "limit": float(limit) if limit else None,
                "reason": "started, not finished (still running, or the check was stopped)"}
    log = _read(os.path.join(folder, "log")) or ""
    step: Dict[str, Any] = {
        "status": "ok" if rc.strip() == "0" else "failed", "exit_code": int(rc.strip()),
        "limit": float(limit) if limit else None,
        "seconds": float((_read(os.path.join(folder, "seconds")) or "nan").strip()),
        "command": (_read(os.path.join(folder, "command")) or "").strip(),
        "log": os.path.relpath(os.path.join(folder, "log"), os.path.dirname(steps_dir))}
    if step["status"] == "failed":
        step["reason"] = (f"exit {step['exit_code']}" + (" (timed out)" if step["exit_code"] in
                                                          (124, 137) else "")
                          + (f": {failure_line(log)[:300]}" if log.strip() else ""))
    try:
        step["figures"] = _step_figures(name, folder, log)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        step["figures"] = {}
        step["parse_error"] = f"{type(exc).__name__}: {exc}"
        if step["status"] == "ok":
            step["status"] = "failed"
            step["reason"] = f"its output did not parse: {step['parse_error']}"
    return step


def _fig(steps: Dict[str, Any], name: str, key: str) -> Any:
    return steps.get(name, {}).get("figures", {}).get(key)


def _curves(folder: str, *names: str) -> Dict[int, tuple]:
    merged: Dict[int, tuple] = {}
    for name in names:
        merged.update(curve(read_jsonl(os.path.join(folder, name, "metrics.jsonl"))))
    return merged


def results(steps: Dict[str, Any], steps_dir: str) -> Dict[str, Any]:
    """The comparisons across steps: throughput and the nanoGPT ratio, fusions and compiled
    layers, kernel accuracy, fp16, the ZeRO-2 resume, memory estimate against the measured
    peak, CPU against GPU."""
    out: Dict[str, Any] = {"throughput": {}, "memory": {}}
    for size in SIZES:
        ours, nano = (_fig(steps, f"train_{size}_bf16", "tokens_per_s"),
                      _fig(steps, f"nanogpt_{size}", "tokens_per_s"))
        out["throughput"][size] = {
            "ours_tokens_per_s": ours, "ours_mfu": _fig(steps, f"train_{size}_bf16", "mfu"),
            "nano_tokens_per_s": nano, "nano_mfu": _fig(steps, f"nanogpt_{size}", "mfu"),
            "ratio": ours / nano if ours and nano else None}
        estimate = _fig(steps, f"memory_{size}", "estimate_gib")
        measured_mb = _fig(steps, f"train_{size}_bf16", "max_cuda_allocated_mb")
        measured = measured_mb / 1024.0 if measured_mb else None
        out["memory"][size] = {"estimate_gib": estimate, "measured_gib": measured,
                               "ratio": estimate / measured if estimate and measured else None,
                               "note": None if measured else "no CUDA measurement"}
    out["kernel_accuracy"] = {
        dtype: _fig(steps, f"bench_kernels_{dtype}", "kernel_max_rel_err") for dtype in
        ("bf16", "fp16")}
    fp16 = steps.get("train_124M_fp16", {}).get("figures", {})
    out["fp16"] = {k: fp16.get(k) for k in ("tokens_per_s", "loss_scale_last", "loss_scale_min",
                                            "skipped_iterations", "skipped_at",
                                            "first_stepped_iteration", "skipped_after_start",
                                            "lm_loss_last")}
    try:
        straight = _curves(steps_dir, "ds_zero2_straight")
        resumed = _curves(steps_dir, "ds_zero2_first", "ds_zero2_resumed")
        out["zero2_resume"] = compare_exact(straight, resumed)
    except (OSError, ValueError, KeyError):
        out["zero2_resume"] = {"exact": None, "note": "a ZeRO-2 run is missing"}
    try:
        gap = max_relative_gap(_curves(steps_dir, "fp32_gpu"), _curves(steps_dir, "fp32_cpu"))
        out["cpu_vs_gpu"] = {"max_relative_loss_gap": gap, "tolerance": CPU_GPU_TOLERANCE,
                             "within": None if gap is None else gap <= CPU_GPU_TOLERANCE}
    except (OSError, ValueError, KeyError):
        out["cpu_vs_gpu"] = {"within": None, "note": "a fp32 run is missing"}
    return out


def _fusion_goal(steps: Dict[str, Any]) -> Dict[str, Any]:
    """Every fusion that is on by default makes the step faster (ours / ours-no-X >= 1)."""
    fusions = next((s["figures"] for n, s in steps.items()
                    if n.startswith("bench_train") and s.get("figures")), None)
    gains = {k: v for k, v in (fusions or {}).get("ours_speedup_over", {}).items()
             if k.startswith("ours-no-")}
    slower = sorted(k[len("ours-no-"):] for k, v in gains.items() if v < 1.0 - FUSION_NOISE)
    return {"goal": "every fusion on by default is faster end to end (ours / ours-no-X >= "
                    f"{1.0 - FUSION_NOISE:g})",
            "value": ", ".join(f"{k[len('ours-no-'):]} {v:.3f}" for k, v in sorted(gains.items()))
            or None, "met": (not slower) if gains else None,
            "note": f"slower with: {', '.join(slower)}" if slower else None}


def goals(res: Dict[str, Any], steps: Dict[str, Any], mode: str) -> List[Dict[str, Any]]:
    """Each goal with its value and whether it is met (None: not measured, or a CPU dry run)."""
    judged = mode == "gpu"

    def row(goal: str, value: Any, met: Optional[bool], speed: bool = False) -> Dict[str, Any]:
        return {"goal": goal, "value": value,
                "met": None if value is None or (speed and not judged) else met}

    rows = [row(f"{size} MFU >= {target:.0%} (bf16, seq 1024)", res["throughput"][size]["ours_mfu"],
                (res["throughput"][size]["ours_mfu"] or 0) >= target, speed=True)
            for size, target in MFU_GOALS.items()]
    ratio = res["throughput"]["124M"]["ratio"]
    rows.append(row(f"124M tokens/s vs nanoGPT + torch.compile >= {NANO_RATIO_GOAL:g}", ratio,
                    (ratio or 0) >= NANO_RATIO_GOAL, speed=True))
    fusion = _fusion_goal(steps)
    rows.append({**row(fusion["goal"], fusion["value"], fusion["met"], speed=True),
                 "note": fusion["note"]})
    for dtype, err in res["kernel_accuracy"].items():
        rows.append(row(f"csrc/ kernels match PyTorch, {dtype} (max rel err <= "
                        f"{KERNEL_TOLERANCE[dtype]:g})", err,
                        err is not None and err <= KERNEL_TOLERANCE[dtype]))
    fp16 = res["fp16"]
    late = fp16.get("skipped_after_start")
    rows.append(row("fp16: iterations skipped only at the start", late,
                    late == 0 and fp16.get("first_stepped_iteration") is not None))
    rows.append(row("ZeRO-2 resume bit-exact", res["zero2_resume"].get("exact"),
                    res["zero2_resume"].get("exact")))
    for size, m in res["memory"].items():
        rows.append(row(f"{size} memory estimate within {MEMORY_TOLERANCE:.0%} of the peak",
                        m["ratio"], m["ratio"] is not None
                        and abs(m["ratio"] - 1.0) <= MEMORY_TOLERANCE))
    rows.append(row(f"fp32 CPU vs GPU losses within {CPU_GPU_TOLERANCE:g}",
                    res["cpu_vs_gpu"].get("max_relative_loss_gap"), res["cpu_vs_gpu"].get("within")))
    return rows


# ---------------------------------------------------------------------------- environment

def environment(mode: str) -> Dict[str, Any]:
    """Date, host, Python, torch, CUDA, DeepSpeed, GPU name and driver."""
    env: Dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                           "host": socket.gethostname(), "python": platform.python_version(),
                           "mode": mode}
    try:
        from importlib import metadata
        env["deepspeed"] = metadata.version("deepspeed")
    except Exception:  # noqa: BLE001 - the report is written whatever is missing
        env["deepspeed"] = None
    try:
        import torch
        env["torch"] = torch.__version__
        env["cuda"] = torch.version.cuda
        env["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception as exc:  # noqa: BLE001
        env["torch"] = f"unavailable: {exc}"
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
        first = smi.stdout.strip().splitlines()[0] if smi.returncode == 0 else ""
        parts = [p.strip() for p in first.split(",")]
        env["driver"] = parts[1] if len(parts) > 1 else None
        env["gpu_memory"] = parts[2] if len(parts) > 2 else None
    except (OSError, subprocess.SubprocessError, IndexError):
        env["driver"] = None
    return env


def cached_environment(out: str, mode: str) -> Dict[str, Any]:
    """`environment(mode)`, read once into OUT/environment.json (once torch imports there):
    the report is rewritten after every step, and importing torch each time costs seconds."""
    path = os.path.join(out, "environment.json")
    if os.path.isfile(path):
        with open(path) as f:
            return json.load(f)
    env = environment(mode)
    if not str(env.get("torch")).startswith("unavailable"):
        with open(path, "w") as f:
            json.dump(env, f, indent=1)
    return env


# ---------------------------------------------------------------------------- the report

def read_plan(out: str) -> List[Dict[str, Any]]:
    """OUT/plan.tsv as [{name, limit (None: in the background), value, what}]; empty without."""
    text = _read(os.path.join(out, "plan.tsv")) or ""
    plan = []
    for line in text.splitlines():
        name, limit, value, what = (line.split("\t") + ["", "", ""])[:4]
        plan.append({"name": name, "limit": None if limit == "bg" else float(limit),
                     "value": value, "what": what})
    return plan


def build_report(out: str, mode: str,
                 env_fn: Callable[[str, str], Dict[str, Any]] = cached_environment
                 ) -> Dict[str, Any]:
    """Every planned step (in the plan's order, then any other that ran), the comparisons,
    the goals and the budget."""
    steps_dir = os.path.join(out, "steps")
    plan = read_plan(out)
    order = (_read(os.path.join(out, "steps.order")) or "").split()
    names = list(dict.fromkeys([p["name"] for p in plan] + order))
    steps = {name: read_step(steps_dir, name) for name in names}
    for entry in plan:
        steps[entry["name"]].update(value=entry["value"], what=entry["what"])
    res = results(steps, steps_dir)
    budget = (_read(os.path.join(out, "budget")) or "").strip()
    spent = sum(s.get("seconds") or 0.0 for name, s in steps.items() if name != "build_kernels"
                and math.isfinite(s.get("seconds") or 0.0))
    return {"mode": mode, "environment": env_fn(out, mode),
            "budget_seconds": float(budget) if budget else None, "total_seconds": spent,
            "steps": steps, "results": res, "goals": goals(res, steps, mode)}


# ---------------------------------------------------------------------------- rendering

def _f(value: Any, fmt: str = "{:.3g}") -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return fmt.format(value)
    return str(value)


def _pct(value: Optional[float]) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _table(header: List[str], rows: List[List[str]]) -> List[str]:
    return (["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
            + ["| " + " | ".join(r) + " |" for r in rows])


def render_markdown(report: Dict[str, Any]) -> str:
    """The report as markdown: environment and budget, goals, steps, then each comparison."""
    env, res, steps = report["environment"], report["results"], report["steps"]
    lines = [f"# GPU check ({report['mode']})", ""]
    if report["mode"] != "gpu":
        lines += ["> CPU dry run: tiny shapes on the CPU, to test the plumbing. No figure here "
                  "says anything about a GPU.", ""]
    budget = report.get("budget_seconds")
    if budget and report["mode"] == "gpu":
        budget_note = f" of a {budget:.0f} s budget (install included)"
    else:
        budget_note = (f" (no budget in a CPU dry run; the GPU plan's: {budget:.0f} s)"
                       if budget else "")
    lines += [f"- date: {env.get('date')}; host {env.get('host')}; steps took "
              f"{report['total_seconds']:.0f} s{budget_note}",
              f"- GPU: {env.get('gpu') or 'none'} (driver {env.get('driver') or '-'}, "
              f"{env.get('gpu_memory') or '-'})",
              f"- torch {env.get('torch')}, CUDA {env.get('cuda') or '-'}, DeepSpeed "
              f"{env.get('deepspeed') or '-'}, Python {env.get('python')}", "", "## Goals", ""]
    lines += _table(["goal", "value", "met"],
                    [[g["goal"], _f(g["value"]).replace("|", "/"),
                      (_f(g["met"]) if g["met"] is not None else "not judged")
                      + (f" ({g['note']})" if g.get("note") else "")] for g in report["goals"]])
    lines += ["", "## Steps (in the order of their value)", ""]
    lines += _table(["value", "step", "status", "limit s", "seconds", "note"],
                    [[s.get("value", ""), name, s["status"],
                      "bg" if name == "build_kernels" else _f(s.get("limit"), "{:.0f}"),
                      _f(s.get("seconds"), "{:.0f}"),
                      (s.get("reason") or s.get("what") or "").replace("|", "/")[:160]]
                     for name, s in steps.items()])
    lines += _speed_sections(res, steps) + _check_sections(res)
    return "\n".join(lines) + "\n"


def _speed_sections(res: Dict[str, Any], steps: Dict[str, Any]) -> List[str]:
    """Throughput beside nanoGPT, the fusion benchmark and the kernel benchmark tables."""
    lines = ["", "## Throughput: pretrain_gpt2.py (bf16) beside nanoGPT-style + torch.compile", ""]
    lines += _table(["model", "ours tokens/s", "ours MFU", "nano tokens/s", "nano MFU",
                     "ours / nano"],
                    [[size, _f(t["ours_tokens_per_s"], "{:,.0f}"), _pct(t["ours_mfu"]),
                      _f(t["nano_tokens_per_s"], "{:,.0f}"), _pct(t["nano_mfu"]),
                      _f(t["ratio"], "{:.3f}")] for size, t in res["throughput"].items()])
    fusions = next((s["figures"] for n, s in steps.items()
                    if n.startswith("bench_train") and s.get("figures")), None)
    if fusions:
        lines += ["", "## Fusions on and off, compiled layers (bench/bench_train.py)", "",
                  "ours / this > 1: the default (every fusion on, eager layers) is faster than "
                  "this variant; < 1 for ours-compiled: compiling the layers is faster.", ""]
        lines += _table(["variant", "tokens/s", "MFU", "ours / this"],
                        [[name, _f(r["tokens_per_s"], "{:,.0f}"), _pct(r["mfu"]),
                          _f(fusions["ours_speedup_over"].get(name), "{:.3f}")]
                         for name, r in fusions["impls"].items()])
    for name, step in steps.items():
        if name.startswith("bench_kernels") and step.get("figures"):
            for model, timings in step["figures"]["models"].items():
                lines += ["", f"## Kernels: {name[len('bench_kernels_'):]}, GPT-2 {model} "
                          "shapes (bench/bench_kernels.py, forward + backward)", ""]
                lines += _table(["op / implementation", "ms", "GB/s", "vs eager",
                                 "max rel err vs eager"],
                                [[k, _f(v["ms"], "{:.3f}"), _f(v["gb_s"], "{:.0f}"),
                                  _f(v["vs_eager"], "{:.2f}x"), _f(v.get("max_rel_err"), "{:.1e}")]
                                 for k, v in timings.items() if v["ms"] is not None])
    return lines


def _check_sections(res: Dict[str, Any]) -> List[str]:
    """fp16, the ZeRO-2 resume, memory estimate vs measured, CPU vs GPU."""
    fp16, z2, cg = res["fp16"], res["zero2_resume"], res["cpu_vs_gpu"]
    lines = ["", "## Native fp16, 124M", "",
             f"tokens/s {_f(fp16['tokens_per_s'], '{:,.0f}')}, loss scale last "
             f"{_f(fp16['loss_scale_last'])} (lowest {_f(fp16['loss_scale_min'])}), skipped "
             f"iterations {_f(fp16['skipped_iterations'])} (at {_f(fp16.get('skipped_at'))}; "
             f"first step taken at {_f(fp16.get('first_stepped_iteration'))}; after it "
             f"{_f(fp16.get('skipped_after_start'))}), last loss {_f(fp16['lm_loss_last'])}",
             "", "## DeepSpeed ZeRO-2 (scripts/ds_zero2_pretrain_gpt2_model_parallel.sh, MP_SIZE=1)",
             "", f"resume bit-exact: {_f(z2.get('exact'))} over "
             f"{_f(z2.get('iterations_compared'))} iterations"
             + (f"; first mismatch {z2['first_mismatch']}" if z2.get("first_mismatch") else "")
             + (f" ({z2['note']})" if z2.get("note") else ""),
             "", "## Memory: --dry-run estimate vs torch.cuda.max_memory_allocated", ""]
    lines += _table(["model", "estimate GiB", "measured GiB", "estimate / measured"],
                    [[size, _f(m["estimate_gib"]), _f(m["measured_gib"]),
                      _f(m["ratio"], "{:.3f}") + (f" ({m['note']})" if m["note"] else "")]
                     for size, m in res["memory"].items()])
    lines += ["", "## fp32 on CPU vs GPU", "",
              f"largest relative loss gap {_f(cg.get('max_relative_loss_gap'))} (tolerance "
              f"{CPU_GPU_TOLERANCE:g}): {_f(cg.get('within'))}"
              + (f" ({cg['note']})" if cg.get("note") else "")]
    return lines


@dataclass(kw_only=True)
class GpuReportOptions:
    """tools/gpu_report.py's command line: the check's folder and how to report."""

    FLAG_GROUP: ClassVar[Tuple[str, str]] = ("report", "the gpu_check.sh folder to report on")

    out: str = option("--out", required=True, help="the gpu_check.sh output folder")
    mode: str = option("--mode", default="gpu", choices=("gpu", "cpu-dry-run"))
    quiet: bool = option("--quiet", default=False, help="write the files, print nothing")


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_config(GpuReportOptions, argv, __doc__.splitlines()[0])
    report = build_report(args.out, args.mode)
    with open(os.path.join(args.out, "report.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    text = render_markdown(report)
    with open(os.path.join(args.out, "report.md"), "w") as f:
        f.write(text)
    failed = [n for n, s in report["steps"].items() if s["status"] in ("failed", "running")]
    if not args.quiet:
        print(text)
        if failed:
            print(f"failed steps: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
