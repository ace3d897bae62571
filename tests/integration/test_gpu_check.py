"""scripts/gpu_check.sh --cpu-dry-run: every step of the GPU check on the CPU with tiny shapes
(the GPU-only ones skipped with the reason), the figures parsed and the report written."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RAN = ["data_corpus", "data_tokenizer", "data_preprocess", "tests", "bench_kernels_bf16",
       "bench_train_124M", "train_124M_bf16", "memory_124M", "nanogpt_124M", "train_350M_bf16",
       "memory_350M", "nanogpt_350M", "train_124M_fp16", "ds_zero2_straight", "ds_zero2_first",
       "ds_zero2_resumed", "fp32_cpu"]
SKIPPED = ["setup", "build_kernels", "bench_kernels_fp16", "fp32_gpu"]


def test_cpu_dry_run_writes_the_whole_report(tmp_path):
    out = tmp_path / "check"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run(["bash", str(ROOT / "scripts/gpu_check.sh"), "--cpu-dry-run", "--out",
                           str(out), "--python", sys.executable], capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-3000:]}"
    report = json.loads((out / "report.json").read_text())
    assert report["mode"] == "cpu-dry-run" and report["environment"]["torch"]
    assert report["environment"]["date"] and report["total_seconds"] > 0
    steps = report["steps"]
    assert list(steps) == ["setup", *RAN[:3], "build_kernels", RAN[3], RAN[4],
                           "bench_kernels_fp16", *RAN[5:], "fp32_gpu"]
    assert all(steps[name]["status"] == "ok" for name in RAN), \
        {n: steps[n].get("reason") for n in RAN if steps[n]["status"] != "ok"}
    assert all(steps[name]["status"] == "skipped" and steps[name]["reason"] for name in SKIPPED)

    # a small vocabulary, not GPT-2's 50257-entry BPE
    assert 256 < steps["data_tokenizer"]["figures"]["vocab_size"] <= 512
    tests = steps["tests"]["figures"]
    assert tests["failed"] == tests["errors"] == 0 and tests["skipped"] > 0
    eager = steps["bench_kernels_bf16"]["figures"]["models"]["tiny"]["layer norm / eager"]
    assert eager["ms"] > 0 and eager["vs_eager"] == 1.0
    fusions = steps["bench_train_124M"]["figures"]
    assert {"ours", "ours-nofuse", "ours-no-layernorm", "nano"} <= set(fusions["impls"])
    assert all(r["tokens_per_s"] > 0 for r in fusions["impls"].values())

    res = report["results"]
    for size in ("124M", "350M"):
        t = res["throughput"][size]
        assert t["ours_tokens_per_s"] > 0 and t["nano_tokens_per_s"] > 0 and t["ratio"] > 0
        assert 0 < t["ours_mfu"] < 1.5 and 0 < t["nano_mfu"] < 1.5
        assert res["memory"][size]["estimate_gib"] > 0
        assert res["memory"][size]["measured_gib"] is None  # no CUDA here
    assert res["fp16"]["loss_scale_last"] >= 1 and res["fp16"]["skipped_iterations"] is not None
    assert res["zero2_resume"]["exact"] is True and res["zero2_resume"]["iterations_compared"] > 0
    assert res["cpu_vs_gpu"]["within"] is None
    goals = {g["goal"]: g["met"] for g in report["goals"]}
    assert goals["ZeRO-2 resume bit-exact"] is True
    assert goals["124M MFU >= 45% (bf16, seq 1024)"] is None  # not judged on a CPU

    text = (out / "report.md").read_text()
    assert text.startswith("# GPU check (cpu-dry-run)")
    assert "No figure here says anything about a GPU" in text and "| ds_zero2_resumed | ok |" in text
