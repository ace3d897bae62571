"""Self-healing (--rollback-on-spike): a poisoned batch triggers one rollback to the last
checkpoint, its data window is skipped and the run finishes; a failure past the retry limit
stops with exit code 3 and no checkpoint from the poisoned state. A diverged run exits
non-zero, saves no checkpoint of a non-finite state and reports its perplexity as NaN."""
import logging
import math
import os
import shutil

import numpy as np
import pytest
import torch

import arguments
import pretrain_gpt2
from app.config import samples_per_split
from app.checkpoint.legacy import per_rank as ckpt
from app.checkpoint import names
from app.training.checkpointing.resume import load_on_all_ranks
from app.training.resilience.nonfinite import TrainingAborted
from app.training.resilience.rollback import SpikeDetector
from app.training.run import build_run
from app.training.state import RunState
from app.utils import faults
from tests.harness.distributed import run_distributed
from tests.harness.synthetic import RandomTokens
from tests.harness.corpus import read_metrics, tiny_gpt_args

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VOCAB = 64  # RandomTokens draw ids below 64; the model's padded vocabulary has 128 rows
POISON_TOKEN = 100  # an id the clean data never holds: after some training its loss is high
SPIKE_ARGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
              "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
              "--global-batch-size", "4", "--train-iters", "30", "--lr", "1e-2",
              "--lr-warmup-iters", "0", "--hidden-dropout", "0", "--attention-dropout", "0",
              "--eval-iters", "0", "--log-interval", "1", "--make-vocab-size-divisible-by", "128",
              "--num-workers", "0", "--distributed-backend", "gloo", "--save-interval", "5",
              "--rollback-on-spike", "--spike-window", "5", "--max-rollbacks", "1"]


class PoisonedSamples:
    """A dataset whose samples at `poisoned` indices are replaced by one repeated unseen token;
    records every index read."""

    def __init__(self, data, poisoned):
        self.data, self.poisoned, self.read = data, set(poisoned), []

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        self.read.append(i)
        if i in self.poisoned:
            return {"text": np.full_like(self.data[i]["text"], POISON_TOKEN)}
        return self.data[i]


def test_spike_detector_rule():
    det = SpikeDetector(arguments.config_from_argv(
        [*SPIKE_ARGS, "--save", "x", "--spike-zscore", "3", "--spike-min-increase", "0.1"],
        1, VOCAB).rollback)
    for loss in (4.0, 4.1, 3.9, 4.0, 4.0):  # mean 4.0, std 0.0632
        assert det.observe(loss) is None
    assert det.observe(4.3) is None  # above mean + 3 std (4.19) but not 10 % above the mean
    assert det.observe(float("nan")) is None and len(det.history) == 5
    reason = det.observe(9.0)
    assert reason is not None and "loss 9.0000" in reason and list(det.history)[-1] == 4.3


def test_rollback_needs_save_and_save_interval_and_sizes_the_data_for_the_skips():
    at = SPIKE_ARGS.index("--save-interval")
    argv = SPIKE_ARGS[:at] + SPIKE_ARGS[at + 2:]
    with pytest.raises(ValueError, match="--rollback-on-spike reloads the latest checkpoint"):
        arguments.config_from_argv([*argv, "--save", "x"], 1, VOCAB)
    cfg = arguments.config_from_argv([*SPIKE_ARGS, "--save", "x"], 1, VOCAB)
    # one rollback of <= --save-interval (5) + --max-consecutive-skipped-iterations (10)
    assert samples_per_split(cfg)[0] == 30 * 4 + 1 * (5 + 10) * 4


def _run(cfg, datasets, state=None, load=None):
    run = build_run(cfg, 1, torch.device("cpu"))
    if load is not None:
        load_on_all_ranks(run.engine, load, torch.device("cpu"))
    trainer = run.attach_trainer(datasets, eod=0, state=state)
    trainer.train()
    return trainer


