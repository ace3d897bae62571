"""The converter's layout against Megatron's (written out by hand) and against the model's own
shards: stage parameter order, partition dims, optimizer groups, exact split/merge, vocabulary
resizing, HF mapping inverses, shard plans."""
import argparse
import dataclasses

import pytest
import torch

from app.config import ModelConfig
from app.checkpoint import param_layout as layout
from app.checkpoint.hf import files as hf_files
from app.checkpoint.hf.families import gpt2 as hf_gpt2
from app.model import GPT2Model
from app.model.stage import build_model_stage, parameter_records
from app.mpu.parallel_state import ParallelState

L, H, HEADS, V = 4, 32, 4, 128


def _config() -> ModelConfig:
    return ModelConfig(num_layers=L, hidden_size=H, num_attention_heads=HEADS, seq_length=16,
                       max_position_embeddings=16, padded_vocab_size=V, seed=3)


# Megatron's GPT-2 layout, written out by hand: a layer's parameters in module order, and the
# dimension tensor parallelism splits each (0 rows: column-parallel and vocab-parallel; 1 columns:
# row-parallel; -1 replicated)
LAYER = [("input_layernorm.weight", -1), ("input_layernorm.bias", -1),
         ("attention.query_key_value.weight", 0), ("attention.query_key_value.bias", 0),
         ("attention.dense.weight", 1), ("attention.dense.bias", -1),
         ("post_attention_layernorm.weight", -1), ("post_attention_layernorm.bias", -1),
         ("mlp.dense_h_to_4h.weight", 0), ("mlp.dense_h_to_4h.bias", 0),
         ("mlp.dense_4h_to_h.weight", 1), ("mlp.dense_4h_to_h.bias", -1)]
STAGE_LAYERS = {1: [[0, 1, 2, 3]], 2: [[0, 1], [2, 3]], 4: [[0], [1], [2], [3]]}


def _expected_stage(pp, stage):
    """[(name, partition dim)] of one stage, from the hand-written layout above."""
    out = []
    if stage == 0:
        out += [("language_model.embedding.word_embeddings.weight", 0),
                ("language_model.embedding.position_embeddings.weight", -1)]
    for i in STAGE_LAYERS[pp][stage]:
        out += [(f"language_model.transformer.layers.{i}.{suffix}", dim) for suffix, dim in LAYER]
    if stage == pp - 1:
        out += [("language_model.transformer.final_layernorm.weight", -1),
                ("language_model.transformer.final_layernorm.bias", -1)]
        out += [("word_embeddings.weight", 0)] if pp > 1 else []
    return out


@pytest.mark.parametrize("pp", [1, 2, 4])
def test_layout_read_from_the_model_is_megatrons(pp):
    """For every stage: the names in module order and the TP partition dims that the layout
    reads from the model are Megatron's (written out above); the names are those of the stage
    training builds, and the optimizer groups Megatron's (written out by hand)."""
    model_layout = layout.Layout(_config(), pp)
    for stage in range(pp):
        expected = _expected_stage(pp, stage)
        names = model_layout.stage_names(stage)
        assert [(n, model_layout.record(n).partition_dim) for n in names] == expected
        for name, record in model_layout.stages[stage].items():
            assert model_layout.stage_of(name) == stage
            assert record.tied_copy == (name == layout.TIED_HEAD)
        state = ParallelState(pipeline_model_parallel_size=pp, pipeline_model_parallel_rank=stage,
                              pipeline_ranks=list(range(pp)))
        model = build_model_stage(_config(), state)
        assert names == list(dict(model.named_parameters())) == list(model.state_dict())
        # Megatron's rule, by hand: biases and LayerNorm parameters take no weight decay
        no_decay = [n for n in names if n.endswith(".bias") or "layernorm" in n]
        assert model_layout.optimizer_groups(names) == {
            "decay": [n for n in names if n not in no_decay], "no_decay": no_decay}
        muon = [n for n in names if n.endswith(("query_key_value.weight", "dense.weight",
                                                "dense_h_to_4h.weight", "dense_4h_to_h.weight"))]
        assert model_layout.optimizer_groups(names, muon=True) == {
            "muon": muon, "decay": [n for n in names if n not in no_decay + muon],
            "no_decay": no_decay}
    assert model_layout.record(layout.WORD_EMBEDDINGS).shape == (V, H)  # full shapes (TP 1)
    with pytest.raises(layout.LayoutError, match="lm_head.foo"):
        model_layout.record("lm_head.foo")
    with pytest.raises(layout.LayoutError, match=r"num_layers \(4\) is not divisible"):
        layout.Layout(_config(), 3)


def test_layout_follows_the_model_options():
    """Without a learned position table there is none to place; untied embeddings give the
    last stage a row-split output layer and no tied copy."""
    config = dataclasses.replace(_config(), position_embedding_type="rope",
                                 untie_embeddings_and_output_weights=True)
    model_layout = layout.Layout(config, 2)
    assert layout.POSITION_EMBEDDINGS not in model_layout.names()
    assert model_layout.stage_names(1)[-1] == layout.OUTPUT_LAYER
    assert model_layout.record(layout.OUTPUT_LAYER).partition_dim == 0
    assert layout.TIED_HEAD not in model_layout.names()
    with pytest.raises(ValueError, match="carries no tensor-parallel mark"):
        parameter_records(torch.nn.Linear(2, 2))


