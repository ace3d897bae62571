"""The per-rank memory estimate (app.training.memory) against what a run really holds.

Parameters per rank against the model stages built at TP2 / PP2; activation bytes against the
tensors autograd saves in a real forward pass (counted by storage through saved-tensor hooks,
CPU semantics); weights, gradients and optimizer states against the engine's own tensors after
a step (native and DeepSpeed ZeRO-2); DeepSpeed's reduce bucket against the buffer it allocates.
"""
import pytest
import torch

import arguments
from app.model import GPT2Model
from app.mpu.parallel_state import ParallelState
from app.mpu.random import model_parallel_seed
from app.training.memory import (FIT_FRACTION, activation_bytes_per_sample, estimate_memory,
                                 params_per_rank)

BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "64", "--micro-batch-size", "4", "--train-iters", "2",
        "--make-vocab-size-divisible-by", "64", "--distributed-backend", "gloo"]


def config(*extra, world=1):
    return arguments.config_from_argv([*BASE, *extra], world, 500)


def stage_model(cfg, tp_rank=0, pp_rank=0):
    p = cfg.parallel
    ps = ParallelState(tensor_model_parallel_size=p.tensor_model_parallel_size,
                       pipeline_model_parallel_size=p.pipeline_model_parallel_size,
                       tensor_model_parallel_rank=tp_rank, pipeline_model_parallel_rank=pp_rank)
    pp = p.pipeline_model_parallel_size
    per = cfg.model.num_layers // pp
    model_parallel_seed(1, ParallelState.single())
    return GPT2Model(cfg.model, ps, pre_process=pp_rank == 0, post_process=pp_rank == pp - 1,
                     layer_range=(pp_rank * per, (pp_rank + 1) * per))


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_params_per_rank_is_the_largest_stage_shard(tp, pp):
    cfg = config("--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
                 world=tp * pp)
    counts = [sum(p.numel() for p in stage_model(cfg, t, s).parameters())
              for t in range(tp) for s in range(pp)]
    assert params_per_rank(cfg) == max(counts)


def saved_activation_bytes(cfg):
    """Bytes of the tensors autograd keeps from one training forward (parameters excluded)."""
    model = stage_model(cfg)
    model.train()
    b, s = cfg.training.micro_batch_size, cfg.model.seq_length
    ids = torch.randint(0, cfg.raw_vocab_size, (b, s), generator=torch.Generator().manual_seed(0))
    mask = None
    if cfg.data.reset_attention_mask:
        mask = ~torch.ones(s, s, dtype=torch.bool).tril()[None, None].expand(b, 1, s, s)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages = {}

    def pack(t):
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids, None, mask, labels=ids)
    return sum(n for ptr, n in storages.items() if ptr not in params)


@pytest.mark.parametrize("extra", [
    ("--attention-dropout", "0"),                       # SDPA's fused CPU kernel: no scores kept
    ("--hidden-dropout", "0", "--attention-dropout", "0"),
    ("--reset-attention-mask",),                        # explicit mask: scores, probs, dropout mask
    (),                                                 # SDPA with dropout: its math path keeps scores
    ("--checkpoint-activations", "--checkpoint-num-layers", "2"),  # chunk inputs only
])
def test_activation_formula_matches_the_tensors_autograd_keeps(extra):
    cfg = config(*extra)
    want = activation_bytes_per_sample(cfg, "cpu")["forward"] * cfg.training.micro_batch_size
    got = saved_activation_bytes(cfg)
    assert abs(want - got) / got < 0.1, (extra, want, got)


def test_model_states_match_the_engines_tensors_after_a_step():
    """Native fp32 and bf16, and DeepSpeed ZeRO-2 (one rank): weights, gradients and optimizer states equal
    the engine's tensors exactly; ZeRO-2's reduce bucket equals the buffer DeepSpeed allocates."""
    from app.testing.synthetic import build_synthetic_run
    for extra in ((), ("--bf16",), ("--deepspeed", "--deepspeed_config", "ds_configs/zero2.json")):
        cfg = config("--global-batch-size", "8", *extra)
        run = build_synthetic_run(cfg, 32)
        buckets = []
        if "--deepspeed" in extra:
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
    device = est.model_states + 10.5 * est.activations_per_sample
    device /= FIT_FRACTION
    largest = est.largest_micro_batch(device)
    assert largest == 10
    assert estimate_memory(cfg, largest).total <= FIT_FRACTION * device
    assert estimate_memory(cfg, largest + 1).total > FIT_FRACTION * device
    assert est.largest_micro_batch(est.model_states / FIT_FRACTION) == 0
