"""The DeepSpeed engine adapter at DP=2 with ZeRO-2: our LR schedule reaches the optimizer that
DeepSpeed steps (warmup and decay visible in its param groups), and the LR each step reports is
the LR its update used — with our optimizer object, and with one DeepSpeed builds from the JSON.
At TP=2 in the same spawn: DeepSpeed's activation checkpointing under --recompute-granularity
selective, and --sequence-parallel under ZeRO-2."""
import json
import os

import pytest

from tests.harness.distributed import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ARGV = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
        "--global-batch-size", "8", "--train-iters", "8", "--lr", "1e-2", "--min-lr", "1e-3",
        "--lr-warmup-iters", "3", "--lr-decay-style", "cosine", "--lr-decay-iters", "8",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--distributed-backend", "gloo",
        "--make-vocab-size-divisible-by", "8", "--deepspeed"]


def expected_lr(step: int) -> float:
    """Megatron's schedule written out by hand: linear warmup over 3 steps, cosine to 1e-3 by 8."""
    import math
    if step < 3:
        return 1e-2 * step / 3
    ratio = (step - 3) / (8 - 3)
    return 1e-3 + (1e-2 - 1e-3) * 0.5 * (math.cos(math.pi * ratio) + 1.0)


def _lr_trace(config_path):
    import torch.distributed as dist

    import arguments
    from tests.harness.synthetic import build_synthetic_run
    cfg = arguments.config_from_argv(ARGV + ["--deepspeed_config", config_path],
                                     dist.get_world_size(), 64)
    run = build_synthetic_run(cfg, 64)
    engine, trainer = run["engine"], run["trainer"]
    stepped = engine.ds.optimizer  # the ZeRO optimizer DeepSpeed steps
    base = getattr(stepped, "optimizer", stepped)
    attached = engine.lr_scheduler.optimizer is base
    trace = []
    for _ in range(8):
        weights = [p.detach().clone() for p in engine.ds.module.parameters()]
        out = trainer.train_step(run["iterator"])
        moved = max((p.detach() - w).abs().max().item()
                    for p, w in zip(engine.ds.module.parameters(), weights))
        trace.append((out.lr, base.param_groups[0]["lr"], moved))
    return attached, trace


def _both_optimizers(tmpdir):
    client = os.path.join(ROOT, "ds_configs", "zero2.json")
    with open(client) as f:
        cfg = json.load(f)
    cfg["optimizer"] = {"type": "AdamW", "params": {}}
    json_opt = os.path.join(tmpdir, "zero2_json_optimizer.json")
    if int(os.environ.get("RANK", "0")) == 0 or not os.path.exists(json_opt):
        with open(json_opt + f".{os.getpid()}", "w") as f:
            json.dump(cfg, f)
        os.replace(json_opt + f".{os.getpid()}", json_opt)
    results = {"client optimizer": _lr_trace(client)}
    from app.mpu import random as mpu_random
    mpu_random.set_checkpoint_implementation(None)
    results["JSON optimizer"] = _lr_trace(json_opt)
    return results


def _both_checks(tmpdir):
    """One spawn for both tests (each DeepSpeed spawn pays its start-up once)."""
    from app.mpu import random as mpu_random
    lr = _both_optimizers(tmpdir)
    mpu_random.set_checkpoint_implementation(None)
    return {"lr": lr, "recompute": _recompute_curves(os.path.join(ROOT, "ds_configs", "zero2.json"))}


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    return run_distributed(_both_checks, 2, str(tmp_path_factory.mktemp("ds_engine")), timeout=600)


def test_lr_schedule_reaches_the_stepped_optimizer(spawned):
    for results in (rank["lr"] for rank in spawned):
        for name, (attached, trace) in results.items():
            assert attached, f"{name}: our schedule drives another optimizer than DeepSpeed's"
            for step, (reported, in_groups_after, moved) in enumerate(trace):
                assert abs(reported - expected_lr(step)) < 1e-12, (name, step, reported)
                assert abs(in_groups_after - expected_lr(step + 1)) < 1e-12, (name, step)
                if reported == 0.0:
                    assert moved == 0.0, f"{name}: weights moved at lr 0 (step {step})"
                else:
                    assert 0 < moved <= reported * 1.01, (name, step, moved, reported)


def _recompute_curves(config_path):
    """TP=2 (ZeRO-2 over DP 1), dropout on: 4 iterations without recompute, then with
    DeepSpeed's checkpointing (partition_activations on in the JSON) for selective recompute
    (full recompute: tests/integration/test_deepspeed.py); and, dropout off, without and with
    sequence parallelism."""
    import torch.distributed as dist

    import arguments
    from app.mpu import random as mpu_random
    from tests.harness.synthetic import build_synthetic_run
    argv = ARGV + ["--deepspeed_config", config_path, "--tensor-model-parallel-size", "2",
                   "--hidden-dropout", "0.1", "--attention-dropout", "0.1",
                   "--global-batch-size", "4"]
    curves = {}
    no_dropout = ["--hidden-dropout", "0", "--attention-dropout", "0"]
    for name, extra in (("none", []), ("no dropout", no_dropout),
                        ("sequence parallel", no_dropout + ["--sequence-parallel"]),
                        ("selective", ["--recompute-granularity", "selective"])):
        if "--recompute-granularity" in extra:
            extra = extra + ["--deepspeed-activation-checkpointing"]
        cfg = arguments.config_from_argv(argv + extra, dist.get_world_size(), 64)
        run = build_synthetic_run(cfg, 16)
        curves[name] = [(o.loss, o.grad_norm) for o in
                        (run["trainer"].train_step(run["iterator"]) for _ in range(4))]
    mpu_random.set_checkpoint_implementation(None)
    return curves


def test_deepspeed_recompute_flags_and_sequence_parallel(spawned):
    """Selective recompute keeps its TP-sharded inputs whole (DeepSpeed's partitioning would mix
    the ranks' heads) and restores DeepSpeed's RNG streams: the dropout masks repeat and it
    trains like no recompute. Sequence parallelism under ZeRO-2 trains like plain TP (its
    LayerNorm gradients are summed before DeepSpeed reduces them)."""
    with open(os.path.join(ROOT, "ds_configs", "zero2.json")) as f:
        assert json.load(f)["activation_checkpointing"]["partition_activations"]
    curves = spawned[1]["recompute"]
    for name, reference in (("selective", "none"), ("sequence parallel", "no dropout")):
        for (loss, norm), (want_loss, want_norm) in zip(curves[name], curves[reference]):
            assert abs(loss - want_loss) <= 1e-5 * abs(want_loss), (name, curves)
            assert abs(norm - want_norm) <= 1e-5 * abs(want_norm), (name, curves)
