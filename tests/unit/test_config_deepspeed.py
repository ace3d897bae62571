"""Reconciling a DeepSpeed JSON with the command line: fill what is missing, reject conflicts
with a message naming the JSON key, the flag and both values."""
import pytest

import arguments
from app.config.deepspeed import offloads_optimizer, reconcile_ds_config

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--train-iters", "10",
        "--micro-batch-size", "2", "--global-batch-size", "16", "--clip-grad", "1.0",
        "--lr", "3e-4", "--distributed-backend", "gloo"]


def cfg(*extra, world=2):
    args = arguments.parse_args(BASE + list(extra))
    args._explicit_flags = frozenset()  # the checks of explicit flags are called directly below
    return arguments.build_run_config(args, world, 128, 128)


def test_missing_values_are_filled_from_the_command_line():
    ds = reconcile_ds_config({"zero_optimization": {"stage": 2}}, cfg())
    assert ds["train_micro_batch_size_per_gpu"] == 2
    assert ds["gradient_accumulation_steps"] == 4  # 16 / (2 x DP 2)
    assert ds["train_batch_size"] == 16
    assert ds["gradient_clipping"] == 1.0
    assert ds["fp16"]["enabled"] is False and ds["bf16"]["enabled"] is False


@pytest.mark.parametrize("key,value,flag", [
    ("train_batch_size", 32, "--global-batch-size"),
    ("train_micro_batch_size_per_gpu", 4, "--micro-batch-size"),
    ("gradient_accumulation_steps", 2, "--global-batch-size"),
    ("gradient_clipping", 0.5, "--clip-grad"),
])
def test_disagreements_name_both_values(key, value, flag):
    with pytest.raises(ValueError) as err:
        reconcile_ds_config({key: value}, cfg(), "x.json")
    msg = str(err.value)
    assert "x.json" in msg and key in msg and flag in msg and str(value) in msg


def test_precision_must_agree():
    with pytest.raises(ValueError, match="--fp16"):
        reconcile_ds_config({"fp16": {"enabled": True}}, cfg())
    import os
    ds_json = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
                           "ds_configs", "zero2.json")
    bf16 = cfg("--bf16", "--deepspeed", "--deepspeed_config", ds_json)
    assert reconcile_ds_config({}, bf16)["bf16"]["enabled"] is True


def test_json_optimizer_must_agree_and_scheduler_conflicts_with_explicit_flags():
    with pytest.raises(ValueError, match="optimizer.params.lr"):
        reconcile_ds_config({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}, cfg())
    filled = reconcile_ds_config({"optimizer": {"type": "AdamW"}}, cfg())
    assert filled["optimizer"]["params"]["lr"] == 3e-4
    both = {"optimizer": {"type": "AdamW"}, "scheduler": {"type": "WarmupLR"}}
    reconcile_ds_config(both, cfg(), explicit_flags={"--lr"})  # --lr is the optimizer's, fine
    with pytest.raises(ValueError, match="--lr-decay-style"):
        reconcile_ds_config(both, cfg(), explicit_flags={"--lr-decay-style"})
    with pytest.raises(ValueError, match="scheduler"):
        reconcile_ds_config({"scheduler": {"type": "WarmupLR"}}, cfg())


def test_zero3_is_filled_other_stages_rejected_and_offload_detected():
    with pytest.raises(ValueError, match="stage 4 is not a ZeRO stage"):
        reconcile_ds_config({"zero_optimization": {"stage": 4}}, cfg())
    filled = reconcile_ds_config({"zero_optimization": {"stage": 3}}, cfg())["zero_optimization"]
    assert filled == {"stage": 3, "memory_efficient_linear": False}  # the native F.linear stays
    muon = {"zero_optimization": {"stage": 3}, "optimizer": {"type": "Muon"}}
    assert reconcile_ds_config(muon, cfg())["zero_optimization"]["reduce_scatter"] is False
    muon["zero_optimization"]["reduce_scatter"] = True
    with pytest.raises(ValueError, match="reduce_scatter false"):
        reconcile_ds_config(muon, cfg(), "x.json")
    assert offloads_optimizer({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}})
    assert not offloads_optimizer({"zero_optimization": {"stage": 2}})


@pytest.mark.parametrize("stage, why", [(2, "reduce-scatters gradients"),
                                        (3, "partitions the weights themselves")])
def test_pipeline_with_deepspeed_is_rejected(stage, why):
    import os
    ds_json = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
                           "ds_configs", f"zero{stage}.json")
    args = arguments.parse_args(BASE + ["--pipeline-model-parallel-size", "2", "--deepspeed",
                                        "--deepspeed_config", ds_json])
    with pytest.raises(ValueError, match="pipeline-model-parallel-size") as err:
        arguments.build_run_config(args, 2, 128, 128)
    assert why in str(err.value) and f"zero{stage}.json" in str(err.value)


def test_loss_scale_flags_fill_the_fp16_block_and_are_checked():
    import os
    ds_json = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
                           "ds_configs", "zero2.json")
    half = cfg("--fp16", "--deepspeed", "--deepspeed_config", ds_json, "--loss-scale-window", "500",
               "--initial-loss-scale", "65536", "--hysteresis", "4")
    flags = {"--loss-scale-window", "--initial-loss-scale", "--hysteresis"}
    ds = reconcile_ds_config({"fp16": {"enabled": True}}, half, explicit_flags=flags)
    assert ds["fp16"]["loss_scale_window"] == 500 and ds["fp16"]["initial_scale_power"] == 16
    assert ds["fp16"]["hysteresis"] == 4
    with pytest.raises(ValueError, match="fp16.hysteresis"):
        reconcile_ds_config({"fp16": {"enabled": True, "hysteresis": 2}}, half, explicit_flags=flags)
    odd = cfg("--fp16", "--deepspeed", "--deepspeed_config", ds_json, "--initial-loss-scale", "1000")
    with pytest.raises(ValueError, match="power of two"):
        reconcile_ds_config({}, odd, explicit_flags={"--initial-loss-scale"})
    bf16 = cfg("--bf16", "--deepspeed", "--deepspeed_config", ds_json, "--hysteresis", "3")
    ds = reconcile_ds_config({"bf16": {"enabled": True}}, bf16, explicit_flags={"--hysteresis"})
    assert "hysteresis" not in ds["fp16"]  # not read without fp16 (app.config.unread warns)


