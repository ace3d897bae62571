#!/usr/bin/env python
"""Read the step folders scripts/gpu_check.sh wrote and write its report (JSON and markdown).

    python tools/gpu_report.py --out runs/gpu_check [--mode gpu|cpu-dry-run]

Each step folder `OUT/steps/NAME/` (their order in `OUT/steps.order`) holds `command`, `log`, `rc` and `seconds` (or `skipped`,
with the reason), and what the step wrote: `metrics.jsonl` (pretrain_gpt2.py --metrics-file),
`bench.json` (bench/*.py --json), `junit.xml` (pytest). The figures of every step are parsed
here; a step that failed, or whose output does not parse, is recorded as such and the others
still count. Writes OUT/report.json and OUT/report.md, prints the markdown, and exits 1 when a
step failed. Standard library only, so it runs on any Python.
"""
from __future__ import annotations

import argparse
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
import xml.etree.ElementTree as ET
from typing import Any, Callable, Dict, List, Optional

GOALS = {"124M": 0.45, "350M": 0.50}
"""MFU goals on one H100 (bf16, seq 1024): ahead of llm.c's ~41% at 124M (docs/gpu.md)."""
NANO_RATIO_GOAL = 1.0
CPU_GPU_TOLERANCE = 1e-3
"""Relative loss gap allowed between the fp32 CPU and GPU runs (TF32 / cuBLAS rounding)."""
SIZES = ("124M", "350M")


# ---------------------------------------------------------------------------- parsers

def read_jsonl(path: str) -> List[Dict[str, Any]]:
    """One JSON object per non-empty line."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _median(values: List[Optional[float]]) -> Optional[float]:
    finite = [v for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    return statistics.median(finite) if finite else None


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


def parse_junit(path: str) -> Dict[str, Any]:
    """pytest's --junitxml: counts and the ids of failed or erroring tests."""
    root = ET.parse(path).getroot()
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failed: List[str] = []
    for case in root.iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        if case.find("failure") is not None:
            counts["failed"] += 1
            failed.append(name)
        elif case.find("error") is not None:
            counts["errors"] += 1
            failed.append(name)
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return {**counts, "failed_tests": failed}


def kernels_summary(bench: Dict[str, Any]) -> Dict[str, Any]:
    """bench_kernels.py --json: per model, every timing keyed 'op / implementation'."""
    return {"kernels_loaded": bench.get("kernels"), "kernels_reason": bench.get("kernels_reason"),
            "models": {model: {f"{r['op']} / {r['implementation']}":
                               {k: r[k] for k in ("ms", "gb_s", "vs_eager")} for r in records}
                       for model, records in bench.get("models", {}).items()}}


def fusions_summary(bench: Dict[str, Any]) -> Dict[str, Any]:
    """bench_train.py --json: tokens/s and MFU per variant, and ours / variant tokens/s: what
    each fusion is worth (ours / ours-no-X > 1: the fusion helps), all of them (ours /
    ours-nofuse), and ours against the references (ours / nano)."""
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


def _step_figures(name: str, folder: str, log: str) -> Dict[str, Any]:
    """The figures of step `name` from what it left in `folder`."""
    metrics, bench = os.path.join(folder, "metrics.jsonl"), os.path.join(folder, "bench.json")
    if name.startswith(("train_", "ds_zero2_", "fp32_")):
        return train_run_figures(read_jsonl(metrics))
    if name.startswith("nanogpt_"):
        with open(bench) as f:
            data = json.load(f)
        return {k: data.get(k) for k in ("tokens_per_s", "mfu", "ms_per_step", "compiled",
                                         "precision", "micro_batch_size", "model",
                                         "max_memory_allocated_mb", "peak_source")}
    if name.startswith("bench_kernels"):
        with open(bench) as f:
            return kernels_summary(json.load(f))
    if name.startswith("bench_train"):
        with open(bench) as f:
            return fusions_summary(json.load(f))
    if name.startswith("memory_"):
        return memory_estimate(log)
    if name == "tests":
        return parse_junit(os.path.join(folder, "junit.xml"))
    if name == "build_kernels":
        return {"libraries": re.findall(r"^(sm_\d+: .*)$", log, re.M)}
    if name == "data_tokenizer":
        vocab = re.search(r"vocab size (\d+)", log)
        return {"vocab_size": int(vocab.group(1)) if vocab else None}
    return {}


_ERROR_LINE = re.compile(r"^(\w[\w.]*(Error|Exception)\b|.*\berror: |ERROR\b|FAILED\b)")


