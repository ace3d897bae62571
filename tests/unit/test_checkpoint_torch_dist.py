"""torch_dist checkpoints without processes: the files of a simulated TP2 x PP2 x DP2 save (each
rank's `save_entries` written as its own `__<rank>_0.distcp`, then the metadata) are read with
PyTorch's own distributed-checkpoint reader and compared with global tensors built here by
hand under Megatron Core's keys (recorded from Megatron Core core_v0.19.0's GPTModel with the
local spec); the same files read back at other layouts give each rank its hand-cut shard; the box
arithmetic, the writer assignment and the safe readers are checked on hand-computed cases.
"""
import argparse
import io
import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from app.checkpoint import CheckpointError, sharding
from app.checkpoint.files import ForeignObject, UnsafeCheckpointError
from app.checkpoint.mcore import names as mcore_names
from app.checkpoint.mcore import state as mcore_state
from app.checkpoint.torch_dist import dcp_files
from app.checkpoint.torch_dist import per_rank as torch_dist
from app.optim.model_space import ModelSpaceState, ParamState
from tests.harness.checkpoints import LAYER, OTHER

# Megatron Core core_v0.19.0, GPTModel(get_gpt_layer_local_spec()), 3 layers, hidden 32, 4 heads,
# vocab 64, sequence 16: the ShardedTensor keys and global shapes of model.sharded_state_dict()
# (untied adds output_layer.weight [64, 32]), printed from Megatron's own code.
MEGATRON_KEYS_L3_H32 = {
    "decoder.final_layernorm.bias": (32,), "decoder.final_layernorm.weight": (32,),
    "decoder.layers.mlp.linear_fc1.bias": (3, 128),
    "decoder.layers.mlp.linear_fc1.layer_norm_bias": (3, 32),
    "decoder.layers.mlp.linear_fc1.layer_norm_weight": (3, 32),
    "decoder.layers.mlp.linear_fc1.weight": (3, 128, 32),
    "decoder.layers.mlp.linear_fc2.bias": (3, 32), "decoder.layers.mlp.linear_fc2.weight": (3, 32, 128),
    "decoder.layers.self_attention.linear_proj.bias": (3, 32),
    "decoder.layers.self_attention.linear_proj.weight": (3, 32, 32),
    "decoder.layers.self_attention.linear_qkv.bias": (3, 96),
    "decoder.layers.self_attention.linear_qkv.layer_norm_bias": (3, 32),
    "decoder.layers.self_attention.linear_qkv.layer_norm_weight": (3, 32),
    "decoder.layers.self_attention.linear_qkv.weight": (3, 96, 32),
    "embedding.position_embeddings.weight": (16, 32), "embedding.word_embeddings.weight": (64, 32),
}
MEGATRON_EXTRA_STATE = {f"decoder.layers.{m}._extra_state/shard_{i}_3" for i in range(3) for m in (
    "mlp.linear_fc1", "mlp.linear_fc2", "self_attention.linear_proj", "self_attention.linear_qkv")}

# our name suffix -> (Megatron key suffix, TP split dim), written out here as the expectation
L, H, V, S = 4, 8, 16, 4


def shapes(num_layers=L, h=H, vocab=V, seq=S):
    """{our name: full shape} of a GPT-2 with hidden h (4 h MLP), and (key, dim, layer)."""
    suffix = {"input_layernorm.weight": (h,), "input_layernorm.bias": (h,),
              "attention.query_key_value.weight": (3 * h, h), "attention.query_key_value.bias": (3 * h,),
              "attention.dense.weight": (h, h), "attention.dense.bias": (h,),
              "post_attention_layernorm.weight": (h,), "post_attention_layernorm.bias": (h,),
              "mlp.dense_h_to_4h.weight": (4 * h, h), "mlp.dense_h_to_4h.bias": (4 * h,),
              "mlp.dense_4h_to_h.weight": (h, 4 * h), "mlp.dense_4h_to_h.bias": (h,)}
    out = {}
    for layer in range(num_layers):
        for s, shape in suffix.items():
            key, dim = LAYER[s]
            out[f"language_model.transformer.layers.{layer}.{s}"] = (shape, "decoder.layers." + key,
                                                                     dim, layer)
    full = {"language_model.embedding.word_embeddings.weight": (vocab, h),
            "language_model.embedding.position_embeddings.weight": (seq, h),
            "language_model.transformer.final_layernorm.weight": (h,),
            "language_model.transformer.final_layernorm.bias": (h,)}
    out.update({n: (shape, OTHER[n][0], OTHER[n][1], None) for n, shape in full.items()})
    return out


