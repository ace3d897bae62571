"""--use-distributed-optimizer against native AdamW (fp32, dropout 0), two spawns:

- DP2 (2 ranks): 6 iterations with overlapped reduce-scatter and weight all-gather over small
  buckets give the native losses and grad norms; optimizer-state bytes are exactly half; a
  checkpoint saved at iteration 3 resumes bit-exactly, and also loads into the plain optimizer;
  then, in this process, the same checkpoint resumes at DP1 and continues the DP2 run.
- TP2 x DP2 and PP2 x DP2 (4 ranks): 5 iterations equal native AdamW; the tied embeddings of
  the first and last stage (reduced after their cross-stage sum) stay identical.
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
        "--make-vocab-size-divisible-by", "8"]
DISTRIBUTED = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
               "--ddp-bucket-size", "1"]  # one bucket per parameter: every wait is exercised
ITERS, SAVED_AT = 6, 3
TIGHT = dict(rtol=1e-6, atol=0.0)


def _build(flags, world):
    import arguments
    from tests.harness.synthetic import build_synthetic_run
    return build_synthetic_run(arguments.config_from_argv(ARGV + flags, world, 64), 256)


def _resume(flags, world, load_dir):
    """A run loaded from `load_dir`, with its data iterator at the saved position."""
    from app.training.data_loading import build_data_iterator
    run = _build(flags + ["--load", load_dir], world)
    loaded = run["engine"].load_checkpoint(load_dir)
    assert loaded.iteration == SAVED_AT, loaded
    iterator = build_data_iterator(run["trainer"].train_ds, loaded.consumed_train_samples, 2,
                                   run["ps"], 0)
    return run, iterator


def _compare(got, want, what, **tolerance):
    for i, ((loss, norm), (want_loss, want_norm)) in enumerate(zip(got, want)):
        if want_loss is not None:
            expect_close(loss, want_loss, f"{what}: loss at iteration {i + 1}", **tolerance)
        expect_close(norm, want_norm, f"{what}: grad norm at iteration {i + 1}", **tolerance)


def _dp2_main(save_dir):
    import torch.distributed as dist
    world, curves = dist.get_world_size(), {}

    def matches_native_and_halves_optimizer_state():
        native = _build([], world)
        curves["native"] = _train(native, ITERS)
        dist_run = _build(DISTRIBUTED, world)
        curves["distributed"] = _train(dist_run, SAVED_AT)
        dist_run["engine"].save_checkpoint(save_dir, SAVED_AT, dict(
            iteration=SAVED_AT, consumed_train_samples=8 * SAVED_AT, consumed_valid_samples=0))
        curves["distributed"] += _train(dist_run, ITERS - SAVED_AT)
        _compare(curves["distributed"], curves["native"], "distributed vs native", **TIGHT)
        plain, sharded = native["engine"].state_bytes(), dist_run["engine"].state_bytes()
        assert sharded["optimizer"] * 2 == plain["optimizer"], (sharded, plain)
        assert sharded["params"] == plain["params"], (sharded, plain)

    def resumes_bit_exactly():
        run, iterator = _resume(DISTRIBUTED, world, save_dir)
        _compare(_train(run, ITERS - SAVED_AT, iterator), curves["distributed"][SAVED_AT:],
                 "resumed distributed", rtol=0.0, atol=0.0)

    def loads_into_the_plain_optimizer():
        run, iterator = _resume([], world, save_dir)
        _compare(_train(run, ITERS - SAVED_AT, iterator), curves["distributed"][SAVED_AT:],
                 "plain AdamW from a distributed checkpoint", **TIGHT)

    outcome = run_checks({"DP2 == native, optimizer bytes / 2":
                          matches_native_and_halves_optimizer_state,
                          "DP2 resume is bit-exact": resumes_bit_exactly,
                          "plain optimizer loads it": loads_into_the_plain_optimizer})
    return outcome, curves.get("distributed")


def _layouts_main():
    import torch.distributed as dist

    from app.mpu import collectives
    world = dist.get_world_size()

    def layout(flags):
        def check():
            want = _train(_build(flags, world), 5)
            run = _build(flags + DISTRIBUTED, world)
            _compare(_train(run, 5), want, " ".join(flags), **TIGHT)
            ps = run["ps"]
            if ps.pipeline_model_parallel_size > 1 and (ps.is_pipeline_first_stage()
                                                        or ps.is_pipeline_last_stage()):
                weights = run["model"].state_dict()  # waits for in-flight weight all-gathers
                tied = weights.get("word_embeddings.weight",
                                   weights.get("language_model.embedding.word_embeddings.weight"))
                first = collectives.broadcast(tied.clone(), ps.pipeline_ranks[0],
                                              ps.embedding_group)
                expect_close(tied, first, "tied embeddings of the first and last stage",
                             rtol=0.0, atol=0.0)
        return check

    return run_checks({"TP2xDP2": layout(["--tensor-model-parallel-size", "2"]),
                       "PP2xDP2": layout(["--pipeline-model-parallel-size", "2"])})


def test_distributed_optimizer_dp2_matches_native_and_resumes_at_dp1(tmp_path):
    save_dir = str(tmp_path / "ck")
    results = run_distributed(_dp2_main, 2, save_dir, timeout=300)
    assert_checks_passed([outcome for outcome, _ in results])
    dp2 = results[-1][1]
    import torch
    torch.manual_seed(0)
    run, iterator = _resume(DISTRIBUTED, 1, save_dir)  # DP1 in this process, same global batch
    got = _train(run, ITERS - SAVED_AT, iterator)
    for (loss, norm), (want_loss, want_norm) in zip(got, dp2[SAVED_AT:]):
        torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=0.0)
        torch.testing.assert_close(norm, want_norm, rtol=1e-5, atol=0.0)


def test_distributed_optimizer_tp2_and_pp2_with_dp2_match_native():
    assert_checks_passed(run_distributed(_layouts_main, 4, timeout=300))
