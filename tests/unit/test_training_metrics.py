"""Metrics: timers, the log line, TensorBoard + JSONL writer, memory, throughput and MFU."""
import json
import math
import time

import numpy as np
import pytest
import torch

from app.config import ModelConfig
from app.training.telemetry import metrics
from app.training.telemetry.flops import model_flops_per_token


def test_timers_accumulate_and_reset():
    calls = []
    timers = metrics.Timers(barrier=lambda: calls.append("barrier"),
                            synchronize=lambda: calls.append("sync"))
    timers("step").start(barrier=True)
    time.sleep(0.02)
    timers("step").stop()
    timers("step").start()
    time.sleep(0.01)
    timers("step").stop()
    assert calls == ["barrier", "sync", "sync", "sync", "sync"]
    assert 0.025 <= timers.elapsed("step", reset=False) < 0.5
    line = timers.log_line(["step", "never-created"], normalizer=2.0)
    assert line.startswith("time (ms) | step: ") and "never-created" not in line
    assert 12.0 <= float(line.split(": ")[-1]) < 250.0
    assert timers.elapsed("step") == 0.0  # log_line reset it
    with pytest.raises(RuntimeError, match="not started"):
        timers("step").stop()
    timers("step").start()
    with pytest.raises(RuntimeError, match="already started"):
        timers("step").start()


def test_format_train_log_is_megatron_style():
    values = {"consumed_samples": 80, "ms_per_iteration": 123.44, "lr": 1e-4, "lm_loss": 5.25,
              "loss_scale": 1.0, "grad_norm": 1.2345, "skipped_iterations": 0,
              "tokens_per_s": 1234.4, "tflops_per_rank": 0.1234, "mfu": 0.1234,
              "mem_rss_mb": 812.2, "mem_peak_rss_mb": 900.0}
    line = metrics.format_train_log(10, 200, values)
    assert line.startswith(" iteration       10/     200 |")
    for part in ["consumed samples:           80", "elapsed time per iteration (ms): 123.4",
                 "learning rate: 1.000000E-04", "lm loss: 5.250000E+00", "loss scale: 1.0",
                 "grad norm: 1.234", "number of skipped iterations:   0", "tokens/s: 1234",
                 "TFLOP/s per rank: 0.123", "MFU: 12.34%", "mem RSS/peak (MB): 812/900"]:
        assert f"| {part} |" in line, part
    short = metrics.format_train_log(1, 2, {"lm_loss": 1.0, "grad_norm": None})
    assert "grad norm" not in short and short.endswith("lm loss: 1.000000E+00 |")


def test_metrics_writer_jsonl_rows_and_megatrons_tensorboard_tags(tmp_path):
    """The metrics file gets our rows; TensorBoard gets Megatron's tags (each with its
    "vs samples" twin over the consumed samples, the CUDA memory tags without one) and our
    other records as {kind}/{name}."""
    tb_dir, path = tmp_path / "tb", tmp_path / "sub" / "metrics.jsonl"
    with metrics.MetricsWriter(str(tb_dir), str(path)) as writer:
        writer.write("train", 10, {"lm_loss": 2.5, "lr": 1e-4, "grad_norm": float("nan"),
                                   "loss": torch.tensor(3.0),
                                   "n": np.float32(0.5), "skipped": np.int64(2)})
        writer.write("valid", 10, {"lm_loss": 2.75, "ppl": math.exp(2.75)})
        writer.scalars(10, {"lm loss": 2.5, "learning-rate": 1e-4, "mem-allocated-bytes": 7},
                       consumed_samples=80)
        writer.scalars(10, {"iteration-time": 0.25})
        writer.write("stragglers", 10, {"slowest_ms": 12.0})
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["kind"] for r in rows] == ["train", "valid", "stragglers"]
    assert rows[0]["iteration"] == 10 and rows[0]["lm_loss"] == 2.5 and rows[0]["loss"] == 3.0
    assert rows[0]["n"] == 0.5 and rows[0]["skipped"] == 2
    assert rows[0]["grad_norm"] is None  # NaN is not JSON
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == {
        "lm loss", "lm loss vs samples", "learning-rate", "learning-rate vs samples",
        "mem-allocated-bytes", "iteration-time", "stragglers/slowest_ms"}
    assert [(e.step, e.value) for e in acc.Scalars("lm loss")] == [(10, 2.5)]
    assert [(e.step, e.value) for e in acc.Scalars("lm loss vs samples")] == [(80, 2.5)]