def test_keep_last_n_checkpoints_must_be_positive():
    with pytest.raises(ValueError, match="--keep-last-n-checkpoints"):
        cfg("--keep-last-n-checkpoints", "0")


def test_universal_checkpoint_flag_sets_load_universal(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{"zero_optimization": {"stage": 2}}')
    ds_flags = ["--deepspeed", "--deepspeed_config", str(path)]
    assert "checkpoint" not in reconcile_ds_config({}, cfg(*ds_flags))
    universal = cfg(*ds_flags, "--universal-checkpoint")
    assert reconcile_ds_config({}, universal)["checkpoint"] == {"load_universal": True}
    with pytest.raises(ValueError, match="--universal-checkpoint needs --deepspeed"):
        cfg("--universal-checkpoint")


def test_deepspeeds_universal_merge_of_our_tp2_shards_gives_the_tp1_tensors(tmp_path):
    """DeepSpeed's own ds_to_universal.merge_tp_slices, fed the TP2 shards of a model with the
    Llama block and our universal_checkpoint_info, gives the TP1 model's tensors: --swiglu's fc1
    [gate_r; up_r] as two sub-parameters, row-parallel weights by columns, norms replicated."""
    import torch
    from deepspeed.checkpoint import constants, ds_to_universal

    from app.config import ModelConfig
    from app.model import GPT2Model
    from app.mpu.parallel_state import ParallelState
    from app.training.engines.deepspeed import universal_checkpoint_info
    config = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, seq_length=16,
                         max_position_embeddings=16, padded_vocab_size=64, seed=3, swiglu=True,
                         normalization="RMSNorm", add_bias_linear=False, ffn_hidden_size=48)
    full = dict(GPT2Model(config).named_parameters())
    ranks = [dict(GPT2Model(config, ParallelState(tensor_model_parallel_size=2,
                                                  tensor_model_parallel_rank=r)).named_parameters())
             for r in range(2)]
    info = universal_checkpoint_info(GPT2Model(config, ParallelState(
        tensor_model_parallel_size=2)), vocab_size=64)
    for name, value in full.items():  # ds_to_universal's slice files: <name>/<tp>/<state>.<dp>
        for rank in range(2):
            (tmp_path / "slices" / name / str(rank)).mkdir(parents=True)
            for state in ("fp32", "exp_avg", "exp_avg_sq"):
                torch.save(ranks[rank][name].detach().flatten().clone(),
                           tmp_path / "slices" / name / str(rank) / f"{state}.00")
        ds_to_universal.merge_tp_slices(info, str(tmp_path / "out"), str(tmp_path / "slices"), 2,
                                        (name, [tuple(r[name].shape) for r in ranks]))
        merged = torch.load(tmp_path / "out" / name / "fp32.pt", weights_only=False)
        assert torch.equal(merged[constants.PARAM], value.detach()), name


MOE = ["--num-experts", "4", "--disable-bias-linear", "--swiglu", "--deepspeed"]


def _json(tmp_path, **zero):
    import json
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2, **zero}}))
    return ["--deepspeed_config", str(path)]


@pytest.mark.parametrize("extra,world,zero,message", [
    (["--tensor-model-parallel-size", "2", "--sequence-parallel"], 2, {},
     "--num-experts with --deepspeed and --tensor-model-parallel-size 2 is not supported"),
    (["--pipeline-model-parallel-size", "2"], 2, {},
     "--num-experts with --deepspeed and --pipeline-model-parallel-size 2 is not supported"),
    (["--expert-tensor-parallel-size", "2"], 2, {},
     "--num-experts with --deepspeed and --expert-tensor-parallel-size 2 is not supported"),
    ([], 2, {"stage": 3}, "Native DeepSpeed MoE is not supported with ZeRO Stage 3. Use AutoEP "
                          "or choose ZeRO stage 1/2."),
    ([], 2, {"stage": 0}, "--num-experts at ZeRO stage 0 is not supported"),
    ([], 2, {"contiguous_gradients": False},
     "Contiguous Gradients in ZeRO Stage 2 must be set to True for MoE."),
    ([], 2, {"reduce_scatter": False},
     "Reduce Scatter in ZeRO Stage 2 must be set to True for MoE."),
    (["--universal-checkpoint"], 2, {},
     "--universal-checkpoint with --num-experts is not supported"),
])
def test_moe_under_deepspeed_refusals_are_one_line(tmp_path, extra, world, zero, message):
    """What MoE under DeepSpeed does not take is refused when the config is built, in one line
    naming the flag or JSON key (DeepSpeed's own words where DeepSpeed refuses the same)."""
    with pytest.raises(ValueError) as err:
        cfg(*MOE, *_json(tmp_path, **zero), *extra, world=world)
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_moe_under_zero1_and_zero2_builds_with_clipping_from_the_command_line(tmp_path):
    for stage in (1, 2):
        run = cfg(*MOE, *_json(tmp_path, stage=stage), "--expert-model-parallel-size", "2",
                  "--clip-grad", "0.3")
        assert run.deepspeed.config["gradient_clipping"] == 0.3
