"""DeepSpeed ZeRO-3 against the native path, in two spawns (synthetic data, fp32, dropout off
unless said).

DP 2 (2 ranks): the model built under deepspeed.zero.Init is partitioned before the engine
exists and its gathered initial weights equal the native model's bit for bit (learned positions
and an untied output layer included); 20 iterations of ZeRO-3, and of ZeRO-3 with parameters
and optimizer offloaded to the CPU (DeepSpeedCPUAdam), give native DP 2's losses and gradient
norms within 1e-5, and so does Llama's block (built partitioned with the native weights);
bf16 weights track fp32 within 1e-2, and their save reads the same weights in the engine's
weights-only load and the converter (DeepSpeed's zero_to_fp32's); the bytes each rank holds equal
--dry-run's estimate (app.training.planning.memory) exactly.

TP 2 x DP 2 (4 ranks): 20 iterations of ZeRO-3 over the data-parallel group (the mpu) give
native TP 2 x DP 2's losses and norms; with dropout on, DeepSpeed's activation checkpointing
(partition_activations) gives the curve of the run without recompute.
"""
import json
import os

import pytest

from tests.harness.distributed import run_distributed, write_json_once

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ITERS = 20
ARGV = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
        "--global-batch-size", "8", "--train-iters", str(ITERS), "--lr", "1e-2", "--min-lr",
        "1e-3", "--lr-warmup-iters", "3", "--lr-decay-style", "cosine", "--hidden-dropout", "0",
        "--attention-dropout", "0", "--distributed-backend", "gloo",
        "--make-vocab-size-divisible-by", "8"]
LLAMA = ["--swiglu", "--normalization", "RMSNorm", "--disable-bias-linear", "--qk-layernorm",
         "--position-embedding-type", "rope", "--group-query-attention", "--num-query-groups",
         "2", "--untie-embeddings-and-output-weights"]
RELEASE_EARLY = {"stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0,
                 "stage3_param_persistence_threshold": 64}
"""Release each parameter after its module (tiny models stay whole with the defaults), so the
memory check sees pieces, persistent parameters and gathered ones apart."""


def _config(tmpdir, name, **zero):
    """ds_configs/zero3.json with `zero` merged into its zero_optimization block (and an AdamW
    block when the optimizer is offloaded), written once by rank 0."""
    with open(os.path.join(ROOT, "ds_configs", "zero3.json")) as f:
        config = json.load(f)
    config["zero_optimization"].update(zero)
    if "offload_optimizer" in zero:
        config["optimizer"] = {"type": "AdamW", "params": {}}
    return ["--deepspeed", "--deepspeed_config",
            write_json_once(os.path.join(tmpdir, f"{name}.json"), config)]


def _curve(argv, memory=False, save_dir=None):
    """(loss, grad norm) of ITERS iterations; with `memory` also (state bytes, estimate); with
    `save_dir` also the module's weights after a save at ITERS, one more step and a weights-only
    load of that save (`_save_and_reload`)."""
    import torch.distributed as dist

    import arguments
    from app.mpu import random as mpu_random
    from tests.harness.synthetic import build_synthetic_run
    from app.training.planning.memory import estimate_memory
    mpu_random.set_checkpoint_implementation(None)
    cfg = arguments.config_from_argv(argv, dist.get_world_size(), 64)
    run = build_synthetic_run(cfg, 8 * (ITERS + 1))  # one step past ITERS for save_dir
    curve = [(o.loss, o.grad_norm) for o in
             (run["trainer"].train_step(run["iterator"]) for _ in range(ITERS))]
    if save_dir is not None:
        return curve, _save_and_reload(run, save_dir)
    if not memory:
        return curve
    est = estimate_memory(cfg)
    return curve, run["engine"].state_bytes(), (est.weights, est.gradients, est.optimizer)


