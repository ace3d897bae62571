"""--optimizer muon across layouts (fp32, Newton-Schulz in fp32, dropout 0), two spawns:

- TP2 (2 ranks): the orthogonalisation of column-parallel, row-parallel and fused-QKV shards
  (also with key/value heads replicated over the two ranks) in the duplicated and distributed
  modes equals the one-process result, and both equal the polar factor of the full matrix from
  the SVD; blockwise equals the polar factor of each shard alone. Whole runs at TP2
  (duplicated; distributed with sequence parallelism; distributed with one query group) give
  the losses and grad norms of the same model at TP1. A TP2 checkpoint resumes bit-exactly;
  in this process it is resharded to TP1 with the converter (--include-optimizer, momentum
  buffers included) and the TP1 run continues the TP2 one.
- 4 ranks: TP2 x DP2 with the distributed optimizer (both TP modes, both overlaps; also in
  Llama's block: SwiGLU's gate/up shards, RMSNorm and qk norms, no biases), TP2 x PP2
  (1F1B, duplicated) and TP2 x PP2 interleaved (distributed) equal DP4 at TP1; bf16 with the
  distributed optimizer and Newton-Schulz in bf16 stays close to its DP4 run.
"""
from __future__ import annotations

from tests.harness.distributed import (assert_checks_passed, expect_close, run_checks,
                                       run_distributed)
from tests.harness.synthetic import train_steps as _train

ARGV = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
        "--global-batch-size", "8", "--train-iters", "6", "--lr", "1e-2", "--min-lr", "1e-3",
        "--lr-warmup-iters", "2", "--lr-decay-style", "cosine", "--hidden-dropout", "0",
        "--attention-dropout", "0", "--distributed-backend", "gloo",
        "--make-vocab-size-divisible-by", "8", "--optimizer", "muon",
        "--muon-fp32-matmul-prec", "high", "--muon-nesterov"]
TP2 = ["--tensor-model-parallel-size", "2"]
LLAMA = ["--swiglu", "--normalization", "RMSNorm", "--disable-bias-linear", "--qk-layernorm",
         "--position-embedding-type", "rope", "--group-query-attention", "--num-query-groups",
         "2", "--untie-embeddings-and-output-weights"]
ITERS, SAVED_AT = 6, 3
TOL = dict(rtol=1e-5, atol=1e-6)


def _build(flags, world, argv=ARGV):
    import arguments
    from tests.harness.synthetic import build_synthetic_run
    return build_synthetic_run(arguments.config_from_argv(argv + flags, world, 64), 256)


def _compare(got, want, what, **tolerance):
    for i, ((loss, norm), (want_loss, want_norm)) in enumerate(zip(got, want)):
        if want_loss is not None and loss is not None:
            expect_close(loss, want_loss, f"{what}: loss at iteration {i + 1}", **tolerance)
        expect_close(norm, want_norm, f"{what}: grad norm at iteration {i + 1}", **tolerance)


def _resume(flags, world, load_dir):
    from app.training.data_loading import build_data_iterator
    run = _build(flags + ["--load", load_dir], world)
    loaded = run["engine"].load_checkpoint(load_dir)
    assert loaded.iteration == SAVED_AT, loaded
    iterator = build_data_iterator(run["trainer"].train_ds, loaded.consumed_train_samples, 2,
                                   run["ps"], 0)
    return run, iterator


# ---------------------------------------------------------------------------- orthogonaliser

def _polar(matrix):
    import torch
    u, _, vh = torch.linalg.svd(matrix.double(), full_matrices=False)
    return (u @ vh).float()


def _shard_rows_replicated_kv(full, rank):
    """Rank `rank`'s QKV rows at TP2 with one query group (4 heads, head_dim 2): its two query
    heads, then the group's key and value (app.model.attention.replicated_kv_init)."""
    import torch
    view = full.view(1, 6, 2, full.shape[1])
    return torch.cat([view[0, 2 * rank:2 * rank + 2], view[0, 4:]]).reshape(-1, full.shape[1])


