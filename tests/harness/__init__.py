"""What only tests (and benchmarks) run, kept out of the product (`app/` never imports it):

- distributed: run_distributed() (N gloo ranks in child processes) and per-rank check runners;
- synthetic: RandomTokens and build_synthetic_run (a run built in-process over random tokens);
- netns: TestHosts, Linux network namespaces as test hosts;
- tools: load_tool, a tools/*.py command line imported as a module.
"""
from tests.harness.distributed import (DistributedTestError, expect_close, run_checks,
                                       run_distributed)

__all__ = ["DistributedTestError", "expect_close", "run_checks", "run_distributed"]