LOCAL = ("--non-persistent-save-interval", "2", "--non-persistent-ckpt-type", "local",
         "--non-persistent-local-ckpt-dir")
"""Local checkpoints every 2 iterations (the test's folder follows): 16 is newer than the
persistent 15, so the rollback goes back to 16, as a resume would."""
GLOBAL = ("--non-persistent-save-interval", "2", "--non-persistent-ckpt-type", "global")
"""Global non-persistent checkpoints every 2 iterations into <--save>/non_persistent: the
rollback goes back to 16 as with local ones."""


@pytest.mark.parametrize("engine", [LOCAL, ("--deepspeed", "--deepspeed_config",
                                             os.path.join(ROOT, "ds_configs", "zero2.json")),
                                    ("--deepspeed", "--deepspeed_config",
                                     os.path.join(ROOT, "ds_configs", "zero3.json")),
                                    ("--async-save",), GLOBAL],
                         ids=["native_local_checkpoints", "deepspeed", "deepspeed_zero3",
                              "native_async_save", "native_global_non_persistent"])
def test_poisoned_batch_rolls_back_once_skips_its_window_and_finishes(tmp_path, caplog, engine):
    ck = tmp_path / "ck"
    local = engine in (LOCAL, GLOBAL)  # non-persistent checkpoints: back to 16
    flags = [*engine, str(tmp_path / "local")] if engine == LOCAL else list(engine)
    cfg = arguments.config_from_argv([*SPIKE_ARGS, *flags, "--save", str(ck)], 1, VOCAB)
    poisoned = range(4 * 17, 4 * 17 + 3)  # three of the four samples of iteration 18
    data = PoisonedSamples(RandomTokens(400, 16, VOCAB, seed=3), poisoned)
    with caplog.at_level(logging.WARNING):
        trainer = _run(cfg, (data, None, None))
    log = caplog.text
    back, kind = 15, f"persistent checkpoint of iteration 15 in {ck}"
    if local:
        back, kind = 16, (f"local checkpoint of iteration 16 in {tmp_path / 'local'}"
                          if engine == LOCAL else "global non-persistent checkpoint of "
                          f"iteration 16 in {ck}/non_persistent")
    assert "iteration 18: loss" in log and "rolling back (1 of 1)" in log, log
    assert f"rolled back to iteration {back} from the {kind}" in log, log
    assert f"skipping training samples [{4 * back}, 72)" in log
    assert trainer.state.iteration == 30
    assert trainer.state.consumed_train_samples == 30 * 4 + 72 - 4 * back
    after = data.read[data.read.index(72):]  # reads once the rollback resumed at sample 72
    assert not set(after) & set(range(4 * back, 72)), "the skipped window was read again"
    assert ckpt.read_tracker(str(ck)) == 30

    # the rollback is exactly "load iteration 15 (with local checkpoints: and train iteration
    # 16 on its samples [60, 64)), then continue at sample 72": a fresh run doing that by hand
    # ends with the same weights, bit for bit
    reference = tmp_path / "ref"
    shutil.copytree(ck / "iter_0000015", reference / "iter_0000015")
    if "--deepspeed" in engine:
        (reference / "latest").write_text("iter_0000015")
    names.write_tracker(str(reference), 15)
    again_argv = [*SPIKE_ARGS, *([] if local else engine), "--save", str(tmp_path / "other")]
    clean = (RandomTokens(400, 16, VOCAB, seed=3), None, None)
    if local:
        run = build_run(arguments.config_from_argv([*again_argv, "--exit-interval", "16"], 1,
                                                   VOCAB), 1, torch.device("cpu"))
        load_on_all_ranks(run.engine, str(reference), torch.device("cpu"))
        run.attach_trainer(clean, eod=0, state=RunState(15, 60, 0)).train()
        again = run.attach_trainer(clean, eod=0, state=RunState(16, 72, 0))
        again.train()
    else:
        again = _run(arguments.config_from_argv(again_argv, 1, VOCAB), clean,
                     state=RunState(15, 72, 0), load=str(reference))
    assert again.state.iteration == 30
    for (name, p), (_, q) in zip(trainer.engine.local_parameters(),
                                 again.engine.local_parameters(), strict=True):
        assert torch.equal(p, q), name