def reference(seed):
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(shape, generator=gen) for n, (shape, _, _, _) in shapes().items()}


def expected_global(full):
    """Megatron Core's global tensors of our full tensors: the layers stacked."""
    out = {}
    for name, (_, key, _, layer) in shapes().items():
        if layer is None:
            out[key] = full[name]
    for key in {k for (_, k, _, layer) in shapes().values() if layer is not None}:
        names = sorted((layer, n) for n, (_, k, _, layer) in shapes().items() if k == key)
        out[key] = torch.stack([full[n] for _, n in names])
    return out


def local_tensors(full, tp, pp, tp_rank, pp_rank):
    """One rank's local tensors (its layers, its TP chunk, marked as app.mpu marks them); the
    last stage of PP > 1 also holds the tied copy of the word embeddings."""
    per = L // pp
    out = {}
    for name, (_, key, dim, layer) in shapes().items():
        stage = (layer // per) if layer is not None else (
            pp - 1 if "final_layernorm" in name else 0)
        if stage != pp_rank:
            continue
        t = full[name] if dim < 0 else torch.chunk(full[name], tp, dim)[tp_rank].clone()
        t.partition_dim = dim
        out[name] = t
    if pp > 1 and pp_rank == pp - 1:
        tied = torch.chunk(full["language_model.embedding.word_embeddings.weight"], tp, 0)[tp_rank]
        tied = tied.clone()
        tied.partition_dim = 0
        out["word_embeddings.weight"] = tied
    return out


def dp_pieces(local, dp, dp_rank):
    """A distributed optimizer's flat pieces: dp contiguous ranges of every local tensor
    (deliberately not aligned to rows)."""
    out = {}
    for name, t in local.items():
        bounds = [round(i * t.numel() / dp) for i in range(dp + 1)]
        lo, hi = bounds[dp_rank], bounds[dp_rank + 1]
        if hi > lo:
            out[name] = (lo, hi)
    return out


def save_simulated(directory, full, moments, tp, pp, dp, distributed):
    """Every rank of a TP x PP x DP world writes its entries; then rank 0's publish."""
    args = argparse.Namespace(num_layers=L, vocab_size=V, tensor_model_parallel_size=tp,
                              pipeline_model_parallel_size=pp, data_parallel_size=dp)
    records = []
    for pp_rank in range(pp):
        for dp_rank in range(dp):
            for tp_rank in range(tp):
                rank = pp_rank * dp * tp + dp_rank * tp + tp_rank
                layout = torch_dist.RankLayout(tp_rank, tp, pp_rank, pp, dp_rank, dp, rank, L)
                local = local_tensors(full, tp, pp, tp_rank, pp_rank)
                avg = local_tensors(moments, tp, pp, tp_rank, pp_rank)
                pieces = dp_pieces(local, dp, dp_rank) if distributed else {n: None for n in local}
                params = [ParamState(n, p, {"exp_avg": avg[n] if p is None else
                                            avg[n].reshape(-1)[p[0]:p[1]]},
                                     ("exp_avg",)) for n, p in pieces.items()]
                state = ModelSpaceState(params, [{"name": "decay", "lr": 1.0}], 3.0)
                common = mcore_state.build_common(
                    args, 3, scheduler={"num_steps": 3},
                    optimizer=mcore_state.optimizer_part(state, distributed=distributed),
                    distributed_optimizer=distributed)
                entries = torch_dist.save_entries(local, layout, state, common,
                                                  {"torch_rng_state": torch.tensor([rank])})
                records.append(dcp_files.write_rank_files(directory, rank, entries))
    dcp_files.publish(directory, records)
    return records


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("td"))
    full, moments = reference(0), reference(1)
    records = save_simulated(directory, full, moments, tp=2, pp=2, dp=2, distributed=True)
    return directory, full, moments, records


