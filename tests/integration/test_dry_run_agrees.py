"""`pretrain_gpt2.py ... --dry-run` agrees with the run it checks: for command lines a user gets
wrong and for good ones, the dry run and the real run (tiny model, two iterations) exit with
the same code, a refused command's one `error:` line and the dry run's report name the same flag
or file, and the dry run writes nothing into the directories it checks.

Both run `pretrain_gpt2.main(argv)` as `python pretrain_gpt2.py argv` does (its own process, the
case's directory as working directory, a user's environment, exit code, stdout and stderr apart),
in a child forked from a process that has imported torch and the trainer once
(tests/harness/distributed.run_main: no interpreter start-up per run), two cases at a time; every
case's checkpoint is a copy (or a damaged copy) of one real checkpoint saved once for the module.
"""
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import psutil
import pytest

from app.checkpoint import names
from app.data import MMapIndexedDatasetBuilder
from app.training.resilience.save_dir import LOCK_FILENAME
from tests.harness.distributed import run_main
from tests.harness.corpus import tiny_gpt_args
from tests.harness.launch import ROOT, env

BASE = ["--train-iters", "2", "--eval-iters", "0", "--log-interval", "1"]
ZERO2 = os.path.join(ROOT, "ds_configs", "zero2.json")
SPAWN_TIMEOUT_S = 300


def spawn(argv: List[str], cwd: Path) -> Tuple[int, str, str]:
    """(exit code, stdout, stderr) of `python pretrain_gpt2.py argv`, run in `cwd`."""
    return run_main(argv, str(cwd), env(), timeout=SPAWN_TIMEOUT_S)


def snapshot(directory: Path) -> Dict[str, Tuple[int, int]]:
    """{relative path: (size, mtime_ns)} of everything under `directory`."""
    found = {}
    for root, dirs, files in os.walk(directory):
        for name in dirs + files:
            path = os.path.join(root, name)
            info = os.lstat(path)
            found[os.path.relpath(path, directory)] = (info.st_size, info.st_mtime_ns)
    return found


@dataclass
class Case:
    """One command line: `extra` flags (built in the case's directory), the exit code both runs
    must give, and what both must name (the refused command's error line and a dry-run ERROR
    line; for exit 0, a line the dry-run report must hold)."""

    name: str
    extra: Callable[[Path, Path], List[str]]
    code: int
    names: Callable[[Path], str]


def _copy(ck: Path, where: Path) -> Path:
    return Path(shutil.copytree(ck, where / "ck"))


