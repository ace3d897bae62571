"""Chaos: a job whose ranks are SIGKILLed at random moments, restarted each time with --load equal
to --save, ends exactly where an uninterrupted run ends.

Each configuration runs KILLS + 1 attempts of tests/integration/chaos_child.py, which kills one
random rank per attempt: in the forward pass of a random iteration, or while it writes a
checkpoint file (with --async-save in the thread writing in the background). After KILLS kills
the job must finish with exit 0, its final checkpoint must hold the uninterrupted run's tensors
bit for bit, and the last logged loss and grad norm of every iteration must equal the
uninterrupted run's. Native TP 2 and DeepSpeed ZeRO-2 DP 2 with synchronous saves, native TP 2
with --ckpt-format torch_dist and --async-save, and ZeRO-3 DP 2 with --async-save (CASES),
against one uninterrupted (synchronous) run per engine on forked ranks. One case per engine
(the asynchronous ones) is restarted by a real `torchrun --max-restarts KILLS`, whose SIGTERM
reaches the surviving rank; the other restarts the job itself on forked ranks
(tests.harness.distributed.run_pretrain), each attempt ending by its planned kill, without a
launcher and fresh interpreters for every attempt. The seed of the kill plan is printed and in
every failure message; set CHAOS_SEED to replay one.

Non-persistent checkpoints (app.training.checkpointing.local), against one
uninterrupted DP 2 run per engine, on forked gloo ranks (the launcher is not the point): a
rank SIGKILLed after iteration 7, the job restarted, resumes from the non-persistent iteration
6, not the persistent 5 (local and global ones, of the native engine and of DeepSpeed ZeRO-2);
with --replication, a job stopped after iteration 7 whose rank_1 folder is
then deleted resumes from iteration 6 with rank 1's state from rank 0's replica.
Both end bit-identical to the uninterrupted run.
"""
import functools
import glob
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from app.checkpoint.deepspeed import load_deepspeed_file
from app.checkpoint.files import safe_torch_load
from tests.harness.corpus import read_metrics, tiny_gpt_args
from tests.harness.distributed import DistributedTestError, run_pretrain
from tests.harness.children import chaos_child, kill_once
from tests.harness.launch import ROOT, env
from tests.harness.checkpoints import tensors

CHILD = os.path.join(ROOT, "tests", "harness", "children", "chaos_child.py")
KILLS = 3
TRAIN_ITERS, GLOBAL_BATCH, SAVE_INTERVAL = 14, 4, 2
RUN = ["--train-iters", str(TRAIN_ITERS), "--log-interval", "1", "--eval-iters", "0",
       "--hidden-dropout", "0.1", "--global-batch-size", str(GLOBAL_BATCH),
       "--micro-batch-size", "2", "--save-interval", str(SAVE_INTERVAL), "--distributed-timeout-minutes", "1"]
ENGINES = {
    "native_tp2": ["--tensor-model-parallel-size", "2"],
    "zero2_dp2": ["--deepspeed", "--deepspeed_config",
                  os.path.join(ROOT, "ds_configs", "zero2.json")],
    "zero3_dp2": ["--deepspeed", "--deepspeed_config",
                  os.path.join(ROOT, "ds_configs", "zero3.json")],
    "native_tp2_torch_dist": ["--tensor-model-parallel-size", "2", "--ckpt-format", "torch_dist"],
    "native_dp2": [],
}
HANG_S = 540
"""A job still running after this long hangs: four attempts of a DeepSpeed job take a few
minutes on two cores shared with another suite (300 s was not enough under load); below the
suite's 600 s per-test limit, so this message, with the log, is what a hang reports."""
CASES = [("native_tp2", False, "forked"), ("zero2_dp2", False, "forked"),
         ("native_tp2_torch_dist", True, "torchrun"), ("zero3_dp2", True, "torchrun")]
"""Each engine once with synchronous saves (the default) and once with --async-save: the native
asynchronous case in the torch_dist format (its background write and the metadata published
after it), DeepSpeed's with ZeRO-3 (written as ZeRO-2's files are, plus the host copies). The
legacy format's background write SIGKILLed at each stage: tests/unit/test_checkpoint_async.py.
The asynchronous cases run under torchrun (a survivor's SIGTERM while its background write may
still be going); torchrun restarts of synchronous native TP 2 jobs, legacy and torch_dist, are
also in tests/integration/test_restarts.py."""