def _gathered(module):
    """The whole weights of a ZeRO-3 module, gathered, in the module's dtype."""
    import deepspeed
    params = dict(module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values())):
        return {n: p.detach().clone() for n, p in params.items()}


def _save_and_reload(run, save_dir):
    """Save at ITERS, take one more step (the weights move), then the engine's weights-only
    load of that save (its ZeRO-3 path, app.checkpoint.deepspeed.read_rank): the module's
    weights after the step and after the load."""
    from app.checkpoint import names, saved_layout
    from app.training.checkpointing.resume import ResumePlan
    engine = run["engine"]
    engine.save_checkpoint(save_dir, ITERS, dict(iteration=ITERS, consumed_train_samples=8 * ITERS,
                                                 consumed_valid_samples=0))
    run["trainer"].train_step(run["iterator"])
    moved = _gathered(engine.ds.module)
    layout = saved_layout.inspect_directory(names.checkpoint_dir(save_dir, ITERS))
    engine.read_checkpoint(save_dir, ResumePlan(ITERS, weights_only=True, load_optimizer=False,
                                                load_rng=False, layout=layout))
    return {"moved": moved, "loaded": _gathered(engine.ds.module)}


def _initial_weights(argv):
    """The whole initial weights of the model built for `argv`, and whether every parameter
    was partitioned when its construction ended (before any engine existed)."""
    import torch.distributed as dist

    import arguments
    from app.model.stage import build_model_stage
    from app.training.run import build_parallel_state, set_seeds
    from app.training.engines.deepspeed import partitioned_construction
    cfg = arguments.config_from_argv(argv, dist.get_world_size(), 64)
    ps = build_parallel_state(cfg, dist.get_world_size())
    set_seeds(cfg.training.seed, ps)
    if not cfg.deepspeed.enabled:
        model = build_model_stage(cfg.model, ps)
        return {n: p.detach().clone() for n, p in model.named_parameters()}, True
    with partitioned_construction(cfg, ps):
        model = build_model_stage(cfg.model, ps)
    pieces = all(p.data.numel() == 0 and p.ds_tensor.numel() == -(-p.ds_numel // 2)
                 for p in model.parameters())
    return _gathered(model), pieces


def _dp2(tmpdir):
    import torch
    untied = ARGV + ["--untie-embeddings-and-output-weights"]
    native, zero3 = _initial_weights(untied), _initial_weights(untied + _config(tmpdir, "z3"))
    out = {"init_equal": native[0].keys() == zero3[0].keys() and all(
        torch.equal(native[0][k], zero3[0][k]) for k in native[0]), "partitioned": zero3[1]}
    out["native"] = _curve(ARGV)
    out["zero3"], out["bytes"], out["estimate"] = _curve(
        ARGV + _config(tmpdir, "z3_early", **RELEASE_EARLY), memory=True)
    offload = {"offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}
    out["offload"] = _curve(ARGV + _config(tmpdir, "z3_offload", **offload))
    out["bf16_save"] = os.path.join(tmpdir, "bf16_ck")
    out["bf16"], out["bf16_reload"] = _curve(ARGV + _config(tmpdir, "z3") + ["--bf16"],
                                             save_dir=out["bf16_save"])
    llama = ARGV + LLAMA
    native, zero3 = _initial_weights(llama), _initial_weights(llama + _config(tmpdir, "z3"))
    out["llama_init_equal"] = native[0].keys() == zero3[0].keys() and all(
        torch.equal(native[0][k], zero3[0][k]) for k in native[0])
    out["llama_native"] = _curve(llama)
    out["llama_zero3"] = _curve(llama + _config(tmpdir, "z3"))
    return out


@pytest.fixture(scope="module")
def dp2(tmp_path_factory):
    return run_distributed(_dp2, 2, str(tmp_path_factory.mktemp("zero3_dp2")), timeout=900)


def _close(got, want, rel):
    worst = 0.0
    for (loss, norm), (want_loss, want_norm) in zip(got, want, strict=True):
        worst = max(worst, abs(loss - want_loss) / want_loss, abs(norm - want_norm) / want_norm)
    assert worst < rel, (worst, got, want)
    return worst


def test_zero3_model_is_built_partitioned_with_the_native_initial_weights(dp2):
    for rank in dp2:
        assert rank["partitioned"], "a parameter was whole on a rank after its construction"
        assert rank["init_equal"], "ZeRO-3's initial weights differ from the native ones"


def test_zero3_dp2_and_its_cpu_offload_match_native_dp2(dp2):
    for name in ("zero3", "offload"):
        worst = _close(dp2[0][name], dp2[0]["native"], 1e-5)
        print(f"parity {name} DP=2 vs native DP=2 over {ITERS} iterations: {worst:.2e}")
    _close(dp2[0]["bf16"], dp2[0]["native"], 1e-2)


def test_zero3_bf16_save_reads_the_same_weights_in_the_engine_and_the_converter(dp2):
    """One whole read (app.checkpoint.deepspeed.read_rank) for both: the converter's weights
    and the engine's per-rank read are DeepSpeed's own zero_to_fp32 answer (the fp32 masters,
    finer than bf16), and the engine's weights-only load puts them, cast to bf16, in the module."""
    import torch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from app.checkpoint import deepspeed, formats, names
    save = dp2[0]["bf16_save"]
    reference = get_fp32_state_dict_from_zero_checkpoint(save, tag=names.iteration_tag(ITERS))
    converted = formats.read(formats.detect(save, ITERS)).weights
    engine_read = deepspeed.read_rank(os.path.join(save, names.iteration_tag(ITERS)), 0).weights
    assert set(converted) == set(engine_read) == set(reference)
    for name, want in reference.items():
        assert want.dtype == torch.float32 and torch.equal(converted[name], want), name
        assert torch.equal(engine_read[name], want), name
    assert any(not torch.equal(w.bfloat16().float(), w) for w in reference.values())
    for rank in dp2:
        moved, loaded = rank["bf16_reload"]["moved"], rank["bf16_reload"]["loaded"]
        assert any(not torch.equal(moved[n], reference[n].bfloat16()) for n in reference)
        for name, want in reference.items():
            assert loaded[name].dtype == torch.bfloat16, name
            assert torch.equal(loaded[name], want.bfloat16()), name


def test_zero3_builds_and_trains_the_llama_block_like_native(dp2):
    """SwiGLU (gate and up shards), RMSNorm, no biases, qk-layernorm, RoPE, GQA, untied."""
    assert all(rank["llama_init_equal"] for rank in dp2)
    _close(dp2[0]["llama_zero3"], dp2[0]["llama_native"], 1e-5)


def test_zero3_state_bytes_equal_the_estimate(dp2):
    for rank in dp2:
        held = rank["bytes"]
        assert held["host"] == 0
        assert (held["params"], held["grads"], held["optimizer"]) == rank["estimate"], rank


def _tp2_dp2(tmpdir):
    tp2 = ARGV + ["--tensor-model-parallel-size", "2"]
    dropout = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
    zero3 = _config(tmpdir, "z3")
    return {"native": _curve(tp2), "zero3": _curve(tp2 + zero3),
            "dropout": _curve(tp2 + zero3 + dropout),
            "recompute": _curve(tp2 + zero3 + dropout + [
                "--recompute-granularity", "full", "--deepspeed-activation-checkpointing"])}


def test_zero3_tp2_dp2_matches_native_and_deepspeed_recompute(tmp_path):
    rank = run_distributed(_tp2_dp2, 4, str(tmp_path), timeout=900)[0]
    worst = _close(rank["zero3"], rank["native"], 1e-5)
    print(f"parity ZeRO-3 TP=2 x DP=2 vs native TP=2 x DP=2 over {ITERS} iterations: {worst:.2e}")
    _close(rank["recompute"], rank["dropout"], 1e-5)
