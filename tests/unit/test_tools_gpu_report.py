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
    assert fig["skipped_at"] == [10] and fig["skipped_after_start"] == 0
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


def _step(steps, name, rc=0, seconds=3, files=None, log="", limit=None):
    folder = steps / name
    folder.mkdir(parents=True)
    if limit is not None:
        (folder / "limit").write_text(f"{limit}\n")
    (folder / "rc").write_text(f"{rc}\n")
    (folder / "seconds").write_text(f"{seconds}\n")
    (folder / "command").write_text(f"python {name}.py\n")
    (folder / "log").write_text(log)
    for filename, text in (files or {}).items():
        (folder / filename).write_text(text)


ENV = {"date": "today", "host": "h", "python": "3.12", "gpu": "H100"}
PLAN = [("train_124M_bf16", "50", "1"), ("nanogpt_124M", "60", "1"),
        ("bench_kernels_bf16", "25", "2"), ("bench_train_124M", "75", "2"),
        ("train_350M_bf16", "45", "3"), ("train_124M_fp16", "30", "4"),
        ("memory_124M", "10", "6"), ("fp32_cpu", "15", "7"), ("fp32_gpu", "15", "7")]


def _write_plan(out, plan=PLAN, budget=480):
    (out / "plan.tsv").write_text("".join(f"{n}\t{limit}\t{v}\twhat {n}\n"
                                          for n, limit, v in plan))
    (out / "budget").write_text(f"{budget}\n")


def _kernel_bench(error):
    return json.dumps({"dtype": "bf16", "kernels": True, "models": {"124M": [
        {"op": "layer norm", "implementation": "kernel", "ms": 0.1, "gb_s": 900.0,
         "vs_eager": 2.0, "max_rel_err": error},
        {"op": "layer norm", "implementation": "eager", "ms": 0.2, "gb_s": 450.0,
         "vs_eager": 1.0, "max_rel_err": None}]}})


def _train_bench(**tokens):
    return json.dumps({"rows": [{"impl": name.replace("_", "-"), "tokens_per_s": t, "mfu": 0.4,
                                 "ms_step": 1.0} for name, t in tokens.items()]})


