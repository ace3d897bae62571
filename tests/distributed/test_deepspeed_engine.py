"""The DeepSpeed engine adapter at DP=2 with ZeRO-2: our LR schedule reaches the optimizer that
DeepSpeed steps (warmup and decay visible in its param groups), and the LR each step reports is
the LR its update used — with our optimizer object, and with one DeepSpeed builds from the JSON.
At TP=2 in the same spawn: DeepSpeed's activation checkpointing under --recompute-granularity
selective, and --sequence-parallel under ZeRO-2.

Mixture of Experts in the same spawn: a Qwen3-MoE-shaped model (the Llama block + QK-norm, 4
experts, top-2, aux loss) at expert-parallel size 2 under ZeRO-2 and ZeRO-1, with the clipping
threshold only on the command line (--clip-grad 0.3, which the norms exceed), trains 8
iterations like one native process (losses, gradient norms, the load-balancing loss and every
weight, each rank's experts against the one-process experts it holds, 1e-5); so does ZeRO-2 at
context-parallel size 2 x EP2 (the expert group is the context group), and ZeRO-2 with the
expert bias (sigmoid scores), z-loss and a gated shared expert (the biases too). The ZeRO-2 run
saved at iteration 4 in DeepSpeed's MoE layout (one file per expert) resumes bit-exactly; at
expert-parallel size 1 it is refused with the optimizer (naming both sizes) and its weights
alone (--no-load-optim) give the saved run's next step; its
save at iteration 8 is read by the converter into our names, the final weights bit for bit
(also from the module and expert files alone), and converts to Megatron's legacy layout and to
Hugging Face's Qwen3-MoE with them; the save at 4 converted to torch_dist with the optimizer
continues the run in one native process (1e-5)."""
import json
import os

import pytest
import torch

from tests.harness.distributed import run_distributed, write_json_once

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
    # torch_adam: DeepSpeed builds torch's AdamW from the JSON instead of its FusedAdam, whose
    # CPU build (a C++ op compiled at first use, ~96 s of CPU) no GPU run uses; what is checked
    # is our schedule reaching an optimizer DeepSpeed made, whichever class it is
    cfg["optimizer"] = {"type": "AdamW", "params": {"torch_adam": True}}
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
    """One spawn for all tests (each DeepSpeed spawn pays its start-up once)."""
    from app.mpu import random as mpu_random
    lr = _both_optimizers(tmpdir)
    mpu_random.set_checkpoint_implementation(None)
    recompute = _recompute_curves(os.path.join(ROOT, "ds_configs", "zero2.json"))
    return {"lr": lr, "recompute": recompute, "moe": _moe_runs(tmpdir)}


@pytest.fixture(scope="module")
def spawn_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("ds_engine")


@pytest.fixture(scope="module")
def spawned(spawn_dir):
    return run_distributed(_both_checks, 2, str(spawn_dir), timeout=600)


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


# ---------------------------------------------------------------------------- Mixture of Experts

QWEN3_MOE = ["--swiglu", "--normalization", "RMSNorm", "--disable-bias-linear", "--qk-layernorm",
             "--position-embedding-type", "rope", "--group-query-attention", "--num-query-groups",
             "2", "--untie-embeddings-and-output-weights", "--num-experts", "4",
             "--moe-router-topk", "2", "--moe-ffn-hidden-size", "16", "--moe-aux-loss-coeff",
             "1e-2", "--clip-grad", "0.3"]
EP2 = ["--expert-model-parallel-size", "2"]
MOE_OPTIONS = ["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
               "--moe-router-bias-update-rate", "1e-2", "--moe-z-loss-coeff", "1e-3",
               "--moe-shared-expert-intermediate-size", "32", "--moe-shared-expert-gate"]
"""The Qwen3-MoE shape with the expert bias (updated at DeepSpeed's boundary step), z-loss and
a gated shared expert."""
MOE_LAYOUTS = {"ZeRO-2": (2, EP2), "ZeRO-1": (1, EP2),
               "ZeRO-2 CP2": (2, EP2 + ["--context-parallel-size", "2"]),
               "ZeRO-2 options": (2, EP2 + MOE_OPTIONS)}