def kill_plan(rng):
    """KILLS entries [rank, kind, n], one per attempt: a kill in the n-th iteration the attempt
    trains (possibly before any checkpoint exists), or in the first file of its first or second
    save (a first save into an empty --save included: an uncommitted save is never a
    checkpoint). Each attempt gains at most 2 x SAVE_INTERVAL iterations, so every kill fires
    before TRAIN_ITERS."""
    plan = []
    for _ in range(KILLS):
        rank = rng.randrange(2)
        if rng.random() < 0.5:
            plan.append([rank, "write", rng.choice([1, 2])])
        else:
            plan.append([rank, "iteration", rng.randint(1, 2 * SAVE_INTERVAL + 1)])
    return plan


def last_logged(metrics_file):
    """{iteration: (loss, grad norm)} of the last train row logged for each iteration."""
    return {r["iteration"]: (r["lm_loss"], r["grad_norm"])
            for r in read_metrics(metrics_file) if r["kind"] == "train"}


def final_tensors(save_dir):
    """{file/key path: tensor} of every .pt file of the final iteration's checkpoint; of a
    torch_dist checkpoint, every stored tensor, read whole with PyTorch's own DCP reader."""
    directory = os.path.join(save_dir, f"iter_{TRAIN_ITERS:07d}")
    if os.path.isfile(os.path.join(directory, ".metadata")):
        stored = FileSystemReader(directory).read_metadata().state_dict_metadata
        found = {k: torch.empty(tuple(md.size), dtype=md.properties.dtype)
                 for k, md in stored.items() if hasattr(md, "chunks")}
        dcp.load(found, checkpoint_id=directory, no_dist=True)
        return found
    found = {}
    for path in sorted(glob.glob(os.path.join(directory, "**", "*.pt"), recursive=True)):
        rel = os.path.relpath(path, directory)
        load = safe_torch_load if rel.endswith("model_optim_rng.pt") else load_deepspeed_file
        found.update({f"{rel}{k}": v for k, v in tensors(load(path)).items()})
    return found


@pytest.fixture(scope="module")
def uninterrupted(tiny_corpus, tmp_path_factory):
    """`uninterrupted(engine)`: (save dir, metrics file) of one uninterrupted synchronous run
    of that engine, run the first time it is asked for (shared by the cases of that engine)."""
    runs = {}

    def run(engine):
        if engine not in runs:
            tmp = tmp_path_factory.mktemp(f"straight_{engine}")
            args = tiny_gpt_args(tiny_corpus, tmp, *RUN, *ENGINES[engine], "--save",
                                 str(tmp / "ck"), "--metrics-file", str(tmp / "m.jsonl"))
            run_pretrain(2, args, timeout=HANG_S)
            runs[engine] = (str(tmp / "ck"), tmp / "m.jsonl")
        return runs[engine]
    return run


