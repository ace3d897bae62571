"""Megatron-LM's MoE flags: names, types, defaults and rules as Megatron's own code has them.

Defaults against Megatron Core 0.16.1's TransformerConfig / ModelParallelConfig fields; the
values of two MoE command lines against the `args` Megatron-LM's own parse_args +
validate_args made of them (tests/data/megatron_args, core_v0.16.1 and today's main);
--moe-layer-freq's list grammar against Python's evaluation of the same expressions (what
Megatron does after its character check); and every refusal with its words.
"""
from __future__ import annotations

import dataclasses

import pytest

from app.config import MoEConfig
from app.config.moe import moe_freq_type
from tests.harness import megatron_args as fixtures
from tests.harness.arguments import DS_JSON, build, expect_error

MOE = ["--num-experts", "4", "--disable-bias-linear", "--swiglu"]
FIELD_NAMES = {"num_experts": "num_moe_experts"}
"""Our field -> Megatron Core's TransformerConfig field where the flag and the field differ."""


def _scalar(value):
    """Megatron turns a one-element list of these nargs='+' flags into its element."""
    return value[0] if isinstance(value, list) and len(value) == 1 else value


def test_defaults_equal_megatron_core_config_fields():
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.transformer.transformer_config import TransformerConfig
    theirs = {f.name: f for f in dataclasses.fields(TransformerConfig)}
    compared = 0
    for field in dataclasses.fields(MoEConfig):
        name = FIELD_NAMES.get(field.name, field.name)
        if name not in theirs or name == "moe_latent_size":
            continue
        default = (field.default_factory() if field.default_factory is not dataclasses.MISSING
                   else field.default)
        assert _scalar(default) == theirs[name].default, name
        compared += 1
    assert compared >= 25
    parallel = {f.name: f.default for f in dataclasses.fields(ModelParallelConfig)}
    cfg = build([])
    assert cfg.parallel.expert_model_parallel_size == parallel["expert_model_parallel_size"]
    assert parallel["expert_tensor_parallel_size"] is None  # Megatron: None means TP
    assert build(["--tensor-model-parallel-size", "2", "--sequence-parallel"], world_size=2
                 ).parallel.expert_tensor_parallel_size == 2


@pytest.mark.parametrize("version", fixtures.VERSIONS)
@pytest.mark.parametrize("flag_set", ["qwen3_moe", "moe_options"])
def test_parsed_flags_equal_megatrons_args(version, flag_set):
    import arguments
    record = fixtures.record(version, flag_set)
    megatron = fixtures.load(version, flag_set)
    cfg = arguments.build_run_config(arguments.parse_args(record["argv"]), 1, 300,
                                     megatron.padded_vocab_size)
    ours = {**dataclasses.asdict(cfg.model.moe),
            "expert_model_parallel_size": cfg.parallel.expert_model_parallel_size,
            "expert_tensor_parallel_size": cfg.parallel.expert_tensor_parallel_size}
    compared = [name for name in ours if hasattr(megatron, name)]  # some are HEAD's only
    for name in compared:
        assert _scalar(ours[name]) == _scalar(getattr(megatron, name)), (version, name)
    assert len(compared) >= 24


@pytest.mark.parametrize("text", ["([0]+[1]*23)", "([1]*3+[0]*2)*2", "[1,0]*2", "[0, 1, 1]",
                                  "[1]+[0]*(2+1)", "[(1)]*2"])
def test_layer_freq_grammar_equals_python(text):
    assert moe_freq_type(text) == eval(text)  # noqa: S307 - the reference Megatron uses
    assert moe_freq_type("3") == 3 and moe_freq_type(2) == 2


@pytest.mark.parametrize("text", ["[1,0]+__import__('os')", "[1,0", "[1]*[2]", "(1,0)", "2*"])
def test_layer_freq_grammar_refuses_anything_else(text):
    import argparse
    with pytest.raises(argparse.ArgumentTypeError, match="Invalid pattern"):
        moe_freq_type(text)


def test_layer_freq_list_length_and_values():
    expect_error(MOE + ["--moe-layer-freq", "[1,1]"],
                 "Invalid length of moe_layer_pattern: 2, expected 4")
    expect_error(MOE + ["--moe-layer-freq", "[1,2,1,1]"], "must be 0 (dense) or 1 (MoE)")
    cfg = build(MOE + ["--moe-layer-freq", "2"])
    assert cfg.model.moe.layer_pattern(4) == [True, False, True, False]