def test_megatrons_scalars_by_flag():
    """Which tags an iteration, an interval and an evaluation write, by Megatron's flags."""
    from app.config import LogConfig
    from app.training.telemetry import scalars
    plain = scalars.iteration_scalars(LogConfig(), lr=1e-4, batch_size=8,
                                      losses={"lm loss": 2.0, "z_loss": None}, loss_scale=1.0,
                                      grad_norm=float("nan"), world_size=4)
    assert plain == {"learning-rate": 1e-4, "batch-size": 8, "lm loss": 2.0, "loss-scale": 1.0}
    every = LogConfig(log_loss_scale_to_tensorboard=False, log_world_size_to_tensorboard=True,
                      log_memory_to_tensorboard=True, log_timers_to_tensorboard=True,
                      log_throughput=True, log_validation_ppl_to_tensorboard=True)
    memory = {"reserved_bytes.all.current": 4, "allocated_bytes.all.current": 3,
              "allocated_bytes.all.peak": 5, "allocation.all.current": 2}
    tags = scalars.iteration_scalars(every, lr=None, batch_size=8, losses={"lm loss": 2.0},
                                     loss_scale=1.0, grad_norm=0.5, world_size=4,
                                     cuda_memory=memory)
    assert tags == {"batch-size": 8, "lm loss": 2.0, "world-size": 4, "grad-norm": 0.5,
                    "mem-reserved-bytes": 4, "mem-allocated-bytes": 3,
                    "mem-max-allocated-bytes": 5, "mem-allocated-count": 2}
    values = {"tokens_per_s": 100.0, "mfu": 0.5, "hfu": None}
    assert scalars.interval_scalars(LogConfig(), values, 0.2, 3.0, {"optimizer": 0.1}) == {
        "tokens-per-second": 100.0, "mfu": 0.5}
    assert scalars.interval_scalars(every, values, 0.2, 3.0, {"optimizer": 0.1}) == {
        "iteration-time": 0.2, "optimizer-time": 0.1, "throughput": 3.0,
        "tokens-per-second": 100.0, "mfu": 0.5}
    assert scalars.validation_scalars(LogConfig(), {"lm loss": 2.0}) == {"lm loss validation": 2.0}
    assert scalars.validation_scalars(every, {"lm loss": 30.0}) == {
        "lm loss validation": 30.0, "lm loss validation ppl": math.exp(20.0)}


def test_disabled_writer_creates_nothing(tmp_path):
    writer = metrics.MetricsWriter(str(tmp_path / "tb"), str(tmp_path / "m.jsonl"),
                                   enabled=False)
    writer.write("train", 1, {"lm_loss": 1.0})
    writer.close()
    assert list(tmp_path.iterdir()) == []


def test_memory_stats():
    stats = metrics.memory_stats(torch.device("cpu"))
    assert stats["mem_rss_mb"] > 10 and stats["mem_peak_rss_mb"] >= stats["mem_rss_mb"] * 0.5
    assert not any(k.startswith("mem_cuda") for k in stats)


def test_throughput_and_mfu_math():
    m = ModelConfig(num_layers=6, hidden_size=384, num_attention_heads=6, seq_length=256,
                    max_position_embeddings=256, padded_vocab_size=50304)
    tps = metrics.tokens_per_second(8, 256, 0.5)
    assert tps == 4096.0
    per_rank = metrics.achieved_flops_per_rank(tps, model_flops_per_token(m), world_size=2)
    L, h, s, V = 6, 384, 256, 50304
    expected = 4096 * 72 * L * h * h * (1 + s / (12 * h) + V / (12 * L * h)) / 2  # causal core
    assert per_rank == pytest.approx(expected)
    assert metrics.model_flops_utilization(per_rank, 2 * per_rank) == pytest.approx(0.5)
    assert math.isnan(metrics.model_flops_utilization(1.0, 0.0))
    assert math.isnan(metrics.tokens_per_second(1, 1, 0.0))


def test_eta_in_the_log_line():
    assert metrics.format_duration(3725.2) == "1:02:05"
    assert metrics.format_duration(2 * 86400 + 5) == "2 days, 0:00:05"
    assert metrics.format_duration(float("nan")) == "?"
    line = metrics.format_train_log(10, 100, {"ms_per_iteration": 250.0, "eta_s": 22.5, "lr": 1e-4})
    assert "elapsed time per iteration (ms): 250.0 | ETA: 0:00:22 | learning rate" in line
