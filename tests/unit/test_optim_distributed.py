"""The distributed optimizer in one process (DP = 1): the same steps and the same checkpoint format
as the plain wrappers (fp32, bf16, and an MoE model whose experts get buffers of their own),
bucket layout, and the start-up rules of its flags."""
from __future__ import annotations

import pytest
import torch

import arguments
from app.model import GPT2Model
from app.mpu.parallel_state import ParallelState
from app.optim.distributed_optimizer import DistributedOptimizer
from app.optim.mixed_precision import build_precision_optimizer

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--train-iters", "10",
        "--micro-batch-size", "2", "--hidden-dropout", "0", "--attention-dropout", "0",
        "--distributed-backend", "gloo", "--lr", "1e-2", "--clip-grad", "0.05"]


def _models_and_optimizers(extra):
    cfg = arguments.config_from_argv(BASE + extra, 1, 64)
    plain_model, sharded_model = GPT2Model(cfg.model), GPT2Model(cfg.model)
    plain = build_precision_optimizer(plain_model, cfg.optimizer, cfg.precision)
    sharded = DistributedOptimizer(sharded_model, cfg.optimizer, cfg.precision,
                                   ParallelState.single(), num_micro_batches=2)
    return cfg, (plain_model, plain), (sharded_model, sharded)


def _steps(model, optimizer, n):
    gen = torch.Generator().manual_seed(3)
    norms = []
    for _ in range(n):
        optimizer.zero_grad()
        for _ in range(2):  # two micro-batches
            ids = torch.randint(0, 64, (2, 16), generator=gen)
            loss = model(ids, labels=torch.roll(ids, -1, 1)).mean() / 2
            optimizer.scale_loss(loss).backward()
        optimizer.reduction_grads()
        norms.append(optimizer.step(ParallelState.single(), 0.05, None).grad_norm)
    return norms


MOE = ["--num-experts", "4", "--disable-bias-linear", "--moe-ffn-hidden-size", "32",
       "--moe-layer-freq", "[0,1]"]  # experts: buffers of their own


@pytest.mark.parametrize("precision", [[], ["--bf16"], MOE], ids=["fp32", "bf16", "moe"])
def test_same_steps_and_same_checkpoint_format_as_the_plain_wrapper(precision):
    cfg, (plain_model, plain), (sharded_model, sharded) = _models_and_optimizers(
        precision + ["--use-distributed-optimizer", "--ddp-bucket-size", "3000",
                     "--global-batch-size", "4"])
    assert len(sharded.buckets) > 2  # small buckets: several
    assert len(sharded.domains) == (2 if precision == MOE else 1)
    precision = [f for f in precision if f == "--bf16"]
    torch.testing.assert_close(_steps(sharded_model, sharded, 3), _steps(plain_model, plain, 3),
                               rtol=1e-6, atol=0)
    # the norm, summed from shards in another order, rounds differently by ~1e-7 (torch 2.13's
    # vectorised norms), which moves the clipped fp32 weights by ~1e-7 and can move a bf16 one
    # by one bf16 step
    weights_tol = dict(rtol=1e-2, atol=1e-5) if precision else dict(rtol=1e-5, atol=1e-6)
    states_tol = dict(rtol=1e-4, atol=1e-7) if precision else dict(rtol=1e-4, atol=1e-7)
    for (name, a), b in zip(plain_model.state_dict().items(), sharded_model.state_dict().values()):
        torch.testing.assert_close(b, a, msg=name, **weights_tol)
    mine, theirs = sharded.state_dict(), plain.state_dict()
    adam_mine = mine["optimizer"] if precision else mine
    adam_theirs = theirs["optimizer"] if precision else theirs
    assert set(mine) == set(theirs)
    assert adam_mine["param_groups"] == adam_theirs["param_groups"]
    assert adam_mine["state"].keys() == adam_theirs["state"].keys()
    for index, entry in adam_theirs["state"].items():
        for key, value in entry.items():
            torch.testing.assert_close(adam_mine["state"][index][key], value, **states_tol)
    if precision:
        assert mine["param_names"] == theirs["param_names"]
    # the plain state loads into the sharded optimizer (as a resume would: weights, fp32 main
    # weights, AdamW moments) and both continue alike; the sharded state loads into the plain one
    sharded_model.load_state_dict(plain_model.state_dict())
    sharded.set_main_weights({n: p.float() for n, p in plain_model.state_dict().items()})
    sharded.load_state_dict(theirs)
    torch.testing.assert_close(_steps(sharded_model, sharded, 2), _steps(plain_model, plain, 2),
                               rtol=1e-5 if precision else 1e-6, atol=0)
    plain.load_state_dict(sharded.state_dict())


def test_buckets_cover_every_parameter_once_in_reverse_order():
    _, _, (model, sharded) = _models_and_optimizers(
        ["--use-distributed-optimizer", "--ddp-bucket-size", "2000", "--global-batch-size", "4"])
    placed = [p for bucket in sharded.buckets for p in bucket.params]
    assert placed == list(reversed(list(model.parameters())))
    buffers = sharded.domains[0]
    for p in model.parameters():  # the weights live in the flat buffer now
        begin = buffers.offset[id(p)]
        assert p.data_ptr() == buffers.param_buffer[begin:].data_ptr()
    assert sum(p.numel() for p in model.parameters()) <= buffers.param_buffer.numel()


@pytest.mark.parametrize("flags, fragments", [
    (["--overlap-grad-reduce"], ["--overlap-grad-reduce", "--use-distributed-optimizer"]),
    (["--use-distributed-optimizer", "--overlap-param-gather"],
     ["--overlap-param-gather", "--overlap-grad-reduce"]),
    (["--use-distributed-optimizer", "--ddp-bucket-size", "0"], ["--ddp-bucket-size", "0"]),
])
def test_flag_rules_name_both_flags(flags, fragments):
    with pytest.raises(ValueError) as info:
        arguments.config_from_argv(BASE + ["--global-batch-size", "4"] + flags, 1, 64)
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)


def test_distributed_optimizer_is_refused_with_deepspeed():
    import pathlib
    json_path = str(pathlib.Path(__file__).resolve().parents[2] / "ds_configs" / "zero1.json")
    with pytest.raises(ValueError) as info:
        arguments.config_from_argv(BASE + ["--global-batch-size", "4", "--deepspeed",
                                           "--deepspeed_config", json_path,
                                           "--use-distributed-optimizer"], 1, 64)
    assert "--use-distributed-optimizer" in str(info.value) and "ZeRO" in str(info.value)
