"""Pipeline parallelism under DeepSpeed on 4 gloo ranks (one spawn), PP2 x DP2 with ZeRO-1 and
DeepSpeed's activation checkpointing (partitioned activations), as the seed script runs it: the
tiny GPT-2 trained 6 iterations gives the native PP2 x DP2 losses and grad norms; a run saved
at iteration 3 through DeepSpeed's checkpoints and resumed gives iterations 4-6 of the straight
run exactly (loss and grad norm), converts to Megatron's per-stage files, and is refused by a
TP2 run (as many files); the tied embeddings stay equal on the two stages; ZeRO-2 is refused.
At TP2 x PP2, sequence parallelism, RoPE, GQA and an untied output layer in Llama's block (SwiGLU,
RMSNorm, no biases, qk-layernorm) equal the native run."""
from __future__ import annotations

import os

from tests.harness.distributed import (assert_checks_passed, expect_close, run_checks,
                                       run_distributed)
from tests.harness.synthetic import train_steps as _train

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ZERO1 = os.path.join(ROOT, "ds_configs", "zero1.json")
ZERO2 = os.path.join(ROOT, "ds_configs", "zero2.json")
ARGV = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
        "--global-batch-size", "16", "--train-iters", "6", "--lr", "1e-2", "--min-lr", "1e-3",
        "--lr-warmup-iters", "2", "--lr-decay-style", "cosine", "--hidden-dropout", "0",
        "--attention-dropout", "0", "--distributed-backend", "gloo",
        "--make-vocab-size-divisible-by", "8", "--pipeline-model-parallel-size", "2"]
DS = ["--deepspeed", "--deepspeed_config", ZERO1, "--checkpoint-activations",
      "--deepspeed-activation-checkpointing"]  # as the seed script; partitioned activations
ITERS = 6


def _build(flags):
    import torch.distributed as dist

    import arguments
    from app.mpu import random as mpu_random
    from tests.harness.synthetic import build_synthetic_run
    mpu_random.set_checkpoint_implementation(None)
    cfg = arguments.config_from_argv(ARGV + flags, dist.get_world_size(), 64)
    return build_synthetic_run(cfg, 256)