"""name -> (ZeRO stage, flags) of the MoE runs (CP2 x EP2: the expert group is the context
group, as Megatron folds them)."""
MOE_SAVED_AT = 4


def _moe_config(tmpdir, stage):
    """ds_configs/zero{stage}.json without its gradient_clipping (--clip-grad fills it in)."""
    with open(os.path.join(ROOT, "ds_configs", f"zero{stage}.json")) as f:
        config = json.load(f)
    del config["gradient_clipping"]
    return ["--deepspeed", "--deepspeed_config",
            write_json_once(os.path.join(tmpdir, f"zero{stage}_moe.json"), config)]


def _moe_build(argv, world, load=""):
    import arguments
    from tests.harness.synthetic import build_synthetic_run
    argv = ARGV[:-1] + QWEN3_MOE + argv + (["--load", load] if load else [])
    return build_synthetic_run(arguments.config_from_argv(argv, world, 64), 64)


def _moe_train(run, iterations, iterator=None):
    iterator = run["iterator"] if iterator is None else iterator
    steps = [run["trainer"].train_step(iterator) for _ in range(iterations)]
    return [(s.loss, s.grad_norm, s.metrics["load_balancing_loss"]) for s in steps]


def _moe_params(run):
    """Every parameter and the routers' expert biases (buffers), as numpy copies: tensors would
    travel back from a rank through shared memory that is gone once it exits."""
    model = run["model"]
    return {n: p.detach().numpy().copy() for n, p in [*model.named_parameters(), *(
        (n, b) for n, b in model.named_buffers() if n.endswith("expert_bias"))]}


def _moe_runs(tmpdir):
    """Each MOE_LAYOUTS run for 8 iterations (ZeRO-2 saved at 4 and at 8), and the ZeRO-2
    save of iteration 4 resumed for 4 more."""
    import torch.distributed as dist
    from app.training.data_loading import build_data_iterator
    out = {}
    for name, (stage, flags) in MOE_LAYOUTS.items():
        run = _moe_build(flags + _moe_config(tmpdir, stage), dist.get_world_size())
        curve = _moe_train(run, MOE_SAVED_AT)
        if name == "ZeRO-2":
            run["engine"].save_checkpoint(os.path.join(tmpdir, "moe"), MOE_SAVED_AT, dict(
                iteration=MOE_SAVED_AT, consumed_train_samples=8 * MOE_SAVED_AT,
                consumed_valid_samples=0))
        curve += _moe_train(run, 8 - MOE_SAVED_AT)
        if name == "ZeRO-2":
            run["engine"].save_checkpoint(os.path.join(tmpdir, "moe_end"), 8, dict(
                iteration=8, consumed_train_samples=64, consumed_valid_samples=0))
        ds = run["engine"].ds
        out[name] = {"curve": curve, "params": _moe_params(run),
                     "ep_rank": run["ps"].expert_model_parallel_rank,
                     "clipping": ds.gradient_clipping(),
                     "groups": [(g["name"], g.get("moe", False))
                                for g in ds.optimizer.optimizer.param_groups],
                     "partitions": list(ds.optimizer.partition_count)}
    run = _moe_build(EP2 + _moe_config(tmpdir, 2), dist.get_world_size(),
                     load=os.path.join(tmpdir, "moe"))
    loaded = run["engine"].load_checkpoint(os.path.join(tmpdir, "moe"))
    iterator = build_data_iterator(run["trainer"].train_ds, loaded.consumed_train_samples, 2,
                                   run["ps"], 0)
    out["resumed"] = _moe_train(run, 8 - MOE_SAVED_AT, iterator)
    # at EP1: the experts' ZeRO partitions cannot be re-split, the weights load
    from app.checkpoint import CheckpointError
    try:
        _moe_build(_moe_config(tmpdir, 2), dist.get_world_size(),
                   load=os.path.join(tmpdir, "moe"))["engine"].load_checkpoint(
                       os.path.join(tmpdir, "moe"))
        out["other split"] = None
    except CheckpointError as exc:
        out["other split"] = str(exc)
    run = _moe_build(_moe_config(tmpdir, 2) + ["--no-load-optim"], dist.get_world_size(),
                     load=os.path.join(tmpdir, "moe"))
    loaded = run["engine"].load_checkpoint(os.path.join(tmpdir, "moe"))
    iterator = build_data_iterator(run["trainer"].train_ds, loaded.consumed_train_samples, 2,
                                   run["ps"], 0)
    out["weights at EP1"] = _moe_train(run, 1, iterator)
    return out


