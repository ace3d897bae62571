"""tools/gpu_report.py: parsing each step's output and the report of scripts/gpu_check.sh."""
import json

import pytest

from tools import gpu_report as gr


def _train_rows(tokens, mfu, loss_scale=None, cuda_mb=None, skipped=0):
    return [{"kind": "train", "iteration": 10 * (i + 1), "tokens_per_s": t, "mfu": m,
             "tflops_per_rank": 1.0, "ms_per_iteration": 5.0, "lm_loss": 10.0 - i,
             "loss_scale": loss_scale, "total_skipped_iterations": skipped,
             "mem_cuda_max_allocated_mb": cuda_mb, "mem_peak_rss_mb": 900.0}
            for i, (t, m) in enumerate(zip(tokens, mfu))]


def test_train_run_figures_leave_the_first_interval_out():
    rows = _train_rows([10.0, 100.0, 110.0, 120.0], [0.01, 0.4, 0.5, None], loss_scale=1024.0,
                       cuda_mb=2048.0, skipped=3) + [{"kind": "valid", "iteration": 40}]
    rows[1]["loss_scale"] = 512.0
    fig = gr.train_run_figures(rows)
    assert fig["tokens_per_s"] == 110.0 and fig["mfu"] == 0.45  # None mfu ignored
    assert fig["iterations"] == 40 and fig["log_intervals"] == 4
    assert (fig["lm_loss_first"], fig["lm_loss_last"]) == (10.0, 7.0)
    assert (fig["loss_scale_last"], fig["loss_scale_min"]) == (1024.0, 512.0)
    assert fig["skipped_iterations"] == 3 and fig["max_cuda_allocated_mb"] == 2048.0
    with pytest.raises(ValueError, match="no train rows"):
        gr.train_run_figures([{"kind": "valid", "iteration": 1}])


def test_resume_comparison_is_bit_exact_and_names_the_first_difference():
    straight = {1: (6.0, 1.5), 2: (5.5, 1.25), 3: (5.25, None)}
    assert gr.compare_exact(straight, dict(straight))["exact"] is True
    off = {**straight, 2: (5.5, 1.2500001)}
    result = gr.compare_exact(straight, off)
    assert result["exact"] is False and result["mismatched_iterations"] == 1
    assert result["first_mismatch"]["iteration"] == 2
    assert gr.compare_exact(straight, {1: (6.0, 1.5)})["missing_iterations"] == [2, 3]
    assert gr.max_relative_gap({1: (6.006, 0), 2: (5.0, 0)}, {1: (6.0, 0), 2: (5.0, 0)}) == \
        pytest.approx(1e-3)


def test_memory_estimate_from_the_dry_run_report():
    log = ("[memory (per rank)]\n  ok    weights 237.00 MiB + gradients 474.00 MiB + optimizer "
           "states 1.39 GiB + activations 9.50 GiB (micro-batch 16) = 11.58 GiB\n"
           "preflight passed: 0 error(s), 0 warning(s) in 1.2 s\n")
    assert gr.memory_estimate(log) == {"estimate_gib": 11.58, "micro_batch_size": 16,
                                       "passed": True}
    small = "activations 1.00 MiB (micro-batch 4) = 51.20 MiB\npreflight FAILED"
    assert gr.memory_estimate(small) == {"estimate_gib": 0.05, "micro_batch_size": 4,
                                         "passed": False}
    with pytest.raises(ValueError):
        gr.memory_estimate("nothing here")


def test_junit_counts(tmp_path):
    path = tmp_path / "junit.xml"
    path.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.a" name="test_ok"/>'
        '<testcase classname="tests.a" name="test_bad"><failure message="x"/></testcase>'
        '<testcase classname="tests.b" name="test_gpu"><skipped message="needs a GPU"/></testcase>'
        '<testcase classname="tests.b" name="test_err"><error message="y"/></testcase>'
        '</testsuite></testsuites>')
    assert gr.parse_junit(str(path)) == {"passed": 1, "failed": 1, "errors": 1, "skipped": 1,
                                         "failed_tests": ["tests.a::test_bad", "tests.b::test_err"]}


def _step(steps, name, rc=0, seconds=3, files=None, log=""):
    folder = steps / name
    folder.mkdir(parents=True)
    (folder / "rc").write_text(f"{rc}\n")
    (folder / "seconds").write_text(f"{seconds}\n")
    (folder / "command").write_text(f"python {name}.py\n")
    (folder / "log").write_text(log)
    for filename, text in (files or {}).items():
        (folder / filename).write_text(text)