# only the non-finite limit triggers here (no spike is called before 100 losses)
NAN_LIMIT_ARGS = [*SPIKE_ARGS, "--max-consecutive-skipped-iterations", "3", "--spike-window",
                  "100"]


def _poison_iterations(first_samples):
    """A faults.TRAINING_LOSS handler: the loss is NaN in the iterations that start at
    `first_samples`."""
    return lambda first, loss: loss * float("nan") if first in first_samples else loss


def test_nonfinite_run_over_a_save_point_fits_the_data_allowance(tmp_path, caplog):
    """NaN losses at iterations 9-11 (--save-interval 5, limit 3): the save at 10 is suppressed,
    so the rollback goes back to 5 and skips 6 iterations, more than one --save-interval; data
    sized exactly as the run's datasets are still reaches --train-iters."""
    cfg = arguments.config_from_argv([*NAN_LIMIT_ARGS, "--save", str(tmp_path / "ck")], 1, VOCAB)
    data = RandomTokens(samples_per_split(cfg)[0], 16, VOCAB, seed=3)
    with faults.injected(faults.TRAINING_LOSS, _poison_iterations({32, 36, 40})):
        with caplog.at_level(logging.WARNING):
            trainer = _run(cfg, (data, None, None))
    assert "rolled back to iteration 5" in caplog.text, caplog.text
    assert "skipping training samples [20, 44)" in caplog.text
    assert trainer.state.iteration == 30 and trainer.state.consumed_train_samples == 30 * 4 + 24


def test_short_validation_data_is_an_error_before_the_first_iteration(tmp_path):
    """Evaluations at 10, 20, 30 of one global batch each need 12 validation samples."""
    cfg = arguments.config_from_argv([*SPIKE_ARGS, "--save", str(tmp_path), "--eval-iters", "1",
                                      "--eval-interval", "10"], 1, VOCAB)
    trainer = build_run(cfg, 1, torch.device("cpu")).attach_trainer(
        (RandomTokens(200, 16, VOCAB), RandomTokens(11, 16, VOCAB), None), eod=0)
    with pytest.raises(ValueError, match="the validation data set holds 11 samples, but the run "
                                         "reads up to sample 12"):
        trainer.train()
    assert trainer.state.iteration == 0


def _tp2_data_running_out(save_dir):
    """Rank function (TP 2, so a rank that reads no data waits in the batch broadcast): a
    training set too short from the start, then a rollback whose skip would leave too few
    samples. Returns the error text each scenario raised on this rank."""
    cfg = arguments.config_from_argv([*NAN_LIMIT_ARGS, "--tensor-model-parallel-size", "2",
                                      "--save", save_dir], 2, VOCAB)
    run = build_run(cfg, 2, torch.device("cpu"))
    errors = {}
    try:
        run.attach_trainer((RandomTokens(30 * 4 - 4, 16, VOCAB), None, None), eod=0).train()
    except ValueError as exc:
        errors["start"] = str(exc)
    # NaN at 10 (the save at 10 is suppressed) and at 12-14 (the limit): going back to 5 skips
    # 9 iterations, more than the allowance of 5 + 3 the data was sized for
    try:
        with faults.injected(faults.TRAINING_LOSS, _poison_iterations({36, 44, 48, 52})):
            data = RandomTokens(samples_per_split(cfg)[0], 16, VOCAB, seed=3)
            run.attach_trainer((data, None, None), eod=0).train()
    except TrainingAborted as exc:
        errors["rollback"] = str(exc)
    return errors


