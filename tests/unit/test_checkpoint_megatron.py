"""The legacy format's whole-model writer and reader (app.checkpoint.legacy.whole) without
training: a whole model with Adam state written at TP2 x PP2 in bf16 (Megatron's
Float16Optimizer layout, fp32 main weights kept) and read back, with the padded vocabulary growing for TP2 and shrinking again for TP1."""
import argparse

import torch

from app.config import ModelConfig
from app.checkpoint import param_layout as layout
from app.checkpoint.legacy.whole import read_legacy, write_legacy
from app.checkpoint.request import WriteRequest
from app.checkpoint.saved_layout import detect
from app.checkpoint.state import ModelCheckpoint, OptimizerState
from app.model import GPT2Model
from app.checkpoint.legacy import per_rank as ckpt
from app.checkpoint import names

L, H, HEADS, VOCAB, MULTIPLE = 4, 32, 4, 100, 48  # padded: 144 at TP1, 192 at TP2


LLAMA = dict(swiglu=True, normalization="RMSNorm", add_bias_linear=False, qk_layernorm=True,
             position_embedding_type="rope", group_query_attention=True, num_query_groups=2,
             untie_embeddings_and_output_weights=True)
"""The Llama recipe's options, as ModelConfig fields and as a checkpoint's args alike."""


def write_megatron(source, save, tp, pp, dtype, iteration, include_optimizer):
    """The legacy writer asked for TP x PP, a dtype name, an iteration and the optimizer."""
    return write_legacy(source, save, WriteRequest(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, params_dtype=dtype,
        iteration=iteration, include_optimizer=include_optimizer))


def read_megatron(load, include_optimizer=False):
    """The legacy checkpoint in `load`, whole, as its detection found it."""
    return read_legacy(detect(load), include_optimizer)


def _source(**options):
    model = GPT2Model(ModelConfig(num_layers=L, hidden_size=H, num_attention_heads=HEADS,
                                  seq_length=16, max_position_embeddings=16,
                                  padded_vocab_size=144, seed=2, **options))
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    gen = torch.Generator().manual_seed(0)
    per_param = {n: {"exp_avg": torch.randn(w.shape, generator=gen),
                     "exp_avg_sq": torch.rand(w.shape, generator=gen), "step": torch.tensor(7.0)}
                 for n, w in weights.items()}
    hparams = {g: {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": wd,
                   "amsgrad": False, "name": g} for g, wd in (("decay", 0.01), ("no_decay", 0.0))}
    args = argparse.Namespace(num_layers=L, hidden_size=H, num_attention_heads=HEADS,
                              ffn_hidden_size=4 * H, max_position_embeddings=16, seq_length=16,
                              vocab_size=VOCAB, make_vocab_size_divisible_by=MULTIPLE,
                              padded_vocab_size=144, params_dtype=torch.float32,
                              tokenizer_type="GPT2BPETokenizer", tensor_model_parallel_size=1,
                              pipeline_model_parallel_size=1, data_parallel_size=1,
                              consumed_train_samples=56, **options)
    scaler = {"scale": 1024.0, "growth_tracker": 3}
    return ModelCheckpoint(args=args, weights=weights, iteration=7,
                           optimizer=OptimizerState(per_param, hparams, scaler),
                           lr_scheduler={"num_steps": 7})


def test_bf16_tp2pp2_with_optimizer_round_trip(tmp_path):
    source = _source()
    write_megatron(source, str(tmp_path / "tp2pp2"), 2, 2, "bf16", None, include_optimizer=False)
    assert (tmp_path / "tp2pp2" / names.TRACKER_FILENAME).read_text() == "release"
    write_megatron(source, str(tmp_path / "a"), 2, 2, "bf16", 7, include_optimizer=True)
    state, _ = ckpt.load_checkpoint_dict(str(tmp_path / "a"), tp_rank=1, pp_rank=1, pp_size=2)
    flat = ckpt.from_megatron_model(state["model"])
    assert flat[layout.TIED_HEAD].shape == (96, H) and flat[layout.TIED_HEAD].dtype == torch.bfloat16
    assert state["args"].padded_vocab_size == 192 and state["args"].tensor_model_parallel_size == 2
    mains = ckpt.fp32_main_weights(state)
    assert set(mains) == set(flat) and all(v.dtype == torch.float32 for v in mains.values())
    assert state["optimizer"]["grad_scaler"] == {"scale": 1024.0, "growth_tracker": 3}

    back = read_megatron(str(tmp_path / "a"), include_optimizer=True)
    write_megatron(back, str(tmp_path / "b"), 1, 1, "fp32", 7, include_optimizer=True)
    final = read_megatron(str(tmp_path / "b"), include_optimizer=True)
    assert final.weights[layout.WORD_EMBEDDINGS].shape == (144, H)
    for name, value in source.weights.items():  # the fp32 main weights survive bf16 storage
        assert torch.equal(final.weights[name], value), name
        for kind in ("exp_avg", "exp_avg_sq"):
            got, want = final.optimizer.per_param[name][kind], source.optimizer.per_param[name][kind]
            if name == layout.WORD_EMBEDDINGS:  # rows 144..191 were zero padding at TP2
                assert torch.count_nonzero(back.optimizer.per_param[name][kind][144:]) == 0
            assert torch.equal(got, want), (name, kind)
    assert final.lr_scheduler == {"num_steps": 7} and final.iteration == 7
    assert final.args.consumed_train_samples == 56