def test_report_of_a_gpu_run(tmp_path):
    steps = tmp_path / "steps"
    _write_plan(tmp_path)
    metrics = "\n".join(json.dumps(r) for r in _train_rows(
        [1.0, 2000.0, 2200.0], [0.1, 0.44, 0.48], cuda_mb=10240.0))
    _step(steps, "train_124M_bf16", files={"metrics.jsonl": metrics})
    _step(steps, "nanogpt_124M", files={"bench.json": json.dumps(
        {"tokens_per_s": 2000.0, "mfu": 0.42, "compiled": True})})
    _step(steps, "bench_kernels_bf16", files={"bench.json": _kernel_bench(0.004)})
    _step(steps, "bench_train_124M", files={"bench.json": _train_bench(
        ours=1000.0, ours_no_layernorm=900.0, ours_no_masked_softmax=1005.0,
        ours_no_bias_gelu=1050.0, ours_compiled=1100.0)})
    _step(steps, "train_350M_bf16", rc=1, log="Traceback\nRuntimeError: CUDA out of memory\n",
          limit=45)
    fp16 = [{"kind": "train", "iteration": i, "total_skipped_iterations": min(i, 3),
             "loss_scale": 2.0 ** (32 - min(i, 3)), "lm_loss": 11.0} for i in range(1, 7)]
    _step(steps, "train_124M_fp16", files={"metrics.jsonl": "\n".join(map(json.dumps, fp16))})
    _step(steps, "memory_124M", log="activations 6.00 GiB (micro-batch 16) = 10.80 GiB\n"
                                    "preflight passed")
    (tmp_path / "steps.order").write_text("train_124M_bf16\nnanogpt_124M\n")
    report = gr.build_report(str(tmp_path), "gpu", env_fn=lambda out, mode: ENV)
    s = report["steps"]
    assert list(s) == [name for name, _, _ in PLAN]  # the plan's order
    assert s["train_350M_bf16"]["status"] == "failed"
    assert "CUDA out of memory" in s["train_350M_bf16"]["reason"]
    assert s["fp32_cpu"]["status"] == "not run" and s["train_124M_bf16"]["limit"] is None
    assert report["budget_seconds"] == 480 and report["total_seconds"] == 21
    t = report["results"]["throughput"]["124M"]
    assert t["ours_tokens_per_s"] == 2100.0 and t["ratio"] == pytest.approx(1.05)
    m = report["results"]["memory"]["124M"]
    assert m["ratio"] == pytest.approx(10.8 / 10.0) and m["measured_gib"] == 10.0
    fp16 = report["results"]["fp16"]
    assert fp16["skipped_at"] == [1, 2, 3] and fp16["first_stepped_iteration"] == 4
    assert fp16["skipped_after_start"] == 0 and fp16["loss_scale_min"] == 2.0 ** 29
    assert report["results"]["zero2_resume"]["exact"] is None
    goals = {g["goal"]: g for g in report["goals"]}
    assert goals["124M MFU >= 45% (bf16, seq 1024)"]["met"] is True
    assert goals["124M tokens/s vs nanoGPT + torch.compile >= 1"]["met"] is True
    assert goals["350M MFU >= 50% (bf16, seq 1024)"]["met"] is None  # not measured
    fusion = goals["every fusion on by default is faster end to end (ours / ours-no-X >= 0.99)"]
    assert fusion["met"] is False and fusion["note"] == "slower with: bias-gelu"  # 1000/1050
    assert goals["csrc/ kernels match PyTorch, bf16 (max rel err <= 0.016)"]["met"] is True
    assert goals["csrc/ kernels match PyTorch, fp16 (max rel err <= 0.002)"]["met"] is None
    assert goals["fp16: iterations skipped only at the start"]["met"] is True
    assert goals["124M memory estimate within 10% of the peak"]["met"] is True
    text = gr.render_markdown(report)
    assert "| 3 | train_350M_bf16 | failed | 45 |" in text
    assert "| 124M | 2,100 | 46.0% | 2,000 |" in text and "| ours-compiled | 1,100 |" in text
    assert "| layer norm / kernel | 0.100 | 900 | 2.00x | 4.0e-03 |" in text
    assert "of a 480 s budget" in text and "CPU dry run" not in text
    dry = gr.build_report(str(tmp_path), "cpu-dry-run", env_fn=lambda out, mode: ENV)
    assert {g["goal"]: g["met"] for g in dry["goals"]}[
        "124M MFU >= 45% (bf16, seq 1024)"] is None
    assert "No figure here says anything about a GPU" in gr.render_markdown(dry)


def test_late_fp16_skips_and_inaccurate_kernels_fail_their_goals(tmp_path):
    steps = tmp_path / "steps"
    _write_plan(tmp_path)
    rows = [{"kind": "train", "iteration": i, "total_skipped_iterations": t}
            for i, t in enumerate([1, 1, 1, 2, 2], start=1)]  # a skip at 4, after a step at 2
    _step(steps, "train_124M_fp16", files={"metrics.jsonl": "\n".join(map(json.dumps, rows))})
    _step(steps, "bench_kernels_bf16", files={"bench.json": _kernel_bench(0.05)})
    goals = {g["goal"]: g for g in gr.build_report(str(tmp_path), "gpu",
                                                   env_fn=lambda out, mode: ENV)["goals"]}
    assert goals["fp16: iterations skipped only at the start"] == {
        "goal": "fp16: iterations skipped only at the start", "value": 1, "met": False}
    assert goals["csrc/ kernels match PyTorch, bf16 (max rel err <= 0.016)"]["met"] is False


def test_the_environment_is_read_once(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(gr, "environment", lambda mode: calls.append(mode) or {"torch": "2.11"})
    assert gr.cached_environment(str(tmp_path), "gpu") == {"torch": "2.11"}
    assert gr.cached_environment(str(tmp_path), "gpu") == {"torch": "2.11"}
    assert calls == ["gpu"]


def test_a_step_whose_output_does_not_parse_counts_as_failed(tmp_path):
    steps = tmp_path / "steps"
    _step(steps, "train_124M_bf16", files={"metrics.jsonl": ""})
    (tmp_path / "steps.order").write_text("train_124M_bf16\n")
    report = gr.build_report(str(tmp_path), "gpu", env_fn=lambda out, mode: ENV)
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
