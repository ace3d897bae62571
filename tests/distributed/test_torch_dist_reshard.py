"""--ckpt-format torch_dist saved at one TP x PP x DP resumes at others and continues the
uninterrupted run (one 4-rank spawn, then this process as the one-rank layout):

- fp32 AdamW, distributed optimizer, TP2 x DP2, saved in the background (--async-save) at
  iteration 3 of 6: resumed at PP2 x DP2 (plain optimizer), TP2 x PP2 (distributed) and DP4,
  and here at TP1 PP1 DP1, the losses of iterations 4-6 equal the uninterrupted run's within
  1e-5; the data position is the saved one. PyTorch's own DCP reader gives the weights and Adam
  moments of a dense one-process run of the same 3 iterations (Megatron Core keys, layers
  stacked), within 1e-5.
- fp16 with its dynamic loss scale, distributed optimizer, PP2 x DP2: at the same layout the
  resume is bit-exact, at TP2 x DP2 (plain) it carries the loss scale and tracks within the
  fp16 layout tolerance of tests/distributed/test_precision_layouts.py (1e-4 relative).
- bf16 Muon, plain, TP2 x DP2 -> PP2 x DP2 with the distributed optimizer: within bf16's
  layout tolerance (1e-3 relative).
- the Llama block (SwiGLU, whose fc1 each TP rank holds as [gate_r; up_r], RMSNorm, no biases,
  QK-norm, RoPE, 2 query groups, untied), fp32, distributed optimizer, TP2 x DP2 -> PP2 x DP2:
  within 1e-5.
- Mixture of Experts (the Llama block with 4 experts, top-2, in layers 1-3 after a dense layer 0:
  Megatron's per-layer keys; a gated shared expert; sigmoid routing with the expert bias, a
  buffer the checkpoint carries), fp32, plain optimizer, EP2 x DP4 (experts replicated over two
  expert-DP ranks, which share their writing): resumed at EP1 (DP4) and at EP2 x TP2 with
  sequence parallelism (each expert's FFN split over the two expert-tensor ranks), within 1e-5.
"""
import torch

from tests.harness.distributed import (assert_checks_passed, expect_close, run_checks,
                                     run_distributed)
from tests.harness.checkpoints import LAYER, OTHER

ARGV = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
        "--global-batch-size", "8", "--train-iters", "6", "--lr", "1e-2", "--min-lr", "1e-3",
        "--lr-warmup-iters", "2", "--lr-decay-style", "cosine", "--hidden-dropout", "0",
        "--attention-dropout", "0", "--distributed-backend", "gloo",
        "--make-vocab-size-divisible-by", "16", "--ckpt-format", "torch_dist"]
TP2, PP2 = ["--tensor-model-parallel-size", "2"], ["--pipeline-model-parallel-size", "2"]
DIST = ["--use-distributed-optimizer"]
LLAMA = ["--swiglu", "--normalization", "RMSNorm", "--disable-bias-linear", "--qk-layernorm",
         "--position-embedding-type", "rope", "--group-query-attention", "--num-query-groups", "2",
         "--untie-embeddings-and-output-weights"]