def test_untied_output_layer_is_padded_for_the_target_like_the_word_embeddings(tmp_path):
    """With untied embeddings the output layer's rows are the padded vocabulary too: at TP2 both
    grow from 144 to 192 rows (zeros appended) and each rank holds its 96 rows of them."""
    source = _source()
    source.args.untie_embeddings_and_output_weights = True
    head = torch.randn(144, H, generator=torch.Generator().manual_seed(1))
    source.weights[layout.OUTPUT_LAYER] = head
    write_megatron(source, str(tmp_path / "tp2"), 2, 1, None, None, include_optimizer=False)
    padded = torch.cat([head, torch.zeros(48, H)])
    for tp_rank in range(2):
        state, _ = ckpt.load_checkpoint_dict(str(tmp_path / "tp2"), tp_rank=tp_rank, pp_rank=0,
                                             pp_size=1)
        flat = ckpt.from_megatron_model(state["model"])
        assert layout.TIED_HEAD not in flat
        assert torch.equal(flat[layout.OUTPUT_LAYER], padded[96 * tp_rank:96 * (tp_rank + 1)])
        assert flat[layout.WORD_EMBEDDINGS].shape == (96, H)


def test_llama_tp2pp2_with_optimizer_round_trip(tmp_path):
    """The Llama block (SwiGLU, RMSNorm, no biases, QK-norm, RoPE, 2 query groups, untied) at
    TP2 x PP2: each rank's fc1 and its Adam moments are [gate_r; up_r] (Megatron's split, by
    hand), the norms sit in the no-weight-decay group, and TP1 gives every tensor back."""
    source = _source(**LLAMA)
    write_megatron(source, str(tmp_path / "a"), 2, 2, None, 7, include_optimizer=True)
    fc1 = layout.layer_param_name(3, "mlp.dense_h_to_4h.weight")
    for tp_rank in range(2):
        state, _ = ckpt.load_checkpoint_dict(str(tmp_path / "a"), tp_rank=tp_rank, pp_rank=1,
                                             pp_size=2)
        flat = ckpt.from_megatron_model(state["model"])
        # optimizer order: the decay group, then the norms (Megatron: no decay for 1-D tensors)
        no_decay = [n for n in flat if "layernorm" in n]
        order = [n for n in flat if n not in no_decay] + no_decay
        groups = {g["name"]: g["params"] for g in state["optimizer"]["param_groups"]}
        assert groups["no_decay"] == list(range(len(order) - len(no_decay), len(order)))
        index = order.index(fc1)
        for got, full in ((flat[fc1], source.weights[fc1]),
                          (state["optimizer"]["state"][index]["exp_avg"],
                           source.optimizer.per_param[fc1]["exp_avg"])):
            gate, up = full.chunk(2)  # [ffn, h] each
            assert torch.equal(got, torch.cat([gate.chunk(2)[tp_rank], up.chunk(2)[tp_rank]]))
    final = read_megatron(str(tmp_path / "a"), include_optimizer=True)
    assert set(final.weights) == set(source.weights)
    for name, value in source.weights.items():  # the vocabulary: 144 rows, 192 at TP2
        assert torch.equal(final.weights[name][:len(value)], value), name
        for kind in ("exp_avg", "exp_avg_sq"):
            want = source.optimizer.per_param[name][kind]
            assert torch.equal(final.optimizer.per_param[name][kind][:len(want)], want), name
