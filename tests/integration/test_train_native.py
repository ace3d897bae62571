"""End-to-end runs of pretrain_gpt2 on the native path (one process, CPU, fp32)."""
import os
import subprocess
import sys

import pytest

from tests.integration.conftest import read_metrics, tiny_gpt_args

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(argv):
    from app.training.pretrain import pretrain
    return pretrain(argv)


def _train_losses(metrics_file):
    rows = [r for r in read_metrics(metrics_file) if r["kind"] == "train"]
    return {r["iteration"]: (r["lm_loss"], r["grad_norm"]) for r in rows}


def test_resume_is_bit_identical_with_dropout(tiny_corpus, tmp_path):
    """8 iterations straight == 4 iterations, exit with a checkpoint, resume for 4 more."""
    common = ["--train-iters", "8", "--log-interval", "1", "--eval-interval", "100",
              "--eval-iters", "1", "--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
    straight = tmp_path / "straight.jsonl"
    _run(tiny_gpt_args(tiny_corpus, tmp_path, *common, "--metrics-file", str(straight)))
    ck = tmp_path / "ck"
    first = tmp_path / "first.jsonl"
    _run(tiny_gpt_args(tiny_corpus, tmp_path, *common, "--save", str(ck), "--save-interval", "100",
                       "--exit-interval", "4", "--metrics-file", str(first)))
    assert (ck / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    second = tmp_path / "second.jsonl"
    trainer = _run(tiny_gpt_args(tiny_corpus, tmp_path, *common, "--load", str(ck),
                                 "--save", str(ck), "--metrics-file", str(second)))
    assert trainer.state.iteration == 8 and trainer.state.consumed_train_samples == 32
    want = _train_losses(straight)
    got = {**_train_losses(first), **_train_losses(second)}
    assert sorted(got) == list(range(1, 9))
    for it in range(1, 9):
        assert got[it] == want[it], f"iteration {it}: resumed {got[it]} != straight {want[it]}"


def test_loss_falls_and_logs_are_written(tiny_corpus, tmp_path):
    """Validation loss falls below ln(vocab); metrics JSONL and TensorBoard events are written."""
    import math
    metrics = tmp_path / "m.jsonl"
    tb = tmp_path / "tb"
    trainer = _run(tiny_gpt_args(tiny_corpus, tmp_path, "--train-iters", "150", "--log-interval", "50",
                                 "--eval-interval", "75", "--eval-iters", "2", "--lr", "3e-3",
                                 "--hidden-dropout", "0", "--attention-dropout", "0",
                                 "--metrics-file", str(metrics), "--tensorboard-dir", str(tb)))
    rows = read_metrics(metrics)
    valid = [r for r in rows if r["kind"] == "valid"]
    assert [r["iteration"] for r in valid] == [75, 150]
    assert any(r["kind"] == "test" for r in rows)
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["iteration"] for r in train] == [50, 100, 150]
    for key in ("lr", "lm_loss", "grad_norm", "tokens_per_s", "tflops_per_rank", "mfu",
                "ms_per_iteration", "consumed_samples", "skipped_iterations"):
        assert key in train[-1], key
    assert valid[-1]["lm_loss"] < math.log(tiny_corpus["vocab_size"]) - 0.75
    assert train[-1]["lm_loss"] < train[0]["lm_loss"]
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(tb))
    assert trainer.state.consumed_train_samples == 600


def _cli(argv, tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_gpt2.py"), *argv],
                          capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)


def test_cli_errors_exit_nonzero_with_clear_messages(tiny_corpus, tmp_path):
    """Config errors, a shape mismatch against a checkpoint and a damaged tracker exit 2."""
    base = ["--train-iters", "2", "--log-interval", "1", "--eval-iters", "0"]
    bad = _cli(tiny_gpt_args(tiny_corpus, tmp_path, *base, "--global-batch-size", "3"), tmp_path)
    assert bad.returncode == 2, bad.stderr
    assert "global" in bad.stderr and "3" in bad.stderr and "Traceback" not in bad.stderr

    ck = tmp_path / "ck"
    ok = _cli(tiny_gpt_args(tiny_corpus, tmp_path, *base, "--save", str(ck)), tmp_path)
    assert ok.returncode == 0, ok.stderr
    wide = tiny_gpt_args(tiny_corpus, tmp_path, *base, "--load", str(ck))
    wide[wide.index("--hidden-size") + 1] = "128"
    mismatch = _cli(wide, tmp_path)
    assert mismatch.returncode == 2 and "hidden_size" in mismatch.stderr, mismatch.stderr

    (ck / "latest_checkpointed_iteration.txt").write_text("abc")
    garbled = _cli(tiny_gpt_args(tiny_corpus, tmp_path, *base, "--load", str(ck)), tmp_path)
    assert garbled.returncode == 2 and "latest_checkpointed_iteration.txt" in garbled.stderr

    empty = tmp_path / "empty"
    empty.mkdir()
    fresh = _cli(tiny_gpt_args(tiny_corpus, tmp_path, *base, "--load", str(empty)), tmp_path)
    assert fresh.returncode == 0 and "starting from iteration 0" in fresh.stdout


def test_finetune_loads_weights_and_restarts_iteration(tiny_corpus, tmp_path):
    """--finetune takes the weights but starts at iteration 0 with fresh consumed samples."""
    import torch
    ck = tmp_path / "ck"
    base = ["--log-interval", "1", "--eval-iters", "0"]
    first = _run(tiny_gpt_args(tiny_corpus, tmp_path, "--train-iters", "3", *base, "--save", str(ck)))
    saved = {k: v.clone() for k, v in first.engine.module.state_dict().items()}
    tuned = _run(tiny_gpt_args(tiny_corpus, tmp_path, "--train-iters", "1", *base, "--load", str(ck),
                               "--finetune", "--lr", "0", "--min-lr", "0",
                               "--lr-warmup-iters", "0"))
    assert tuned.state.iteration == 1 and tuned.state.consumed_train_samples == 4
    for k, v in tuned.engine.module.state_dict().items():
        assert torch.equal(v, saved[k]), k  # lr 0: weights are exactly the loaded ones
