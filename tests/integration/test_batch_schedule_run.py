"""Batch-size schedules in real runs (native path, one process): Megatron's per-iteration global
batch, micro-batch count, consumed samples and sample-based LR schedule, checked against values
computed by hand here; a run resumed in the middle of the ramp is bit-identical."""
import math

import pretrain_gpt2
from tests.harness.corpus import read_metrics, tiny_gpt_args

LR, MIN_LR, WARMUP, DECAY = 1e-3, 1e-4, 16, 100
RAMP = ["--rampup-batch-size", "4", "4", "40",
        "--train-samples", "100", "--lr-warmup-samples", str(WARMUP), "--log-interval", "1",
        "--eval-interval", "5", "--eval-iters", "1", "--hidden-dropout", "0.1",
        "--attention-dropout", "0.1"]
# Megatron's classic ramp 4 -> 16 by 4 over 40 samples: 40 / 3 samples per increment, and the
# batch of an iteration is the one of the samples consumed before it
CONSUMED_BEFORE = [0, 4, 8, 12, 16, 24, 32, 44, 60, 76]
BATCHES = [4, 4, 4, 4, 8, 8, 12, 16, 16, 16]
# --train-samples 100: the ramp's 7 iterations reach 44 samples, then (100 - 44) // 16 = 3 more


def lr_at(samples):
    """Megatron's linear warmup + cosine decay, counted in samples (written out here)."""
    if samples <= WARMUP:
        return LR * samples / WARMUP
    ratio = (samples - WARMUP) / (DECAY - WARMUP)
    return MIN_LR + (LR - MIN_LR) * 0.5 * (math.cos(math.pi * ratio) + 1)


def train_rows(path):
    return {r["iteration"]: r for r in read_metrics(path) if r["kind"] == "train"}


def test_rampup_batches_lr_and_a_resume_in_the_middle_of_the_ramp(tiny_corpus, tmp_path,
                                                                   caplog):
    args = lambda *extra: _without(tiny_gpt_args(  # noqa: E731
        tiny_corpus, tmp_path, *RAMP, *extra, "--global-batch-size", "16"), "--lr-warmup-iters")
    with caplog.at_level("INFO"):
        trainer = pretrain_gpt2.run(args("--metrics-file", str(tmp_path / "straight.jsonl")))
    assert trainer.state.iteration == 10 and trainer.state.consumed_train_samples == 92
    straight = train_rows(tmp_path / "straight.jsonl")
    assert [straight[i]["global_batch_size"] for i in range(1, 11)] == BATCHES
    assert [straight[i]["consumed_samples"] for i in range(1, 11)] == CONSUMED_BEFORE[1:] + [92]
    for i in range(1, 11):
        assert math.isclose(straight[i]["lr"], lr_at(CONSUMED_BEFORE[i - 1]), rel_tol=1e-12)
    # micro-batches of 2 samples on one data-parallel rank: batch / 2
    for before, after, at in ((4, 8, 16), (8, 12, 32), (12, 16, 44)):
        assert (f"batch size {before} -> {after} at consumed samples {at} ({after // 2} "
                "micro-batches of 2 per data-parallel rank)") in caplog.text

    ck = str(tmp_path / "ck")
    pretrain_gpt2.run(args("--save", ck, "--exit-interval", "5",
                           "--metrics-file", str(tmp_path / "first.jsonl")))
    trainer = pretrain_gpt2.run(args("--load", ck, "--metrics-file",
                                     str(tmp_path / "second.jsonl")))
    assert trainer.state.consumed_train_samples == 92
    resumed = {**train_rows(tmp_path / "first.jsonl"), **train_rows(tmp_path / "second.jsonl")}
    for i in range(1, 11):
        for key in ("lm_loss", "grad_norm", "lr", "global_batch_size", "consumed_samples"):
            assert resumed[i][key] == straight[i][key], (i, key)


def test_step_schedule_in_tokens(tiny_corpus, tmp_path):
    """'0:4 512:8 1K:16' at --seq-length 32: batch 8 from 512 // 32 = 16 samples, 16 from
    1000 // 32 = 31 samples; the LR counts samples, warmup and decay iterations x 16."""
    trainer = pretrain_gpt2.run(_without(tiny_gpt_args(
        tiny_corpus, tmp_path, "--step-batch-size-schedule", "0:4 512:8 1K:16",
        "--train-iters", "7", "--log-interval", "1", "--eval-iters", "0",
        "--metrics-file", str(tmp_path / "m.jsonl")), "--global-batch-size"))
    rows = train_rows(tmp_path / "m.jsonl")
    assert [rows[i]["global_batch_size"] for i in range(1, 8)] == [4, 4, 4, 4, 8, 8, 16]
    assert trainer.state.consumed_train_samples == 48
    warmup = 2 * 16  # --lr-warmup-iters 2 x the schedule's global batch
    assert math.isclose(rows[5]["lr"], 1e-3 * 16 / warmup, rel_tol=1e-12)


def _without(argv, flag):
    """`argv` without the first `flag` and its value (tiny_gpt_args sets a few)."""
    i = argv.index(flag)
    return argv[:i] + argv[i + 2:]
