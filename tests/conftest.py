"""Shared pytest setup: one torch thread per test process (the suite runs on 2 cores), also as
OMP_NUM_THREADS=1, which the runs a test starts in-process or in children take as the user's
choice (app.launch.threads); the launch variables an in-process DeepSpeed run sets (RANK,
WORLD_SIZE, MASTER_PORT, ...) put back after each test, so no later test or command it starts
inherits them; and every fault-injection point (app/utils/faults.py) disarmed after each test,
so a test may simply `faults.arm` one; and a default process group a test (or the in-process run
it started) left behind destroyed, so the next test in that worker can start its own."""
import os

import pytest
import torch
import torch.distributed as dist

from app.utils import faults

torch.set_num_threads(1)
os.environ["OMP_NUM_THREADS"] = "1"

_LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                     "MASTER_PORT")


@pytest.fixture(autouse=True)
def _launch_variables_restored():
    saved = {k: os.environ.get(k) for k in _LAUNCH_VARIABLES}
    yield
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(autouse=True)
def _faults_disarmed():
    yield
    faults.disarm_all()


@pytest.fixture(autouse=True)
def _process_group_destroyed():
    before = dist.is_initialized()  # a module-scoped group set up before this test stays
    yield
    if not before and dist.is_initialized():
        dist.destroy_process_group()
