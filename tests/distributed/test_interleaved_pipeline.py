"""Interleaved 1F1B on 4 gloo ranks (one spawn): the tiny GPT-2 trained 5 iterations with two
model chunks per stage gives the single-process losses and grad norms at PP2 x DP2 (M = 4, the
steady 1F1B phase) and PP4 (M = 4, all warm-up; M = 8), evaluation too; a checkpoint saved
interleaved converts to one file and loads into a plain PP2 run by global names and back, and asking for its optimizer
states across the two layouts fails with a message naming the fix."""
from __future__ import annotations

import os

import torch

from tests.harness.distributed import (assert_checks_passed, expect_close, run_checks,
                                       run_distributed)

ARGV = ["--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--max-position-embeddings", "16", "--micro-batch-size", "2", "--train-iters", "5",
        "--lr", "1e-2", "--min-lr", "1e-3", "--lr-warmup-iters", "1", "--lr-decay-style", "cosine",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--distributed-backend", "gloo",
        "--make-vocab-size-divisible-by", "8"]
VOCAB, SAMPLES, ITERS = 64, 256, 5
WORD_EMBEDDINGS = "language_model.embedding.word_embeddings.weight"
CASES = {  # name: (flags shared with the reference, parallel flags)
    "PP2xDP2 V2 M4": (["--num-layers", "4", "--global-batch-size", "16"],
                      ["--pipeline-model-parallel-size", "2",
                       "--num-layers-per-virtual-pipeline-stage", "1"]),
    "PP4 V2 M4": (["--num-layers", "8", "--global-batch-size", "8"],
                  ["--pipeline-model-parallel-size", "4",
                   "--num-layers-per-virtual-pipeline-stage", "1"]),
    "PP4 V2 M8": (["--num-layers", "8", "--global-batch-size", "16"],
                  ["--pipeline-model-parallel-size", "4",
                   "--num-layers-per-virtual-pipeline-stage", "1"]),
}


def _build(flags, world):
    import arguments
    from tests.harness.synthetic import build_synthetic_run
    return build_synthetic_run(arguments.config_from_argv(ARGV + flags, world, VOCAB), SAMPLES)


def _train(run):
    """Losses and grad norms of ITERS iterations, then the loss of one evaluation iteration."""
    trainer, curve = run["trainer"], []
    for _ in range(ITERS):
        step = trainer.train_step(run["iterator"])
        curve.append((step.loss, step.grad_norm))
    return curve, trainer.evaluate(run["iterator"], 1)


def reference():
    """Every case in one process: curves, evaluation losses, and the weights after training."""
    out = {}
    for name, (shared, _) in CASES.items():
        run = _build(shared, 1)
        curve, evaluation = _train(run)
        weights = {k: v.numpy().copy() for k, v in run["model"].state_dict().items()}
        out[name] = (curve, evaluation, weights)  # numpy: tensors would travel as file handles
    return out


def _compare(run, expected, what):
    curve, evaluation = _train(run)
    want_curve, want_eval, _ = expected
    if run["ps"].rank != run["ps"].world_size - 1:
        return
    for i, ((loss, norm), (want_loss, want_norm)) in enumerate(zip(curve, want_curve)):
        expect_close(loss, want_loss, f"{what} loss at iteration {i}")
        expect_close(norm, want_norm, f"{what} grad norm at iteration {i}")
    expect_close(evaluation, want_eval, f"{what} evaluation loss")


def _rank_main(refs, tmpdir):
    import torch.distributed as dist

    from app.checkpoint.legacy import per_rank as ckpt
    world = dist.get_world_size()
    runs = {}

    def parity(name):
        def check():
            shared, parallel = CASES[name]
            runs[name] = _build(shared + parallel, world)
            _compare(runs[name], refs[name], name)
        return check

    def interleaved_checkpoint_loads_plain_and_back():
        name = "PP2xDP2 V2 M4"
        shared, parallel = CASES[name]
        saver = runs[name]
        first = os.path.join(tmpdir, "interleaved")
        position = dict(iteration=ITERS, consumed_train_samples=16 * ITERS,
                        consumed_valid_samples=0)
        saver["engine"].save_checkpoint(first, ITERS, position)
        weights = refs[name][2]
        if dist.get_rank() == 0:  # the converter finds each layer in whichever stage's file
            from tools.convert_checkpoint import main as convert
            single = os.path.join(tmpdir, "single")
            assert convert(["--input-format", "megatron", "--load", first, "--save", single,
                            "--iteration", str(ITERS)]) == 0
            state, _ = ckpt.load_checkpoint_dict(single, iteration=ITERS)
            converted = ckpt.from_megatron_model(state["model"])
            assert sorted(converted) == sorted(weights)
            for key, value in converted.items():
                expect_close(value, torch.from_numpy(weights[key]), f"converted {key}",
                             atol=1e-5, rtol=1e-4)
        plain_flags = shared + ["--pipeline-model-parallel-size", "2"]
        plain = _build(plain_flags + ["--load", first, "--no-load-optim"], world)
        assert plain["engine"].load_checkpoint(first).iteration == ITERS
        for key, value in plain["model"].state_dict().items():
            full_name = WORD_EMBEDDINGS if key == "word_embeddings.weight" else key  # tied copy
            expect_close(value, torch.from_numpy(weights[full_name]), f"plain PP2 {key} vs one process",
                         atol=1e-5,
                         rtol=1e-4)
        second = os.path.join(tmpdir, "plain")
        plain["engine"].save_checkpoint(second, ITERS, position)
        again = _build(shared + parallel + ["--load", second, "--no-load-optim"], world)
        again["engine"].load_checkpoint(second)
        saved = saver["model"].state_dict()
        for key, value in again["model"].state_dict().items():
            expect_close(value, saved[key], f"interleaved {key} after the round trip", atol=0,
                         rtol=0)
        refused = _build(shared + parallel + ["--load", second], world)
        try:
            refused["engine"].load_checkpoint(second)
        except ckpt.CheckpointError as exc:
            message = str(exc)
        else:
            message = "loaded"
        assert "--num-layers-per-virtual-pipeline-stage" in message, message
        assert "--no-load-optim" in message and "1 model chunks" in message, message

    checks = {f"parity {name}": parity(name) for name in CASES}
    checks["interleaved checkpoint <-> plain"] = interleaved_checkpoint_loads_plain_and_back
    return run_checks(checks)


def test_interleaved_pipeline_matches_one_process_and_checkpoints_by_name(tmp_path):
    refs = reference()
    outcomes = run_distributed(_rank_main, 4, refs, str(tmp_path), timeout=300)
    assert_checks_passed(outcomes)
