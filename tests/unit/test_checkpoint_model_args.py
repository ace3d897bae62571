"""A checkpoint's `args` both ways: the ModelConfig read back from the args written for it is the
same ModelConfig, for every option the args record; older args fall back to the defaults. And the
args Megatron-LM's own parse_args makes (tests/data/megatron_args, core_v0.16.1 and today's main)
are accepted for the matching run and refused, naming the field and both values, for another."""
import argparse
import json

import pytest
import torch

import arguments
from app.checkpoint import CheckpointError
from app.checkpoint.model_args import (NOT_SAVED, check_checkpoint_args,
                                          checkpoint_args_namespace, model_config_from_args)
from app.config import (CheckpointConfig, DataConfig, DeepSpeedConfig, ModelConfig,
                        OptimizerConfig, ParallelConfig, PrecisionConfig, RunConfig,
                        TrainingConfig)
from tests.harness import megatron_args as fixtures


def run_config(model: ModelConfig, tp: int = 1, bf16: bool = False) -> RunConfig:
    return RunConfig(
        model=model,
        parallel=ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=1,
                                world_size=tp),
        optimizer=OptimizerConfig(), precision=PrecisionConfig(bf16=bf16), data=DataConfig(),
        training=TrainingConfig(micro_batch_size=1, global_batch_size=1, train_iters=10,
                                seed=model.seed),
        checkpoint=CheckpointConfig(), deepspeed=DeepSpeedConfig(), raw_vocab_size=100)


SHAPE = dict(num_layers=4, hidden_size=64, num_attention_heads=8, seq_length=32,
             max_position_embeddings=48, padded_vocab_size=128)