def _rank_main(tmpdir):
    import torch.distributed as dist

    from app.mpu import collectives
    from app.checkpoint.legacy import per_rank as ckpt
    from app.training.data_loading import build_data_iterator
    last = dist.get_rank() == dist.get_world_size() - 1
    curves = {}

    def deepspeed_pp2_matches_native_pp2():
        curves["native"] = _train(_build([]), ITERS)
        straight = _build(DS)  # saves at iteration 3 on its way (the resume check's start)
        curves["deepspeed"] = _train(straight, 3)
        straight["engine"].save_checkpoint(tmpdir, 3, dict(iteration=3, consumed_train_samples=48,
                                                           consumed_valid_samples=0))
        curves["deepspeed"] += _train(straight, ITERS - 3)
        for i, ((loss, norm), (want_loss, want_norm)) in enumerate(zip(curves["deepspeed"],
                                                                       curves["native"])):
            if last:
                expect_close(loss, want_loss, f"loss at iteration {i + 1}", rtol=1e-6, atol=0)
            expect_close(norm, want_norm, f"grad norm at iteration {i + 1}", rtol=1e-6, atol=0)
        ps, model = straight["ps"], straight["engine"].ds.module
        if ps.is_pipeline_first_stage() or ps.is_pipeline_last_stage():  # tied copies agree
            tied = model.word_embeddings_weight().detach().clone()
            first = collectives.broadcast(tied.clone(), ps.pipeline_ranks[0], ps.embedding_group)
            expect_close(tied, first, "word embeddings of the first and last stage", atol=0,
                         rtol=0)

    def model_options_match_native():
        """TP2 x PP2 (ZeRO-1 over DP 1): sequence-parallel slices between the stages, RoPE,
        GQA and an untied output layer (no embedding-group sum), in Llama's block (SwiGLU,
        RMSNorm, no biases, qk-layernorm), train like the native path."""
        options = ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                   "--position-embedding-type", "rope", "--group-query-attention",
                   "--num-query-groups", "2", "--untie-embeddings-and-output-weights",
                   "--swiglu", "--normalization", "RMSNorm", "--disable-bias-linear",
                   "--qk-layernorm"]
        native = _train(_build(options), 3)
        for i, (got, want) in enumerate(zip(_train(_build(DS + options), 3), native)):
            if last:
                expect_close(got[0], want[0], f"loss at iteration {i + 1}", rtol=1e-6, atol=0)
            expect_close(got[1], want[1], f"grad norm at iteration {i + 1}", rtol=1e-6, atol=0)

    def resume_is_exact():
        resumed = _build(DS + ["--load", tmpdir])
        loaded = resumed["engine"].load_checkpoint(tmpdir)
        assert loaded.iteration == 3 and loaded.consumed_train_samples == 48, loaded
        ps = resumed["ps"]
        megatron = tmpdir + "_megatron"  # the converter maps DeepSpeed's TP x PP file numbers
        if dist.get_rank() == 0:
            from tools.convert_checkpoint import main as convert
            assert convert(["--input-format", "deepspeed", "--load", tmpdir, "--save", megatron,
                            "--iteration", "3", "--target-pipeline-model-parallel-size", "2",
                            "--include-optimizer"]) == 0
        dist.barrier()
        state, _ = ckpt.load_checkpoint_dict(megatron, tp_rank=0, pp_size=2, iteration=3,
                                             pp_rank=ps.pipeline_model_parallel_rank)
        converted = ckpt.from_megatron_model(state["model"])
        weights = resumed["engine"].ds.module.state_dict()
        assert sorted(converted) == sorted(weights)
        for name, value in weights.items():
            expect_close(converted[name], value, f"converted {name}", rtol=0, atol=0)
        iterator = build_data_iterator(resumed["trainer"].train_ds, loaded.consumed_train_samples,
                                       2, ps, 0)
        again = _train(resumed, ITERS - 3, iterator)
        for i, (got, want) in enumerate(zip(again, curves["deepspeed"][3:])):
            if last:
                expect_close(got[0], want[0], f"resumed loss at iteration {i + 4}", rtol=0, atol=0)
            expect_close(got[1], want[1], f"resumed grad norm at iteration {i + 4}", rtol=0,
                         atol=0)

    def another_split_is_refused():
        """mp_rank_00/01 are TP x PP ranks: a TP2 run must not take stage files for TP shards."""
        wrong = _build(DS + ["--load", tmpdir, "--tensor-model-parallel-size", "2",
                             "--pipeline-model-parallel-size", "1"])
        try:
            wrong["engine"].load_checkpoint(tmpdir)
        except ckpt.CheckpointError as exc:
            message = str(exc)
        else:
            message = "loaded"
        assert "pipeline_model_parallel_size 2 but this run uses 1" in message or (
            "tensor_model_parallel_size 1 but this run uses 2" in message), message

    def zero2_is_refused():
        import arguments
        try:
            arguments.config_from_argv(ARGV + ["--deepspeed", "--deepspeed_config", ZERO2],
                                       dist.get_world_size(), 64)
        except ValueError as exc:
            message = str(exc)
        else:
            message = "accepted"
        for fragment in ("zero_optimization.stage 2", "--pipeline-model-parallel-size (2)",
                         "ZeRO stage 1", "zero1.json"):
            assert fragment in message, message

    return run_checks({"DeepSpeed PP2xDP2 == native PP2xDP2": deepspeed_pp2_matches_native_pp2,
                       "DeepSpeed PP2xDP2 resume is exact": resume_is_exact,
                       "DeepSpeed TP2xPP2 with SP, RoPE, GQA, untied, Llama block == native":
                           model_options_match_native,
                       "TP2 cannot load the PP2 files": another_split_is_refused,
                       "ZeRO-2 with PP is refused": zero2_is_refused})


def test_deepspeed_pipeline_matches_native_and_resumes_exactly(tmp_path):
    outcomes = run_distributed(_rank_main, 4, str(tmp_path / "ck"), timeout=400)
    assert_checks_passed(outcomes)
