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
    """Megatron's count for f = 4h, MHA: per layer per token 24 h^2 (QKV, output) + 48 h^2
    (MLP) fwd+bwd, the causal attention core 6 s h, the logits 6 h V; full recompute runs each
    layer's forward again (a third of its fwd+bwd), selective the core's forward."""
    m = model_config()
    model = 72 * L * H * H * (1 + S / (12 * H) + V / (12 * L * H))
    assert flops.model_flops_per_token(m) == pytest.approx(model)
    assert flops.num_floating_point_operations(m, 8) == pytest.approx(8 * S * model)
    assert flops.hardware_flops_per_token(m, "none") == pytest.approx(model)
    full = 4 / 3 * 72 * L * H * H * (1 + S / (12 * H)) + 6 * H * V
    assert flops.hardware_flops_per_token(m, "full") == pytest.approx(full)
    half = 72 * L * H * H * (1 + S / (12 * H)) * (1 + 1 / 3 * 3 / L) + 6 * H * V
    assert flops.hardware_flops_per_token(m, "full", recomputed_layers=3) == pytest.approx(half)
    selective = model + L * 6 * S * H / 3
    assert flops.hardware_flops_per_token(m, "selective") == pytest.approx(selective)
    with pytest.raises(ValueError, match="recompute"):
        flops.hardware_flops_per_token(m, "some")


def test_flops_count_any_mlp_width_and_query_groups():
    """With f != 4h and 2 key/value groups of 6 heads: per layer fwd MACs per token are
    h q (Q) + 2 h kv (K, V) + q h (out) + 2 h f (MLP) + s q (scores and AV, half of each
    under the causal mask); FLOPs = 2 x MACs, x3 for fwd+bwd; logits 2 h V x 3."""
    m = ModelConfig(num_layers=L, hidden_size=H, num_attention_heads=6, seq_length=S,
                    max_position_embeddings=S, padded_vocab_size=V, ffn_hidden_size=3 * H,
                    group_query_attention=True, num_query_groups=2)
    q, kv = H, 2 * H // 6
    macs = H * q + 2 * H * kv + q * H + 2 * H * (3 * H) + S * q
    assert flops.model_flops_per_token(m) == pytest.approx(L * 6 * macs + 6 * H * V)
    assert flops.model_flops_per_token(m) < flops.model_flops_per_token(model_config())


def test_moe_layers_count_active_flops_as_megatron():
    """Megatron's num_floating_point_operations: a dense layer's MLP term 3 x 2 x h x (f x g),
    an MoE layer's 3 x 2 x h x (k x F_moe x g + F_shared x g) with g = 3 (SwiGLU) or 2; the
    router is not counted. Here L = 4, layers 1 and 3 MoE, 8 experts, top-2, a shared expert."""
    from app.config import MoEConfig
    h, f, f_moe, f_sh = 64, 128, 32, 48
    dense = ModelConfig(num_layers=4, hidden_size=h, num_attention_heads=4, seq_length=S,
                        padded_vocab_size=V, ffn_hidden_size=f, swiglu=True,
                        add_bias_linear=False, position_embedding_type="rope")
    moe = ModelConfig(num_layers=4, hidden_size=h, num_attention_heads=4, seq_length=S,
                      padded_vocab_size=V, ffn_hidden_size=f, swiglu=True,
                      add_bias_linear=False, position_embedding_type="rope",
                      moe=MoEConfig(num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=f_moe,
                                    moe_shared_expert_intermediate_size=f_sh,
                                    moe_layer_freq=[0, 1, 0, 1]))
    mlp = lambda width: 3 * 2 * h * width * 3  # noqa: E731 - fwd+bwd, FMA, SwiGLU's 3 GEMMs
    difference = 2 * (mlp(2 * f_moe + f_sh) - mlp(f))
    assert flops.model_flops_per_token(moe) == pytest.approx(
        flops.model_flops_per_token(dense) + difference)
    # full recompute: every layer's forward again (a third of fwd+bwd), logits not
    logits = 6 * h * V
    assert flops.hardware_flops_per_token(moe, "full") - logits == pytest.approx(
        4 / 3 * (flops.model_flops_per_token(moe) - logits))


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


def _trainer(extra):
    import arguments
    from tests.harness.synthetic import build_synthetic_run
    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--micro-batch-size", "2", "--train-iters", "4",
            "--distributed-backend", "gloo", *extra]
    return build_synthetic_run(arguments.config_from_argv(argv, 1, 64), 16)["trainer"].reporter


