"""A checkpoint of any earlier release resumes exactly as it would have in that release: the same
samples, the same losses, gradient norms, loss scales and learning rates as its writer logged.

tests/data/old_checkpoints holds, per set, checkpoints of iteration 2 of 4-iteration runs written
by that set's code, the tokenizer and data they trained on, their command lines (commands.json)
and the train rows of iterations 3 and 4 their writer logged (expected.json; make_fixtures.py
shows how they were made):

- v0.2.0 (release 0.2.0): native fp32, native fp16 with its dynamic loss scale, DeepSpeed
  ZeRO-1; their checkpoints record no data order, so the resume must recognise them as this
  trainer's and read the order of those releases (app.data.legacy_order);
- d8367dc (the code just before the data order became Megatron Core's): the same three, native
  fp32 and fp16 saved as torch_dist, and the ZeRO-1 one converted to torch_dist by that code's
  converter (resumed on the native path); their records say version 1.

Each is resumed through the command line to iteration 4 (pretrain_gpt2.main in ONE child forked
from a process that has imported the trainer: tests/harness/distributed.run_mains) and its rows
compared with the writer's: bit for bit where expected.json holds this machine's environment key,
within the precision's tolerance elsewhere, and always within it for a DeepSpeed run continued on
the native path (tests/harness/numerics.py states the tolerances); each test says which. Other
samples than the writer's would give other losses at once (they differ by ~1e-2).
"""
import shutil

import pytest

from tests.harness.distributed import run_mains
from tests.harness.launch import env
from tests.harness.old_checkpoints import command, fixtures, folder, mismatches, recorded, source


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """{(set, checkpoint): (exit code, stdout, stderr, metrics file)} of every fixture resumed."""
    work = tmp_path_factory.mktemp("old_checkpoints")
    argvs = []
    for set_name, name in fixtures():
        run = work / set_name / name
        shutil.copytree(folder(set_name, name), run / "ck")
        argvs.append([*command(name, run), "--load", str(run / "ck"), "--metrics-file",
                      str(run / "metrics.jsonl")])
    results = run_mains(argvs, str(work), env(), timeout=900)
    return {fixture: (*result, work / fixture[0] / fixture[1] / "metrics.jsonl")
            for fixture, result in zip(fixtures(), results)}


@pytest.mark.parametrize("set_name, name", fixtures(), ids=[f"{s}/{n}" for s, n in fixtures()])
def test_old_checkpoint_resumes_with_its_writers_losses(set_name, name, resumed):
    code, out, err, metrics = resumed[(set_name, name)]
    assert code == 0, f"{set_name}/{name}: exited {code}\n{out[-3000:]}\n{err[-5000:]}"
    log = out + err
    assert f"data order of this resume: this trainer's order before 0.5.0" in log, log[-3000:]
    assert "was written by gpt2-megatron-deepspeed 0." in log, log[-3000:]
    want, comparison = recorded(set_name, name, across_paths=source(name) != name)
    comparison.announce(f"{set_name}/{name}")
    problems = mismatches(metrics, want, comparison)
    assert not problems, f"{set_name}/{name}: {problems}; {comparison.describe()}"

