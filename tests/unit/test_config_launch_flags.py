"""Megatron-LM's flags with Megatron's meaning where they only pick a kernel, switch a runtime
feature or need hardware this machine lacks: accepted, never silently ignored
(app.config.unread), FP8 counted for a GPU world and refused without the hardware, and the
rules that agree with Megatron's (sequence parallelism at TP 1, --split as Megatron reads it)."""
import pytest

import arguments
from app.config import Fp8Config
from app.config.unread import no_effect, unread_flags
from app.config.rules import split_weights

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--micro-batch-size", "2", "--train-iters", "4",
        "--distributed-backend", "gloo"]


def config(*extra, world=1):
    return arguments.config_from_argv(BASE + list(extra), world, 64)


def test_sequence_parallel_at_tp1_is_turned_off_and_said():
    cfg = config("--sequence-parallel")
    assert cfg.model.sequence_parallel is False
    assert any("--sequence-parallel is turned off" in n and "Disabling sequence parallelism"
               in n for n in no_effect(cfg))
    kept = config("--sequence-parallel", "--tensor-model-parallel-size", "2", world=2)
    assert kept.model.sequence_parallel is True and not unread_flags(kept)


@pytest.mark.parametrize("text, fractions", [
    ("969,30,1", (0.969, 0.03, 0.001)), ("90/5/5", (0.9, 0.05, 0.05)),
    ("'99,1,0'", (0.99, 0.01, 0.0)), ("99", (1.0, 0.0, 0.0)), (" 1, 1 ", (0.5, 0.5, 0.0))])
def test_split_is_read_as_megatron_reads_it(text, fractions):
    """Megatron Core's parse_and_normalize_split: the numbers, whatever separates them."""
    assert split_weights(text) == pytest.approx(fractions)


def test_kernel_switches_pick_a_path_or_say_they_change_nothing():
    cfg = config("--no-rope-fusion", "--no-gradient-accumulation-fusion", "--attention-backend",
                 "unfused", "--no-masked-softmax-fusion", "--no-bias-swiglu-fusion",
                 "--no-bias-dropout-fusion")
    m = cfg.model
    assert (m.attention_impl, m.masked_softmax_fusion, m.bias_swiglu_fusion,
            m.bias_dropout_fusion, m.apply_rope_fusion) == ("unfused", False, False, False, False)
    notes = no_effect(cfg)
    assert [n.split()[0] for n in notes] == ["--no-rope-fusion",
                                             "--no-gradient-accumulation-fusion"]
    with pytest.raises(ValueError, match="--use-flash-attn .* --attention-backend fused"):
        config("--use-flash-attn", "--attention-backend", "fused")


def test_settings_without_their_switch_are_named():
    cfg = config("--profile-step-start", "3", "--manual-gc-interval", "2",
                 "--fp8-amax-history-len", "16", "--log-throughput", "--log-timers-to-tensorboard",
                 "--reset-attention-mask", "--no-create-attention-mask-in-dataloader",
                 "--empty-unused-memory-level", "1", "--fp8-interval", "2")
    notes = no_effect(cfg, "cpu")
    for fragment in ("--profile-step-start has no effect without --profile",
                     "--manual-gc-interval has no effect without --manual-gc",
                     "--fp8-interval, --fp8-amax-history-len have no effect without --fp8-format",
                     "--log-timers-to-tensorboard has no effect without --tensorboard-dir",
                     "--reset-attention-mask has no effect with "
                     "--no-create-attention-mask-in-dataloader",
                     "--empty-unused-memory-level 1 has no effect on the cpu",
                     "--fp8-interval is ignored"):
        assert any(fragment in n for n in notes), (fragment, notes)
    assert not cfg.data.attention_mask_resets and cfg.data.reset_attention_mask
    assert not any("--empty-unused-memory-level" in n for n in no_effect(cfg, "cuda"))


def test_fp8_rules_and_what_a_machine_lacks():
    with pytest.raises(ValueError, match="--fp8-param-gather only supported with distributed "
                                         "optimizer"):
        config("--bf16", "--fp8-format", "hybrid", "--fp8-param-gather")
    fp8 = config("--bf16", "--fp8-format", "hybrid", "--fp8-amax-history-len", "1024",
                 "--fp8-amax-compute-algo", "max", "--fp8-param-gather",
                 "--use-distributed-optimizer").fp8
    flags = "--fp8-format hybrid --fp8-amax-history-len 1024 --fp8-amax-compute-algo max " \
            "--fp8-param-gather"
    assert " ".join(fp8.flags()) == flags
    assert "E4M3 forward, E5M2 gradients" in fp8.recipe() and "amax history 1024" in fp8.recipe()
    assert fp8.requirement(None, False) == (
        f"{flags} needs NVIDIA Transformer Engine (transformer_engine.pytorch) on GPUs with FP8 "
        "tensor cores (compute capability >= 8.9); this machine has no CUDA device: drop the "
        "FP8 flags to train in bf16 here, or run on such GPUs")
    assert "compute capability 8.0" in fp8.requirement((8, 0), True)
    assert "transformer_engine is not installed" in fp8.requirement((9, 0), False)
    assert "not implemented in this project yet" in fp8.requirement((9, 0), True)
    assert Fp8Config().requirement(None, False) is None


def test_dry_run_counts_fp8_for_a_gpu_world_and_refuses_it_here(capsys):
    from pretrain_gpt2 import run
    flags = BASE + ["--bf16", "--mock-data", "--vocab-size", "64", "--fp8-format", "e4m3"]
    planned = run(flags + ["--dry-run", "--dry-run-device-memory", "80"])
    text = planned.render()
    assert not planned.errors, text
    assert "[fp8]" in text and "FP8 E4M3 everywhere, delayed scaling" in text
    assert "+ 2Ψ_lin for the FP8 copy and transpose of the linear weights" in text
    here = run(flags + ["--dry-run"]).render()
    assert "ERROR --fp8-format e4m3 needs NVIDIA Transformer Engine" in here
