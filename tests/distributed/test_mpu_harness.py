"""app.testing.distributed.run_distributed: results, error propagation, timeouts (no hangs)."""
from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from app.testing.distributed import DistributedTestError, run_distributed


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


def test_results_come_back_in_rank_order():
    assert run_distributed(_rank_sum, 2, 0.5, timeout=30) == [1.5, 11.5]


def test_rank_exception_is_reraised_with_traceback():
    start = time.monotonic()
    with pytest.raises(DistributedTestError, match=r"(?s)rank 1 of 2 failed.*deliberate failure"):
        run_distributed(_fail_on_rank_one, 2, timeout=30)
    assert time.monotonic() - start < 15


def test_timeout_kills_stragglers():
    with pytest.raises(TimeoutError, match=r"ranks \[0\] of 2 did not finish within 8 s"):
        run_distributed(_sleep_on_rank_zero, 2, timeout=8)