def run_with_kills(args, cwd, plan, seed):
    """torchrun --max-restarts KILLS of chaos_child.py under `plan`; returns its output after
    checking it exited 0 after exactly KILLS restarts."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           f"--max-restarts={KILLS}", CHILD, *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(env(), CHAOS_PLAN=json.dumps(plan)), cwd=cwd,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=HANG_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        pytest.fail(f"seed {seed}, plan {plan}: torchrun still running after {HANG_S} s:\n"
                    f"{log[-6000:]}")
    (cwd / "torchrun.log").write_text(log)
    what = f"seed {seed}, plan {plan} (whole log: {cwd / 'torchrun.log'})"
    assert proc.returncode == 0, f"{what}: exit {proc.returncode}\n{log[-6000:]}"
    assert f"restart {KILLS} of torchrun's --max-restarts {KILLS}" in log, \
        f"{what}: not every kill fired\n{log[-6000:]}"
    return log


def run_forked_with_kills(args, cwd, plan, seed):
    """run_with_kills on forked ranks (run_pretrain) restarted by this test instead of torchrun:
    attempt a (0 first) arms plan[a] (chaos_child.arm_attempt); each of the KILLS planned
    attempts must end by its kill and nothing else, the one after them must finish."""
    what = f"seed {seed}, plan {plan}"
    deadline = time.monotonic() + HANG_S
    for attempt in range(KILLS + 1):
        fired = cwd / f"killed_in_attempt_{attempt}"
        setup = functools.partial(chaos_child.arm_attempt, plan, attempt, str(fired))
        try:
            run_pretrain(2, args, timeout=max(1.0, deadline - time.monotonic()), setup=setup)
        except (DistributedTestError, TimeoutError) as err:
            assert attempt < KILLS and fired.exists(), \
                f"{what}: attempt {attempt} failed, not by its planned kill:\n{str(err)[-6000:]}"
        else:
            assert attempt == KILLS, f"{what}: attempt {attempt} ended without its kill"


@pytest.mark.parametrize("engine,asynchronous,launcher", CASES,
                         ids=[f"{e}-{'async' if a else 'sync'}_save" for e, a, _ in CASES])
def test_random_kills_and_restarts_end_like_an_uninterrupted_run(tiny_corpus, tmp_path,
                                                                 uninterrupted, engine,
                                                                 asynchronous, launcher):
    seed = int(os.environ.get("CHAOS_SEED") or random.SystemRandom().randrange(2**31))
    plan = kill_plan(random.Random(seed))
    what = f"seed {seed}, plan {plan}"
    print(f"chaos {engine} async={asynchronous} ({launcher}): {what}")
    ck, metrics = str(tmp_path / "ck"), tmp_path / "m.jsonl"
    args = tiny_gpt_args(tiny_corpus, tmp_path, *RUN, *ENGINES[engine], "--save", ck,
                         "--load", ck, "--metrics-file", str(metrics),
                         *(["--async-save"] if asynchronous else []))
    if launcher == "torchrun":
        run_with_kills(args, tmp_path, plan, seed)
    else:
        run_forked_with_kills(args, tmp_path, plan, seed)
    want_dir, want_metrics = uninterrupted(engine)
    got, want = last_logged(metrics), last_logged(want_metrics)
    assert sorted(got) == list(range(1, TRAIN_ITERS + 1)), f"{what}: logged {sorted(got)}"
    for it in sorted(want):
        assert got[it] == want[it], f"{what}: iteration {it}: {got[it]} != {want[it]}"
    got_t, want_t = final_tensors(ck), final_tensors(want_dir)
    assert sorted(got_t) == sorted(want_t) and want_t, f"{what}: {sorted(got_t)[:8]}"
    for name, tensor in want_t.items():
        assert tensor.equal(got_t[name]), f"{what}: final checkpoint {name} differs"


LOCAL_EVERY, PERSISTENT_EVERY, KILLED_AFTER = 2, 5, 7
"""Local checkpoints every 2 iterations, persistent ones every 5: a job stopped after
iteration 7 resumes from the local checkpoint of iteration 6, not the persistent one of 5."""


def local_args(tmp_path, *extra, kind="local"):
    """The non-persistent checkpoint flags: local into tmp_path/local (plus `extra`), or global
    into Megatron's default <--save>/non_persistent."""
    where = (["--non-persistent-local-ckpt-dir", str(tmp_path / "local")] if kind == "local"
             else [])
    return ["--non-persistent-save-interval", str(LOCAL_EVERY), "--non-persistent-ckpt-type",
            kind, *where, *extra]


def assert_like_uninterrupted(ck, metrics, uninterrupted, what, engine="native_dp2"):
    """The run's last logged loss and grad norm of every iteration and its final checkpoint's
    tensors equal the uninterrupted DP 2 run's of `engine`, bit for bit."""
    want_dir, want_metrics = uninterrupted(engine)
    got, want = last_logged(metrics), last_logged(want_metrics)
    assert sorted(got) == list(range(1, TRAIN_ITERS + 1)), f"{what}: logged {sorted(got)}"
    for it in sorted(want):
        assert got[it] == want[it], f"{what}: iteration {it}: {got[it]} != {want[it]}"
    got_t, want_t = final_tensors(ck), final_tensors(want_dir)
    assert sorted(got_t) == sorted(want_t) and want_t, what
    for name, tensor in want_t.items():
        assert tensor.equal(got_t[name]), f"{what}: final checkpoint {name} differs"


NON_PERSISTENT_CASES = [("native_dp2", "local"), ("zero2_dp2", "local"), ("native_dp2", "global"),
                        ("zero2_dp2", "global")]
"""Local checkpoints of the native engine and of DeepSpeed ZeRO-2 (its partitioned optimizer
state, each rank's own); global non-persistent ones of both (the run's own format, Megatron's
legacy files or DeepSpeed's, written by the persistent save path into <--save>/non_persistent)."""


@pytest.mark.parametrize("engine,kind", NON_PERSISTENT_CASES,
                         ids=[f"{e}-{k}" for e, k in NON_PERSISTENT_CASES])
