"""MFU that users can trust: the FLOP formulas, the GPU peak table, the cached CPU peak, the
over-100% warning and HFU with activation recompute."""
import json
import logging
import os
import subprocess
import sys

import pytest
import torch

from app.config import ModelConfig
from app.training.telemetry import flops

L, H, S, V = 6, 384, 256, 50304


def model_config():
    return ModelConfig(num_layers=L, hidden_size=H, num_attention_heads=6, seq_length=S,
                       max_position_embeddings=S, padded_vocab_size=V)


def test_flop_formulas_by_hand():
    m = model_config()
    model = 72 * L * H * H * (1 + S / (6 * H) + V / (12 * L * H))
    assert flops.model_flops_per_token(m) == pytest.approx(model)
    assert flops.hardware_flops_per_token(m, "none") == pytest.approx(model)
    # full recompute: one more forward of every layer (x 4/3), the logits are not recomputed
    full = 4 / 3 * 72 * L * H * H * (1 + S / (6 * H)) + 6 * H * V
    assert flops.hardware_flops_per_token(m, "full") == pytest.approx(full)
    assert flops.hardware_flops_per_token(m, "full") == pytest.approx(
        96 * L * H * H * (1 + S / (6 * H) + V / (16 * L * H)))
    selective = 72 * L * H * H * (1 + S / (3 * H) + V / (12 * L * H))
    assert flops.hardware_flops_per_token(m, "selective") == pytest.approx(selective)
    with pytest.raises(ValueError, match="recompute"):
        flops.hardware_flops_per_token(m, "some")


def test_flops_count_any_mlp_width():
    """With f != 4h: per layer fwd MACs per token are 3h^2 (QKV) + h^2 (out) + 2hf (MLP) +
    2sh (scores, AV); FLOPs = 2 x MACs, x3 for fwd+bwd; logits 2hV x 3."""
    m = ModelConfig(num_layers=L, hidden_size=H, num_attention_heads=6, seq_length=S,
                    max_position_embeddings=S, padded_vocab_size=V, ffn_hidden_size=3 * H)
    macs = 3 * H * H + H * H + 2 * H * (3 * H) + 2 * S * H
    assert flops.model_flops_per_token(m) == pytest.approx(L * 6 * macs + 6 * H * V)
    assert flops.model_flops_per_token(m) < flops.model_flops_per_token(model_config())


@pytest.mark.parametrize("name, dtype, tf32, value", [
    ("NVIDIA H100 80GB HBM3", torch.bfloat16, False, 989.4e12),
    ("NVIDIA H100 80GB HBM3", torch.float32, True, 494.7e12),
    ("NVIDIA H100 80GB HBM3", torch.float32, False, 66.9e12),
    ("NVIDIA H100 PCIe", torch.bfloat16, False, 756.5e12),
    ("NVIDIA H100 NVL", torch.float16, False, 835.5e12),
    ("NVIDIA H200", torch.float16, False, 989.4e12),
    ("NVIDIA H200 NVL", torch.bfloat16, False, 835.5e12),
    ("NVIDIA A100-SXM4-80GB", torch.bfloat16, False, 312e12),
    ("NVIDIA A100-PCIE-40GB", torch.float32, True, 156e12),
    ("NVIDIA L40S", torch.bfloat16, False, 362.05e12),
    ("NVIDIA L40", torch.bfloat16, False, 181.05e12),
    ("NVIDIA L4", torch.bfloat16, False, 121e12),
    ("Tesla V100-SXM2-32GB", torch.float16, False, 125e12),
    ("Tesla V100-PCIE-16GB", torch.float16, False, 112e12),
])
def test_gpu_peak_table(name, dtype, tf32, value):
    peak, desc = flops.gpu_peak_from_table(name, dtype, allow_tf32=tf32)
    assert peak == value and name in desc and "dense" in desc


def test_unknown_gpu_or_dtype_is_not_guessed():
    assert flops.gpu_peak_from_table("Tesla V100-SXM2-32GB", torch.bfloat16) is None  # no bf16
    assert flops.gpu_peak_from_table("Some New GPU", torch.bfloat16) is None
    assert flops.peak_flops(torch.device("cpu"), torch.float32, override=3e12) == (
        3e12, "--peak-flops")


