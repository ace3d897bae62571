"""The 0.2.0 checkpoints of tests/data/old_checkpoints (native fp16 with its loss scale and fp32
main weights, DeepSpeed ZeRO-1; the fp32 one converts in
tests/unit/test_checkpoint_torch_dist_convert.py), converted to --ckpt-format torch_dist with
their optimizer states by today's tools/convert_checkpoint.py, resume on the native path through
the command line in their writer's data order and give the losses, grad norms, loss scales and
LRs their writer logged for iterations 3 and 4 (expected.json, compared as
test_old_checkpoints.py compares: bit for bit for the fp16 one where this machine's rows are
recorded, within the precision's tolerance elsewhere and for the DeepSpeed one, whose run
continues on the native path). --dry-run names the format, the layout and the data order the
resume reads, and reads the saved state as a resume would. The converter runs as a command;
pretrain_gpt2.py's runs in a child forked from a process that has imported the trainer
(tests/harness/distributed.run_main).
"""
import os
import sys

import pytest

from tests.harness.distributed import run_main
from tests.harness.launch import ROOT, env, run
from tests.harness.old_checkpoints import (COMMANDS, folder, mismatches, native_command,
                                          recorded)

SOURCES = {"native_fp16": "megatron", "deepspeed_zero1": "deepspeed"}
SET = "v0.2.0"


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_old_checkpoint_converted_to_torch_dist_resumes_with_the_same_losses(name, tmp_path):
    converted, metrics = tmp_path / "td", tmp_path / "metrics.jsonl"
    run([sys.executable, os.path.join(ROOT, "tools", "convert_checkpoint.py"),
         "--input-format", SOURCES[name], "--output-format", "torch_dist", "--include-optimizer",
         "--load", folder(SET, name), "--save", str(converted)], tmp_path)
    saved = COMMANDS["saved_iteration"]
    assert sorted(os.listdir(converted / f"iter_{saved:07d}")) == [
        ".metadata", "__0_0.distcp", "common.pt", "integrity.json", "metadata.json"]
    args = native_command(name, tmp_path) + ["--load", str(converted)]
    if name == "native_fp16":
        code, report, err = run_main([*args, "--dry-run"], str(tmp_path), env())
        assert code == 0, report[-3000:] + err[-3000:]
        assert ("torch_dist layout saved at tensor-parallel size 1, pipeline-parallel size 1"
                in report and "resharded to this run's tensor-parallel size 1" in report
                and "data order of this resume: this trainer's order before 0.5.0" in report
                and "written by gpt2-megatron-deepspeed 0.1.0 to 0.3.0" in report
                and "records no data order" in report), report  # the saved state was read
    code, out, err = run_main([*args, "--metrics-file", str(metrics)], str(tmp_path), env())
    assert code == 0, out[-3000:] + err[-5000:]
    want, comparison = recorded(SET, name, across_paths=SOURCES[name] == "deepspeed")
    comparison.announce(f"{SET}/{name} converted to torch_dist")
    problems = mismatches(metrics, want, comparison)
    assert not problems, f"{name}: {problems}; {comparison.describe()}"
