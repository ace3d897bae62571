"""Readers of checkpoints written from the formats' documentation, not from our code, and the
walk of a checkpoint's nested tensors; shared by the tests that check what we save."""
import argparse
import os
import re

import torch

from app.checkpoint.legacy import per_rank as ckpt
from app.mpu.random import rng_state_dict


def tensors(tree, prefix=""):
    """{key path: tensor} of every tensor in a checkpoint's nested dicts and lists."""
    found = {}
    items = tree.items() if isinstance(tree, dict) else enumerate(tree)
    for key, value in items:
        name = f"{prefix}/{key}"
        if isinstance(value, torch.Tensor):
            found[name] = value
        elif isinstance(value, (dict, list, tuple)):
            found.update(tensors(value, name))
    return found


def megatron_reader(load_dir, tp_rank=0, pp_rank=0, pp_size=1):
    """A reader written from Megatron-LM's documented legacy layout, not from our code."""
    with open(os.path.join(load_dir, "latest_checkpointed_iteration.txt")) as f:
        meta = f.read().strip()
    directory = "release" if meta == "release" else "iter_{:07d}".format(int(meta))
    rank = ("mp_rank_{:02d}".format(tp_rank) if pp_size == 1
            else "mp_rank_{:02d}_{:03d}".format(tp_rank, pp_rank))
    sd = torch.load(os.path.join(load_dir, directory, rank, "model_optim_rng.pt"),
                    map_location="cpu", weights_only=False)
    lm = sd["model"]["language_model"]
    emb = lm["embedding"]
    layers = {}
    for key, value in lm["transformer"].items():
        m = re.match(r"layers\.(\d+)\.([a-z0-9_.]+)\.([a-z]+)$", key)
        if m:
            layers.setdefault(int(m.group(1)), {})[f"{m.group(2)}.{m.group(3)}"] = value
    return dict(meta=meta, version=sd["checkpoint_version"], iteration=sd["iteration"],
                args=sd["args"], word=emb["word_embeddings"]["weight"],
                pos=emb["position_embeddings"]["weight"], layers=layers,
                final_w=lm["transformer"]["final_layernorm.weight"], rng=sd["rng_state"][0],
                optimizer=sd.get("optimizer"), sched=sd.get("lr_scheduler"))


# Megatron Core key of each of our names (suffix -> (Megatron key suffix, TP split dim)), written
# out here as the expectation of the torch_dist tests


LAYER = {"input_layernorm.weight": ("self_attention.linear_qkv.layer_norm_weight", -1),
         "input_layernorm.bias": ("self_attention.linear_qkv.layer_norm_bias", -1),
         "attention.query_key_value.weight": ("self_attention.linear_qkv.weight", 0),
         "attention.query_key_value.bias": ("self_attention.linear_qkv.bias", 0),
         "attention.dense.weight": ("self_attention.linear_proj.weight", 1),
         "attention.dense.bias": ("self_attention.linear_proj.bias", -1),
         "post_attention_layernorm.weight": ("mlp.linear_fc1.layer_norm_weight", -1),
         "post_attention_layernorm.bias": ("mlp.linear_fc1.layer_norm_bias", -1),
         "mlp.dense_h_to_4h.weight": ("mlp.linear_fc1.weight", 0),
         "mlp.dense_h_to_4h.bias": ("mlp.linear_fc1.bias", 0),
         "mlp.dense_4h_to_h.weight": ("mlp.linear_fc2.weight", 1),
         "mlp.dense_4h_to_h.bias": ("mlp.linear_fc2.bias", -1)}


OTHER = {"language_model.embedding.word_embeddings.weight": ("embedding.word_embeddings.weight", 0),
         "language_model.embedding.position_embeddings.weight":
             ("embedding.position_embeddings.weight", -1),
         "language_model.transformer.final_layernorm.weight": ("decoder.final_layernorm.weight", -1),
         "language_model.transformer.final_layernorm.bias": ("decoder.final_layernorm.bias", -1)}


# Small legacy checkpoints saved by hand (crash-safety and asynchronous-save tests)


def rng_state(tracker=None):
    """This process's RNG states as the engines save them, with `tracker` as tracker states."""
    state = rng_state_dict()
    state["rng_tracker_states"] = dict(tracker or {})
    return state


H = 4


def small_dict(iteration, fill):
    flat = {"language_model.embedding.word_embeddings.weight": torch.full((8, H), float(fill)),
            "language_model.embedding.position_embeddings.weight": torch.zeros(4, H),
            "language_model.transformer.final_layernorm.weight": torch.ones(H)}
    args = argparse.Namespace(num_layers=1, hidden_size=H, iteration=iteration)
    return ckpt.build_checkpoint_dict(iteration, flat, {"state": {}, "param_groups": []}, {},
                                      rng_state(), args)


def assert_tracker_names_complete_checkpoint(save_dir, tp_size=1, allowed=(10, 20)):
    """The tracker names an allowed iteration and every rank file of it loads with its data."""
    iteration = ckpt.read_tracker(save_dir)
    assert iteration in allowed
    for tp in range(tp_size):
        state, it = ckpt.load_checkpoint_dict(save_dir, tp_rank=tp)
        assert it == iteration and state["iteration"] == iteration
        weight = state["model"]["language_model"]["embedding"]["word_embeddings"]["weight"]
        assert torch.equal(weight, torch.full((8, H), float(iteration + tp)))
    return iteration


def save_two_ranks(save_dir, iteration):
    """Two tensor-parallel ranks saving in turn (barrier is a no-op: rank 1 then rank 0)."""
    ckpt.save_checkpoint(save_dir, iteration, small_dict(iteration, iteration + 1), tp_rank=1,
                         is_tracker_writer=False)
    ckpt.save_checkpoint(save_dir, iteration, small_dict(iteration, iteration), tp_rank=0,
                         is_tracker_writer=True)


class Crash(Exception):
    pass


RANK_FILE_STAGES = ("start", "rank_tmp_written", "rank_checksum_committed", "rank_file_committed")