def _check_orthogonalizer():
    import torch
    import torch.distributed as dist

    from app.config import OptimizerConfig
    from app.optim.muon import MatrixSpec, TensorParallelOrthogonalizer
    from app.optim.newton_schulz import join_qkv_rows, split_qkv_rows
    rank, group = dist.get_rank(), dist.group.WORLD
    gen = torch.Generator().manual_seed(11)
    column, row = torch.randn(24, 10, generator=gen), torch.randn(10, 24, generator=gen)
    qkv = torch.randn(2 * (2 + 2) * 3, 12, generator=gen)  # 2 groups of 2 queries, head_dim 3
    mqa = torch.randn((4 + 2) * 2, 12, generator=gen)  # 1 group of 4 queries, head_dim 2
    cases = {  # name: (full, this rank's part, spec at TP2, spec at TP1, keep rows of full)
        "column": (column, column.chunk(2, 0)[rank], MatrixSpec(0), MatrixSpec(0)),
        "row": (row, row.chunk(2, 1)[rank], MatrixSpec(1), MatrixSpec(1)),
        "qkv": (qkv, qkv.chunk(2, 0)[rank], MatrixSpec(0, (1, 2, 3)), MatrixSpec(0, (2, 2, 3))),
        "qkv, kv replicated": (mqa, _shard_rows_replicated_kv(mqa, rank),
                               MatrixSpec(0, (1, 2, 2), kv_replicas=2), MatrixSpec(0, (1, 4, 2))),
    }
    for mode in ("duplicated", "distributed"):
        quintic = OptimizerConfig(optimizer="muon", muon_tp_mode=mode,
                                  muon_fp32_matmul_prec="high")
        exact = OptimizerConfig(optimizer="muon", muon_tp_mode=mode, muon_fp32_matmul_prec="high",
                                muon_coefficient_type="polar_express", muon_num_ns_steps=25,
                                muon_scale_mode="unit_rms_norm")
        for name, (full, part, spec, spec1) in cases.items():
            local = TensorParallelOrthogonalizer(quintic, group)(part, spec)
            whole = TensorParallelOrthogonalizer(quintic)(full, spec1)
            mine = (_shard_rows_replicated_kv(whole, rank) if name == "qkv, kv replicated" else
                    whole.chunk(2, 1 if name == "row" else 0)[rank])
            expect_close(local, mine, f"{mode} {name}: TP2 == one process", **TOL)
            got = TensorParallelOrthogonalizer(exact, group)(part, spec)
            parts = split_qkv_rows(full, *spec1.qkv) if spec1.qkv else [full]
            ref = [_polar(p) * (p.shape[0] / p.shape[1]) ** 0.5 for p in parts]
            ref = join_qkv_rows(ref, spec1.qkv[0]) if spec1.qkv else ref[0]
            ref = (_shard_rows_replicated_kv(ref, rank) if name == "qkv, kv replicated" else
                   ref.chunk(2, 1 if name == "row" else 0)[rank])
            expect_close(got, ref, f"{mode} {name}: polar factor of the full matrix",
                         rtol=0, atol=1e-4)
    blockwise = OptimizerConfig(optimizer="muon", muon_tp_mode="blockwise",
                                muon_fp32_matmul_prec="high", muon_num_ns_steps=25,
                                muon_coefficient_type="polar_express",
                                muon_scale_mode="unit_rms_norm")
    for name in ("column", "row"):
        full, part, spec, _ = cases[name]
        got = TensorParallelOrthogonalizer(blockwise, group)(part, spec)
        expect_close(got, _polar(part) * (part.shape[0] / part.shape[1]) ** 0.5,
                     f"blockwise {name}: the shard's own polar factor", rtol=0, atol=1e-4)
        assert (got - _polar(full).chunk(2, 1 if name == "row" else 0)[rank]).abs().max() > 0.05


# ---------------------------------------------------------------------------- spawn 1: TP2

def _tp2_main(save_dir):
    import torch.distributed as dist
    world, curves = dist.get_world_size(), {}
    gqa = ["--group-query-attention", "--num-query-groups", "1"]

    def whole_runs_equal_tp1():
        reference = _train(_build([], world), 5)
        _compare(_train(_build(TP2, world), 5), reference, "TP2 duplicated", **TOL)
        _compare(_train(_build(TP2 + ["--muon-tp-mode", "distributed", "--sequence-parallel"],
                               world), 5), reference, "TP2 distributed + SP", **TOL)
        _compare(_train(_build(TP2 + gqa + ["--muon-tp-mode", "distributed"], world), 5),
                 _train(_build(gqa, world), 5), "TP2 distributed, one query group", **TOL)

    def resumes_bit_exactly():
        run = _build(TP2, world)
        curves["tp2"] = _train(run, SAVED_AT)
        run["engine"].save_checkpoint(save_dir, SAVED_AT, dict(
            iteration=SAVED_AT, consumed_train_samples=8 * SAVED_AT, consumed_valid_samples=0))
        curves["tp2"] += _train(run, ITERS - SAVED_AT)
        resumed, iterator = _resume(TP2, world, save_dir)
        _compare(_train(resumed, ITERS - SAVED_AT, iterator), curves["tp2"][SAVED_AT:],
                 "resumed TP2", rtol=0.0, atol=0.0)

    outcome = run_checks({"orthogonaliser at TP2": _check_orthogonalizer,
                          "TP2 == TP1": whole_runs_equal_tp1,
                          "TP2 resume is bit-exact": resumes_bit_exactly})
    return outcome, curves.get("tp2")


