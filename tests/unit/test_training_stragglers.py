"""The straggler comparison (pure), its log line and metrics record, and the detector's timing
in one process; the two-rank run is tests/distributed/test_straggler_detection.py."""
import json
import socket
import time

import pytest
import torch

import arguments
from app.training.telemetry.metrics import MetricsWriter
from app.training.telemetry.stragglers import (LISTED_STRAGGLERS, StragglerDetector,
                                                find_stragglers, format_report, report_values)


def test_a_rank_above_the_margin_is_named_and_one_within_it_is_not():
    times = [(50.0, 1.0)] * 8
    times[5] = (100.0, 2.0)   # 2x the median
    times[2] = (54.0, 1.0)    # 8% slower: within a 10% margin
    found = find_stragglers(times, margin=0.1)
    assert found.median_ms == 51.0 and found.ranks == 8
    assert [r.rank for r in found.stragglers] == [5]
    assert found.stragglers[0].forward_ms == 100.0 and found.stragglers[0].data_wait_ms == 2.0
    assert find_stragglers(times, margin=1.1).stragglers == ()  # 102 ms is not above 2.1 x 51


def test_data_wait_counts_toward_a_rank_time():
    found = find_stragglers([(50.0, 0.5), (50.0, 40.0), (50.0, 0.4)], margin=0.2)
    assert [r.rank for r in found.stragglers] == [1]


def test_two_ranks_are_each_compared_with_the_other():
    """The lower median of two ranks is the faster one, so the slower is named when it is
    slower by more than the margin (a plain median, their mean, would need 22% for 10%)."""
    assert [r.rank for r in find_stragglers([(115.0, 0.0), (100.0, 0.0)], 0.1).stragglers] == [0]
    assert find_stragglers([(105.0, 0.0), (100.0, 0.0)], 0.1).stragglers == ()


def test_slow_ranks_below_half_do_not_move_the_median_and_are_listed_slowest_first():
    times = [(10.0, 0.0)] * 4 + [(30.0, 0.0), (50.0, 0.0), (40.0, 0.0), (20.0, 0.0)]
    found = find_stragglers(times, margin=0.5, minmax_count=2)
    assert found.median_ms == 10.0
    assert [r.rank for r in found.stragglers] == [5, 6, 4, 7]
    assert [r.rank for r in found.slowest] == [5, 6]
    assert [r.rank for r in found.fastest] == [0, 1]  # ties keep rank order


def test_an_even_world_names_nobody_and_one_rank_names_itself_fastest_and_slowest():
    assert find_stragglers([(20.0, 1.0)] * 16, margin=0.1).stragglers == ()
    alone = find_stragglers([(20.0, 1.0)], margin=0.1, minmax_count=4)
    assert alone.stragglers == () and alone.slowest == alone.fastest
    with pytest.raises(ValueError, match="at least one rank"):
        find_stragglers([], margin=0.1)


def test_the_log_line_names_hosts_and_the_split_of_each_straggler():
    hosts = ["node-a", "node-a", "node-b", "node-b"]
    found = find_stragglers([(50.0, 1.0), (50.0, 1.0), (149.0, 4.0), (50.0, 1.0)], margin=0.1)
    line = format_report(30, found, hosts)
    assert line == (
        "straggler check at iteration 30: median 51.0 ms per iteration (forward + data wait) "
        "over 4 ranks; 1 rank more than 10% slower than the median: rank 2 (host node-b) "
        "153.0 ms (+200%: forward 149.0 ms, data wait 4.0 ms) | slowest: rank 2 (host node-b) "
        "153.0 ms | fastest: rank 0 (host node-a) 51.0 ms")
    even = format_report(30, find_stragglers([(50.0, 1.0)] * 4, 0.1), hosts)
    assert "no rank is more than 10% slower than the median" in even


