"""scripts/gpu_check.sh --cpu-dry-run: every step of the GPU check on the CPU with tiny shapes
(the GPU-only ones skipped with the reason), in the plan's order, the figures parsed and the
report written and published; the plan's limits add up to the 8-minute budget, and a step whose
time is gone is skipped, not run."""
import json
import math
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from tests.harness.forked_python import ForkedPython

ROOT = Path(__file__).resolve().parents[2]
ORDER = ["setup", "build_kernels", "nanogpt_124M", "train_124M_bf16", "bench_kernels_bf16",
         "bench_kernels_fp16", "bench_train_124M", "train_350M_bf16", "train_124M_fp16",
         "ds_zero2_straight", "ds_zero2_first", "ds_zero2_resumed", "memory_124M",
         "memory_350M", "fp32_cpu", "fp32_gpu"]
VALUES = ["0", "1", "1", "1", "2", "2", "2", "3", "4", "5", "5", "5", "6", "6", "7", "7"]
"""The plan's order of value (docs/gpu.md): 1 throughput beside nanoGPT, 2 kernels and
fusions, 3 350M, 4 fp16, 5 ZeRO-2 resume, 6 memory estimate, 7 CPU vs GPU."""
SKIPPED = ["setup", "build_kernels", "bench_kernels_fp16", "fp32_gpu"]


def _check(*args, timeout=900):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")  # deepspeed
    return subprocess.run(["bash", str(ROOT / "scripts/gpu_check.sh"), *args], capture_output=True,
                          stdin=subprocess.DEVNULL, text=True, env=env, timeout=timeout)


@pytest.fixture(scope="module")
def python(tmp_path_factory):
    """The --python of the dry runs: its script runs (pretrain_gpt2.py, bench/, tools/) forked
    from the session's forkserver rather than new interpreters (tests/harness/forked_python.py);
    `deepspeed` too: its launcher's code runs, and starts its ranks through the forked python."""
    with ForkedPython(tmp_path_factory.mktemp("python"), launchers=("deepspeed",)) as forked:
        yield forked.python


def test_the_plan_fits_eight_minutes_in_the_order_of_value():
    proc = _check("--plan")
    assert proc.returncode == 0, proc.stderr
    assert "budget 480 s (limits add up to 480 s), install included" in proc.stdout
    rows = [line.split() for line in proc.stdout.splitlines()[2:]]
    assert [r[1] for r in rows] == ORDER and [r[0] for r in rows] == VALUES
    assert sum(int(r[2]) for r in rows if r[2] != "bg") == 480


def test_a_step_whose_time_is_gone_is_skipped(tmp_path, python):
    proc = _check("--cpu-dry-run", "--budget", "2", "--steps", "fp32_cpu", "--out",
                  str(tmp_path), "--python", python)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    steps = json.loads((tmp_path / "report.json").read_text())["steps"]
    assert list(steps) == ["setup", "fp32_cpu"]
    assert steps["fp32_cpu"]["status"] == "skipped"
    assert steps["fp32_cpu"]["reason"].startswith("budget spent")


def test_cpu_dry_run_writes_the_whole_report(tmp_path, python):
    out, published = tmp_path / "check", tmp_path / "published"
    proc = _check("--cpu-dry-run", "--out", str(out), "--python", python, "--publish",
                  str(published))
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-3000:]}"
    assert "GPU check plan: budget 480 s" in proc.stdout  # the dry run prints the plan
    report = json.loads((out / "report.json").read_text())
    assert report["mode"] == "cpu-dry-run" and report["environment"]["torch"]
    assert report["environment"]["date"] and report["total_seconds"] > 0
    steps = report["steps"]
    assert list(steps) == ORDER and [steps[n]["value"] for n in ORDER] == VALUES
    ran = [name for name in ORDER if name not in SKIPPED]
    assert all(steps[name]["status"] == "ok" for name in ran), \
        {n: steps[n].get("reason") for n in ran if steps[n]["status"] != "ok"}
    assert all(steps[name]["status"] == "skipped" and steps[name]["reason"] for name in SKIPPED)

    eager = steps["bench_kernels_bf16"]["figures"]["models"]["tiny"]["layer norm / eager"]
    assert eager["ms"] > 0 and eager["vs_eager"] == 1.0
    fusions = steps["bench_train_124M"]["figures"]
    assert {"ours", "ours-nofuse", "ours-no-layernorm", "ours-compiled"} <= set(fusions["impls"])
    assert all(r["tokens_per_s"] > 0 for r in fusions["impls"].values())

    res = report["results"]
    t = res["throughput"]["124M"]
    assert t["ours_tokens_per_s"] > 0 and t["nano_tokens_per_s"] > 0 and t["ratio"] > 0
    # MFU is there; its size on a CPU depends on the matmul peak this machine measured and
    # cached (an AVX2 CI machine reported 2.8 against its cached peak): not judged on a CPU
    assert math.isfinite(t["ours_mfu"]) and t["ours_mfu"] > 0
    assert math.isfinite(t["nano_mfu"]) and t["nano_mfu"] > 0
    assert res["throughput"]["350M"]["ours_tokens_per_s"] > 0
    for size in ("124M", "350M"):
        assert res["memory"][size]["estimate_gib"] > 0
        assert res["memory"][size]["measured_gib"] is None  # no CUDA here
    fp16 = res["fp16"]  # Megatron's scale from 2^32 skips the first iterations, then steps
    assert fp16["skipped_at"] and fp16["skipped_at"] == list(range(1, len(fp16["skipped_at"]) + 1))
    assert fp16["first_stepped_iteration"] and fp16["skipped_after_start"] == 0
    assert res["zero2_resume"]["exact"] is True and res["zero2_resume"]["iterations_compared"] > 0
    assert res["cpu_vs_gpu"]["within"] is None
    goals = {g["goal"]: g["met"] for g in report["goals"]}
    assert goals["ZeRO-2 resume bit-exact"] is True
    assert goals["fp16: iterations skipped only at the start"] is True
    assert goals["124M MFU >= 45% (bf16, seq 1024)"] is None  # not judged on a CPU

    text = (out / "report.md").read_text()
    assert text.startswith("# GPU check (cpu-dry-run)")
    assert "No figure here says anything about a GPU" in text
    assert "| 5 | ds_zero2_resumed | ok | 600 |" in text
    assert (published / "report.md").read_text() == text  # published after the last step too
    with tarfile.open(published / "logs.tar.gz") as tar:
        names = set(tar.getnames())
    assert {"steps/train_124M_bf16/log", "steps/train_124M_bf16/metrics.jsonl",
            "plan.tsv"} <= names
    assert not any("/ck/" in name for name in names)  # no checkpoints in the logs
