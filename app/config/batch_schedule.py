"""Batch-size schedules: the global batch of each iteration as a function of the samples
consumed before it (pure arithmetic, Megatron-LM's rules). Part of `app.config`.

- `--rampup-batch-size START INCREMENT SAMPLES` (Megatron's classic
  RampupBatchsizeNumMicroBatchesCalculator, also DeepSpeedExamples'): from START, the batch
  grows by INCREMENT every `SAMPLES / ((G - START) / INCREMENT)` consumed samples until it
  reaches G = --global-batch-size; after SAMPLES consumed samples it is G:
  `batch(c) = G if c > SAMPLES else START + int(c / per_increment) * INCREMENT`.
- `--step-batch-size-schedule "THRESHOLD:BATCH ..."` (today's Megatron-LM
  StepBatchsizeNumMicroBatchesCalculator, as its trainer builds it, with the sequence length):
  thresholds in tokens with optional K/M/B/T suffixes (1e3 .. 1e12), converted to samples by
  `int(tokens) // seq_length`, sorted; the first must be 0 and they must increase strictly;
  `batch(c)` is the batch of the last threshold <= c. Entries may also be separated by commas.

Each iteration's number of micro-batches is batch / (micro-batch x data-parallel size); the
run's consumed samples grow by each iteration's batch, and with a schedule the learning-rate
schedule counts samples (Megatron's `opt_param_scheduler.step(increment=batch)`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

_SUFFIXES = {"K": 10 ** 3, "M": 10 ** 6, "B": 10 ** 9, "T": 10 ** 12}
FLAG_STEP = "--step-batch-size-schedule"
FLAG_RAMPUP = "--rampup-batch-size"


def _number(text: str, entry: str) -> int:
    """'250B' -> 250_000_000_000 (Megatron: int(float(digits) * multiplier))."""
    text = text.strip().upper()
    multiplier = _SUFFIXES.get(text[-1:], 1)
    digits = text[:-1] if text[-1:] in _SUFFIXES else text
    try:
        return int(float(digits) * multiplier)
    except ValueError:
        raise ValueError(f"{FLAG_STEP}: {text!r} in entry {entry!r} is not a number (e.g. "
                         "250B, 1.5T, 768)") from None


def parse_step_schedule(text: str, seq_length: int) -> Tuple[Tuple[int, int], ...]:
    """((threshold in samples, global batch), ...) of a step schedule, by the rules above."""
    entries = text.strip().replace(",", " ").split()
    if not entries:
        raise ValueError(f"{FLAG_STEP} is empty; give 'THRESHOLD:BATCH ...', e.g. "
                         "'0:256 10B:512 20B:1024' (thresholds in tokens)")
    steps = []
    for entry in entries:
        if ":" not in entry:
            raise ValueError(f"{FLAG_STEP}: entry {entry!r} is not THRESHOLD:BATCH")
        threshold, batch = entry.split(":", 1)
        steps.append((_number(threshold, entry) // seq_length, _number(batch, entry)))
    steps.sort(key=lambda step: step[0])
    if steps[0][0] != 0:
        raise ValueError(f"{FLAG_STEP} {text!r}: the first threshold must be 0 (the batch size "
                         f"to start with), got {steps[0][0]} samples")
    for (t0, _), (t1, _) in zip(steps, steps[1:]):
        if t1 <= t0:
            raise ValueError(f"{FLAG_STEP} {text!r}: thresholds must increase strictly in "
                             f"samples (tokens // --seq-length {seq_length}); got {t0} then {t1}")
    if any(batch <= 0 for _, batch in steps):
        raise ValueError(f"{FLAG_STEP} {text!r}: every batch size must be positive")
    return tuple(steps)


@dataclass(frozen=True)
class BatchSchedule:
    """The global batch of an iteration from the samples consumed before it: a step schedule
    (`steps`), a ramp-up (`rampup` = (start, increment, samples) to `final`), or constant."""

    final: int
    """--global-batch-size: the batch once the schedule is done (a step schedule's last)."""
    rampup: Optional[Tuple[int, int, int]] = None
    steps: Optional[Tuple[Tuple[int, int], ...]] = None

    def __post_init__(self) -> None:
        if self.rampup is None:
            return
        start, increment, samples = self.rampup
        if start <= 0 or increment <= 0 or samples < 0 or (samples == 0 and start < self.final):
            raise ValueError(f"{FLAG_RAMPUP} {start} {increment} {samples}: START, INCREMENT and "
                             "SAMPLES (the samples to ramp over) must be positive")
        if self.final < start or (self.final - start) % increment:
            raise ValueError(
                f"{FLAG_RAMPUP} {start} {increment} {samples}: --global-batch-size "
                f"({self.final}) - START ({start}) must be a non-negative multiple of INCREMENT "
                f"({increment})")

    @property
    def varies(self) -> bool:
        """True when the batch changes during training (a ramp-up or a step schedule)."""
        return (self.steps is not None and len(self.steps) > 1) or (
            self.rampup is not None and self.rampup[0] != self.final)

    def batch_at(self, consumed_samples: int) -> int:
        """The global batch of the iteration that starts after `consumed_samples` samples."""
        if self.steps is not None:
            batch = self.steps[0][1]
            for threshold, size in self.steps:
                if consumed_samples < threshold:
                    break
                batch = size
            return batch
        if self.rampup is None or self.rampup[0] == self.final:
            return self.final
        start, increment, samples = self.rampup
        if consumed_samples > samples:
            return self.final
        per_increment = samples / ((self.final - start) // increment)
        return start + int(consumed_samples / per_increment) * increment

    def _next_change(self, consumed: int) -> Optional[int]:
        """The least consumed count above `consumed` whose batch differs (None: never)."""
        if self.steps is not None:
            return next((t for t, _ in self.steps if t > consumed), None)
        if not self.varies or consumed > self.rampup[2]:  # type: ignore[index]
            return None
        start, increment, samples = self.rampup  # type: ignore[misc]
        per_increment = samples / ((self.final - start) // increment)
        step = int(consumed / per_increment)
        change = max(consumed + 1, math.ceil((step + 1) * per_increment))
        while change - 1 > consumed and int((change - 1) / per_increment) > step:
            change -= 1
        while int(change / per_increment) <= step:
            change += 1
        return min(change, samples + 1)

    def walk(self, consumed: int = 0, iterations: Optional[int] = None,
             start_below: Optional[int] = None, seen: Optional[List[int]] = None
             ) -> Tuple[int, int]:
        """(iterations run, samples consumed after them), from `consumed` on, until
        `iterations` have run or the next one would start at `start_below` or later (one of
        the two must be given). Stretches of one batch size are crossed in one step; `seen`
        collects each stretch's batch size."""
        if iterations is None and start_below is None:
            raise ValueError("walk needs iterations or start_below")
        done, now = 0, consumed
        while ((iterations is None or done < iterations)
               and (start_below is None or now < start_below)):
            batch = self.batch_at(now)
            change = self._next_change(now)
            limits = [] if iterations is None else [iterations - done]
            for bound in (change, start_below):
                if bound is not None:
                    limits.append(-(-(bound - now) // batch))
            count = max(1, min(limits))
            done, now = done + count, now + count * batch
            if seen is not None:
                seen.append(batch)
        return done, now

    def sizes_from(self, consumed_samples: int, iterations: int) -> List[int]:
        """The batch sizes `iterations` iterations from `consumed_samples` on use, in order."""
        seen: List[int] = []
        self.walk(consumed_samples, iterations=iterations, seen=seen)
        return seen

    def samples_in(self, iterations: int, consumed_samples: int = 0) -> int:
        """Samples read by `iterations` iterations starting after `consumed_samples`."""
        return self.walk(consumed_samples, iterations=iterations)[1] - consumed_samples

    def iterations_for(self, train_samples: int) -> int:
        """--train-samples -> iterations, as Megatron's update_train_iters: a constant batch
        gives train_samples // G; a ramp-up counts its iterations while consumed <= SAMPLES
        (and <= train_samples), then (train_samples - consumed) // G full batches; a step
        schedule counts iterations until train_samples are consumed."""
        if self.steps is not None:
            return self.walk(0, start_below=train_samples)[0]
        if self.rampup is None:
            return train_samples // self.final
        iterations, consumed = self.walk(0, start_below=min(self.rampup[2], train_samples) + 1)
        if train_samples > consumed:
            iterations += (train_samples - consumed) // self.final
        return iterations


def schedule_of(global_batch_size: int, rampup_batch_size: Sequence[int],
                step_batch_size_schedule: Optional[str], seq_length: int) -> BatchSchedule:
    """The BatchSchedule of the flags (--rampup-batch-size as a list, empty when absent)."""
    steps = (None if step_batch_size_schedule is None else
             parse_step_schedule(step_batch_size_schedule, seq_length))
    rampup = tuple(rampup_batch_size) if rampup_batch_size else None
    return BatchSchedule(global_batch_size, rampup=rampup, steps=steps)  # type: ignore[arg-type]


def micro_batches(batch: int, micro_batch_size: int, data_parallel_size: int) -> int:
    """Micro-batches per rank for a global `batch`, validated exactly."""
    per_step = micro_batch_size * data_parallel_size
    if batch % per_step:
        raise ValueError(f"global batch size {batch} is not divisible by --micro-batch-size "
                         f"({micro_batch_size}) x data-parallel size ({data_parallel_size})")
    return batch // per_step


def check_batches_from(schedule: BatchSchedule, consumed_samples: int, iterations: int,
                       micro_batch_size: int, data_parallel_size: int,
                       micro_batch_multiple: int = 1) -> None:
    """Every batch the next `iterations` iterations from `consumed_samples` on use splits
    into whole micro-batches on every rank, and (interleaved pipeline) into a multiple of
    `micro_batch_multiple` of them. Earlier batches of the schedule are not checked: a run
    resumed at another data-parallel size needs only the batches still ahead to fit it."""
    sizes = schedule.sizes_from(consumed_samples, iterations)
    check_divisible(sizes, micro_batch_size, data_parallel_size,
                    f"the batch-size schedule from consumed sample {consumed_samples} on")
    per_step = micro_batch_size * data_parallel_size
    odd = [b for b in sizes if (b // per_step) % micro_batch_multiple]
    if odd:
        raise ValueError(f"the interleaved pipeline schedule needs the micro-batches of every "
                         f"iteration to be a multiple of --pipeline-model-parallel-size "
                         f"({micro_batch_multiple}); the batch-size schedule's batches {odd} "
                         f"give {[b // per_step for b in odd]}: use batches that are multiples "
                         f"of {per_step * micro_batch_multiple}")


def check_divisible(sizes: Sequence[int], micro_batch_size: int, data_parallel_size: int,
                    what: str) -> None:
    """Every batch size of `sizes` splits into whole micro-batches on every rank."""
    per_step = micro_batch_size * data_parallel_size
    bad = [b for b in sizes if b % per_step]
    if bad:
        raise ValueError(f"{what}: global batch size(s) {bad} are not divisible by "
                         f"--micro-batch-size ({micro_batch_size}) x data-parallel size "
                         f"({data_parallel_size}) = {per_step}; choose batch sizes that are "
                         "multiples of it")
