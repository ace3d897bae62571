"""The per-rank memory estimate (app.training.planning.memory) against what a run really holds.

Parameters per rank against the model stages built at TP2 / PP2; activation bytes against the
tensors autograd saves in a real forward pass (counted by storage through saved-tensor hooks,
CPU semantics), for both attention backends and for the first and last pipeline stage;
weights, gradients and optimizer states against the engine's own tensors after a step (native
fp32/bf16/fp16 and DeepSpeed ZeRO-2 and ZeRO-3; ZeRO-3 at DP 2 in
tests/distributed/test_deepspeed_zero3.py); DeepSpeed's reduce bucket against the buffer it
allocates; the largest micro-batch against the estimates of runs configured with it.
"""
import pytest

from app.training.planning.memory import (FIT_FRACTION, estimate_memory, params_per_rank,
                                 stage_activations)
from tests.harness.memory import config, saved_activation_bytes, stage_model

@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
@pytest.mark.parametrize("options", [
    (), ("--position-embedding-type", "rope", "--untie-embeddings-and-output-weights"),
    ("--group-query-attention", "--num-query-groups", "1", "--position-embedding-type", "alibi"),
    ("--swiglu", "--normalization", "RMSNorm", "--disable-bias-linear", "--qk-layernorm",
     "--position-embedding-type", "rope", "--group-query-attention", "--num-query-groups", "2",
     "--untie-embeddings-and-output-weights", "--kv-channels", "32"),
], ids=["gpt2", "rope-untied", "mqa-alibi", "llama"])
def test_params_per_rank_is_the_largest_stage_shard(tp, pp, options):
    cfg = config("--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
                 *options, world=tp * pp)
    counts = [sum(p.numel() for p in stage_model(cfg, t, s).parameters())
              for t in range(tp) for s in range(pp)]
    assert params_per_rank(cfg) == max(counts)


@pytest.mark.parametrize("backend", ["auto", "local"])
@pytest.mark.parametrize("extra", [
    ("--attention-dropout", "0"),     # SDPA's fused CPU kernel keeps no scores; local: the probs
    ("--hidden-dropout", "0", "--attention-dropout", "0"),
    ("--reset-attention-mask",),      # explicit mask: probs, dropout mask, dropped probs
    (),                               # SDPA with dropout: its math path keeps them too
    ("--checkpoint-activations", "--checkpoint-num-layers", "2"),  # chunk inputs only
    ("--recompute-granularity", "full", "--recompute-method", "block",
     "--recompute-num-layers", "2"),                    # 2 layer inputs + 2 layers kept
    ("--recompute-granularity", "selective"),           # no attention core kept
    ("--recompute-granularity", "selective", "--recompute-modules", "core_attn", "mlp"),
    ("--recompute-granularity", "selective", "--reset-attention-mask"),
    ("--swiglu", "--normalization", "RMSNorm", "--disable-bias-linear", "--kv-channels", "32",
     "--attention-dropout", "0"),     # Llama's block: gate, up and product kept
])
def test_activation_formula_matches_the_tensors_autograd_keeps(extra, backend):
    cfg = config(*extra, "--attention-backend", backend)
    want = stage_activations(cfg, "cpu").forward * cfg.training.micro_batch_size
    got = saved_activation_bytes(cfg)
    assert abs(want - got) / got < 0.1, (extra, want, got)


MOE = ("--swiglu", "--normalization", "RMSNorm", "--disable-bias-linear", "--num-experts", "4",
       "--moe-ffn-hidden-size", "96", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "1e-2")


