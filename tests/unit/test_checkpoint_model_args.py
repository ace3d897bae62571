"""A checkpoint's `args` both ways: the ModelConfig read back from the args written for it is the
same ModelConfig, for every option the args record; older args fall back to the defaults."""
import argparse

import pytest
import torch

from app.checkpoint import CheckpointError
from app.checkpoint.model_args import (NOT_SAVED, checkpoint_args_namespace,
                                          model_config_from_args)
from app.config import (CheckpointConfig, DataConfig, DeepSpeedConfig, ModelConfig,
                        OptimizerConfig, ParallelConfig, PrecisionConfig, RunConfig,
                        TrainingConfig)


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