def test_the_table_gives_megatron_cores_keys_and_shapes():
    ours = shapes(num_layers=3, h=32, vocab=64, seq=16)
    found = {}
    for name, (shape, _, _, layer) in ours.items():
        key, got_layer = mcore_names.to_mcore(name)
        assert got_layer == layer and mcore_names.from_mcore(key, layer) == name
        found[key] = ((3,) if layer is not None else ()) + shape
    assert found == MEGATRON_KEYS_L3_H32
    assert mcore_names.to_mcore("language_model.output_layer.weight") == ("output_layer.weight", None)
    assert mcore_names.to_mcore("word_embeddings.weight") == ("embedding.word_embeddings.weight", None)
    assert {mcore_names.extra_state_key(m, i, 3) for i in range(3)
            for m in mcore_names.EXTRA_STATE_MODULES} == MEGATRON_EXTRA_STATE
    with pytest.raises(KeyError, match="rotary"):
        mcore_names.to_mcore("language_model.rotary.inv_freq")


def test_pytorchs_reader_gives_the_global_tensors_built_by_hand(saved):
    directory, full, moments, records = saved
    assert sorted(os.listdir(directory)) == sorted(
        [f"__{r}_0.distcp" for r in range(8)] + [".metadata", "metadata.json", "integrity.json"])
    assert dcp_files.read_config(directory) == {"sharded_backend": "torch_dist",
                                                "sharded_backend_version": 1}
    metadata = FileSystemReader(directory).read_metadata()  # PyTorch's own reader
    want = expected_global(full)
    want.update({mcore_names.optimizer_key("exp_avg", k): v
                 for k, v in expected_global(moments).items()})
    tensors = {k for k, v in metadata.state_dict_metadata.items() if hasattr(v, "chunks")}
    assert tensors == set(want)
    for key, tensor in want.items():  # every element written exactly once
        chunks = metadata.state_dict_metadata[key].chunks
        assert sum(torch.Size(c.sizes).numel() for c in chunks) == tensor.numel(), key
    got = {k: torch.empty_like(v) for k, v in want.items()}
    dcp.load(got, checkpoint_id=directory, no_dist=True)
    for key, tensor in want.items():
        assert torch.equal(got[key], tensor), key
    sizes = [sum(os.path.getsize(os.path.join(directory, n)) for n in r.digests) for r in records]
    assert min(sizes) > 0.3 * max(sizes), f"writes are unbalanced over the ranks: {sizes}"


def _empty_like(t):
    """A zero tensor with `t`'s shape and TP mark: what a freshly built model holds."""
    out = torch.zeros_like(t)
    out.partition_dim = t.partition_dim
    return out


def _read_at(directory, full, moments, tp, pp, dp, pieces_for):
    """Read every rank of another layout; check its weights and optimizer pieces."""
    for pp_rank in range(pp):
        for dp_rank in range(dp):
            for tp_rank in range(tp):
                layout = torch_dist.RankLayout(tp_rank, tp, pp_rank, pp, dp_rank, dp, 0, L)
                local = local_tensors(full, tp, pp, tp_rank, pp_rank)
                avg = local_tensors(moments, tp, pp, tp_rank, pp_rank)
                pieces = pieces_for(local, dp, dp_rank)
                template = ModelSpaceState([ParamState(n, p, {}, ("exp_avg",))
                                            for n, p in pieces.items()], [{"name": "decay"}])
                got = torch_dist.read_rank_state(directory, {n: _empty_like(t) for n, t in
                                                             local.items()}, layout, template)
                for name, tensor in local.items():
                    assert torch.equal(got.weights[name], tensor), (name, layout)
                for entry in got.optimizer.params:
                    want = avg[entry.name] if entry.piece is None else \
                        avg[entry.name].reshape(-1)[entry.piece[0]:entry.piece[1]]
                    assert torch.equal(entry.tensors["exp_avg"], want), (entry.name, layout)
                assert got.optimizer.step == 3.0
                assert got.common["opt_param_scheduler"] == {"num_steps": 3}
                if (tp, pp) == (2, 2):
                    assert int(got.rng_state[0]["torch_rng_state"]) == pp_rank * 4 + tp_rank