def test_running_out_of_training_data_stops_every_tensor_parallel_rank(tmp_path):
    """Both failures raise on both TP ranks: rank 0 (the reader) does not stop alone and
    leave rank 1 waiting in the batch broadcast until the process-group timeout."""
    ck = tmp_path / "ck"
    ranks = run_distributed(_tp2_data_running_out, 2, str(ck), timeout=180)
    assert ranks[0] == ranks[1], ranks
    errors = ranks[0]
    assert "the training data set holds 116 samples, but the run reads up to sample 120" in \
        errors.get("start", ""), errors
    rollback = errors.get("rollback", "")
    assert "iteration 14: the non-finite limit was reached" in rollback, errors
    assert "rolling back to iteration 5" in rollback and "training samples up to 156" in rollback
    assert f"holds {30 * 4 + 8 * 4}" in rollback and "stopping without saving" in rollback
    assert ckpt.read_tracker(str(ck)) == 5


def test_failure_past_the_retry_limit_stops_without_a_new_checkpoint(tiny_corpus, tmp_path,
                                                                      capsys):
    """NaN losses injected into two data windows: the first reaches the non-finite limit and is
    rolled back; the second finds the budget (--max-rollbacks 1) spent: exit 3, the latest
    checkpoint stays the last one saved before it."""
    ck = tmp_path / "ck"
    # samples 44-51 are iterations 12-13; after the rollback to 10 skips samples [40, 52),
    # samples 100-107 are iterations 23-24
    windows = [range(44, 52), range(100, 108)]

    def poison(first_sample, loss):
        bad = any(first_sample in w for w in windows)
        return loss * float("nan") if bad else loss

    with faults.injected(faults.TRAINING_LOSS, poison):
        code = pretrain_gpt2.main(tiny_gpt_args(
            tiny_corpus, tmp_path, "--train-iters", "40", "--log-interval", "1", "--eval-iters",
            "0", "--save", str(ck), "--save-interval", "5", "--rollback-on-spike",
            "--max-rollbacks", "1", "--max-consecutive-skipped-iterations", "2",
            "--metrics-file", str(tmp_path / "m.jsonl")))
    out = capsys.readouterr()
    assert code == 3, out.err[-3000:]
    assert "rolled back to iteration 10" in out.out and "skipping training samples [40, 52)" in out.out
    stop = [line for line in out.err.splitlines() if line.startswith("error:")]
    assert len(stop) == 1 and "1 rollback(s) already made (--max-rollbacks)" in stop[0], out.err
    assert "iteration 24: the non-finite limit was reached (2 consecutive iterations" in stop[0]
    assert ckpt.read_tracker(str(ck)) == 20 and names.list_checkpoint_iterations(str(ck))[-1] == 20
    rows = [r for r in read_metrics(tmp_path / "m.jsonl") if r["kind"] == "train"]
    assert all(math.isfinite(r["lm_loss"]) for r in rows if r["lm_loss"] is not None)


def test_diverged_run_exits_nonzero_without_nan_checkpoint_and_nan_perplexity(
        tiny_corpus, tmp_path, capsys):
    """--lr 1e6 diverges: the run exits non-zero, writes no checkpoint of the NaN state and
    prints the perplexity as NaN, not as a finite overflowed number."""
    ck = tmp_path / "ck"
    code = pretrain_gpt2.main(tiny_gpt_args(
        tiny_corpus, tmp_path, "--train-iters", "30", "--lr", "1e6", "--lr-warmup-iters", "0",
        "--save", str(ck), "--save-interval", "2", "--eval-interval", "4", "--eval-iters", "1",
        "--log-interval", "1", "--max-consecutive-skipped-iterations", "5"))
    out = capsys.readouterr()
    assert code == 3, out.err[-2000:]
    assert "lm loss PPL: NAN" in out.out and "E+08" not in out.out
    # the update of iteration 1 (finite gradients) already breaks the model: every save
    # (interval 2) fell inside the run of non-finite iterations, so none was written
    assert not ck.exists() or ckpt.read_tracker(str(ck)) is None
