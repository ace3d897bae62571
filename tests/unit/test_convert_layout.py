"""The converter's layout arithmetic against the model itself: partition dims, stage parameter
order, optimizer groups, exact split/merge, vocabulary resizing, HF mapping inverses, shard plans."""
import argparse

import pytest
import torch

from app.config import ModelConfig
from app.convert import hf_gpt2, layout
from app.model import GPT2Model
from app.optim.param_groups import get_param_groups

L, H, HEADS, V = 4, 32, 4, 128


def _config() -> ModelConfig:
    return ModelConfig(num_layers=L, hidden_size=H, num_attention_heads=HEADS, seq_length=16,
                       max_position_embeddings=16, padded_vocab_size=V, seed=3)


@pytest.mark.parametrize("pp", [1, 2, 4])
def test_stage_names_partition_dims_and_optimizer_groups_match_the_model(pp):
    """For every stage the model builds: names in module order, TP partition dims, and the
    decay / no-decay groups of get_param_groups, all as app.convert.layout predicts."""
    for stage in range(pp):
        start, end = layout.stage_layer_range(L, pp, stage)
        model = GPT2Model(_config(), pre_process=stage == 0, post_process=stage == pp - 1,
                          layer_range=(start, end))
        params = dict(model.named_parameters())
        names = layout.stage_parameter_names(L, pp, stage)
        assert names == list(params) == list(model.state_dict())
        for name, p in params.items():
            assert layout.partition_dim(name) == p.partition_dim, name
            assert layout.stage_of(name, L, pp) == stage
        by_id = {id(p): n for n, p in params.items()}
        groups = {g["name"]: [by_id[id(p)] for p in g["params"]] for g in get_param_groups(model)}
        assert layout.optimizer_groups(names) == {"decay": groups.get("decay", []),
                                                  "no_decay": groups.get("no_decay", [])}


def test_split_merge_round_trip_is_exact_and_replicas_are_checked():
    model = GPT2Model(_config())
    for name, p in model.named_parameters():
        for tp in (1, 2, 4):
            shards = layout.split_tensor(p.detach(), name, tp)
            assert torch.equal(layout.merge_shards(shards, name), p.detach()), name
    with pytest.raises(layout.LayoutError, match="differs"):
        layout.merge_shards([torch.zeros(3), torch.ones(3)], layout.POSITION_EMBEDDINGS)
    with pytest.raises(layout.LayoutError, match="not divisible"):
        layout.split_tensor(torch.zeros(6, 2), layout.WORD_EMBEDDINGS, 4)
    with pytest.raises(layout.LayoutError, match="lm_head.foo"):
        layout.partition_dim("lm_head.foo")


def test_resize_vocab_pads_with_zeros_and_refuses_to_cut_real_tokens():
    w = torch.randn(10, 3)
    grown = layout.resize_vocab(w, 16, 9, "w")
    assert torch.equal(grown[:10], w) and torch.count_nonzero(grown[10:]) == 0
    assert torch.equal(layout.resize_vocab(grown, 10, 9, "w"), w)
    with pytest.raises(layout.LayoutError, match="tokenizer has 9"):
        layout.resize_vocab(w, 8, 9, "w")


def test_hf_mapping_round_trip_and_errors():
    model = GPT2Model(_config())
    ours = {n: p.detach() for n, p in model.named_parameters()}
    hf = hf_gpt2.to_hf_state(ours, L, HEADS, vocab_size=100)
    assert hf["transformer.wte.weight"].shape == (100, H)
    assert hf["transformer.h.0.attn.c_attn.weight"].shape == (H, 3 * H)  # Conv1D: [in, out]
    back = hf_gpt2.from_hf_state(hf, L, HEADS)
    for name, value in ours.items():
        want = value[:100] if name == layout.WORD_EMBEDDINGS else value
        assert torch.equal(back[name], want), name
    # head 1's query rows: [3 hd, 4 hd) in ours ([heads, (q,k,v), hd]); [hd, 2 hd) in HF's q block
    hd = H // HEADS
    qkv = ours[layout.layer_param_name(0, "attention.query_key_value.weight")]
    assert torch.equal(hf["transformer.h.0.attn.c_attn.weight"].t()[hd:2 * hd], qkv[3 * hd:4 * hd])
    with pytest.raises(hf_gpt2.HFConversionError, match="transformer.h.9.mlp.c_fc.weight"):
        hf_gpt2.from_hf_state({**hf, "transformer.h.9.mlp.c_fc.weight": torch.zeros(1)}, L, HEADS)
    untied = {**hf, "lm_head.weight": torch.zeros_like(hf["transformer.wte.weight"])}
    with pytest.raises(hf_gpt2.HFConversionError, match="lm_head.weight"):
        hf_gpt2.from_hf_state(untied, L, HEADS)
    missing = {k: v for k, v in hf.items() if k != "transformer.ln_f.bias"}
    with pytest.raises(hf_gpt2.HFConversionError, match="transformer.ln_f.bias"):
        hf_gpt2.from_hf_state(missing, L, HEADS)


def test_hf_config_round_trip_and_unsupported_configs():
    args = argparse.Namespace(num_layers=L, hidden_size=H, num_attention_heads=HEADS,
                              ffn_hidden_size=4 * H, max_position_embeddings=16, vocab_size=100,
                              padded_vocab_size=128, openai_gelu=True, layernorm_epsilon=1e-5)
    config = hf_gpt2.hf_config(args, torch.float32, eod=99)
    assert config["activation_function"] == "gelu_new" and config["vocab_size"] == 100
    back = hf_gpt2.args_from_hf_config(config, "config.json")
    for key in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                "max_position_embeddings", "vocab_size", "openai_gelu"):
        assert getattr(back, key) == getattr(args, key), key
    for key, value in (("activation_function", "relu"), ("scale_attn_by_inverse_layer_idx", True),
                       ("tie_word_embeddings", False)):
        with pytest.raises(hf_gpt2.HFConversionError, match=key if key != "activation_function" else "relu"):
            hf_gpt2.args_from_hf_config({**config, key: value}, "config.json")


def test_shard_sizes():
    assert hf_gpt2.parse_size("2GB") == 2 * 10**9 and hf_gpt2.parse_size("1MiB") == 2**20
    assert hf_gpt2.parse_size("1000") == 1000
    with pytest.raises(ValueError, match="--max-shard-size"):
        hf_gpt2.parse_size("two gigs")
    tensors = {f"t{i}": torch.zeros(100) for i in range(5)}  # 400 bytes each
    assert hf_gpt2.shard_plan(tensors, 1000) == [["t0", "t1"], ["t2", "t3"], ["t4"]]
    assert hf_gpt2.shard_plan({"big": torch.zeros(1000)}, 10) == [["big"]]