@pytest.mark.parametrize("layout,pattern", [
    (("--expert-model-parallel-size", "2"), "1"),
    (("--tensor-model-parallel-size", "2", "--sequence-parallel",
      "--expert-model-parallel-size", "2"), "1"),
    (("--tensor-model-parallel-size", "2", "--sequence-parallel",
      "--expert-tensor-parallel-size", "1"), "[0,1,1,0]"),
    (("--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2"), "[0,0,1,1]"),
], ids=["ep2", "tp2xep2", "tp2-etp1", "pp2xep2-dense-stage"])
def test_moe_params_per_rank_is_the_largest_shard_and_experts_shard_over_expert_dp(layout,
                                                                                    pattern):
    from app.training.planning.memory import expert_params_per_rank
    cfg = config(*MOE, "--moe-layer-freq", pattern, *layout, world=4)
    p = cfg.parallel
    counts, expert_counts = [], []
    for t in range(p.tensor_model_parallel_size):
        for s in range(p.pipeline_model_parallel_size):
            for e in range(p.expert_model_parallel_size):
                for r in range(p.expert_tensor_parallel_size):
                    model = stage_model(cfg, t, s, e, r)
                    counts.append(sum(q.numel() for q in model.parameters()))
                    expert_counts.append(sum(q.numel() for n, q in model.named_parameters()
                                             if ".mlp.experts." in n))
    assert params_per_rank(cfg) == max(counts)
    assert expert_params_per_rank(cfg) == max(expert_counts) > 0
    dist = config(*MOE, "--moe-layer-freq", pattern, *layout, "--use-distributed-optimizer",
                  world=4)
    est, psi_e = estimate_memory(dist), expert_params_per_rank(dist)
    dense_shards = (est.params - psi_e) / (p.data_parallel_size * p.context_parallel_size)
    assert est.optimizer == pytest.approx(8 * (dense_shards + psi_e / p.expert_data_parallel_size))


@pytest.mark.parametrize("extra", [(), ("--moe-shared-expert-intermediate-size", "64",
                                        "--moe-token-dispatcher-type", "alltoall"),
                                   ("--moe-shared-expert-intermediate-size", "64",
                                    "--moe-layer-recompute"),
                                   ("--moe-shared-expert-intermediate-size", "64",
                                    "--recompute-granularity", "selective",
                                    "--recompute-modules", "shared_experts", "mlp")],
                         ids=["plain", "shared-alltoall", "moe-layer-recompute",
                              "recompute-shared-and-mlp"])
def test_moe_activation_formula_matches_the_tensors_autograd_keeps(extra):
    """Balanced routing is assumed; the random-token model routes close to it."""
    cfg = config(*MOE, *extra, "--attention-dropout", "0", "--hidden-dropout", "0",
                 "--moe-layer-freq", "[0,1,1,0]")
    want = stage_activations(cfg, "cpu").forward * cfg.training.micro_batch_size
    got = saved_activation_bytes(cfg)
    assert abs(want - got) / got < 0.1, (extra, want, got)


@pytest.mark.parametrize("vocab", [500, 8000])  # the first stage needs more; the last does
def test_pipeline_estimate_is_the_larger_of_the_first_and_the_last_stage(vocab):
    """PP 2 with 4 micro-batches: the first stage keeps 2 in flight, the last one plus the
    output layer (its fp32 log-probabilities kept, its logits alive at the loss)."""
    cfg = config("--pipeline-model-parallel-size", "2", "--global-batch-size", "16", world=2,
                 vocab=vocab)
    b, s, w = cfg.training.micro_batch_size, cfg.model.seq_length, 4
    first, last = (saved_activation_bytes(cfg, r) for r in (0, 1))
    for rank, got in ((0, first), (1, last)):
        want = stage_activations(cfg, "cpu", rank).forward * b
        assert abs(want - got) / got < 0.1, (rank, want, got)
    logits = b * s * cfg.model.padded_vocab_size * w
    measured = max(2 * first, last + logits)
    est = estimate_memory(cfg, device_type="cpu")
    assert abs(est.activations - measured) / measured < 0.1, (est.activations, first, last)
    assert (est.activations == est.stages[1].bytes(b, 4)) == (vocab == 8000)


def test_model_states_match_the_engines_tensors_after_a_step(monkeypatch):
    """Native fp32, bf16 and fp16 (half gradients cast to fp32 and freed one by one), Muon
    (one momentum per hidden matrix) and SGD, and DeepSpeed ZeRO-2 and ZeRO-3 (one rank): weights,
    gradients and optimizer states equal the engine's
    tensors exactly; ZeRO-2's reduce bucket equals the buffer DeepSpeed allocates."""
    import torch.distributed as dist
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)  # DeepSpeed's one-rank start-up exports these
    try:
        _check_states_against_engines()
    finally:
        if dist.is_initialized():  # DeepSpeed's one-rank group must not leak into other tests
            dist.destroy_process_group()
        for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            monkeypatch.delenv(key, raising=False)


