"""Batch-size schedules against values computed by hand from Megatron-LM's rules
(RampupBatchsizeNumMicroBatchesCalculator, StepBatchsizeNumMicroBatchesCalculator,
update_train_iters), their flags, and the data position across a data-parallel change in
the middle of a ramp."""
import os
from collections import Counter

import pytest

import arguments
from app.config import samples_per_split
from app.config.batch_schedule import BatchSchedule, parse_step_schedule
from app.data import MegatronPretrainingSampler
from tests.harness.arguments import BASE, expect_error

NO_ITERS = [a for i, a in enumerate(BASE) if "--train-iters" not in BASE[max(0, i - 1):i + 1]]


def build(extra):
    """The RunConfig of BASE's flags without --train-iters, plus `extra`."""
    args = arguments.parse_args(NO_ITERS + list(extra))
    return arguments.build_run_config(args, 1, 100, 128)


def test_megatrons_example_step_schedule_in_tokens():
    steps = parse_step_schedule("0:768 250B:1536 500B:3072 750B:6144", 2048)
    # 250e9 // 2048 = 122070312 (.5 dropped), 500e9 // 2048 = 244140625, 750e9 // 2048 = 366210937
    assert steps == ((0, 768), (122070312, 1536), (244140625, 3072), (366210937, 6144))
    schedule = BatchSchedule(6144, steps=steps)
    assert [schedule.batch_at(c) for c in (0, 122070311, 122070312, 366210937, 10 ** 12)] == \
        [768, 768, 1536, 6144, 6144]
    assert parse_step_schedule("1.5K:8,0:4 2k:16", 10) == ((0, 4), (150, 8), (200, 16))


@pytest.mark.parametrize("text,match", [
    ("10:4 20:8", "first threshold must be 0"),
    ("0:4 5:8", "increase strictly"),  # 5 // 10 = 0 samples, as the first
    ("0:4 100", "not THRESHOLD:BATCH"),
    ("0:4 1Q:8", "not a number"),
    ("0:0", "positive"),
])
def test_bad_step_schedules_are_refused(text, match):
    with pytest.raises(ValueError, match=match):
        parse_step_schedule(text, 10)


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RAMP = BatchSchedule(16, rampup=(4, 4, 40))  # 3 increments, 40 / 3 samples each


def test_rampup_batches_by_hand():
    # batch(c) = 4 + int(c / 13.33) x 4 while c <= 40, then 16
    assert [RAMP.batch_at(c) for c in (0, 13, 14, 26, 27, 39, 40, 41)] == \
        [4, 4, 8, 8, 12, 12, 16, 16]
    consumed, batches = 0, []
    for _ in range(10):
        batches.append(RAMP.batch_at(consumed))
        consumed += batches[-1]
    assert batches == [4, 4, 4, 4, 8, 8, 12, 16, 16, 16] and consumed == 92
    assert RAMP.samples_in(10) == 92 and RAMP.samples_in(3, consumed_samples=16) == 28
    assert RAMP.sizes_from(12, 4) == [4, 8, 12] and RAMP.sizes_from(12, 5) == [4, 8, 12, 16]
    # --train-samples 100: 7 ramp iterations reach 44 > 40, then (100 - 44) // 16 = 3
    assert RAMP.iterations_for(100) == 10
    assert BatchSchedule(16).iterations_for(100) == 6
    # a step schedule counts iterations until the samples are consumed (the last one partial)
    assert BatchSchedule(8, steps=((0, 4), (10, 8))).iterations_for(21) == 3 + 2  # 12, then 28


def test_schedule_flags_and_their_rules():
    cfg = build(["--rampup-batch-size", "4", "4", "40", "--global-batch-size", "16",
                 "--train-samples", "100",
                 "--lr-warmup-samples", "16"])
    assert cfg.training.train_iters == 10
    o = cfg.optimizer
    assert o.lr_in_samples and o.lr_decay_samples == 100 and o.lr_warmup_samples == 16
    assert samples_per_split(cfg)[0] == 92  # the ten iterations' batches
    steps = build(["--step-batch-size-schedule", "0:4 2K:8", "--train-iters", "5",
                   "--lr-warmup-fraction", "0.5"])
    assert steps.training.global_batch_size == 8  # the schedule's last batch
    assert steps.optimizer.lr_decay_samples == 5 * 8 and steps.optimizer.lr_warmup_samples == 20


@pytest.mark.parametrize("extra,fragments", [
    (["--train-samples", "100"], ["--train-samples and --train-iters"]),
    (["--step-batch-size-schedule", "0:4 2K:8", "--global-batch-size", "8"],
     ["--step-batch-size-schedule and --global-batch-size"]),
    (["--rampup-batch-size", "4", "4", "40", "--step-batch-size-schedule", "0:4"],
     ["both given"]),
    (["--rampup-batch-size", "4", "5", "40", "--global-batch-size", "16"],
     ["multiple of INCREMENT (5)"]),
    (["--lr-decay-samples", "100"], ["--lr-decay-samples", "needs --train-samples"]),
    (["--rampup-batch-size", "4", "4", "40", "--global-batch-size", "16", "--deepspeed",
      "--deepspeed_config", os.path.join(ROOT, "ds_configs", "zero1.json")],
     ["not supported with --deepspeed", "gradient_accumulation_steps"]),
])
def test_bad_schedule_flags_are_refused(extra, fragments):
    expect_error(extra, *fragments)  # BASE gives --train-iters 100 and --micro-batch-size 2


def iteration_reads(consumed, micro, dp, schedule, iterations):
    """Per iteration, the sample indices all `dp` ranks read from `consumed` on."""
    ranks = [iter(MegatronPretrainingSampler(1000, consumed, micro, r, dp)) for r in range(dp)]
    out = []
    for _ in range(iterations):
        batch = schedule.batch_at(consumed)
        out.append(Counter(i for sampler in ranks for _ in range(batch // (micro * dp))
                           for i in next(sampler)))
        consumed += batch
    return out


def test_a_data_parallel_change_in_the_ramp_reads_the_same_samples():
    straight = iteration_reads(0, 2, 1, RAMP, 10)
    assert [sorted(c) for c in straight[:2]] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    # saved after iteration 5 (consumed 24); resumed at data-parallel size 2
    assert iteration_reads(24, 2, 2, RAMP, 5) == straight[5:]


def test_dry_run_describes_the_schedule():
    from app.training.planning.preflight import Report, describe_config

    report = Report()
    describe_config(report, build(["--rampup-batch-size", "4", "4", "40",
                                   "--global-batch-size", "16", "--train-samples", "100"]))
    text = report.render()
    assert "10 iterations = 92 samples" in text
    assert ("--rampup-batch-size 4 4 40: global batch 4 -> 8 -> 12 -> 16, micro-batches "
            "2 -> 4 -> 6 -> 8 per data-parallel rank") in text