def failure_line(log: str) -> str:
    """The line that says why a step failed: the last exception or error line, else the last."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    errors = [line for line in lines if _ERROR_LINE.match(line)]
    return (errors or lines or [""])[-1]


def read_step(steps_dir: str, name: str) -> Dict[str, Any]:
    """Status, duration, command, log path and figures of one step."""
    folder = os.path.join(steps_dir, name)
    skipped = _read(os.path.join(folder, "skipped"))
    if skipped is not None:
        return {"status": "skipped", "reason": skipped.strip()}
    rc = _read(os.path.join(folder, "rc"))
    if rc is None:
        return {"status": "missing", "reason": "the step did not finish"}
    log = _read(os.path.join(folder, "log")) or ""
    step: Dict[str, Any] = {
        "status": "ok" if rc.strip() == "0" else "failed", "exit_code": int(rc.strip()),
        "seconds": float((_read(os.path.join(folder, "seconds")) or "nan").strip()),
        "command": (_read(os.path.join(folder, "command")) or "").strip(),
        "log": os.path.relpath(os.path.join(folder, "log"), os.path.dirname(steps_dir))}
    if step["status"] == "failed":
        step["reason"] = (f"exit {step['exit_code']}" + (" (timed out)" if step["exit_code"] in
                                                          (124, 137) else "")
                          + (f": {failure_line(log)[:300]}" if log.strip() else ""))
    try:
        step["figures"] = _step_figures(name, folder, log)
    except (OSError, ValueError, KeyError, TypeError, ET.ParseError) as exc:
        step["figures"] = {}
        step["parse_error"] = f"{type(exc).__name__}: {exc}"
        if step["status"] == "ok":
            step["status"] = "failed"
            step["reason"] = f"its output did not parse: {step['parse_error']}"
    return step


def _fig(steps: Dict[str, Any], name: str, key: str) -> Any:
    return steps.get(name, {}).get("figures", {}).get(key)


def results(steps: Dict[str, Any]) -> Dict[str, Any]:
    """The comparisons across steps: throughput and the nanoGPT ratio, fp16, ZeRO-2 resume,
    memory estimate against the measured peak, CPU against GPU."""
    out: Dict[str, Any] = {"throughput": {}, "memory": {}}
    for size in SIZES:
        ours, nano = _fig(steps, f"train_{size}_bf16", "tokens_per_s"), \
            _fig(steps, f"nanogpt_{size}", "tokens_per_s")
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
    fp16 = steps.get("train_124M_fp16", {}).get("figures", {})
    out["fp16"] = {k: fp16.get(k) for k in ("tokens_per_s", "loss_scale_last", "loss_scale_min",
                                            "skipped_iterations", "lm_loss_last")}
    try:
        folder = steps["_dir"]
        straight = curve(read_jsonl(os.path.join(folder, "ds_zero2_straight", "metrics.jsonl")))
        resumed = {**curve(read_jsonl(os.path.join(folder, "ds_zero2_first", "metrics.jsonl"))),
                   **curve(read_jsonl(os.path.join(folder, "ds_zero2_resumed", "metrics.jsonl")))}
        out["zero2_resume"] = compare_exact(straight, resumed)
    except (OSError, ValueError, KeyError):
        out["zero2_resume"] = {"exact": None, "note": "a ZeRO-2 run is missing"}
    try:
        cpu = curve(read_jsonl(os.path.join(steps["_dir"], "fp32_cpu", "metrics.jsonl")))
        gpu = curve(read_jsonl(os.path.join(steps["_dir"], "fp32_gpu", "metrics.jsonl")))
        gap = max_relative_gap(gpu, cpu)
        out["cpu_vs_gpu"] = {"max_relative_loss_gap": gap, "tolerance": CPU_GPU_TOLERANCE,
                             "within": None if gap is None else gap <= CPU_GPU_TOLERANCE}
    except (OSError, ValueError, KeyError):
        out["cpu_vs_gpu"] = {"within": None, "note": "a fp32 run is missing"}
    return out


def goals(res: Dict[str, Any], steps: Dict[str, Any], mode: str) -> List[Dict[str, Any]]:
    """Each goal with its value and whether it is met (None: not measured, or a CPU dry run)."""
    judged = mode == "gpu"
    rows = []
    for size, target in GOALS.items():
        mfu = res["throughput"][size]["ours_mfu"]
        rows.append({"goal": f"{size} MFU >= {target:.0%} (bf16, seq 1024)", "value": mfu,
                     "met": (mfu >= target) if judged and mfu is not None else None})
    for size in SIZES:
        ratio = res["throughput"][size]["ratio"]
        rows.append({"goal": f"{size} tokens/s vs nanoGPT + torch.compile >= {NANO_RATIO_GOAL:g}",
                     "value": ratio,
                     "met": (ratio >= NANO_RATIO_GOAL) if judged and ratio is not None else None})
    rows.append({"goal": "ZeRO-2 resume bit-exact", "value": res["zero2_resume"].get("exact"),
                 "met": res["zero2_resume"].get("exact")})
    rows.append({"goal": f"fp32 CPU vs GPU losses within {CPU_GPU_TOLERANCE:g}",
                 "value": res["cpu_vs_gpu"].get("max_relative_loss_gap"),
                 "met": res["cpu_vs_gpu"].get("within")})
    tests = steps.get("tests", {}).get("figures", {})
    bad = (tests.get("failed", 0) + tests.get("errors", 0)) if tests else None
    rows.append({"goal": "GPU tests: none failed", "value": bad,
                 "met": None if bad is None else bad == 0})
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
    """The report as markdown: environment, goals, steps, then each comparison."""
    env, res, steps = report["environment"], report["results"], report["steps"]
    lines = [f"# GPU check ({report['mode']})", ""]
    if report["mode"] != "gpu":
        lines += ["> CPU dry run: tiny shapes on the CPU, to test the plumbing. No figure here "
                  "says anything about a GPU.", ""]
    lines += [f"- date: {env['date']}; host {env['host']}; total {report['total_seconds']:.0f} s",
              f"- GPU: {env.get('gpu') or 'none'} (driver {env.get('driver') or '-'}, "
              f"{env.get('gpu_memory') or '-'})",
              f"- torch {env.get('torch')}, CUDA {env.get('cuda') or '-'}, DeepSpeed "
              f"{env.get('deepspeed') or '-'}, Python {env['python']}", "", "## Goals", ""]
    lines += _table(["goal", "value", "met"],
                    [[g["goal"], _f(g["value"]), _f(g["met"]) if g["met"] is not None
                      else "not judged"] for g in report["goals"]])
    lines += ["", "## Steps", ""]
    lines += _table(["step", "status", "seconds", "note"],
                    [[name, s["status"], _f(s.get("seconds"), "{:.0f}"),
                      (s.get("reason") or "").replace("|", "/")[:160]]
                     for name, s in steps.items()])
    lines += _speed_sections(res, steps) + _check_sections(res, steps)
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
        lines += ["", "## Fusions on and off (bench/bench_train.py)", ""]
        lines += _table(["variant", "tokens/s", "MFU", "ours / this"],
                        [[name, _f(r["tokens_per_s"], "{:,.0f}"), _pct(r["mfu"]),
                          _f(fusions["ours_speedup_over"].get(name), "{:.3f}")]
                         for name, r in fusions["impls"].items()])
    for name, step in steps.items():
        if name.startswith("bench_kernels") and step.get("figures"):
            for model, timings in step["figures"]["models"].items():
                lines += ["", f"## Kernels: {name[len('bench_kernels_'):]}, GPT-2 {model} "
                          "shapes (bench/bench_kernels.py, forward + backward)", ""]
                lines += _table(["op / implementation", "ms", "GB/s", "vs eager"],
                                [[k, _f(v["ms"], "{:.3f}"), _f(v["gb_s"], "{:.0f}"),
                                  _f(v["vs_eager"], "{:.2f}x")] for k, v in timings.items()
                                 if v["ms"] is not None])
    return lines


def _check_sections(res: Dict[str, Any], steps: Dict[str, Any]) -> List[str]:
    """fp16, the ZeRO-2 resume, memory estimate vs measured, CPU vs GPU, the tests."""
    fp16, z2, cg = res["fp16"], res["zero2_resume"], res["cpu_vs_gpu"]
    lines = ["", "## Native fp16, 124M", "",
             f"tokens/s {_f(fp16['tokens_per_s'], '{:,.0f}')}, loss scale last "
             f"{_f(fp16['loss_scale_last'])} (lowest {_f(fp16['loss_scale_min'])}), skipped "
             f"iterations {_f(fp16['skipped_iterations'])}, last loss {_f(fp16['lm_loss_last'])}",
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
    tests = steps.get("tests", {}).get("figures")
    if tests:
        lines += ["", "## Tests", "", ", ".join(f"{k} {tests[k]}" for k in
                                                ("passed", "failed", "errors", "skipped"))]
        lines += [f"- {t}" for t in tests["failed_tests"]]
    return lines


def build_report(out: str, mode: str, env_fn: Callable[[str], Dict[str, Any]] = environment
                 ) -> Dict[str, Any]:
    """Every step under OUT/steps (in the order OUT/steps.order lists them), the comparisons
    and the goals."""
    steps_dir = os.path.join(out, "steps")
    order = _read(os.path.join(out, "steps.order"))
    names = list(dict.fromkeys(order.split())) if order else sorted(os.listdir(steps_dir))
    steps = {name: read_step(steps_dir, name) for name in names}
    res = results({**steps, "_dir": steps_dir})
    return {"mode": mode, "environment": env_fn(mode),
            "total_seconds": sum(s.get("seconds") or 0.0 for s in steps.values()
                                 if math.isfinite(s.get("seconds") or 0.0)),
            "steps": steps, "results": res, "goals": goals(res, steps, mode)}


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="the gpu_check.sh output folder")
    parser.add_argument("--mode", choices=["gpu", "cpu-dry-run"], default="gpu")
    args = parser.parse_args(argv)
    report = build_report(args.out, args.mode)
    with open(os.path.join(args.out, "report.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    text = render_markdown(report)
    with open(os.path.join(args.out, "report.md"), "w") as f:
        f.write(text)
    print(text)
    failed = [n for n, s in report["steps"].items() if s["status"] in ("failed", "missing")]
    if failed:
        print(f"failed steps: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