def _check_states_against_engines():
    from tests.harness.synthetic import build_synthetic_run
    for extra in ((), ("--bf16",), ("--fp16", "--initial-loss-scale", "4096"),  # step applied
                  ("--optimizer", "muon"), ("--optimizer", "sgd", "--bf16"),
                  ("--deepspeed", "--deepspeed_config", "ds_configs/zero2.json"),
                  ("--deepspeed", "--deepspeed_config", "ds_configs/zero3.json")):
        cfg = config("--global-batch-size", "8", *extra)
        run = build_synthetic_run(cfg, 32)
        buckets = []
        if "ds_configs/zero3.json" in extra:  # one bucket, allocated once
            buckets = [sum(b.buffer.numel() * b.buffer.element_size()
                           for b in run["engine"].ds.optimizer.ipg_buckets.values())]
        elif "--deepspeed" in extra:
            zero = run["engine"].ds.optimizer
            setup = zero.setup_buckets

            def record(*args, **kwargs):
                out = setup(*args, **kwargs)
                buckets.append(sum(t.numel() * t.element_size()
                                   for b in zero.ipg_buckets.values() for t in b.buffer))
                return out
            zero.setup_buckets = record
        run["trainer"].train_step(run["iterator"])
        held = run["engine"].state_bytes()
        est = estimate_memory(cfg)
        assert (est.weights, est.gradients, est.optimizer) == (
            held["params"], held["grads"], held["optimizer"]), (extra, held)
        assert est.buffers == (max(buckets) if buckets else 0), (extra, buckets)


def test_largest_micro_batch_is_the_last_that_fits():
    cfg = config()
    est = estimate_memory(cfg)
    device = est.model_states + 10.5 * est.activations_at(1)
    device /= FIT_FRACTION
    largest = est.largest_micro_batch(device)
    assert largest == 10
    assert estimate_memory(cfg, largest).total <= FIT_FRACTION * device
    assert estimate_memory(cfg, largest + 1).total > FIT_FRACTION * device
    assert est.largest_micro_batch(est.model_states / FIT_FRACTION) == 0


def test_largest_micro_batch_counts_the_micro_batches_in_flight():
    """PP 2, 8 samples per rank: micro-batch 1 keeps 2 of 8 micro-batches in flight on the first
    stage, micro-batch 8 one of one. For each micro-batch b that divides 8, the device on which
    a run configured with b just fits must give an answer >= b, and the answer must fit."""
    def pp2(b):
        return config("--pipeline-model-parallel-size", "2", "--global-batch-size", "8",
                      "--micro-batch-size", str(b), "--num-layers", "8", world=2)
    est = estimate_memory(pp2(1))
    for b in (1, 2, 4, 8):
        own = estimate_memory(pp2(b))
        assert est.activations_at(b) == own.activations
        device = own.total / FIT_FRACTION * (1 + 1e-12)
        largest = est.largest_micro_batch(device)
        assert largest >= b, (b, largest)
        assert estimate_memory(pp2(1), largest).total <= FIT_FRACTION * device


def test_zero3_offloads_leave_the_persistent_parameters_on_the_device():
    """ZeRO-3 at DP 4 with offload_param and offload_optimizer: on the device only the
    parameters under the persistence threshold (whole, counted from the real model), and the
    gathered ones; without offloads each parameter's piece is ceil(numel / 4)."""
    import json
    import os
    import tempfile
    with open("ds_configs/zero3_offload.json") as f:
        ds = json.load(f)
    ds["zero_optimization"]["stage3_param_persistence_threshold"] = 64
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "z3.json")
        with open(path, "w") as f:
            json.dump(ds, f)
        offload = config("--deepspeed", "--deepspeed_config", path, "--global-batch-size", "16",
                         world=4)
        plain = config("--deepspeed", "--deepspeed_config", "ds_configs/zero3.json",
                       "--global-batch-size", "16", world=4)
    sizes = [p.numel() for p in stage_model(offload).parameters()]
    small = sum(n for n in sizes if n <= 64)
    est = estimate_memory(offload)
    assert (est.weights, est.gradients, est.optimizer) == (4 * small, 0, 0)
    assert est.gathered == 4 * (sum(sizes) - small)  # reuse distance 1e9: all of it
    pieces = sum(-(-n // 4) for n in sizes)
    est = estimate_memory(plain)  # every parameter persistent (<= 1e5 elements)
    assert (est.weights, est.gradients, est.optimizer) == (
        4 * (pieces + sum(sizes)), 4 * pieces, (4 + 8) * pieces)
