"""Checkpoint format: Megatron layout and dict structure, round trips, args check, RNG, rotation."""
import argparse
import os
import random

import numpy as np
import pytest
import torch

from app.mpu.random import load_rng_state_dict, rng_state_dict
from app.utils import faults


def rng_state(tracker=None):
    """This process's RNG states as the engines save them, with `tracker` as tracker states."""
    state = rng_state_dict()
    state["rng_tracker_states"] = dict(tracker or {})
    return state

from app.config import (CheckpointConfig, DataConfig, DeepSpeedConfig, ModelConfig,
                        OptimizerConfig, ParallelConfig, PrecisionConfig, RunConfig,
                        TrainingConfig)
from app.checkpoint.legacy import per_rank as ckpt
from app.checkpoint import commit, names
from app.checkpoint.model_args import check_checkpoint_args, checkpoint_args_namespace
from tests.harness.checkpoints import megatron_reader

LAYER_PARAMS = {  # name -> shape as a function of h (PyTorch [out, in])
    "input_layernorm.weight": lambda h: (h,), "input_layernorm.bias": lambda h: (h,),
    "attention.query_key_value.weight": lambda h: (3 * h, h),
    "attention.query_key_value.bias": lambda h: (3 * h,),
    "attention.dense.weight": lambda h: (h, h), "attention.dense.bias": lambda h: (h,),
    "post_attention_layernorm.weight": lambda h: (h,),
    "post_attention_layernorm.bias": lambda h: (h,),
    "mlp.dense_h_to_4h.weight": lambda h: (4 * h, h), "mlp.dense_h_to_4h.bias": lambda h: (4 * h,),
    "mlp.dense_4h_to_h.weight": lambda h: (h, 4 * h), "mlp.dense_4h_to_h.bias": lambda h: (h,),
}


def make_cfg(tp=1, pp=1, world=None, hidden=8, layers=2) -> RunConfig:
    return RunConfig(
        model=ModelConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=2,
                          seq_length=4, max_position_embeddings=8, padded_vocab_size=16),
        parallel=ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                world_size=world or tp * pp),
        optimizer=OptimizerConfig(), precision=PrecisionConfig(), data=DataConfig(),
        training=TrainingConfig(micro_batch_size=1, global_batch_size=1, train_iters=10),
        checkpoint=CheckpointConfig(), deepspeed=DeepSpeedConfig(), raw_vocab_size=10)