def test_each_rank_of_another_layout_reads_its_own_shard(saved):
    directory, full, moments, _ = saved
    _read_at(directory, full, moments, 1, 1, 1, lambda local, dp, r: {n: None for n in local})
    _read_at(directory, full, moments, 4, 1, 1, lambda local, dp, r: {n: None for n in local})
    _read_at(directory, full, moments, 1, 4, 3, dp_pieces)
    _read_at(directory, full, moments, 2, 2, 2, dp_pieces)


def test_a_plain_optimizer_save_reads_into_the_distributed_one(tmp_path):
    full, moments = reference(2), reference(3)
    save_simulated(str(tmp_path), full, moments, tp=1, pp=2, dp=2, distributed=False)
    _read_at(str(tmp_path), full, moments, 2, 1, 3, dp_pieces)


def test_boxes_of_the_parallel_layers():
    col = sharding.place("k", (6, 4), partition_dim=0, tp_rank=1, tp_size=2, layer=2, num_layers=5)
    assert col.global_shape == (5, 12, 4)
    assert col.regions == (sharding.Region((0, 0), (6, 4), (2, 6, 0)),)
    row = sharding.place("k", (4, 3), partition_dim=1, tp_rank=2, tp_size=3)
    assert row.global_shape == (4, 9) and row.regions[0].global_offset == (0, 6)
    rep = sharding.place("k", (4,), partition_dim=-1, tp_rank=1, tp_size=2)
    assert (rep.regions[0].copies, rep.regions[0].copy_index) == (2, 1)
    # grouped-query attention, 4 heads, 1 key/value group, head_dim 2, TP 2: rank 1 holds query
    # heads 2-3 (global rows 4-7) and the group's k, v (rows 8-11, also on rank 0)
    gqa = sharding.place("k", (8, 5), partition_dim=0, tp_rank=1, tp_size=2, replicated_rows=(4, 2))
    assert gqa.global_shape == (12, 5)
    assert [(r.local_start, r.size, r.global_offset, r.copies, r.copy_index)
            for r in gqa.regions] == [((0, 0), (4, 5), (4, 0), 1, 0),
                                      ((4, 0), (4, 5), (8, 0), 2, 1)]
    # --swiglu's fc1, ffn 6, TP 3, layer 1 of 2: rank 2 holds [gate rows 4-5; up rows 4-5], at
    # global rows 4-5 and 6 + 4 = 10-11 of [gate; up] (Megatron Core's swiglu sharded factory)
    glu = sharding.place("k", (4, 3), partition_dim=0, tp_rank=2, tp_size=3, layer=1,
                         num_layers=2, glu_halves=True)
    assert glu.global_shape == (2, 12, 3)
    assert [(r.local_start, r.size, r.global_offset) for r in glu.regions] == [
        ((0, 0), (2, 3), (1, 4, 0)), ((2, 0), (2, 3), (1, 10, 0))]
    # a distributed-optimizer piece across the two halves: flat [3, 9) = row 1, row 2
    assert [(r.global_offset, r.size, offset) for r, offset in
            sharding.piece_regions(glu, (4, 3), (3, 9))] == [((1, 5, 0), (1, 3), 0),
                                                            ((1, 10, 0), (1, 3), 3)]


def test_boxes_of_the_experts():
    """An MoE layer's experts: dim 0 is this expert-parallel rank's experts, each expert's FFN
    split over the expert tensor-parallel ranks, SwiGLU halves per expert (Megatron Core 0.16.1's
    SequentialMLP: expert axis after the layer axis, [gate; up] of each expert)."""
    # 8 experts, EP 2, ETP 2, F 6, h 3; layer 1 of 2: ETP rank 1 of EP rank 1 holds experts 4-7,
    # each [gate rows 3-5; up rows 3-5] of [gate (6); up (6)]
    fc1 = sharding.place("k", (4, 6, 3), partition_dim=1, tp_rank=1, tp_size=2, layer=1,
                         num_layers=2, glu_halves=True, expert_axis=(1, 2))
    assert fc1.global_shape == (2, 8, 12, 3)
    assert [(r.local_start, r.size, r.global_offset) for r in fc1.regions] == [
        ((0, 0, 0), (4, 3, 3), (1, 4, 3, 0)), ((0, 3, 0), (4, 3, 3), (1, 4, 9, 0))]
    fc2 = sharding.place("k", (4, 3, 3), partition_dim=2, tp_rank=1, tp_size=2,
                         expert_axis=(1, 2))
    assert fc2.global_shape == (8, 3, 6) and fc2.regions[0].global_offset == (4, 0, 3)
    assert mcore_names.extra_state_key("mlp.experts.experts.linear_fc1", 1, 2, True, (5, 8)) == \
        "decoder.layers.mlp.experts.experts.linear_fc1._extra_state/shard_1.5_2.8"
    assert mcore_names.extra_state_key("mlp.experts.experts.linear_fc1", 1, 2, False, (5, 8)) == \
        "decoder.layers.1.mlp.experts.experts.linear_fc1._extra_state/shard_5_8"