VARIANTS = {
    "rope_gqa_untied": dict(
        ffn_hidden_size=96, hidden_dropout=0.05, attention_dropout=0.2, layernorm_epsilon=1e-6,
        init_method_std=0.01, openai_gelu=True, recompute_granularity="full",
        recompute_method="block", recompute_num_layers=2, sequence_parallel=True,
        position_embedding_type="rope", rotary_percent=0.5, rotary_base=500,
        group_query_attention=True, num_query_groups=2,
        untie_embeddings_and_output_weights=True, bias_gelu_fusion=False,
        bias_dropout_fusion=False, masked_softmax_fusion=False, use_flash_attn=True,
        params_dtype="bfloat16", attention_softmax_in_fp32=True,
        apply_query_key_layer_scaling=True, fp16_lm_cross_entropy=True, seed=7),
    "alibi_multi_query_selective": dict(
        position_embedding_type="alibi", group_query_attention=True, num_query_groups=1,
        recompute_granularity="selective", seq_length=64, params_dtype="bfloat16"),
    "selective_modules": dict(recompute_granularity="selective",
                              recompute_modules=["mlp", "core_attn"]),
    "gpt2_defaults": dict(),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_model_config_survives_the_args_round_trip(variant):
    model = ModelConfig(**{**SHAPE, **VARIANTS[variant]})
    cfg = run_config(model, tp=2, bf16=model.params_dtype == "bfloat16")
    args = checkpoint_args_namespace(cfg, 16, 4, 3)
    assert model_config_from_args(args) == model


def test_the_options_without_a_megatron_arg_come_back_as_defaults():
    model = ModelConfig(**SHAPE, layernorm_fusion=False, cross_entropy_loss_fusion=False,
                        attention_backend="flash")
    back = model_config_from_args(checkpoint_args_namespace(run_config(model), 0, 0, 0))
    defaults = ModelConfig(**SHAPE)
    assert {name: getattr(back, name) for name in NOT_SAVED} == \
        {name: getattr(defaults, name) for name in NOT_SAVED}
    assert back.attention_impl == "flash"  # recorded as use_flash_attn


def test_inference_reads_the_architecture_and_drops_training_options():
    model = ModelConfig(**{**SHAPE, **VARIANTS["rope_gqa_untied"]})
    args = checkpoint_args_namespace(run_config(model, tp=2, bf16=True), 0, 0, 0)
    back = model_config_from_args(args, 256, for_inference=True)
    assert back.padded_vocab_size == 256
    assert (back.hidden_dropout, back.attention_dropout) == (0.0, 0.0)
    assert (back.recompute_granularity, back.sequence_parallel, back.use_flash_attn) == \
        (None, False, False)
    kept = ("ffn_hidden_size", "layernorm_epsilon", "openai_gelu", "position_embedding_type",
            "rotary_percent", "rotary_base", "num_kv_heads", "untie_embeddings_and_output_weights",
            "params_dtype", "attention_softmax_in_fp32", "apply_query_key_layer_scaling")
    assert {k: getattr(back, k) for k in kept} == {k: getattr(model, k) for k in kept}


def test_older_args_take_the_defaults_and_a_missing_shape_is_named():
    old = argparse.Namespace(num_layers=2, hidden_size=16, num_attention_heads=2,
                             max_position_embeddings=32, padded_vocab_size=64,
                             params_dtype=torch.float16, num_query_groups=4)
    back = model_config_from_args(old)
    expected = ModelConfig(num_layers=2, hidden_size=16, num_attention_heads=2, seq_length=32,
                           max_position_embeddings=32, padded_vocab_size=64,
                           params_dtype="float16")
    assert back == expected  # num_query_groups without group_query_attention is ignored
    with pytest.raises(CheckpointError, match="lack hidden_size, padded_vocab_size"):
        model_config_from_args(argparse.Namespace(num_layers=2, num_attention_heads=2,
                                                  max_position_embeddings=8))
    with pytest.raises(CheckpointError, match="cannot build.*--position-embedding-type"):
        model_config_from_args(argparse.Namespace(**vars(old), position_embedding_type="none"))


# ---------------------------------------------------------------- Megatron-LM's own args
# tests/data/megatron_args holds the Namespaces that Megatron-LM's parse_args + validate_args
# (+ its tokenizer build) made for a few flag sets, at core_v0.16.1 and at today's main.

BUILDABLE = ("gpt2", "gpt2_legacy", "gqa", "rope_untied", "qwen3_moe", "moe_options",
             "swiglu_rmsnorm", "llama31", "qwen2", "nemotron", "per_token_decoupled")
MEGATRON_COMPARES = ("num_layers", "hidden_size", "num_attention_heads", "add_position_embedding",
                     "max_position_embeddings", "make_vocab_size_divisible_by",
                     "padded_vocab_size", "tokenizer_type")
"""The fields Megatron-LM's own check_checkpoint_args compares (megatron/training/
checkpointing.py), so a checkpoint of ours must hold Megatron's values."""


def our_run(version, flag_set, *extra):
    """Our RunConfig for the command line Megatron parsed (its argv, plus `extra`)."""
    argv = [a if not a.startswith("tests/") else f"{fixtures.ROOT}/{a}"
            for a in fixtures.record(version, flag_set)["argv"]]
    with open(f"{fixtures.ROOT}/tests/data/old_checkpoints/data/vocab.json") as f:
        raw_vocab = len(json.load(f))
    return arguments.config_from_argv([*argv, *extra], 1, raw_vocab)


@pytest.mark.parametrize("version", fixtures.VERSIONS)
@pytest.mark.parametrize("flag_set", BUILDABLE)
def test_megatrons_args_load_into_the_same_run(version, flag_set):
    megatron = fixtures.load(version, flag_set, consumed_train_samples=12, iteration=3)
    ours = our_run(version, flag_set)
    check_checkpoint_args(megatron, checkpoint_args_namespace(ours, 0, 0, 0), reshardable=True)
    check_checkpoint_args(megatron, checkpoint_args_namespace(ours, 0, 0, 0))
    built = model_config_from_args(megatron)
    fields = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
              "num_kv_heads", "head_dim", "padded_vocab_size", "max_position_embeddings",
              "seq_length", "position_embedding_type", "untie_embeddings_and_output_weights",
              "layernorm_epsilon", "openai_gelu", "hidden_dropout", "params_dtype",
              "normalization", "swiglu", "add_bias_linear", "qkv_bias", "squared_relu",
              "layernorm_zero_centered_gamma", "use_rope_scaling", "rope_scaling_factor",
              "rotary_percent", "rotary_base", "add_position_embedding")
    assert {f: getattr(built, f) for f in fields} == {f: getattr(ours.model, f) for f in fields}
    saved = checkpoint_args_namespace(ours, 0, 0, 0)
    assert {f: getattr(saved, f) for f in MEGATRON_COMPARES} == \
        {f: getattr(megatron, f) for f in MEGATRON_COMPARES}


