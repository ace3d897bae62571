"""Converter directions through torch_dist, on the old-checkpoint fixtures (no training): legacy ->
torch_dist -> legacy gives back every weight, fp32 main weight, optimizer state, the LR schedule
and the RNG states bit for bit; torch_dist -> Hugging Face -> torch_dist the weights; DeepSpeed
-> torch_dist the consolidated fp32 weights and moments; the torch_dist files hold Megatron Core's
stacked tensors (read back with PyTorch's own DCP reader).
"""
import os

import numpy
import torch
import torch.distributed.checkpoint as dcp

from app.checkpoint.convert import ConvertOptions, convert, read_checkpoint

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "old_checkpoints")


def _convert(tmp_path, source, fmt_in, fmt_out, name, optimizer=True):
    out = str(tmp_path / name)
    convert(ConvertOptions(input_format=fmt_in, output_format=fmt_out, load=source, save=out,
                           include_optimizer=optimizer))
    return out


def _read(path, fmt, optimizer=True):
    return read_checkpoint(ConvertOptions(input_format=fmt, output_format="megatron", load=path,
                                          save=path + "_unused", include_optimizer=optimizer))


def _same(a, b, what):
    if isinstance(a, dict):
        assert sorted(a) == sorted(b), (what, sorted(a), sorted(b))
        for key in a:
            _same(a[key], b[key], f"{what}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), what
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{what}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), what
    elif isinstance(a, numpy.ndarray):
        assert numpy.array_equal(a, b), what
    else:
        assert a == b, what


def test_legacy_to_torch_dist_and_back_is_exact(tmp_path):
    source = os.path.join(FIXTURES, "native_fp16")
    td = _convert(tmp_path, source, "megatron", "torch_dist", "td")
    back = _convert(tmp_path, td, "torch_dist", "megatron", "back")
    want, got = _read(source, "megatron"), _read(back, "megatron")
    _same(got.weights, want.weights, "weights")
    _same(got.optimizer.per_param, want.optimizer.per_param, "optimizer")
    _same(got.optimizer.grad_scaler, want.optimizer.grad_scaler, "grad_scaler")
    _same(got.lr_scheduler, want.lr_scheduler, "lr_scheduler")
    _same(got.rng_states, want.rng_states, "rng")
    assert got.iteration == want.iteration == 2
    stored = {"decoder.layers.self_attention.linear_qkv.weight": torch.empty(2, 48, 16),
              "optimizer.state.fp32_param.embedding.word_embeddings.weight":
                  torch.empty_like(want.weights["language_model.embedding.word_embeddings.weight"])}
    dcp.load(stored, checkpoint_id=os.path.join(td, "iter_0000002"), no_dist=True)
    for layer in range(2):
        assert torch.equal(stored["decoder.layers.self_attention.linear_qkv.weight"][layer].half(),
                           want.weights[f"language_model.transformer.layers.{layer}."
                                        "attention.query_key_value.weight"].half())
    assert torch.equal(stored["optimizer.state.fp32_param.embedding.word_embeddings.weight"],
                       want.weights["language_model.embedding.word_embeddings.weight"])


def test_torch_dist_to_hugging_face_and_back_keeps_the_weights(tmp_path):
    source = os.path.join(FIXTURES, "native_fp32")
    td = _convert(tmp_path, source, "megatron", "torch_dist", "td", optimizer=False)
    hf = _convert(tmp_path, td, "torch_dist", "hf", "hf", optimizer=False)
    again = _convert(tmp_path, hf, "hf", "torch_dist", "again", optimizer=False)
    want = _read(source, "megatron", optimizer=False).weights
    _same(_read(again, "torch_dist", optimizer=False).weights, want, "weights")


def test_deepspeed_to_torch_dist_keeps_the_fp32_weights_and_moments(tmp_path):
    source = os.path.join(FIXTURES, "deepspeed_zero1")
    td = _convert(tmp_path, source, "deepspeed", "torch_dist", "td")
    want, got = _read(source, "deepspeed"), _read(td, "torch_dist")
    _same(got.weights, want.weights, "weights")
    for name, entry in want.optimizer.per_param.items():
        for kind in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(got.optimizer.per_param[name][kind], entry[kind]), (name, kind)


def test_generation_tools_load_a_torch_dist_checkpoint(tmp_path):
    from app.checkpoint.formats import detect, detect_format
    from app.inference.runner import load_model
    from app.mpu.parallel_state import ParallelState
    source = os.path.join(FIXTURES, "native_fp32")
    td = _convert(tmp_path, source, "megatron", "torch_dist", "td", optimizer=False)
    assert detect_format(td) == "torch_dist"
    tokens = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(0))
    position = torch.arange(8).unsqueeze(0)
    with torch.no_grad():
        want = load_model(detect(source), ParallelState.single()).model(tokens, position)
        got = load_model(detect(td), ParallelState.single()).model(tokens, position)
    assert torch.equal(got, want)
