"""tests.harness.distributed.run_distributed: results, error propagation, timeouts (no hangs), and
results that come back whole however late the parent reads them."""
from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from tests.harness import distributed
from tests.harness.distributed import DistributedTestError, run_distributed


def _rank_sum(offset: float) -> float:
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    assert torch.get_num_threads() == 1
    return t.item() + offset + 10 * dist.get_rank()


def _fail_on_rank_one() -> None:
    if dist.get_rank() == 1:
        raise ValueError("deliberate failure on rank 1")
    dist.barrier()  # rank 0 would wait here forever: the harness must kill it


def _sleep_on_rank_zero() -> int:
    dist.barrier()  # both ranks are connected before rank 1 leaves (a slow start is no error)
    if dist.get_rank() == 0:
        time.sleep(60)
    return 1


def _tensors_of_rank() -> dict:
    rank = dist.get_rank()
    return {"rank": rank, "values": torch.arange(4.0) + rank, "grad": torch.ones(2) * (rank + 1)}


def _exit_silently_on_rank_one() -> None:
    if dist.get_rank() == 1:
        os._exit(0)
    time.sleep(60)


def _exit_silently_just_after_the_peer_failed() -> None:
    """Rank 0's error reaches the parent first; rank 1 leaves without a word half a second
    later, as a rank whose peer failed in the rendezvous because it had left may report first."""
    dist.barrier()  # both are connected before rank 0 leaves
    if dist.get_rank() == 0:
        raise ConnectionError("the peer closed the connection")
    time.sleep(0.5)
    os._exit(0)


def _unpicklable_value():
    return lambda: None


def test_results_come_back_in_rank_order():
    assert run_distributed(_rank_sum, 2, 0.5, timeout=30) == [1.5, 11.5]


@pytest.mark.parametrize("fn, message", [
    (_fail_on_rank_one, r"(?s)rank 1 of 2 failed.*deliberate failure"),  # with its traceback
    (_exit_silently_on_rank_one, r"^rank 1 of 2 exited with code 0 without reporting"),
    # the rank that left is named first, its peer's error after it
    (_exit_silently_just_after_the_peer_failed,
     r"(?s)^rank 1 of 2 exited with code 0 without reporting.*rank 0 of 2 failed.*closed"),
    (_unpicklable_value, r"(?s)rank \d of 2 failed.*pickle"),
], ids=["raises", "exits-silently", "exits-after-its-peer-failed", "unpicklable-value"])
def test_a_failing_rank_fails_the_call_at_once(fn, message):
    """The other rank waits in a collective or sleeps: the call still fails well before the
    timeout, with the failing rank's reason."""
    start = time.monotonic()
    with pytest.raises(DistributedTestError, match=message):
        run_distributed(fn, 2, timeout=60)
    assert time.monotonic() - start < 30


def test_timeout_kills_stragglers():
    with pytest.raises(TimeoutError, match=r"ranks \[0\] of 2 did not finish within 8 s"):
        run_distributed(_sleep_on_rank_zero, 2, timeout=8)


def test_tensors_come_back_after_the_ranks_exited(monkeypatch):
    """The race of a loaded machine, made certain: every rank returns tensors and has exited
    before the parent reads the first result (tensors sent as file descriptors fetched from the
    rank's process could then no longer be read: EOFError / FileNotFoundError)."""
    collect = distributed._collect

    def collect_after_the_ranks_exited(procs, *rest):
        deadline = time.monotonic() + 30
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(p.is_alive() for p in procs), "the ranks did not exit within 30 s"
        return collect(procs, *rest)

    monkeypatch.setattr(distributed, "_collect", collect_after_the_ranks_exited)
    out = run_distributed(_tensors_of_rank, 2, timeout=60)
    assert [o["rank"] for o in out] == [0, 1]
    for rank, o in enumerate(out):
        torch.testing.assert_close(o["values"], torch.tensor([0.0, 1.0, 2.0, 3.0]) + rank)
        torch.testing.assert_close(o["grad"], torch.full((2,), rank + 1.0))
