"""Conversion of a model with every layout-changing option the trainer has (RoPE, grouped-query
attention with 2 key/value groups, untied output layer; fp32, dropout 0): saved at TP2 in the
legacy format with its optimizer, converted by the converter to torch_dist and to TP1 legacy
(--include-optimizer), each resumes at TP1 and continues the straight TP2 run's losses and grad
norms (1e-5). One spawn (2 ranks) trains the straight run and saves; the resumes run here.
"""
from __future__ import annotations

from tests.harness.distributed import assert_checks_passed, run_checks, run_distributed
from tests.harness.synthetic import train_steps as _train

ARGV = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
        "--global-batch-size", "8", "--train-iters", "6", "--lr", "1e-2", "--min-lr", "1e-3",
        "--lr-warmup-iters", "2", "--lr-decay-style", "cosine", "--hidden-dropout", "0",
        "--attention-dropout", "0", "--distributed-backend", "gloo",
        "--make-vocab-size-divisible-by", "8", "--position-embedding-type", "rope",
        "--group-query-attention", "--num-query-groups", "2",
        "--untie-embeddings-and-output-weights"]
TP2 = ["--tensor-model-parallel-size", "2"]
ITERS, SAVED_AT = 6, 3
TOL = dict(rtol=1e-5, atol=1e-5)


def _build(flags, world):
    import arguments
    from tests.harness.synthetic import build_synthetic_run
    return build_synthetic_run(arguments.config_from_argv(ARGV + flags, world, 64), 256)


def _straight_tp2_run(save_dir):
    """The uninterrupted TP2 run; its legacy checkpoint (with the optimizer) at SAVED_AT."""
    import torch.distributed as dist
    curves = {}

    def train_and_save():
        run = _build(TP2, dist.get_world_size())
        curves["tp2"] = _train(run, SAVED_AT)
        run["engine"].save_checkpoint(save_dir, SAVED_AT, dict(
            iteration=SAVED_AT, consumed_train_samples=8 * SAVED_AT, consumed_valid_samples=0))
        curves["tp2"] += _train(run, ITERS - SAVED_AT)

    return run_checks({"TP2 run and save": train_and_save}), curves.get("tp2")


def test_rope_gqa_untied_tp2_converts_to_torch_dist_and_tp1_and_resumes(tmp_path):
    import torch

    from app.checkpoint.convert import ConvertOptions, convert
    from app.training.data_loading import build_data_iterator
    save_dir = str(tmp_path / "tp2")
    results = run_distributed(_straight_tp2_run, 2, save_dir, timeout=300)
    assert_checks_passed([outcome for outcome, _ in results])
    straight = results[0][1][SAVED_AT:]
    for output, name in (("torch_dist", "td"), ("torch", "tp1")):
        target = str(tmp_path / name)
        convert(ConvertOptions(load=save_dir, save=target, output_format=output,
                               include_optimizer=True))
        torch.manual_seed(0)
        run = _build(["--load", target], 1)
        loaded = run["engine"].load_checkpoint(target)
        assert loaded.iteration == SAVED_AT, (output, loaded)
        iterator = build_data_iterator(run["trainer"].train_ds, loaded.consumed_train_samples,
                                       2, run["ps"], 0)
        got = _train(run, ITERS - SAVED_AT, iterator)
        for i, ((loss, norm), (want_loss, want_norm)) in enumerate(zip(got, straight)):
            torch.testing.assert_close(loss, want_loss, **TOL, msg=f"{output}: loss {i}")
            torch.testing.assert_close(norm, want_norm, **TOL, msg=f"{output}: grad norm {i}")