def test_cpu_peak_is_cached_read_by_another_process_and_remeasured(tmp_path, monkeypatch):
    cache = tmp_path / "peaks.json"
    monkeypatch.setenv(flops.CACHE_ENV, str(cache))
    calls = []

    def fake_measure(device, dtype, *a, **k):
        calls.append(dtype)
        return 123.25e9  # a value no real measurement gives: proves who answered

    monkeypatch.setattr(flops, "measure_matmul_peak", fake_measure)
    value, desc = flops.peak_flops(torch.device("cpu"), torch.float32)
    assert value == 123.25e9 and "measured" in desc and len(calls) == 1
    key = flops.cpu_peak_key(torch.float32, torch.get_num_threads())
    assert json.loads(cache.read_text()) == {key: 123.25e9}
    assert flops.peak_flops("cpu", torch.float32)[0] == 123.25e9 and len(calls) == 1
    code = ("import torch; from app.training.telemetry import flops; "
            f"torch.set_num_threads({torch.get_num_threads()}); "
            "print(repr(flops.peak_flops('cpu', torch.float32)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=dict(os.environ, **{flops.CACHE_ENV: str(cache)}))
    value2, desc2 = eval(out.stdout.strip())  # noqa: S307 - our own repr of a (float, str)
    assert value2 == 123.25e9 and desc2.startswith("cached")
    again, desc3 = flops.cached_cpu_peak(torch.float32, remeasure=True)
    assert again == 123.25e9 and "measured" in desc3 and len(calls) == 2
    # another dtype or thread count is another entry
    flops.cached_cpu_peak(torch.bfloat16, threads=1)
    assert len(json.loads(cache.read_text())) == 2
    # a re-measurement on a busy machine (lower) keeps the best; a higher one replaces it;
    # reset forgets the cached value
    measured = iter([100e9, 130e9, 90e9])
    monkeypatch.setattr(flops, "measure_matmul_peak", lambda *a, **k: next(measured))
    low, desc4 = flops.cached_cpu_peak(torch.float32, remeasure=True)
    assert low == 123.25e9 and "below the" in desc4
    assert flops.cached_cpu_peak(torch.float32, remeasure=True)[0] == 130e9
    assert flops.cached_cpu_peak(torch.float32, reset=True)[0] == 90e9
    assert json.loads(cache.read_text())[key] == 90e9


def test_real_cpu_measurement_is_positive_and_best_of():
    by_n = flops.matmul_flops_by_size(torch.device("cpu"), torch.float32, sizes=(64, 128),
                                      repeats=3)
    assert set(by_n) == {64, 128} and all(v > 1e7 for v in by_n.values())


def _report(extra):
    """The TrainingReport (MFU, HFU) of a one-rank synthetic run with these extra flags."""
    import arguments
    from tests.harness.synthetic import build_synthetic_run
    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--micro-batch-size", "2", "--train-iters", "4",
            "--distributed-backend", "gloo", *extra]
    return build_synthetic_run(arguments.config_from_argv(argv, 1, 64), 16)["trainer"].report


def test_mfu_over_100_percent_warns_once_and_hfu_counts_recompute(caplog):
    plain = _report(["--peak-flops", "1e15"])
    tps = 1000.0
    u = plain.utilization(tps)
    assert "hfu" not in u and u["mfu"] == pytest.approx(tps * plain.flops_per_token / 1e15)
    recompute = _report(["--peak-flops", "1e15", "--checkpoint-activations"])
    u = recompute.utilization(tps)
    m = recompute.cfg.model
    Ln, h, s, v = m.num_layers, m.hidden_size, m.seq_length, m.padded_vocab_size
    factor = (96 * Ln * h * h * (1 + s / (6 * h)) + 6 * h * v) / (
        72 * Ln * h * h * (1 + s / (6 * h) + v / (12 * Ln * h)))
    assert u["hfu"] / u["mfu"] == pytest.approx(factor) and factor > 1
    tiny_peak = _report(["--peak-flops", "1e3"])
    with caplog.at_level(logging.WARNING, logger="app"):
        first = tiny_peak.utilization(tps)
        tiny_peak.utilization(tps)
    warnings = [r for r in caplog.records if "exceeds the peak" in r.getMessage()]
    assert first["mfu"] > 1.0 and len(warnings) == 1
    assert "--peak-flops" in warnings[0].getMessage()


def test_hfu_follows_the_configured_recompute():
    """Selective recompute uses its own formula; block recompute counts only the recomputed
    layers (24 h^2 (1 + s/(6h)) per token for each)."""
    tps = 1000.0
    plain = _report(["--peak-flops", "1e15", "--num-layers", "4"])
    m = plain.cfg.model
    L, h, s, v = m.num_layers, m.hidden_size, m.seq_length, m.padded_vocab_size
    model_flops = 72 * L * h * h * (1 + s / (6 * h) + v / (12 * L * h))
    cases = {
        ("--recompute-granularity", "selective"): 72 * L * h * h * (1 + s / (3 * h) + v / (12 * L * h)),
        ("--recompute-granularity", "full", "--recompute-method", "block",
         "--recompute-num-layers", "1"): model_flops + 24 * 1 * h * h * (1 + s / (6 * h)),
        ("--recompute-granularity", "full", "--recompute-method", "uniform",
         "--recompute-num-layers", "2"): 96 * L * h * h * (1 + s / (6 * h)) + 6 * h * v,
    }
    for flags, hardware in cases.items():
        report = _report(["--peak-flops", "1e15", "--num-layers", "4", *flags])
        u = report.utilization(tps)
        assert report.recompute == flags[1]
        assert u["hfu"] / u["mfu"] == pytest.approx(hardware / model_flops), flags