def test_the_log_line_lists_a_bounded_number_of_stragglers():
    count = LISTED_STRAGGLERS + 3
    times = [(10.0, 0.0)] * (count + 1) + [(100.0 + r, 0.0) for r in range(count)]
    line = format_report(1, find_stragglers(times, 0.1), ["h"] * len(times))
    assert f"{count} ranks more than 10% slower" in line and line.count("(+") == LISTED_STRAGGLERS
    assert ", and 3 more |" in line


def test_the_metrics_record_round_trips_through_the_metrics_file(tmp_path):
    hosts = ["a", "b", "c"]
    found = find_stragglers([(10.0, 0.0), (30.0, 5.0), (11.0, 0.0)], margin=0.5)
    path = tmp_path / "m.jsonl"
    with MetricsWriter(None, str(path)) as writer:
        writer.write("straggler", 7, report_values(found, hosts))
    (row,) = [json.loads(line) for line in path.read_text().splitlines()]
    assert row["kind"] == "straggler" and row["iteration"] == 7
    assert row["median_ms"] == 11.0 and row["straggler_count"] == 1 and row["ranks"] == 3
    assert row["slowest_ms"] == 35.0 and row["fastest_ms"] == 10.0 and row["margin"] == 0.5
    assert row["stragglers"] == [{"rank": 1, "host": "b", "ms": 35.0, "forward_ms": 30.0,
                                  "data_wait_ms": 5.0}]
    assert [e["rank"] for e in row["slowest"]] == [1] and [e["rank"] for e in row["fastest"]] == [0]


class _Writer:
    def __init__(self):
        self.rows = []

    def write(self, kind, iteration, values):
        self.rows.append((kind, iteration, values))


def test_a_disabled_detector_times_nothing_and_reports_nothing():
    detector = StragglerDetector(False, 0.1, 1, None, torch.device("cpu"))
    batch, forward = (lambda: 1), (lambda b: b)
    assert detector.timed(batch, forward) == (batch, forward)
    writer = _Writer()
    assert detector.report(10, 10, writer) is None and writer.rows == []


def test_an_enabled_detector_measures_forward_and_data_wait_per_iteration():
    detector = StragglerDetector(True, 0.1, 1, None, torch.device("cpu"))

    def fetch():
        time.sleep(0.02)
        return 3

    def forward(batch):
        time.sleep(0.01)
        return batch * 2

    timed_fetch, timed_forward = detector.timed(fetch, forward)
    for _ in range(4):  # 2 iterations of 2 micro-batches
        assert timed_forward(timed_fetch()) == 6
    writer = _Writer()
    found = detector.report(2, 2, writer)
    (only,) = found.slowest
    assert 20.0 <= only.forward_ms < 200.0 and 40.0 <= only.data_wait_ms < 400.0
    (kind, iteration, values), = writer.rows
    assert (kind, iteration, values["ranks"]) == ("straggler", 2, 1)
    assert values["fastest"][0]["host"] == socket.gethostname()
    assert detector.report(4, 2, writer).slowest[0].ms == 0.0  # a new interval starts at zero


def test_the_flags_reach_the_config_and_are_validated():
    base = ["--train-iters", "10"]
    t = arguments.config_from_argv(base, 1, 64).training
    assert (t.log_straggler, t.straggler_margin, t.straggler_minmax_count) == (False, 0.1, 1)
    t = arguments.config_from_argv(base + ["--log-straggler", "--straggler-margin", "0.25",
                                           "--straggler-minmax-count", "3"], 1, 64).training
    assert (t.log_straggler, t.straggler_margin, t.straggler_minmax_count) == (True, 0.25, 3)
    with pytest.raises(ValueError, match="--straggler-margin must be positive"):
        arguments.config_from_argv(base + ["--straggler-margin", "0"], 1, 64)
    with pytest.raises(ValueError, match="--straggler-minmax-count must be positive"):
        arguments.config_from_argv(base + ["--straggler-minmax-count", "0"], 1, 64)