FP16 = ["--fp16", "--initial-loss-scale", "4096"]
MOE = LLAMA + ["--ffn-hidden-size", "64", "--num-experts", "4", "--moe-ffn-hidden-size", "16",
               "--moe-router-topk", "2", "--moe-aux-loss-coeff", "1e-2", "--moe-layer-freq",
               "([0]+[1]*3)", "--moe-shared-expert-intermediate-size", "16",
               "--moe-shared-expert-gate", "--moe-router-score-function", "sigmoid",
               "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "0.05"]
EP2 = ["--expert-model-parallel-size", "2"]
SAVED_AT, ITERS = 3, 6
CASES = {  # name: (saving flags, background save, {resume name: (flags, relative tolerance)})
    "fp32": (TP2 + DIST, True, {"PP2xDP2": (PP2, 1e-5), "TP2xPP2 dist": (TP2 + PP2 + DIST, 1e-5),
                                "DP4": ([], 1e-5)}),
    "fp16": (PP2 + DIST + FP16, False, {"PP2xDP2 dist": (PP2 + DIST + FP16, 0.0),
                                        "TP2xDP2": (TP2 + FP16, 1e-4)}),
    "bf16 muon": (TP2 + ["--bf16", "--optimizer", "muon"], False,
                  {"PP2xDP2 dist": (PP2 + DIST + ["--bf16", "--optimizer", "muon"], 1e-3)}),
    "llama": (TP2 + DIST + LLAMA, False, {"PP2xDP2 dist": (PP2 + DIST + LLAMA, 1e-5)}),
    "moe": (EP2 + MOE, False, {"EP1": (MOE, 1e-5),
                               "EP2xTP2": (EP2 + TP2 + ["--sequence-parallel"] + MOE, 1e-5)}),
}


def _build(flags, world):
    import arguments
    from tests.harness.synthetic import build_synthetic_run
    return build_synthetic_run(arguments.config_from_argv(ARGV + flags, world, 64), 256)


def _train(run, iterations, iterator=None):
    iterator = run["iterator"] if iterator is None else iterator
    return [run["trainer"].train_step(iterator).loss for _ in range(iterations)]


def _resume(flags, world, load_dir):
    """A run loaded from `load_dir` at its layout; its losses of the remaining iterations and
    its loss scale."""
    from app.training.data_loading import build_data_iterator
    run = _build(flags + ["--load", load_dir], world)
    loaded = run["engine"].load_checkpoint(load_dir)
    assert (loaded.iteration, loaded.consumed_train_samples) == (SAVED_AT, 8 * SAVED_AT), loaded
    iterator = build_data_iterator(run["trainer"].train_ds, loaded.consumed_train_samples, 2,
                                   run["ps"], 0)
    return _train(run, ITERS - SAVED_AT, iterator), run["engine"].loss_scale


def _compare(got, want, what, rtol):
    for i, (loss, ref) in enumerate(zip(got, want)):
        if loss is not None and ref is not None:  # known on the last pipeline stages
            expect_close(loss, ref, f"{what}: loss of iteration {SAVED_AT + i + 1}",
                         rtol=rtol, atol=1e-5 if rtol else 0.0)


def _main(base):
    import torch.distributed as dist
    world, uninterrupted = dist.get_world_size(), {}

    def case(name):
        save_flags, background, resumes = CASES[name]
        load_dir = f"{base}/{name.replace(' ', '_')}"

        def check():
            run = _build(save_flags, world)
            losses = _train(run, SAVED_AT)
            run["engine"].save_checkpoint(load_dir, SAVED_AT, dict(
                iteration=SAVED_AT, consumed_train_samples=8 * SAVED_AT,
                consumed_valid_samples=0), asynchronous=background)
            losses += _train(run, ITERS - SAVED_AT)  # training goes on while it is written
            run["engine"].finish_save()
            scale = run["engine"].loss_scale if name == "fp16" else None
            uninterrupted[name] = losses
            for resume, (flags, rtol) in resumes.items():
                got, got_scale = _resume(flags, world, load_dir)
                _compare(got, losses[SAVED_AT:], f"{name} resumed at {resume}", rtol)
                if scale is not None:
                    assert got_scale == scale, (resume, got_scale, scale)
        return check

    outcome = run_checks({name: case(name) for name in CASES})
    return outcome, uninterrupted


def _megatron_tensors(named):
    """Megatron Core's global tensors of a one-process model's (name, tensor) pairs: the hand
    table of tests/unit/test_checkpoint_torch_dist.py, the layers stacked."""
    out, layers = {}, {}
    for name, param in named:
        if name in OTHER:
            out[OTHER[name][0]] = param.detach()
            continue
        _, _, _, layer, suffix = name.split(".", 4)
        layers.setdefault("decoder.layers." + LAYER[suffix][0], {})[int(layer)] = param.detach()
    out.update({k: torch.stack([v[i] for i in sorted(v)]) for k, v in layers.items()})
    return out


def test_torch_dist_resumes_at_every_layout_with_its_optimizer(tmp_path):
    import torch.distributed.checkpoint as dcp
    results = run_distributed(_main, 4, str(tmp_path), timeout=600)
    assert_checks_passed([outcome for outcome, _ in results])
    losses = next(u for _, u in results if u.get("fp32") and u["fp32"][-1] is not None)["fp32"]
    load_dir = str(tmp_path / "fp32")
    got, _ = _resume([], 1, load_dir)  # the one-rank layout, in this process
    _compare(got, losses[SAVED_AT:], "fp32 resumed at TP1 PP1 DP1", 1e-5)
    dense = _build([], 1)  # the reference: a dense one-process run of the same iterations
    _train(dense, SAVED_AT)
    named = list(dense["model"].named_parameters())
    want = _megatron_tensors(named)
    state = dense["engine"].optimizer.state
    want.update({f"optimizer.state.exp_avg.{k}": v for k, v in _megatron_tensors(
        (n, state[p]["exp_avg"]) for n, p in named).items()})
    stored = {k: torch.empty_like(v) for k, v in want.items()}
    dcp.load(stored, checkpoint_id=f"{load_dir}/iter_{SAVED_AT:07d}", no_dist=True)
    for key, value in want.items():
        torch.testing.assert_close(stored[key], value, rtol=1e-5, atol=1e-5, msg=key)