# Megatron Core 0.16.1, GPTModel(get_gpt_decoder_block_spec(use_transformer_engine=False)): 2
# layers, hidden 16, 4 heads, ffn 32, vocab 64, untied, RMSNorm, QK-norm, SwiGLU, 4 experts of
# width 8; every key (and global shape) dist_checkpointing.save wrote, printed from Megatron's
# own files: every layer MoE with a gated shared expert of 24 and the expert bias (stacked), and
# --moe-layer-freq [0, 1] (non-homogeneous: per-layer keys).
_EXPERT_STATE = ([f"decoder.layers.mlp.experts.experts.linear_fc{i}._extra_state/shard_{l}.{g}_2.4"
                  for i in (1, 2) for l in range(2) for g in range(4)]
                 + [f"decoder.layers.{m}._extra_state/shard_{l}_2" for l in range(2) for m in (
                     "mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2",
                     "self_attention.linear_proj", "self_attention.linear_qkv")])
MEGATRON_MOE_KEYS = {"stacked": {**{k: None for k in _EXPERT_STATE}, **{
    "decoder.final_layernorm.weight": (16,),
    "decoder.layers.mlp.experts.experts.linear_fc1.weight": (2, 4, 16, 16),
    "decoder.layers.mlp.experts.experts.linear_fc2.weight": (2, 4, 16, 8),
    "decoder.layers.mlp.linear_fc1.layer_norm_weight": (2, 16),
    "decoder.layers.mlp.router.expert_bias": (2, 4), "decoder.layers.mlp.router.weight": (2, 4, 16),
    "decoder.layers.mlp.shared_experts.gate_weight": (2, 1, 16),
    "decoder.layers.mlp.shared_experts.linear_fc1.weight": (2, 48, 16),
    "decoder.layers.mlp.shared_experts.linear_fc2.weight": (2, 16, 24),
    "decoder.layers.self_attention.k_layernorm.weight": (2, 4),
    "decoder.layers.self_attention.linear_proj.weight": (2, 16, 16),
    "decoder.layers.self_attention.linear_qkv.layer_norm_weight": (2, 16),
    "decoder.layers.self_attention.linear_qkv.weight": (2, 48, 16),
    "decoder.layers.self_attention.q_layernorm.weight": (2, 4),
    "embedding.word_embeddings.weight": (64, 16), "output_layer.weight": (64, 16)}},
    "per_layer": {**{f"decoder.layers.{l}.{m}._extra_state/shard_0_1": None for l, m in (
        (0, "mlp.linear_fc1"), (0, "mlp.linear_fc2"), (0, "self_attention.linear_proj"),
        (0, "self_attention.linear_qkv"), (1, "self_attention.linear_proj"),
        (1, "self_attention.linear_qkv"))},
        **{f"decoder.layers.1.mlp.experts.experts.linear_fc{i}._extra_state/shard_{g}_4": None
           for i in (1, 2) for g in range(4)}, **{
        "decoder.final_layernorm.weight": (16,),
        "decoder.layers.0.mlp.linear_fc1.layer_norm_weight": (16,),
        "decoder.layers.0.mlp.linear_fc1.weight": (64, 16),
        "decoder.layers.0.mlp.linear_fc2.weight": (16, 32),
        "decoder.layers.1.mlp.experts.experts.linear_fc1.weight": (4, 16, 16),
        "decoder.layers.1.mlp.experts.experts.linear_fc2.weight": (4, 16, 8),
        "decoder.layers.1.mlp.linear_fc1.layer_norm_weight": (16,),
        "decoder.layers.1.mlp.router.weight": (4, 16),
        **{f"decoder.layers.{l}.self_attention.{k}": shape for l in range(2) for k, shape in (
            ("k_layernorm.weight", (4,)), ("q_layernorm.weight", (4,)),
            ("linear_proj.weight", (16, 16)), ("linear_qkv.layer_norm_weight", (16,)),
            ("linear_qkv.weight", (48, 16)))},
        "embedding.word_embeddings.weight": (64, 16), "output_layer.weight": (64, 16)}}}