REFUSALS = [
    (["--expert-model-parallel-size", "2"], 2,
     "num_experts must be non None to use expert model parallelism"),
    (MOE + ["--num-experts", "3", "--expert-model-parallel-size", "2"], 2,
     "Number of experts should be a multiple of expert model parallel_size."),
    (MOE + ["--expert-model-parallel-size", "4"], 2,
     "world_size (2) is not divisible by expert_tensor_model_pipeline_parallel size (4"),
    (MOE + ["--tensor-model-parallel-size", "2"], 2,
     "During training, performance may degrade if MoE and tensor parallelism"),
    (MOE + ["--moe-router-topk", "1"], 1, "Please use --moe-router-pre-softmax when topk is 1."),
    (MOE + ["--moe-router-enable-expert-bias"], 1,
     "Expert bias for aux-loss-free routing only supports sigmoid score function."),
    (MOE + ["--moe-pad-expert-input-to-capacity"], 1,
     "moe_expert_capacity_factor must be set to use moe_pad_expert_input_to_capacity"),
    (MOE + ["--moe-router-load-balancing-type", "aux_loss", "z", "--moe-aux-loss-coeff", "1"],
     1, None),  # argparse's choices: exit 2 (tested below)
    (MOE + ["--moe-router-load-balancing-type", "aux_loss", "seq_aux_loss"], 1,
     "moe_aux_loss_coeff must be a list of the same length as moe_router_load_balancing_type"),
    (["--num-experts", "4", "--swiglu"], 1, "add --disable-bias-linear"),
    (["--moe-ffn-hidden-size", "8"], 1,
     "moe_ffn_hidden_size is set but num_moe_experts is None."),
    (MOE + ["--moe-router-load-balancing-type", "sinkhorn"], 1,
     "--moe-router-load-balancing-type sinkhorn: not supported yet"),
    (MOE + ["--moe-token-dispatcher-type", "flex", "--moe-router-num-groups", "2",
            "--moe-use-upcycling"], 1,
     "--moe-token-dispatcher-type flex, --moe-router-num-groups, --moe-use-upcycling: not "
     "supported yet"),
    (MOE + ["--tensor-model-parallel-size", "2", "--sequence-parallel",
            "--expert-tensor-parallel-size", "1", "--save", "ck"], 2,
     "--save with --ckpt-format torch, --expert-tensor-parallel-size 1"),
    (MOE + ["--moe-router-score-function", "sqrtsoftplus"], 1,
     "--moe-router-score-function sqrtsoftplus: not supported yet"),
    (MOE + ["--deepspeed", "--deepspeed_config", DS_JSON, "--tensor-model-parallel-size", "2",
            "--sequence-parallel"], 2,
     "--num-experts with --deepspeed and --tensor-model-parallel-size 2 is not supported"),
]


@pytest.mark.parametrize("extra,world,message", REFUSALS)
def test_refusals_name_the_rule(extra, world, message):
    if message is None:
        with pytest.raises(SystemExit):
            build(extra, world_size=world)
        return
    expect_error(extra, message, world_size=world)


def test_deepspeed_zero3_refused_with_deepspeeds_line(tmp_path):
    import json
    config = tmp_path / "zero3.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 2,
                                  "zero_optimization": {"stage": 3}}))
    expect_error(MOE + ["--deepspeed", "--deepspeed_config", str(config)],
                 "Native DeepSpeed MoE is not supported with ZeRO Stage 3. Use AutoEP or "
                 "choose ZeRO stage 1/2.")


def test_zero_experts_and_negative_capacity_mean_what_megatron_says():
    assert build(["--num-experts", "0"]).model.moe.enabled is False
    cfg = build(MOE + ["--moe-expert-capacity-factor", "-1"])
    assert cfg.model.moe.moe_expert_capacity_factor is None  # dropless
    assert cfg.model.moe.moe_ffn_hidden_size == cfg.model.ffn_hidden_size
    assert cfg.model.moe.tracked_losses == ["load_balancing_loss"]