ROPE_GQA_UNTIED = dict(position_embedding_type="rope", group_query_attention=True,
                       num_query_groups=2, untie_embeddings_and_output_weights=True)
LLAMA = dict(ROPE_GQA_UNTIED, swiglu=True, normalization="RMSNorm", add_bias_linear=False,
             qk_layernorm=True, ffn_hidden_size=48)


def test_llama_layout_is_megatrons():
    """The Llama block's layer (SwiGLU, RMSNorm, no biases, QK-norm): Megatron's parameters in
    module order with their TP split (written out by hand), the fc1 rows [gate; up] of 2 x ffn,
    the norms (1-D) without weight decay, at PP 2."""
    model_layout = layout.Layout(dataclasses.replace(_config(), **LLAMA), 2)
    layer = [("input_layernorm.weight", -1), ("attention.query_key_value.weight", 0),
             ("attention.q_layernorm.weight", -1), ("attention.k_layernorm.weight", -1),
             ("attention.dense.weight", 1), ("post_attention_layernorm.weight", -1),
             ("mlp.dense_h_to_4h.weight", 0), ("mlp.dense_4h_to_h.weight", 1)]
    expected = [(layout.WORD_EMBEDDINGS, 0)] + [
        (layout.layer_param_name(i, s), d) for i in (0, 1) for s, d in layer]
    names = model_layout.stage_names(0)
    assert [(n, model_layout.record(n).partition_dim) for n in names] == expected
    assert model_layout.stage_names(1)[-2:] == [layout.FINAL_NORM[0], layout.OUTPUT_LAYER]
    fc1 = layout.layer_param_name(2, "mlp.dense_h_to_4h.weight")
    assert model_layout.record(fc1).shape == (2 * 48, H) and model_layout.record(fc1).glu_halves
    no_decay = [n for n in names if "layernorm" in n]
    assert model_layout.optimizer_groups(names) == {
        "decay": [n for n in names if n not in no_decay], "no_decay": no_decay}


@pytest.mark.parametrize("options", [{}, ROPE_GQA_UNTIED, LLAMA],
                         ids=["gpt2", "rope-gqa2-untied", "llama"])
def test_split_is_what_each_tensor_parallel_rank_holds_and_merge_inverts_it(options):
    """The converter's split of the full (TP 1) model gives, for every parameter, exactly the
    shard that the model built at TP 2 and TP 4 holds on each rank (with 2 query groups at TP 4
    each group's key/value rows on two ranks); merging gives it back."""
    config = dataclasses.replace(_config(), **options)
    full = dict(GPT2Model(config).named_parameters())
    model_layout = layout.Layout(config, 1)
    for tp in (2, 4):
        ranks = [dict(GPT2Model(config, ParallelState(tensor_model_parallel_size=tp,
                                                      tensor_model_parallel_rank=r))
                      .named_parameters()) for r in range(tp)]
        for name, value in full.items():
            shards = model_layout.split(name, value.detach(), tp)
            for r in range(tp):
                assert torch.equal(shards[r], ranks[r][name].detach()), (name, tp, r)
            assert torch.equal(model_layout.merge(name, shards), value.detach()), name
    if options.get("swiglu"):  # Megatron's split, by hand: rank r holds [gate_r; up_r]
        name = layout.layer_param_name(1, "mlp.dense_h_to_4h.weight")
        gate, up = full[name].detach().chunk(2)  # [ffn, h] each
        for r, shard in enumerate(model_layout.split(name, full[name].detach(), 4)):
            assert torch.equal(shard, torch.cat([gate.chunk(4)[r], up.chunk(4)[r]]))
    if options:  # the rows two ranks share must agree
        name = layout.layer_param_name(0, "attention.query_key_value.weight")
        shards = model_layout.split(name, full[name].detach(), 4)
        shards[1] = shards[1].clone()
        shards[1][-1] += 1
        with pytest.raises(layout.LayoutError, match="rank 1's copy"):
            model_layout.merge(name, shards)
        return
    record = model_layout.record(layout.WORD_EMBEDDINGS)
    with pytest.raises(layout.LayoutError, match="differs"):
        layout.merge_shards([torch.zeros(3), torch.ones(3)],
                            model_layout.record(layout.POSITION_EMBEDDINGS))
    with pytest.raises(layout.LayoutError, match="not divisible"):
        layout.split_tensor(torch.zeros(6, 2), record, 4)


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
    assert hf_files.parse_size("2GB") == 2 * 10**9 and hf_files.parse_size("1MiB") == 2**20
    assert hf_files.parse_size("1000") == 1000
    with pytest.raises(ValueError, match="--max-shard-size"):
        hf_files.parse_size("two gigs")
    tensors = {f"t{i}": torch.zeros(100) for i in range(5)}  # 400 bytes each
    assert hf_files.shard_plan(tensors, 1000) == [["t0", "t1"], ["t2", "t3"], ["t4"]]
    assert hf_files.shard_plan({"big": torch.zeros(1000)}, 10) == [["big"]]