@pytest.mark.parametrize("version", fixtures.VERSIONS)
def test_a_real_mismatch_with_megatrons_args_names_the_field_and_both_values(version):
    cases = [  # (Megatron's flag set, our flags after its plain GPT-2 ones, the message)
        ("gpt2", ["--hidden-size", "64"], "hidden_size 32 but this run uses 64"),
        ("gqa", [], "num_query_groups 2 but this run uses 4"),
        ("gpt2", ["--group-query-attention", "--num-query-groups", "2"],
         "num_query_groups 4 but this run uses 2"),
        ("rope_untied", ["--untie-embeddings-and-output-weights"],
         "position_embedding_type rope but this run uses learned_absolute"),
        ("gpt2", ["--untie-embeddings-and-output-weights"],
         "untie_embeddings_and_output_weights False but this run uses True"),
        ("gpt2", ["--ffn-hidden-size", "96"], "ffn_hidden_size 128 but this run uses 96"),
        ("qwen3_moe", ["--swiglu", "--normalization", "RMSNorm", "--disable-bias-linear",
                       "--qk-layernorm"], "num_experts 4 but this run uses None")]
    nemotron = [a for a in fixtures.record(version, "nemotron")["argv"][len(BASE_ARGV):]
                if a != "--apply-layernorm-1p"]
    qwen2 = [a for a in fixtures.record(version, "qwen2")["argv"][len(BASE_ARGV):]
             if a != "--add-qkv-bias"]
    llama31 = [a for a in fixtures.record(version, "llama31")["argv"][len(BASE_ARGV):]
               if a != "--use-rope-scaling"]
    cases += [("nemotron", nemotron, "layernorm_zero_centered_gamma True but this run uses False"),
              ("qwen2", qwen2, "add_qkv_bias True but this run uses False"),
              ("llama31", llama31, "use_rope_scaling True but this run uses False")]
    for flag_set, extra, message in cases:
        ours = checkpoint_args_namespace(our_run(version, "gpt2", *extra), 0, 0, 0)
        with pytest.raises(CheckpointError, match=message):
            check_checkpoint_args(fixtures.load(version, flag_set), ours, reshardable=True)


@pytest.mark.parametrize("version", fixtures.VERSIONS)
def test_swiglu_rmsnorm_without_bias_is_refused_by_name(version):
    """Megatron's --swiglu --normalization RMSNorm --disable-bias-linear: refused by name while
    ModelConfig has no such options, read when it has them."""
    megatron = fixtures.load(version, "swiglu_rmsnorm")
    assert (megatron.normalization, megatron.swiglu, megatron.add_bias_linear) == \
        ("RMSNorm", True, False)
    unbuildable = [f for f in ("normalization", "swiglu", "add_bias_linear")
                   if not hasattr(ModelConfig(**SHAPE), f)]
    if not unbuildable:
        built = model_config_from_args(megatron)
        assert (built.normalization, built.swiglu, built.add_bias_linear) == \
            ("RMSNorm", True, False)
        return
    first = unbuildable[0]
    value = getattr(megatron, first)
    with pytest.raises(CheckpointError, match=f"cannot build: {first} {value}"):
        model_config_from_args(megatron)
    with pytest.raises(CheckpointError, match=f"saved with {first} {value} but this run uses"):
        check_checkpoint_args(megatron, checkpoint_args_namespace(our_run(version, "gpt2"),
                                                                  0, 0, 0))


BASE_ARGV = fixtures.record("HEAD", "gpt2")["argv"]
"""The flags every recorded flag set starts with (record.py's BASE)."""