def test_muon_at_tp2_equals_tp1_resumes_exactly_and_reshards_to_tp1(tmp_path):
    import torch

    from app.checkpoint.convert import ConvertOptions, convert
    save_dir, tp1_dir = str(tmp_path / "tp2"), str(tmp_path / "tp1")
    results = run_distributed(_tp2_main, 2, save_dir, timeout=300)
    assert_checks_passed([outcome for outcome, _ in results])
    tp2 = results[0][1]
    convert(ConvertOptions(load=save_dir, save=tp1_dir, input_format="megatron",
                           output_format="megatron", target_tensor_model_parallel_size=1,
                           target_pipeline_model_parallel_size=1, include_optimizer=True))
    saved = torch.load(f"{tp1_dir}/iter_{SAVED_AT:07d}/mp_rank_00/model_optim_rng.pt",
                       weights_only=False)["optimizer"]
    assert [g["name"] for g in saved["param_groups"]] == ["muon", "decay", "no_decay"]
    assert set(saved["state"][0]) == {"momentum_buffer"}
    torch.manual_seed(0)
    run, iterator = _resume([], 1, tp1_dir)
    got = _train(run, ITERS - SAVED_AT, iterator)
    for (loss, norm), (want_loss, want_norm) in zip(got, tp2[SAVED_AT:]):
        torch.testing.assert_close(loss, want_loss, **TOL)
        torch.testing.assert_close(norm, want_norm, **TOL)


# ---------------------------------------------------------------------------- spawn 2: 4 ranks

def _layouts_main():
    import torch.distributed as dist
    world = dist.get_world_size()
    four = ARGV[:1] + ["4"] + ARGV[2:]  # 4 layers: two per stage, one per interleaved chunk
    distributed_optimizer = ["--use-distributed-optimizer", "--overlap-grad-reduce",
                             "--overlap-param-gather", "--ddp-bucket-size", "2000"]
    reference = {}

    def layout(flags, argv=four, key="fp32", **tolerance):
        def check():
            if key not in reference:
                reference[key] = _train(_build(["--bf16"] if key == "bf16" else [], world, argv),
                                        5)
            _compare(_train(_build(flags, world, argv), 5), reference[key], " ".join(flags),
                     **(tolerance or TOL))
        return check

    bf16 = list(four)
    bf16[bf16.index("--muon-fp32-matmul-prec") + 1] = "medium"  # Newton-Schulz in bf16
    return run_checks({
        "TP2xDP2 distributed optimizer, duplicated": layout(TP2 + distributed_optimizer),
        "TP2xDP2 distributed optimizer, distributed": layout(
            TP2 + distributed_optimizer + ["--muon-tp-mode", "distributed"]),
        "TP2xPP2 1F1B, duplicated": layout(TP2 + ["--pipeline-model-parallel-size", "2"]),
        "TP2xPP2 interleaved, distributed": layout(
            TP2 + ["--pipeline-model-parallel-size", "2", "--muon-tp-mode", "distributed",
                   "--num-layers-per-virtual-pipeline-stage", "1"]),
        "TP2xDP2 distributed optimizer, Llama block": layout(  # gate/up shards, RMSNorms
            TP2 + distributed_optimizer, four + LLAMA, "llama"),
        "bf16 TP2xDP2 distributed optimizer": layout(
            ["--bf16"] + TP2 + distributed_optimizer, bf16, "bf16", rtol=2e-2, atol=0.0),
    })


def test_muon_tp2_with_dp2_and_pp2_equals_dp4():
    assert_checks_passed(run_distributed(_layouts_main, 4, timeout=400))