def test_report_of_a_gpu_run(tmp_path):
    steps = tmp_path / "steps"
    metrics = "\n".join(json.dumps(r) for r in _train_rows(
        [1.0, 2000.0, 2200.0], [0.1, 0.44, 0.48], cuda_mb=10240.0))
    _step(steps, "train_124M_bf16", files={"metrics.jsonl": metrics})
    _step(steps, "nanogpt_124M", files={"bench.json": json.dumps(
        {"tokens_per_s": 2000.0, "mfu": 0.42, "compiled": True})})
    _step(steps, "memory_124M", log="activations 6.00 GiB (micro-batch 16) = 12.80 GiB\n"
                                    "preflight passed")
    _step(steps, "train_350M_bf16", rc=1, log="Traceback\nRuntimeError: CUDA out of memory\n")
    (steps / "fp32_gpu").mkdir()
    (steps / "fp32_gpu" / "skipped").write_text("no GPU\n")
    (tmp_path / "steps.order").write_text("train_124M_bf16\nmemory_124M\nnanogpt_124M\n"
                                          "train_350M_bf16\nfp32_gpu\n")
    report = gr.build_report(str(tmp_path), "gpu", env_fn=lambda mode: {
        "date": "today", "host": "h", "python": "3.12", "mode": mode, "gpu": "H100"})
    assert list(report["steps"]) == ["train_124M_bf16", "memory_124M", "nanogpt_124M",
                                     "train_350M_bf16", "fp32_gpu"]
    s = report["steps"]
    assert s["train_350M_bf16"]["status"] == "failed"
    assert "CUDA out of memory" in s["train_350M_bf16"]["reason"]
    assert s["fp32_gpu"] == {"status": "skipped", "reason": "no GPU"}
    t = report["results"]["throughput"]["124M"]
    assert t["ours_tokens_per_s"] == 2100.0 and t["ratio"] == pytest.approx(1.05)
    m = report["results"]["memory"]["124M"]
    assert m["ratio"] == pytest.approx(12.8 / 10.0) and m["measured_gib"] == 10.0
    assert report["results"]["zero2_resume"]["exact"] is None
    goals = {g["goal"]: g for g in report["goals"]}
    assert goals["124M MFU >= 45% (bf16, seq 1024)"]["met"] is True
    assert goals["124M tokens/s vs nanoGPT + torch.compile >= 1"]["met"] is True
    assert goals["350M MFU >= 50% (bf16, seq 1024)"]["met"] is None  # not measured
    text = gr.render_markdown(report)
    assert "| train_350M_bf16 | failed |" in text and "| 124M | 2,100 | 46.0% | 2,000 |" in text
    assert "CPU dry run" not in text
    dry = gr.build_report(str(tmp_path), "cpu-dry-run", env_fn=lambda mode: {
        "date": "today", "host": "h", "python": "3.12", "mode": mode})
    assert {g["goal"]: g["met"] for g in dry["goals"]}[
        "124M MFU >= 45% (bf16, seq 1024)"] is None
    assert "No figure here says anything about a GPU" in gr.render_markdown(dry)


def test_a_step_whose_output_does_not_parse_counts_as_failed(tmp_path):
    steps = tmp_path / "steps"
    _step(steps, "train_124M_bf16", files={"metrics.jsonl": ""})
    report = gr.build_report(str(tmp_path), "gpu", env_fn=lambda mode: {
        "date": "d", "host": "h", "python": "3", "mode": mode})
    step = report["steps"]["train_124M_bf16"]
    assert step["status"] == "failed" and "did not parse" in step["reason"]


def test_the_failure_line_is_the_error_not_the_launcher_noise():
    log = ("Traceback (most recent call last):\n  File x\n"
           "torch.distributed.DistNetworkError: address already in use\n"
           "[2026-11-24 08:44:01,313] [INFO] [launch.py:253:sigkill_handler] Killing subprocess\n")
    assert gr.failure_line(log) == "torch.distributed.DistNetworkError: address already in use"
    assert gr.failure_line("error: warmup iterations (5) exceed --lr-decay-iters (4)\n") == \
        "error: warmup iterations (5) exceed --lr-decay-iters (4)"
    assert gr.failure_line("just stopped\n") == "just stopped"