def test_megatrons_names_and_their_older_spellings_read_with_megatrons_meaning(caplog):
    """The model options under Megatron's arg names: layernorm_zero_centered_gamma (and
    apply_layernorm_1p of core_v0.4 to v0.12), add_qkv_bias (on whenever add_bias_linear),
    use_rope_scaling with the factor Megatron's GPT builder computes with (always 8: its args'
    rope_scaling_factor is not passed to the model) unless our args say the factor was applied."""
    nemotron = fixtures.load("HEAD", "nemotron")
    built = model_config_from_args(nemotron)
    assert (built.layernorm_zero_centered_gamma, built.squared_relu, built.rotary_percent,
            built.normalization, built.qkv_bias) == (True, True, 0.5, "LayerNorm", False)
    older = argparse.Namespace(**vars(nemotron))
    del older.layernorm_zero_centered_gamma
    older.apply_layernorm_1p = True
    assert model_config_from_args(older).layernorm_zero_centered_gamma
    qwen2 = model_config_from_args(fixtures.load("HEAD", "qwen2"))
    assert (qwen2.add_bias_linear, qwen2.qkv_bias) == (False, True)
    assert model_config_from_args(fixtures.load("HEAD", "gpt2")).qkv_bias
    llama = fixtures.load("HEAD", "llama31")
    assert model_config_from_args(llama).rope_scaling_factor == 8.0
    llama.rope_scaling_factor = 32.0  # Megatron's --rope-scaling-factor 32: its model used 8
    with caplog.at_level("WARNING"):
        assert model_config_from_args(llama).rope_scaling_factor == 8.0
    assert "ignores it and computes with 8.0" in caplog.text
    ours = checkpoint_args_namespace(our_run("HEAD", "llama31", "--rope-scaling-factor", "32"),
                                     0, 0, 0)
    assert model_config_from_args(ours).rope_scaling_factor == 32.0  # we applied it


def test_moe_args_carry_megatrons_names_and_come_back():
    """Every MoE option is stored under Megatron's arg name (one-element load-balancing lists
    as Megatron's validate_args leaves them: scalars), the ModelConfig comes back equal, and the
    expert shapes and routing must agree on load while the expert layout may change."""
    from app.config.moe import MoEConfig
    moe = MoEConfig(num_experts=8, moe_ffn_hidden_size=24, moe_layer_freq=[0, 1, 1, 1],
                    moe_router_topk=3, moe_router_score_function="sigmoid",
                    moe_router_enable_expert_bias=True, moe_shared_expert_intermediate_size=32,
                    moe_shared_expert_gate=True, moe_aux_loss_coeff=[1e-2], moe_z_loss_coeff=1e-3,
                    moe_router_dtype="fp32", moe_token_dispatcher_type="alltoall")
    model = ModelConfig(**SHAPE, swiglu=True, normalization="RMSNorm", add_bias_linear=False,
                        moe=moe)
    args = checkpoint_args_namespace(run_config(model), 0, 0, 0)
    assert (args.num_experts, args.moe_layer_freq, args.moe_router_load_balancing_type,
            args.moe_aux_loss_coeff, args.expert_model_parallel_size,
            args.expert_tensor_parallel_size) == (8, [0, 1, 1, 1], "aux_loss", 1e-2, 1, 1)
    assert model_config_from_args(args) == model
    other_layout = argparse.Namespace(**{**vars(args), "expert_model_parallel_size": 4})
    check_checkpoint_args(args, other_layout, reshardable=True)
    for field, value, message in (("num_experts", 16, "num_experts 8 but this run uses 16"),
                                  ("moe_layer_freq", 2, "moe_layer_freq .* but this run uses"),
                                  ("moe_router_topk", 2, "moe_router_topk 3 but this run uses 2")):
        changed = argparse.Namespace(**{**vars(args), field: value})
        with pytest.raises(CheckpointError, match=message):
            check_checkpoint_args(args, changed, reshardable=True)


def test_the_recorded_args_are_megatrons_own():
    """The fixtures hold what Megatron's parse_args made: its argparse default
    num_query_groups 1 without --group-query-attention (the value that used to be refused), the
    padded vocabulary of its tokenizer build, and validate_args' derived fields."""
    for version in fixtures.VERSIONS:
        plain = fixtures.load(version, "gpt2")
        assert (plain.group_query_attention, plain.num_query_groups) == (False, 1)
        assert (plain.ffn_hidden_size, plain.kv_channels, plain.padded_vocab_size) == (128, 8, 320)
        assert plain.params_dtype == torch.float32 and plain.world_size == 1
        rope = fixtures.load(version, "rope_untied")
        assert (rope.position_embedding_type, rope.add_position_embedding) == ("rope", True)
        assert fixtures.record(version, "gpt2")["megatron"] == version
