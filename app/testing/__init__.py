"""Test helpers: run_distributed() (N gloo ranks in child processes) and per-rank check runners."""
from app.testing.distributed import (DistributedTestError, expect_close, run_checks,
                                     run_distributed)

__all__ = ["DistributedTestError", "expect_close", "run_checks", "run_distributed"]
