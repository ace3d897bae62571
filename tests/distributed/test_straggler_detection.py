"""--log-straggler on two data-parallel ranks names exactly the rank that was made slow, with its
host, in one log line of the logging rank and in the metrics file, and names no rank while both
run alike.

One run of 8 iterations, logged every 2: iterations 1-2 warm up; 3-4 run evenly; in 5-6 rank
0's forward steps sleep SLOW_S per iteration (a slow GPU); in 7-8 rank 1's batch fetches do (a
slow data reader). An unslowed iteration's forward takes 5-30 ms on this busy two-core machine
(measured), and the two ranks of an even interval differed by up to 3x. MARGIN names a rank
above ten times the median: the slowed rank is 25-100 times it, and an even interval would
need a 10x gap.
"""
import io
import json
import socket
import sys
import time

from tests.harness.distributed import run_distributed

SLOW_S = 0.8
MARGIN = 9.0
ARGS = ["--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4",
        "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "8",
        "--train-iters", "8", "--log-interval", "2", "--lr", "1e-3",
        "--distributed-backend", "gloo", "--make-vocab-size-divisible-by", "32",
        "--num-workers", "0", "--eval-iters", "0", "--peak-flops", "1e12",
        "--log-straggler", "--straggler-margin", str(MARGIN)]


def _slowed(fn, trainer, iterations, seconds_per_call):
    """`fn` that first sleeps `seconds_per_call` while the iteration in progress is in
    `iterations`."""
    def slow(*args):
        if trainer.state.iteration + 1 in iterations:
            time.sleep(seconds_per_call)
        return fn(*args)
    return slow


def _train_with_slow_ranks(metrics_file):
    import torch.distributed as dist

    import arguments
    from tests.harness.synthetic import build_synthetic_run
    from app.utils.rank_logging import setup_logging

    rank = dist.get_rank()
    cfg = arguments.config_from_argv(ARGS + ["--metrics-file", metrics_file], 2, 64)
    trainer = build_synthetic_run(cfg, 64)["trainer"]
    per_call = SLOW_S / trainer.num_micro  # SLOW_S per iteration
    if rank == 0:
        trainer.objective.forward_step = _slowed(trainer.objective.forward_step, trainer,
                                                 {5, 6}, per_call)
    else:
        trainer.batches.next = _slowed(trainer.batches.next, trainer, {7, 8}, per_call)
    setup_logging(rank, 2)
    out, sys.stdout = sys.stdout, io.StringIO()
    try:
        trainer.train()
        printed = sys.stdout.getvalue()
    finally:
        sys.stdout = out
    return [line for line in printed.splitlines() if "straggler check" in line]


def test_the_slowed_rank_and_its_host_are_named_and_nobody_in_an_even_interval(tmp_path):
    metrics_file = str(tmp_path / "metrics.jsonl")
    lines = run_distributed(_train_with_slow_ranks, 2, metrics_file, timeout=120)
    host = socket.gethostname()

    assert lines[0] == [], "only the logging (last) rank prints the straggler line"
    assert len(lines[1]) == 4, lines[1]
    _, even, slow_forward, slow_data = lines[1]
    assert "at iteration 4:" in even and "no rank is more than 900% slower" in even, even
    assert f"1 rank more than 900% slower than the median: rank 0 (host {host})" in slow_forward
    assert f"1 rank more than 900% slower than the median: rank 1 (host {host})" in slow_data

    with open(metrics_file) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    checks = {r["iteration"]: r for r in rows if r["kind"] == "straggler"}
    assert sorted(checks) == [2, 4, 6, 8]
    assert checks[4]["stragglers"] == [] and checks[4]["straggler_count"] == 0
    for iteration, rank, part in ((6, 0, "forward_ms"), (8, 1, "data_wait_ms")):
        named = checks[iteration]["stragglers"]
        assert [(s["rank"], s["host"]) for s in named] == [(rank, host)], named
        assert named[0][part] >= SLOW_S * 1e3, named  # the slowness is in the part slowed
        assert checks[iteration]["slowest"][0]["rank"] == rank
        assert checks[iteration]["fastest"][0]["rank"] == 1 - rank