def test_killed_after_iteration_7_resumes_from_its_non_persistent_checkpoint_of_6(
        tiny_corpus, tmp_path, uninterrupted, engine, kind):
    """DP 2, non-persistent checkpoints every 2 iterations: rank 1 SIGKILLed in iteration 8, the
    test restarts the job (forked ranks, run_pretrain: the launcher is not the point), which
    resumes from the non-persistent iteration 6 (not the persistent 5) and ends bit-identical
    to an uninterrupted run. A local save of 6 is written in the background and committed at
    the end of the first iteration after which every rank's write is over: under load that
    can be after iteration 7, when the kill finds it uncommitted and the persistent 5 is
    (rightly) the resume point; so every rank waits in iteration 7 until its file of 6 is
    durable (kill_once.py), which makes the commit fall at the end of 7. A global save (no
    --async-save) commits in iteration 6 itself."""
    ck, metrics = str(tmp_path / "ck"), tmp_path / "m.jsonl"
    args = tiny_gpt_args(tiny_corpus, tmp_path, *RUN, *ENGINES[engine], "--save", ck, "--load",
                         ck, "--save-interval", str(PERSISTENT_EVERY), "--metrics-file",
                         str(metrics), *local_args(tmp_path, kind=kind))
    fired = tmp_path / "killed"
    kill = dict(KILL_RANK="1", KILL_AT_SAMPLE=str(KILLED_AFTER * GLOBAL_BATCH),
                KILL_FIRED=str(fired))
    if kind == "local":
        kill.update(WAIT_AT_SAMPLE=str((KILLED_AFTER - 1) * GLOBAL_BATCH),
                    WAIT_FOR_FILE=str(tmp_path / "local" / "rank_{rank}" / "iter_0000006" /
                                      "state_rank_0000{rank}.pt"))
    with pytest.raises(DistributedTestError) as failed:  # the first attempt
        run_pretrain(2, args, timeout=HANG_S, setup=functools.partial(kill_once.arm, kill))
    assert fired.exists(), \
        f"the first attempt failed, not by its kill:\n{str(failed.value)[-6000:]}"
    log = run_pretrain(2, args, timeout=HANG_S)[0]  # the restart
    what = ("the local checkpoint of iteration 6" if kind == "local" else
            f"the global non-persistent checkpoint of iteration 6 in {ck}/non_persistent")
    assert f"resuming from {what}" in log, log[-6000:]
    assert "persistent checkpoint of iteration 5" in log, log[-6000:]
    assert_like_uninterrupted(ck, metrics, uninterrupted, f"{engine} {kind}: killed after 7",
                              engine)
    if kind == "global":  # Megatron's cleanup: the older ones removed before each save
        held = sorted(os.listdir(os.path.join(ck, "non_persistent")))
        assert [d for d in held if d.startswith("iter_")] == ["iter_0000008", "iter_0000012"] \
            and "latest_checkpointed_iteration.txt" in held, held
    for rank in (0, 1) if kind == "local" else ():  # older ones removed as new ones commit
        held = sorted(os.listdir(tmp_path / "local" / f"rank_{rank}"))
        assert held == ["iter_0000012", "latest_checkpointed_iteration.txt"], held


def test_lost_local_folder_is_restored_from_its_replica(tiny_corpus, tmp_path, uninterrupted):
    """DP 2 with --replication (jump 1, factor 2): a job stopped after iteration 7 (no
    persistent checkpoint), its rank_1 folder deleted, resumes from iteration 6 with rank 1's
    state sent from rank 0's replica, and ends bit-identical to an uninterrupted run."""
    ck, metrics = str(tmp_path / "ck"), tmp_path / "m.jsonl"
    replication = local_args(tmp_path, "--replication", "--replication-jump", "1",
                             "--replication-factor", "2")
    run_pretrain(2, tiny_gpt_args(tiny_corpus, tmp_path, *RUN, "--exit-interval",
                                  str(KILLED_AFTER), "--metrics-file", str(metrics),
                                  *replication))
    replica = tmp_path / "local" / "rank_0" / "iter_0000006" / "state_rank_00001.pt"
    assert replica.is_file(), sorted(os.listdir(replica.parent))
    shutil.rmtree(tmp_path / "local" / "rank_1")
    logs = run_pretrain(2, tiny_gpt_args(tiny_corpus, tmp_path, *RUN, "--save", ck, "--load", ck,
                                         "--save-interval", str(PERSISTENT_EVERY),
                                         "--metrics-file", str(metrics), *replication))
    assert ("resuming from the local checkpoint of iteration 6" in logs[0]
            and "rank(s) [1] restored from replicas" in logs[0]), logs[0][-6000:]
    assert_like_uninterrupted(ck, metrics, uninterrupted, "rank_1 lost")