@pytest.fixture(scope="module")
def moe_reference():
    """The Qwen3-MoE-shaped model, and with MOE_OPTIONS, trained 8 iterations in this process
    (native, no EP)."""
    runs = {"": _moe_build([], 1), "options": _moe_build(MOE_OPTIONS, 1)}
    return {name: {"curve": _moe_train(run, 8), "params": _moe_params(run)}
            for name, run in runs.items()}


def _expected(name, full, ep_rank):
    """Rank `ep_rank`'s part (EP2) of a one-process weight: its two experts, or all of it."""
    return full[2 * ep_rank:2 * ep_rank + 2] if ".mlp.experts." in name else full


def test_moe_at_ep2_under_zero2_zero1_and_cp2_equals_one_process(spawned, moe_reference):
    for rank, results in enumerate(spawned):
        for layout in MOE_LAYOUTS:
            got = results["moe"][layout]
            reference = moe_reference["options" if "options" in layout else ""]
            what = f"{layout} EP2 rank {rank}"
            assert got["clipping"] == 0.3, what  # from --clip-grad, not DeepSpeed's default 1.0
            # DeepSpeed's MoE param groups: the experts in one named by their groups, which ZeRO
            # partitions over their expert-data-parallel group (1 rank), the others over DP 2
            assert got["groups"] == [("decay", False), ("no_decay", False),
                                     ("ep_size_2", True)], (what, got["groups"])
            assert got["partitions"] == [2, 2, 1], what
            for i, (values, want) in enumerate(zip(got["curve"], reference["curve"])):
                assert values == pytest.approx(want, rel=1e-5), (what, i, values, want)
            assert sorted(got["params"]) == sorted(reference["params"]), what
            for name, value in got["params"].items():
                want = _expected(name, torch.from_numpy(reference["params"][name]),
                                 got["ep_rank"])
                torch.testing.assert_close(torch.from_numpy(value), want, rtol=1e-4, atol=1e-5,
                                           msg=lambda m, n=name: f"{what} {n}: {m}")