def test_mfu_over_100_percent_warns_once_and_hfu_counts_recompute(caplog):
    plain = _trainer(["--peak-flops", "1e15"])
    tps = 1000.0
    u = plain.utilization(tps)
    assert "hfu" not in u and u["mfu"] == pytest.approx(tps * plain.flops_per_token / 1e15)
    recompute = _trainer(["--peak-flops", "1e15", "--checkpoint-activations"])
    u = recompute.utilization(tps)
    m = recompute.cfg.model
    Ln, h, s, v = m.num_layers, m.hidden_size, m.seq_length, m.padded_vocab_size
    factor = (96 * Ln * h * h * (1 + s / (12 * h)) + 6 * h * v) / (
        72 * Ln * h * h * (1 + s / (12 * h) + v / (12 * Ln * h)))
    assert u["hfu"] / u["mfu"] == pytest.approx(factor) and factor > 1
    tiny_peak = _trainer(["--peak-flops", "1e3"])
    with caplog.at_level(logging.WARNING, logger="app"):
        first = tiny_peak.utilization(tps)
        tiny_peak.utilization(tps)
    warnings = [r for r in caplog.records if "exceeds the peak" in r.getMessage()]
    assert first["mfu"] > 1.0 and len(warnings) == 1
    assert "--peak-flops" in warnings[0].getMessage()


def test_hfu_follows_the_configured_recompute():
    """Selective recompute runs the attention core's forward again (2 s h per layer per token,
    causal); block recompute counts only the recomputed layers (24 h^2 (1 + s/(12h)) per token
    for each)."""
    tps = 1000.0
    plain = _trainer(["--peak-flops", "1e15", "--num-layers", "4"])
    m = plain.cfg.model
    L, h, s, v = m.num_layers, m.hidden_size, m.seq_length, m.padded_vocab_size
    model_flops = 72 * L * h * h * (1 + s / (12 * h) + v / (12 * L * h))
    cases = {
        ("--recompute-granularity", "selective"): model_flops + L * 2 * s * h,
        ("--recompute-granularity", "full", "--recompute-method", "block",
         "--recompute-num-layers", "1"): model_flops + 24 * 1 * h * h * (1 + s / (12 * h)),
        ("--recompute-granularity", "full", "--recompute-method", "uniform",
         "--recompute-num-layers", "2"): 96 * L * h * h * (1 + s / (12 * h)) + 6 * h * v,
    }
    for flags, hardware in cases.items():
        trainer = _trainer(["--peak-flops", "1e15", "--num-layers", "4", *flags])
        u = trainer.utilization(tps)
        assert trainer.recompute == flags[1]
        assert u["hfu"] / u["mfu"] == pytest.approx(hardware / model_flops), flags


def _model_of_megatron_args(args: dict) -> ModelConfig:
    """Our ModelConfig of the shape Megatron-LM's validated args describe."""
    return ModelConfig(
        num_layers=args["num_layers"], hidden_size=args["hidden_size"],
        num_attention_heads=args["num_attention_heads"], ffn_hidden_size=args["ffn_hidden_size"],
        kv_channels=args["kv_channels"], swiglu=args["swiglu"], seq_length=args["seq_length"],
        max_position_embeddings=args["max_position_embeddings"],
        position_embedding_type="rope", group_query_attention=args["group_query_attention"],
        num_query_groups=args["num_query_groups"] if args["group_query_attention"] else None,
        padded_vocab_size=1)


def test_megatrons_own_count_of_its_launch_scripts():
    """Megatron's num_floating_point_operations(args, global batch), recorded with Megatron's
    own code for each dense launch it accepts (tests/data/megatron_scripts), equals ours for
    the same shape: GQA, SwiGLU, the causal core, the untied output layer."""
    import dataclasses
    from tests.harness import megatron_scripts
    checked = []
    for name in megatron_scripts.names():
        record = megatron_scripts.fixture(name)
        if record["verdict"] != "accept" or record["args"]["num_experts"] is not None:
            continue  # MoE shapes: checked from the launch's own flags (test_megatron_scripts)
        m = dataclasses.replace(_model_of_megatron_args(record["args"]),
                                padded_vocab_size=record["padded_vocab_size"])
        ours = flops.num_floating_point_operations(m, record["args"]["global_batch_size"])
        assert ours == pytest.approx(record["flops_per_iteration"], rel=1e-12), name
        checked.append(name)
    assert len(checked) >= 8, checked