def _damaged(ck: Path, where: Path) -> Path:
    copy = _copy(ck, where)
    data = copy / "iter_0000001" / "mp_rank_00" / names.MODEL_FILENAME
    blob = bytearray(data.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    data.write_bytes(bytes(blob))
    return copy


def _other_tensor_parallel_size(ck: Path, where: Path) -> Path:
    copy = _copy(ck, where)  # rank files of TP 2: the layout is read from the file names
    shutil.copytree(copy / "iter_0000001" / "mp_rank_00", copy / "iter_0000001" / "mp_rank_01")
    return copy


def _without_tracker(ck: Path, where: Path) -> Path:
    copy = _copy(ck, where)
    os.remove(names.tracker_path(str(copy)))
    return copy


def _tracker_naming_a_missing_iteration(ck: Path, where: Path) -> Path:
    copy = _copy(ck, where)
    Path(names.tracker_path(str(copy))).write_text("7\n")
    return copy


def _locked_by_this_process(ck: Path, where: Path) -> Path:
    """A copy whose writer lock names this (live) test process."""
    copy = _copy(ck, where)
    me = psutil.Process(os.getpid())
    (copy / LOCK_FILENAME).write_text(json.dumps(
        {"host": socket.gethostname(), "pid": me.pid, "process_start": me.create_time(),
         "heartbeat": time.time(), "command": "pytest holding the lock"}))
    return copy


def _left_by_a_killed_run(ck: Path, where: Path) -> Path:
    """A copy with the writer lock of a process that is gone and a temporary file of its
    interrupted save: a relaunch takes the lock over and removes the file."""
    copy = _copy(ck, where)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (copy / LOCK_FILENAME).write_text(json.dumps(
        {"host": socket.gethostname(), "pid": dead.pid, "process_start": 1.0,
         "heartbeat": time.time(), "command": "a killed run"}))
    (copy / f"{names.TRACKER_FILENAME}.tmp.{dead.pid}").write_text("2")
    return copy


def _a_file(where: Path) -> Path:
    path = where / "afile"
    path.write_text("not a directory\n")
    return path


def _empty_dir(where: Path) -> Path:
    (where / "empty").mkdir()
    return where / "empty"


def _unwritable_save(where: Path, create: bool = True) -> Path:
    """A --save path no run can create: under a read-only directory, or (as root, whom the
    permission bits do not stop) under a file."""
    if os.geteuid() == 0:
        return (_a_file(where) if create else where / "afile") / "ck"
    locked = where / "readonly"
    if create:
        locked.mkdir()
        locked.chmod(0o500)
    return locked / "ck"


def _json_with_train_batch_size(where: Path, size: int) -> Path:
    with open(ZERO2) as f:
        config = json.load(f)
    config["train_batch_size"] = size
    path = where / "ds.json"
    path.write_text(json.dumps(config))
    return path


def _small_corpus(where: Path, tokens: int = 24, documents: int = 6) -> str:
    """A .bin/.idx pair with fewer tokens than two iterations of the tiny run consume."""
    prefix = str(where / "small_text_document")
    builder = MMapIndexedDatasetBuilder(prefix + ".bin", np.uint16)
    for doc in range(documents):
        builder.add_item(np.arange(doc, doc + tokens, dtype=np.uint16) % 500 + 1)
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix


CASES = [
    # wrong: the refusal both must give
    Case("--save holds checkpoints, no --load",
         lambda w, ck: ["--save", str(_copy(ck, w))], 2, lambda w: f"--save {w / 'ck'}"),
    Case("--load is an empty directory that is not --save",
         lambda w, ck: ["--load", str(_empty_dir(w))], 2,
         lambda w: f"--load {w / 'empty'}"),
    Case("--load does not exist",
         lambda w, ck: ["--load", str(w / "typo")], 2, lambda w: f"--load {w / 'typo'}"),
    Case("iter_* directories without a tracker",
         lambda w, ck: ["--load", str(_without_tracker(ck, w)), "--save", str(w / "ck")], 2,
         lambda w: str(w / "ck")),
    Case("tracker naming an iteration that is not there",
         lambda w, ck: ["--load", str(_tracker_naming_a_missing_iteration(ck, w)),
                        "--save", str(w / "ck")], 2,
         lambda w: names.tracker_path(str(w / "ck"))),
    Case("checkpoint saved at another tensor-parallel size",
         lambda w, ck: ["--load", str(_other_tensor_parallel_size(ck, w))], 2,
         lambda w: str(w / "ck" / "iter_0000001")),
    Case("checkpoint file that does not match its checksum",
         lambda w, ck: ["--load", str(_damaged(ck, w))], 2,
         lambda w: str(w / "ck" / "iter_0000001" / "mp_rank_00" / names.MODEL_FILENAME)),
    Case("--finetune from --load into the same --save",
         lambda w, ck: ["--load", str(_copy(ck, w)), "--save", str(w / "ck"), "--finetune"], 2,
         lambda w: f"--save {w / 'ck'}"),
    Case("--save of a live run (writer lock held)",
         lambda w, ck: ["--load", str(_locked_by_this_process(ck, w)), "--save", str(w / "ck")],
         2, lambda w: f"--save {w / 'ck'}"),
    Case("--save is a file",
         lambda w, ck: ["--save", str(_a_file(w))], 2, lambda w: f"--save {w / 'afile'}"),
    Case("--save cannot be created or written",
         lambda w, ck: ["--save", str(_unwritable_save(w))], 2,
         lambda w: f"--save {_unwritable_save(w, create=False)}"),
    Case("--universal-checkpoint without latest_universal",
         lambda w, ck: ["--load", str(_copy(ck, w)), "--deepspeed", "--deepspeed_config", ZERO2,
                        "--universal-checkpoint"], 2,
         lambda w: str(w / "ck" / "latest_universal")),
    Case("--data-path does not exist",
         lambda w, ck: ["--data-path", str(w / "missing_text_document")], 2,
         lambda w: str(w / "missing_text_document")),
    Case("--split leaves no training samples",
         lambda w, ck: ["--split", "0,1,0"], 2, lambda w: "--split"),
    Case("DeepSpeed JSON batch size disagrees with the flags",
         lambda w, ck: ["--deepspeed", "--deepspeed_config",
                        str(_json_with_train_batch_size(w, 8))], 2,
         lambda w: "train_batch_size"),
    # allowed, with the documented outcome
    Case("--save holds checkpoints, --overwrite-checkpoints",
         lambda w, ck: ["--save", str(_copy(ck, w)), "--overwrite-checkpoints"], 0,
         lambda w: "--overwrite-checkpoints: --save"),
    Case("fewer tokens than --train-iters needs: the training data repeats",
         lambda w, ck: ["--data-path", _small_corpus(w)], 0,
         lambda w: "the training data repeats"),
    # good
    Case("fresh start into a new --save",
         lambda w, ck: ["--save", str(w / "new")], 0, lambda w: "preflight passed"),
    Case("resume with --load = --save after a killed run (stale lock, temporary file)",
         lambda w, ck: ["--load", str(_left_by_a_killed_run(ck, w)), "--save", str(w / "ck")],
         0, lambda w: "resumes at iteration 1"),
]


def command_line(corpus, shared: Path, extra: List[str]) -> List[str]:
    """The tiny run's flags, then `extra` (a flag given again replaces the tiny run's value)."""
    return tiny_gpt_args(corpus, shared, *BASE, *extra)


@pytest.fixture(scope="module")
def saved_checkpoint(tiny_corpus, tmp_path_factory) -> Path:
    """A real native checkpoint of the tiny run at iteration 1 (of --train-iters 2)."""
    tmp = tmp_path_factory.mktemp("agree_ck")
    code, out, err = spawn(command_line(tiny_corpus, tmp, ["--exit-interval", "1", "--save",
                                                           str(tmp / "ck")]), tmp)
    assert code == 0, err[-3000:]
    return tmp / "ck"


def _both_ways(case: Case, argv: List[str], where: Path) -> Optional[str]:
    """Run the dry run, then the real run; what disagrees, or None."""
    before = snapshot(where)
    dry_code, report, dry_err = spawn(argv + ["--dry-run"], where)
    written = sorted(set(snapshot(where).items()) ^ set(before.items()))
    real_code, _, real_err = spawn(argv, where)
    dry_errors = [line.strip()[len("ERROR"):].strip() for line in report.splitlines()
                  if line.strip().startswith("ERROR")]
    real_errors = [line for line in real_err.splitlines() if line.startswith("error: ")]
    named = case.names(where)
    problems = []
    if (dry_code, real_code) != (case.code, case.code):
        problems.append(f"exit codes: dry run {dry_code}, real run {real_code}, "
                        f"expected {case.code}")
    if written:
        problems.append(f"the dry run wrote into {where}: {written[:4]}")
    if case.code == 0:
        if named not in report:
            problems.append(f"the dry-run report lacks {named!r}")
        if "--save" in argv:  # the real run trained to the end and saved there
            save = argv[argv.index("--save") + 1]
            if real_code == 0 and names.read_tracker(save) != 2:
                problems.append(f"the real run did not save iteration 2 into {save}")
    else:
        if len(real_errors) != 1 or named not in real_errors[0]:
            problems.append(f"the real run's error line does not name {named!r}: {real_errors}")
        if not any(named in line for line in dry_errors):
            problems.append(f"no dry-run ERROR names {named!r}: {dry_errors}")
    if not problems:
        return None
    return (f"{case.name}: " + "; ".join(problems) + f"\n  dry run: {dry_errors or dry_err[-800:]}"
            f"\n  real run: {real_errors or real_err[-1500:]}")


def test_dry_run_and_real_run_agree_on_wrong_and_good_command_lines(
        tiny_corpus, saved_checkpoint, tmp_path):
    shared = tmp_path / "shared"  # the data-index cache, built once for all cases
    shared.mkdir()
    jobs = []
    for number, case in enumerate(CASES):
        where = tmp_path / f"case{number:02d}"
        where.mkdir()
        jobs.append((case, command_line(tiny_corpus, shared, case.extra(where, saved_checkpoint)),
                     where))
    with ThreadPoolExecutor(max_workers=2) as pool:
        outcomes = list(pool.map(lambda job: _both_ways(*job), jobs))
    for _, _, where in jobs:  # let pytest remove the read-only directory
        if (where / "readonly").exists():
            (where / "readonly").chmod(0o700)
    disagreements = [outcome for outcome in outcomes if outcome]
    assert not disagreements, "\n".join(disagreements)