def test_moe_checkpoint_in_deepspeeds_layout_resumes_exactly_and_converts(spawned, spawn_dir,
                                                                          tmp_path):
    for rank, results in enumerate(spawned):
        moe = results["moe"]
        assert moe["resumed"] == moe["ZeRO-2"]["curve"][MOE_SAVED_AT:], rank
        # at expert-parallel size 1: refused with the optimizer, naming both sizes; the weights
        # alone (--no-load-optim) give the next step of the saved run
        assert "(expert-parallel size 2), this run 4 (--expert-model-parallel-size 1)" in \
            moe["other split"] and "--no-load-optim" in moe["other split"], moe["other split"]
        assert moe["weights at EP1"][0] == pytest.approx(moe["ZeRO-2"]["curve"][MOE_SAVED_AT],
                                                         rel=1e-5), rank
    # DeepSpeed's MoE layout: one file per (MoE layer, global expert), none of it in mp_rank_00
    from app.checkpoint.deepspeed import load_deepspeed_file, read_deepspeed
    from app.checkpoint.saved_layout import detect
    folder = spawn_dir / "moe_end" / "iter_0000008"
    experts = sorted(n for n in os.listdir(folder) if n.startswith("layer_") and n.endswith(".pt"))
    assert experts == [f"layer_{layer}_expert_{e}_mp_rank_00_model_states.pt"
                       for layer in range(2) for e in range(4)], experts
    module = load_deepspeed_file(str(folder / "mp_rank_00_model_states.pt"))["module"]
    assert not [k for k in module if ".experts." in k], sorted(module)
    one = load_deepspeed_file(str(folder / "layer_1_expert_3_mp_rank_00_model_states.pt"))
    prefix = "language_model.transformer.layers.1.mlp.deepspeed_moe.experts.deepspeed_experts.3."
    assert {k: tuple(v.shape) for k, v in one.items()} == {
        prefix + "dense_h_to_4h.weight": (32, 32), prefix + "dense_4h_to_h.weight": (32, 16)}
    # the converter's read: our names, whole experts in global order, the final weights exactly
    read = read_deepspeed(detect(str(spawn_dir / "moe_end"), 8)).weights
    by_rank = [r["moe"]["ZeRO-2"]["params"] for r in spawned]
    assert sorted(read) == sorted(by_rank[0])
    for name, value in read.items():
        want = (torch.cat([torch.from_numpy(p[name]) for p in by_rank])
                if ".mlp.experts." in name else torch.from_numpy(by_rank[0][name]))
        assert torch.equal(value, want), name
    # without ZeRO files (the module file's weights): the experts from their own files
    import shutil
    shutil.copytree(spawn_dir / "moe_end", tmp_path / "modules")
    for name in os.listdir(tmp_path / "modules" / "iter_0000008"):
        if name.startswith("zero_pp_rank_"):
            os.remove(tmp_path / "modules" / "iter_0000008" / name)
    modules = read_deepspeed(detect(str(tmp_path / "modules"), 8)).weights
    assert sorted(modules) == sorted(read) and all(torch.equal(modules[n], read[n]) for n in read)
    # through tools/convert_checkpoint.py: Megatron's legacy layout holds those weights, and the
    # save of iteration 4 as torch_dist with the optimizer continues the run in one process
    from app.checkpoint.legacy import per_rank as legacy
    from app.training.data_loading import build_data_iterator
    from tests.harness.tools import run_tool
    run_tool("convert_checkpoint", ["--load", spawn_dir / "moe_end", "--save",
                                    tmp_path / "legacy", "--output-format", "torch"])
    state, _ = legacy.load_checkpoint_dict(str(tmp_path / "legacy"))
    flat = legacy.from_megatron_model(state["model"])
    assert sorted(flat) == sorted(read) and all(torch.equal(flat[n], read[n]) for n in read)
    # and Hugging Face's Qwen3-MoE directory: each expert's gate/up/down as the Hub names them
    from safetensors.torch import load_file
    run_tool("convert_checkpoint", ["--load", spawn_dir / "moe_end", "--save", tmp_path / "hf",
                                    "--output-format", "hf"])
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "qwen3_moe"
    hf = load_file(str(tmp_path / "hf" / "model.safetensors"))
    fc1 = read["language_model.transformer.layers.1.mlp.experts.dense_h_to_4h.weight"]
    fc2 = read["language_model.transformer.layers.1.mlp.experts.dense_4h_to_h.weight"]
    for e in range(4):
        expert = f"model.layers.1.mlp.experts.{e}."
        assert torch.equal(torch.cat([hf[expert + "gate_proj.weight"],
                                      hf[expert + "up_proj.weight"]]), fc1[e]), e
        assert torch.equal(hf[expert + "down_proj.weight"], fc2[e]), e
    run_tool("convert_checkpoint", ["--load", spawn_dir / "moe", "--save", tmp_path / "dist",
                                    "--output-format", "torch_dist", "--include-optimizer"])
    run = _moe_build(["--ckpt-format", "torch_dist"], 1, load=str(tmp_path / "dist"))
    loaded = run["engine"].load_checkpoint(str(tmp_path / "dist"))
    iterator = build_data_iterator(run["trainer"].train_ds, loaded.consumed_train_samples, 2,
                                   run["ps"], 0)
    for i, (got, want) in enumerate(zip(_moe_train(run, 8 - MOE_SAVED_AT, iterator),
                                        spawned[0]["moe"]["ZeRO-2"]["curve"][MOE_SAVED_AT:])):
        assert got == pytest.approx(want, rel=1e-5), (i, got, want)
