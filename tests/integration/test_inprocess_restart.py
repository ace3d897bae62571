"""In-process restart (--inprocess-restart): faults in one rank of a DP 2 run are recovered inside
the same processes and the run ends bit-identical to one without faults.

One spawn of two gloo ranks trains the tiny GPT-2 twice, 8 iterations with dropout: first
undisturbed, then with --inprocess-restart and two faults, armed at the fault-injection point
`faults.TRAINING_LOSS` (app/utils/faults.py):

- in iteration 4, rank 1 raises an ordinary error in its forward pass while rank 0 goes on into
  the gradient all-reduce (a lost peer for rank 0);
- in iteration 7, rank 0's loss is NaN once, which --check-for-nan-in-loss-and-grad turns into
  an error on both ranks.

Each is recovered from the in-memory snapshot of the iteration before, in the same process
(its pid recorded at the fault and at the end), and the final weights, optimizer states and
every iteration's last logged loss and gradient norm equal the undisturbed run's, bit for bit.

The same spawn then checks --inprocess-restart with --rollback-on-spike and local checkpoints
every 2 iterations (persistent every 5): NaN losses in iterations 13 and 14 reach the
non-finite limit (2), the rollback goes back to the local checkpoint of 12 (not the persistent
10) and skips samples [48, 56); then rank 1 raises in the first iteration after it. The restart
resumes from the snapshot the rollback took (iteration 12, past the skipped window; not the
snapshot of 13, before it) and ends bit-identical to the same run without that fault. The run
has --save and no --load: the restarted attempt does not refuse the checkpoints of 5 and 10 it
finds there (its own).
"""
import os
import time

import pytest
import torch

from tests.harness.distributed import _pretrain_on_rank, run_distributed
from tests.harness.corpus import tiny_gpt_args
from tests.harness.launch import ROOT, train_curve

TRAIN_ITERS, GLOBAL_BATCH = 8, 4
RUN = ["--train-iters", str(TRAIN_ITERS), "--log-interval", "1", "--eval-iters", "0",
       "--hidden-dropout", "0.1", "--global-batch-size", str(GLOBAL_BATCH),
       "--micro-batch-size", "2", "--check-for-nan-in-loss-and-grad",
       "--distributed-timeout-minutes", "1"]
ERROR_AT, NAN_AT = 4, 7
"""Iterations of the two faults: an exception in rank 1, a NaN loss in rank 0."""


def _faults(fired):
    """The TRAINING_LOSS handler of the faulty run: each fault once, on its rank."""
    import torch.distributed as dist

    def handler(first_sample, loss):
        iteration = first_sample // GLOBAL_BATCH + 1
        rank = dist.get_rank()
        if iteration == ERROR_AT and rank == 1 and "error" not in fired:
            fired["error"] = (os.getpid(), time.time())
            raise RuntimeError("injected fault: a bug in rank 1's forward pass")
        if iteration == NAN_AT and rank == 0 and "nan" not in fired:
            fired["nan"] = (os.getpid(), time.time())
            return loss * float("nan")
        return loss
    return handler


ROLLBACK_RUN = ["--train-iters", "18", "--log-interval", "1", "--eval-iters", "0",
                "--save-interval", "5", "--rollback-on-spike",
                "--max-consecutive-skipped-iterations", "2", "--non-persistent-save-interval",
                "2", "--non-persistent-ckpt-type", "local"]


def _rollback_faults(fired, fault):
    """The TRAINING_LOSS handler of a rollback run: NaN in iterations 13 and 14 (first samples
    48 and 52) once each; with `fault`, an error in rank 1 in the first iteration after the
    rollback (sample 56)."""
    import torch.distributed as dist

    def handler(first_sample, loss):
        if first_sample in (48, 52) and first_sample not in fired:
            fired[first_sample] = True
            return loss * float("nan")
        if fault and first_sample == 56 and dist.get_rank() == 1 and "error" not in fired:
            fired["error"] = True
            raise RuntimeError("injected fault: a bug in rank 1 after the rollback")
        return loss
    return handler


def _final_state(trainer):
    """{name: tensor} of the final weights and optimizer states."""
    from tests.harness.checkpoints import tensors

    engine = trainer.engine
    return {k: v.detach().clone() for k, v in
            tensors({"model": engine.module.state_dict(),
                     "optimizer": engine.optimizer.state_dict()}).items()}


def _two_runs(clean_argv, faulty_argv, rollback_argvs, log_dir, environ):
    """Rank side: the undisturbed run, then the faulty one, then the two rollback runs (without
    and with the fault), in the same process; the Trainers that pretrain_gpt2.run returns are
    kept for their final states and restart history."""
    import pretrain_gpt2
    from app.utils import faults

    trainers = []
    real_run = pretrain_gpt2.run
    pretrain_gpt2.run = lambda argv: trainers.append(real_run(argv)) or trainers[-1]
    try:
        clean_log = _pretrain_on_rank(clean_argv, os.path.join(log_dir, "clean"), environ)
        fired = {}
        faults.arm(faults.TRAINING_LOSS, _faults(fired))
        faulty_log = _pretrain_on_rank(faulty_argv, os.path.join(log_dir, "faulty"), environ)
        logs = []
        for name, argv in zip(("rollback", "rollback_faulty"), rollback_argvs):
            faults.arm(faults.TRAINING_LOSS, _rollback_faults({}, name == "rollback_faulty"))
            logs.append(_pretrain_on_rank(argv, os.path.join(log_dir, name), environ))
    finally:
        pretrain_gpt2.run = real_run
        faults.disarm_all()
    clean, faulty, rollback, rollback_faulty = trainers
    return {"pid": os.getpid(), "fired": fired, "history": faulty.guard.inprocess.history,
            "clean": _final_state(clean), "faulty": _final_state(faulty),
            "clean_log": clean_log, "faulty_log": faulty_log,
            "rollback": _final_state(rollback), "rollback_faulty": _final_state(rollback_faulty),
            "rollback_history": rollback_faulty.guard.inprocess.history, "rollback_logs": logs}