MOE_FLAGS = {"stacked": ["--moe-shared-expert-intermediate-size", "24", "--moe-shared-expert-gate",
                         "--moe-router-score-function", "sigmoid",
                         "--moe-router-enable-expert-bias"],
             "per_layer": ["--moe-layer-freq", "[0,1]"]}


@pytest.mark.parametrize("kind", sorted(MEGATRON_MOE_KEYS))
def test_moe_models_write_megatron_cores_keys(kind):
    import arguments
    from app.checkpoint.mcore.names import stacks_layers
    from app.model import GPT2Model
    cfg = arguments.config_from_argv([
        "--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "4",
        "--ffn-hidden-size", "32", "--seq-length", "8", "--micro-batch-size", "1",
        "--train-iters", "1",
        "--make-vocab-size-divisible-by", "64", "--swiglu", "--normalization", "RMSNorm",
        "--disable-bias-linear", "--qk-layernorm", "--position-embedding-type", "rope",
        "--untie-embeddings-and-output-weights", "--num-experts", "4", "--moe-ffn-hidden-size",
        "8", *MOE_FLAGS[kind]], 1, 64)
    model = GPT2Model(cfg.model)
    moe = cfg.model.moe
    layout = torch_dist.RankLayout(0, 1, 0, 1, 0, 1, 0, 2,
                                   stacked=stacks_layers(moe.moe_layer_freq, moe.num_experts))
    entries = torch_dist.save_entries(dict(model.state_dict(keep_vars=True)), layout, None, None,
                                      None)
    assert {e.key: (tuple(e.global_shape) if e.data is None else None)
            for e in entries} == MEGATRON_MOE_KEYS[kind]


def test_flat_ranges_become_contiguous_boxes():
    assert sharding.flat_boxes((3, 4), 2, 11) == [((0, 2), (1, 2)), ((1, 0), (1, 4)),
                                                  ((2, 0), (1, 3))]
    assert sharding.flat_boxes((3, 4), 4, 12) == [((1, 0), (2, 4))]
    assert sharding.flat_boxes((7,), 3, 5) == [((3,), (2,))]
    for lo, hi in ((0, 60), (7, 53), (13, 14), (20, 40)):
        covered = []
        for start, size in sharding.flat_boxes((3, 4, 5), lo, hi):
            idx = torch.arange(60).view(3, 4, 5)
            for d, (a, n) in enumerate(zip(start, size)):
                idx = idx.narrow(d, a, n)
            covered += idx.reshape(-1).tolist()
        assert covered == list(range(lo, hi))


def test_every_replica_gets_exactly_one_writer():
    cands = [sharding.Candidate(f"k{i}", (i,), 10 * (i % 3 + 1), copies, copies - 1 - c, True)
             for i in range(12) for copies in (1, 3) for c in range(copies)]
    for copies in (1, 3):
        mine = [c for c in cands if c.copies == copies and c.copy_index == 0]
        writers = {}
        for copy_index in range(copies):
            for dp_rank in range(2):
                view = [sharding.Candidate(c.key, c.global_offset, c.nbytes, copies, copy_index,
                                           True) for c in mine]
                for c, w in zip(view, sharding.assign_writers(view, 2, dp_rank)):
                    writers.setdefault(c.key, []).append(w)
        assert all(sum(w) == 1 for w in writers.values()), writers