def make_flat_state(layers=2, h=8, vocab=16, positions=8, head_copy=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    state = {"language_model.embedding.word_embeddings.weight": torch.randn(vocab, h, generator=g),
             "language_model.embedding.position_embeddings.weight":
                 torch.randn(positions, h, generator=g)}
    for i in range(layers):
        for name, shape in LAYER_PARAMS.items():
            state[f"language_model.transformer.layers.{i}.{name}"] = torch.randn(shape(h),
                                                                                 generator=g)
    state["language_model.transformer.final_layernorm.weight"] = torch.ones(h)
    state["language_model.transformer.final_layernorm.bias"] = torch.zeros(h)
    if head_copy:
        state["word_embeddings.weight"] = state[
            "language_model.embedding.word_embeddings.weight"].clone()
    return state


def make_full_dict(iteration, seed=0, tracker=None):
    flat = make_flat_state(seed=seed)
    params = [torch.nn.Parameter(t.clone()) for t in flat.values()]
    opt = torch.optim.AdamW(params, lr=1e-3)
    sum(p.sum() for p in params).backward()
    opt.step()
    sched = {"num_steps": iteration, "max_lr": 1e-3}
    args = checkpoint_args_namespace(make_cfg(), 8 * iteration, 2, iteration)
    return ckpt.build_checkpoint_dict(iteration, flat, opt.state_dict(), sched,
                                      rng_state(tracker), args)


def test_paths_follow_megatron_layout(tmp_path):
    s = str(tmp_path)
    assert ckpt.checkpoint_path(s, 7) == os.path.join(s, "iter_0000007", "mp_rank_00",
                                                      "model_optim_rng.pt")
    assert ckpt.checkpoint_path(s, 1234567, tp_rank=1, pp_rank=2, pp_size=4) == os.path.join(
        s, "iter_1234567", "mp_rank_01_002", "model_optim_rng.pt")
    assert ckpt.checkpoint_dir(s, "release") == os.path.join(s, "release")
    assert names.tracker_path(s) == os.path.join(s, "latest_checkpointed_iteration.txt")


def test_model_layout_conversion_is_an_exact_inverse():
    flat = make_flat_state(head_copy=True)
    nested = ckpt.to_megatron_model(flat)
    lm = nested["language_model"]
    assert set(nested) == {"language_model", "word_embeddings_for_head"}
    assert set(lm) == {"embedding", "transformer"}
    assert lm["embedding"]["word_embeddings"]["weight"] is flat[
        "language_model.embedding.word_embeddings.weight"]
    assert "layers.1.mlp.dense_4h_to_h.weight" in lm["transformer"]
    assert "final_layernorm.bias" in lm["transformer"]
    assert nested["word_embeddings_for_head"]["weight"] is flat["word_embeddings.weight"]
    back = ckpt.from_megatron_model(nested)
    assert list(back) == list(flat) and all(back[k] is flat[k] for k in flat)
    assert ckpt.to_megatron_model(back) == nested
    with pytest.raises(ValueError, match="lm_head.weight"):
        ckpt.to_megatron_model({"lm_head.weight": torch.zeros(1)})


def test_save_load_round_trip(tmp_path):
    s = str(tmp_path)
    state = make_full_dict(10, tracker={"model-parallel-rng": torch.get_rng_state()})
    out = ckpt.save_checkpoint(s, 10, state)
    assert out == ckpt.checkpoint_dir(s, 10)
    with open(names.tracker_path(s)) as f:
        assert f.read() == "10"
    loaded, iteration = ckpt.load_checkpoint_dict(s)
    assert iteration == 10 and loaded["iteration"] == 10
    assert loaded["checkpoint_version"] == 3.0
    flat = ckpt.from_megatron_model(loaded["model"])
    expected = ckpt.from_megatron_model(state["model"])
    assert flat.keys() == expected.keys()
    assert all(torch.equal(flat[k], expected[k]) for k in flat)
    opt_a, opt_b = loaded["optimizer"], state["optimizer"]
    assert opt_a["param_groups"] == opt_b["param_groups"]
    for idx, entry in opt_b["state"].items():
        for key, value in entry.items():
            assert torch.equal(opt_a["state"][idx][key], value)
            assert opt_a["state"][idx][key] is not value  # really read back, not the same object
    assert loaded["lr_scheduler"] == state["lr_scheduler"]
    assert vars(loaded["args"]) == vars(state["args"])
    assert torch.equal(loaded["rng_state"][0]["rng_tracker_states"]["model-parallel-rng"],
                       state["rng_state"][0]["rng_tracker_states"]["model-parallel-rng"])


def test_optional_parts_are_left_out(tmp_path):
    args = checkpoint_args_namespace(make_cfg(), 0, 0, 3)
    state = ckpt.build_checkpoint_dict(3, make_flat_state(), None, None, None, args)
    assert set(state) == {"args", "checkpoint_version", "iteration", "model"}
    ckpt.save_checkpoint(str(tmp_path), 3, state)
    loaded, _ = ckpt.load_checkpoint_dict(str(tmp_path))
    assert "optimizer" not in loaded and "rng_state" not in loaded


def test_megatron_structure_reader_reads_our_file(tmp_path):
    state = make_full_dict(20)
    ckpt.save_checkpoint(str(tmp_path), 20, state)
    r = megatron_reader(str(tmp_path))
    flat = make_flat_state()
    assert (r["meta"], r["version"], r["iteration"]) == ("20", 3.0, 20)
    assert torch.equal(r["word"], flat["language_model.embedding.word_embeddings.weight"])
    assert r["pos"].shape == (8, 8)
    assert sorted(r["layers"]) == [0, 1] and set(r["layers"][0]) == set(LAYER_PARAMS)
    assert r["layers"][1]["attention.query_key_value.weight"].shape == (24, 8)
    assert r["layers"][1]["mlp.dense_h_to_4h.weight"].shape == (32, 8)  # [out, in]
    assert torch.equal(r["final_w"], torch.ones(8))
    a = r["args"]
    assert isinstance(a, argparse.Namespace)
    for name, value in dict(num_layers=2, hidden_size=8, num_attention_heads=2,
                            ffn_hidden_size=32, max_position_embeddings=8, padded_vocab_size=16,
                            seq_length=4, tensor_model_parallel_size=1,
                            pipeline_model_parallel_size=1, openai_gelu=False,
                            bias_gelu_fusion=True, consumed_train_samples=160,
                            consumed_valid_samples=2, make_vocab_size_divisible_by=128,
                            tokenizer_type="GPT2BPETokenizer", vocab_size=10,
                            layernorm_epsilon=1e-5, iteration=20).items():
        assert getattr(a, name) == value, name
    assert {"random_rng_state", "np_rng_state", "torch_rng_state",
            "rng_tracker_states"} <= set(r["rng"])
    assert "state" in r["optimizer"] and r["sched"]["num_steps"] == 20


def test_megatron_reader_pipeline_names_and_release(tmp_path):
    s = str(tmp_path)
    args = checkpoint_args_namespace(make_cfg(tp=2, pp=2), 0, 0, 5)
    for tp in range(2):
        for pp in range(2):
            state = ckpt.build_checkpoint_dict(5, make_flat_state(head_copy=pp == 1), None, None,
                                               rng_state(), args)
            ckpt.save_checkpoint(s, 5, state, tp_rank=tp, pp_rank=pp, pp_size=2,
                                 is_tracker_writer=(tp, pp) == (1, 1))
    assert sorted(os.listdir(os.path.join(s, "iter_0000005"))) == [
        "mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
    r = megatron_reader(s, tp_rank=1, pp_rank=1, pp_size=2)
    assert r["args"].tensor_model_parallel_size == 2
    loaded, _ = ckpt.load_checkpoint_dict(s, tp_rank=1, pp_rank=1, pp_size=2)
    assert "word_embeddings.weight" in ckpt.from_megatron_model(loaded["model"])
    ckpt.save_checkpoint(s, "release", make_full_dict(0))
    assert megatron_reader(s)["meta"] == "release"
    assert ckpt.load_checkpoint_dict(s)[1] == "release"


def test_rng_state_round_trip_through_a_file(tmp_path):
    from app.mpu.random import get_rng_tracker, model_parallel_seed
    model_parallel_seed(5)  # the real tracker's states: {stream name: {device: state}}
    tracker = get_rng_tracker().get_states()
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    state = make_full_dict(1, tracker=tracker)
    expected = (random.random(), np.random.rand(3).tolist(), torch.rand(3).tolist())
    ckpt.save_checkpoint(str(tmp_path), 1, state)
    random.seed(99), np.random.seed(99), torch.manual_seed(99)
    loaded, _ = ckpt.load_checkpoint_dict(str(tmp_path))
    restored = {}
    ckpt.apply_rng_state(loaded["rng_state"], lambda entry: (load_rng_state_dict(entry),
                                                             restored.update(entry)))
    assert (random.random(), np.random.rand(3).tolist(), torch.rand(3).tolist()) == expected
    model_parallel_seed(77)  # move the tracker; the restore below must bring it back
    ckpt.apply_rng_state(loaded["rng_state"], load_rng_state_dict)
    now = get_rng_tracker().get_states()["model-parallel-rng"]
    assert all(torch.equal(now[k], v) for k, v in tracker["model-parallel-rng"].items())
    with pytest.raises(ckpt.CheckpointError, match="--no-load-rng"):
        ckpt.apply_rng_state([{"np_rng_state": None}], load_rng_state_dict)


def test_check_checkpoint_args_names_field_and_values():
    saved = checkpoint_args_namespace(make_cfg(), 0, 0, 0)
    check_checkpoint_args(saved, checkpoint_args_namespace(make_cfg(), 5, 5, 5))
    check_checkpoint_args(None, saved)
    with pytest.raises(ckpt.CheckpointError, match=r"hidden_size 8 but this run uses 16"):
        check_checkpoint_args(saved, checkpoint_args_namespace(make_cfg(hidden=16), 0, 0, 0))
    with pytest.raises(ckpt.CheckpointError, match=r"num_layers 2 but this run uses 4"):
        check_checkpoint_args(saved, checkpoint_args_namespace(make_cfg(layers=4), 0, 0, 0))
    other = argparse.Namespace(**{**vars(saved), "tokenizer_type": "HFTokenizer"})
    with pytest.raises(ckpt.CheckpointError,
                       match="saved with tokenizer --tokenizer-type GPT2BPETokenizer"):
        check_checkpoint_args(saved, other)
    tp2 = checkpoint_args_namespace(make_cfg(tp=2), 0, 0, 0)
    with pytest.raises(ckpt.CheckpointError) as info:
        check_checkpoint_args(tp2, saved)
    assert str(info.value).startswith("checkpoint was saved with tensor_model_parallel_size 2 but "
                                      "this run uses 1; reshard it first: tools/convert_checkpoint.py")


def test_keep_last_n_rotation(tmp_path):
    s = str(tmp_path)
    os.makedirs(os.path.join(s, "iter_0000099", "mp_rank_00"))  # an abandoned, newer run
    for it in range(1, 6):
        ckpt.save_checkpoint(s, it, make_full_dict(it), keep_last_n=2)
        assert ckpt.read_tracker(s) == it
    assert names.list_checkpoint_iterations(s) == [4, 5, 99]
    assert ckpt.load_checkpoint_dict(s, iteration=4)[0]["iteration"] == 4


def test_rotation_happens_only_after_the_tracker_commit(tmp_path):
    s = str(tmp_path)
    for it in (1, 2):
        ckpt.save_checkpoint(s, it, make_full_dict(it), keep_last_n=1)
    seen = []

    def hook(stage):
        seen.append((stage, names.list_checkpoint_iterations(s), ckpt.read_tracker(s)))

    faults.arm(faults.SAVE_STAGE, hook)
    ckpt.save_checkpoint(s, 3, make_full_dict(3), keep_last_n=1)
    for stage, present, tracker in seen:
        assert tracker in present, (stage, present, tracker)
    assert seen[-1][1:] == ([3], 3)
    assert [x[0] for x in seen] == list(commit.SAVE_STAGES)


def test_no_tracker_means_fresh_start(tmp_path):
    assert ckpt.read_tracker(str(tmp_path)) is None
    assert ckpt.load_checkpoint_dict(str(tmp_path)) == (None, None)
    assert ckpt.load_checkpoint_dict(str(tmp_path / "missing")) == (None, None)


def test_barrier_is_called_exactly_twice(tmp_path):
    calls = []
    ckpt.save_checkpoint(str(tmp_path), 1, make_full_dict(1),
                         barrier=lambda: calls.append(ckpt.read_tracker(str(tmp_path))))
    assert calls == [None, 1]  # before the tracker commit, then after it