def test_faults_recovered_in_process_bit_identical(tiny_corpus, tmp_path):
    clean = tiny_gpt_args(tiny_corpus, tmp_path, *RUN, "--metrics-file",
                          str(tmp_path / "clean.jsonl"))
    faulty = tiny_gpt_args(tiny_corpus, tmp_path, *RUN, "--inprocess-restart",
                           "--inprocess-barrier-timeout", "60",
                           "--metrics-file", str(tmp_path / "faulty.jsonl"))
    rollback_argvs = [tiny_gpt_args(tiny_corpus, tmp_path, *ROLLBACK_RUN, *extra,
                                     "--save", str(tmp_path / name / "ck"),
                                     "--non-persistent-local-ckpt-dir",
                                     str(tmp_path / name / "local"))
                      for name, extra in (("rollback", ()), ("rollback_faulty", (
                          "--inprocess-restart", "--inprocess-barrier-timeout", "60")))]
    for name in ("clean", "faulty", "rollback", "rollback_faulty"):
        os.makedirs(tmp_path / "logs" / name)
    ranks = run_distributed(_two_runs, 2, clean, faulty, rollback_argvs, str(tmp_path / "logs"),
                            dict(os.environ), timeout=400, daemon=False)
    for rank, out in enumerate(ranks):
        what = f"rank {rank}:\n{out['faulty_log'][-3000:]}"
        # both faults happened, in this same process, which then finished the run
        assert set(out["fired"]) == ({"error"} if rank == 1 else {"nan"}), what
        assert all(pid == out["pid"] for pid, _ in out["fired"].values()), what
        # two restarts, each back to the snapshot of the iteration before its fault
        assert [(h["restart"], h["resumed_at"], h["redone"]) for h in out["history"]] == \
            [(1, ERROR_AT - 1, 0), (2, NAN_AT - 1, 0)], what
        assert all(0 < h["seconds"] < 60 for h in out["history"]), what
        for restart in (1, 2):
            assert f"[rank {rank}] WARNING: in-process restart {restart} of 3 (rank {rank}, " \
                f"pid {out['pid']})" in out["faulty_log"], what
        assert sorted(out["faulty"]) == sorted(out["clean"]) and out["clean"], what
        for name, want in out["clean"].items():
            assert torch.equal(out["faulty"][name], want), f"rank {rank}: {name} differs"
    assert "raise RuntimeError(\"injected fault" in ranks[1]["faulty_log"]  # its traceback
    assert "rank 1: RuntimeError: injected fault" in ranks[0]["faulty_log"]  # rank 0 names it
    assert "in-process restart 2: every rank rejoined" in ranks[0]["faulty_log"]
    want = train_curve(tmp_path / "clean.jsonl")  # each iteration's last logged loss, grad norm
    assert sorted(want) == list(range(1, TRAIN_ITERS + 1))
    assert train_curve(tmp_path / "faulty.jsonl") == want
    for rank, out in enumerate(ranks):  # --rollback-on-spike with local checkpoints
        assert [(h["restart"], h["resumed_at"], h["redone"]) for h in out["rollback_history"]] \
            == [(1, 12, 0)], f"rank {rank}: {out['rollback_logs'][1][-3000:]}"
        assert sorted(out["rollback_faulty"]) == sorted(out["rollback"]) and out["rollback"]
        for name, want in out["rollback"].items():
            assert torch.equal(out["rollback_faulty"][name], want), f"rank {rank}: {name} differs"
    for log in ranks[1]["rollback_logs"]:  # the last rank logs the rollback
        assert "rolled back to iteration 12 from the local checkpoint of iteration 12" in log, \
            log[-3000:]
        assert "skipping training samples [48, 56)" in log


def test_inprocess_restart_refuses_what_it_cannot_rebuild(tiny_corpus, tmp_path):
    """--deepspeed and --use-distributed-optimizer are refused with the flags named; so is
    --inprocess-snapshot-interval 0 without --load."""
    from arguments import config_from_argv

    base = tiny_gpt_args(tiny_corpus, tmp_path, "--train-iters", "2", "--inprocess-restart")
    zero2 = os.path.join(ROOT, "ds_configs", "zero2.json")
    with pytest.raises(ValueError, match="--inprocess-restart.*--deepspeed"):
        config_from_argv(base + ["--deepspeed", "--deepspeed_config", zero2], 2, 512)
    with pytest.raises(ValueError, match="--inprocess-restart.*--use-distributed-optimizer"):
        config_from_argv(base + ["--use-distributed-optimizer"], 2, 512)
    with pytest.raises(ValueError, match="--inprocess-snapshot-interval 0.*--load"):
        config_from_argv(base + ["--inprocess-snapshot-interval", "0"], 2, 512)
    with pytest.raises(ValueError, match="--inprocess-max-iterations must be positive"):
        config_from_argv(base + ["--inprocess-max-iterations", "0"], 2, 512)
    cfg = config_from_argv(base + ["--inprocess-snapshot-interval", "0", "--load", "x"], 2, 512)
    assert cfg.inprocess.enabled and cfg.inprocess.snapshot_interval == 0