def test_expert_replicas_are_written_by_the_expert_data_parallel_ranks():
    """Dense boxes are spread over the data-parallel ranks, expert boxes over the expert
    data-parallel ranks (TP 1, DP 4, EP 2: expert DP 2): each box has exactly one writer."""
    def view(dp_rank, edp_rank, ep_rank):
        cands = [sharding.Candidate(f"d{i}", (i,), 10 + i, 1, 0, True) for i in range(6)]
        cands += [sharding.Candidate(f"e{ep_rank}_{i}", (i,), 10 + i, 1, 0, True, expert=True)
                  for i in range(4)]
        return cands, sharding.assign_writers(cands, 4, dp_rank, 2, edp_rank)
    writers = {}
    for rank in range(4):  # ep = rank % 2, edp = rank // 2 (Megatron's expert grid)
        for c, w in zip(*view(rank, rank // 2, rank % 2)):
            writers.setdefault(c.key, []).append((rank, w))
    assert all(sum(w for _, w in ws) == 1 for ws in writers.values()), writers
    assert all({r % 2 for r, w in ws if w} == {int(k[1])} for k, ws in writers.items()
               if k.startswith("e"))


def test_unsafe_or_damaged_files_are_refused(saved, tmp_path):
    directory, *_ = saved
    bad = tmp_path / "bad"
    os.makedirs(bad)
    for name in os.listdir(directory):
        (bad / name).write_bytes(open(os.path.join(directory, name), "rb").read())

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))
    (bad / ".metadata").write_bytes(pickle.dumps(Evil()))
    os.remove(bad / "integrity.json")
    with pytest.raises(UnsafeCheckpointError, match="posix.system|os.system|refused"):
        dcp_files.Reader(str(bad))
    blob = io.BytesIO()
    torch.save([Evil()], blob)
    with pytest.raises(UnsafeCheckpointError, match="allow-list"):
        dcp_files.load_object(blob.getvalue(), "common_state")
    corrupt = tmp_path / "corrupt"
    os.makedirs(corrupt)
    for name in os.listdir(directory):
        data = bytearray(open(os.path.join(directory, name), "rb").read())
        if name == "__3_0.distcp":
            data[len(data) // 2] ^= 0xFF
        (corrupt / name).write_bytes(bytes(data))
    full = reference(0)
    layout = torch_dist.RankLayout(0, 1, 0, 1, 0, 1, 0, L)
    with pytest.raises(CheckpointError, match="__3_0.distcp is corrupt"):
        torch_dist.read_rank_state(str(corrupt), local_tensors(full, 1, 1, 0, 0), layout, None)


def test_another_model_shape_is_refused_with_the_key_and_both_shapes(saved):
    directory, *_ = saved
    wide = {n: torch.zeros(s[:-1] + (s[-1] * 2,)) for n, (s, _, _, _) in shapes().items()
            if "position" in n}
    for t in wide.values():
        t.partition_dim = -1
    layout = torch_dist.RankLayout(0, 1, 0, 1, 0, 1, 0, L)
    with pytest.raises(CheckpointError, match=r"position_embeddings.weight.*\[4, 8\].*\[4, 16\]"):
        torch_dist.read_rank_state(directory, wide, layout, None)


def test_megatron_objects_in_the_common_state_load_as_inert_stand_ins():
    import enum
    import sys
    import types
    # a Megatron class pickled under its own module name, which the reader never imports
    names = ("megatron", "megatron.core", "megatron.core.enums")
    saved = {n: sys.modules.get(n) for n in names}  # megatron-core may be imported already
    module = types.ModuleType(names[-1])
    module.ModelType = enum.Enum("ModelType", "encoder_or_decoder", module=names[-1])
    sys.modules.update({n: module for n in names})
    try:
        blob = io.BytesIO()
        torch.save([{"args": argparse.Namespace(model_type=module.ModelType.encoder_or_decoder,
                                                num_layers=2)}], blob)
    finally:
        for name, before in saved.items():
            if before is None:
                del sys.modules[name]
            else:
                sys.modules[name] = before
    # as in a process without Megatron: megatron-core, once imported, allow-lists its classes
    registered = torch.serialization.get_safe_globals()
    torch.serialization.clear_safe_globals()
    try:
        value = dcp_files.load_object(blob.getvalue(), "common_state")
    finally:
        torch.serialization.add_safe_globals(registered)
    assert value[0]["args"].num_layers == 2
    assert isinstance(value[0]["args"].model_type, ForeignObject)


def test_ckpt_format_flags():
    import arguments
    from tests.harness.arguments import DS_JSON
    base = ["--num-layers", "2", "--hidden-size", "8", "--num-attention-heads", "2",
            "--seq-length", "4", "--max-position-embeddings", "4", "--micro-batch-size", "1",
            "--train-iters", "1"]
    assert arguments.config_from_argv(base, 1, 64).checkpoint.ckpt_format == "torch"
    cfg = arguments.config_from_argv(base + ["--ckpt-format", "torch_dist",
                                             "--auto-detect-ckpt-format"], 1, 64)
    assert (cfg.checkpoint.ckpt_format, cfg.checkpoint.auto_detect_ckpt_format) == ("torch_dist",
                                                                                    True)
    with pytest.raises(ValueError, match="--ckpt-format torch_dist is written by the native"):
        arguments.config_from_argv(base + ["--ckpt-format", "torch_dist", "--deepspeed",
                                           "--deepspeed_config", DS_JSON], 1, 64)


def test_layout_of_a_torch_dist_directory(saved, tmp_path):
    from app.checkpoint import saved_layout
    directory, *_ = saved
    layout = saved_layout.inspect_directory(directory)
    assert (layout.format, layout.tensor_model_parallel_size, layout.pipeline_model_parallel_size,
            layout.data_parallel_size, layout.missing) == ("torch_dist", 2, 2, 2, [])
    assert "resharded on load" in layout.describe()
    kwargs = dict(tensor_model_parallel_size=4, pipeline_model_parallel_size=1,
                  data_parallel_size=3, load_optimizer=True)
    assert saved_layout.loadable_problem(layout, str(tmp_path), deepspeed=False, **kwargs) is None
    assert "resume it without --deepspeed" in saved_layout.loadable_problem(
        layout, str(tmp_path), deepspeed=True, **kwargs)
    partial = tmp_path / "partial"
    os.makedirs(partial)
    for name in os.listdir(directory):
        if name != "__5_0.distcp":
            (partial / name).write_bytes(open(os.path.join(directory, name), "rb").read())
    layout = saved_layout.inspect_directory(str(partial))
    assert "is incomplete" in saved_layout.loadable_problem(layout, str(tmp_path), deepspeed=False,
                                                       **kwargs)


def test_a_failed_save_is_undone_and_a_corrupt_file_is_refused(tmp_path, monkeypatch):
    """One process through the engine: a full disk while a rank writes its shards, or while
    rank 0 writes the metadata, undoes the save (the tracker still names the last good one, no
    file of it is left); a flipped byte in a shard file stops the load naming the file."""
    import errno
    import arguments
    from app.checkpoint import commit, names
    from tests.harness.synthetic import build_synthetic_run
    argv = ["--num-layers", "2", "--hidden-size", "8", "--num-attention-heads", "2",
            "--seq-length", "4", "--max-position-embeddings", "4", "--micro-batch-size", "1",
            "--train-iters", "8", "--ckpt-format", "torch_dist", "--hidden-dropout", "0"]
    run = build_synthetic_run(arguments.config_from_argv(argv, 1, 64), 16)
    engine, ck = run["engine"], str(tmp_path / "ck")
    client = dict(iteration=2, consumed_train_samples=2, consumed_valid_samples=0)
    run["trainer"].train_step(run["iterator"])
    engine.save_checkpoint(ck, 2, client)

    def full_disk(when, real):
        def fail(path, *args, **kwargs):
            if when in str(path):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
            return real(path, *args, **kwargs)
        return fail
    for iteration, target, name in ((4, dcp_files, "sha256_file"),
                                    (6, dcp_files, "atomic_write_bytes")):
        with monkeypatch.context() as patch:
            patch.setattr(target, name, full_disk(f"iter_{iteration:07d}", getattr(target, name)))
            with pytest.raises(commit.CheckpointSaveError, match="ENOSPC.*still iteration 2"):
                engine.save_checkpoint(ck, iteration, client)
        assert names.read_tracker(ck) == 2 and sorted(os.listdir(ck)) == [
            "iter_0000002", "latest_checkpointed_iteration.txt"]
    shard = os.path.join(ck, "iter_0000002", "__0_0.distcp")
    data = bytearray(open(shard, "rb").read())
    data[len(data) // 3] ^= 0x01
    open(shard, "wb").write(bytes(data))
    with pytest.raises(CheckpointError, match=r"__0_0.distcp is corrupt"):
        engine.load_checkpoint(ck)
