"""A checkpoint written by an earlier version of the code resumes and gives the same next losses.

tests/data/old_checkpoints holds checkpoints of iteration 2 of three 4-iteration runs (native fp32,
native fp16 with its dynamic loss scale, DeepSpeed ZeRO-1), the tokenizer and data they trained
on, their command lines (commands.json) and the train rows of iterations 3 and 4 of the runs
that wrote them, uninterrupted (expected.json); make_fixtures.py shows how they were made. Each
checkpoint is resumed here through the command line, as a user would, to iteration 4
(pretrain_gpt2.main in a child forked from a process that has imported the trainer:
tests/harness/distributed.run_main). Since the data order became Megatron Core's (docs/data.md),
iterations 3 and 4 read other samples than the runs that wrote the checkpoints did:
expected.json's rows are those of the resumed runs at that change (tests/data/old_checkpoints
re-recorded by resuming each checkpoint once).

The numbers are bitwise equal in the environment they were recorded in (expected.json's
"environment": torch version and CPU kernel family); elsewhere kernels may round differently, so
there they only have to agree to 1e-3 and the test still checks that every checkpoint loads.
"""
import os
import shutil

import pytest

from tests.harness.distributed import run_main
from tests.harness.launch import env
from tests.harness.old_checkpoints import (COMMANDS, FIXTURES, assert_like_recorded, command,
                                          same_environment)


@pytest.mark.parametrize("name", sorted(COMMANDS["checkpoints"]))
def test_old_checkpoint_resumes_with_the_same_losses(name, tmp_path):
    ck, metrics = tmp_path / "ck", tmp_path / "metrics.jsonl"
    shutil.copytree(os.path.join(FIXTURES, name), ck)
    code, out, err = run_main([*command(name, tmp_path), "--load", str(ck), "--metrics-file",
                               str(metrics)], str(tmp_path), env())
    assert code == 0, f"{name}: exited {code}\n{out[-3000:]}\n{err[-5000:]}"
    assert_like_recorded(name, metrics, exact_floats=same_environment())
