"""End-to-end runs of pretrain_gpt2 on the native path (one process, CPU, fp32)."""
import os
import subprocess
import sys

from tests.harness.distributed import run_main
from tests.harness.corpus import read_metrics, tiny_gpt_args

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(argv):
    from pretrain_gpt2 import run
    return run(argv)


def _train_losses(metrics_file):
    rows = [r for r in read_metrics(metrics_file) if r["kind"] == "train"]
    return {r["iteration"]: (r["lm_loss"], r["grad_norm"]) for r in rows}


def test_resume_is_bit_identical_with_dropout(tiny_corpus, tmp_path):
    """8 iterations straight == 4 iterations, exit with a checkpoint, resume for 4 more."""
    common = ["--train-iters", "8", "--log-interval", "1", "--eval-interval", "100",
              "--eval-iters", "1", "--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
    straight = tmp_path / "straight.jsonl"
    _run(tiny_gpt_args(tiny_corpus, tmp_path, *common, "--metrics-file", str(straight)))
    ck = tmp_path / "ck"
    first = tmp_path / "first.jsonl"
    _run(tiny_gpt_args(tiny_corpus, tmp_path, *common, "--save", str(ck), "--save-interval", "100",
                       "--exit-interval", "4", "--metrics-file", str(first)))
    assert (ck / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    second = tmp_path / "second.jsonl"
    trainer = _run(tiny_gpt_args(tiny_corpus, tmp_path, *common, "--load", str(ck),
                                 "--save", str(ck), "--metrics-file", str(second)))
    assert trainer.state.iteration == 8 and trainer.state.consumed_train_samples == 32
    want = _train_losses(straight)
    got = {**_train_losses(first), **_train_losses(second)}
    assert sorted(got) == list(range(1, 9))
    for it in range(1, 9):
        assert got[it] == want[it], f"iteration {it}: resumed {got[it]} != straight {want[it]}"


def test_loss_falls_and_logs_are_written(tiny_corpus, tmp_path):
    """Validation loss falls below ln(vocab); metrics JSONL and TensorBoard events are written."""
    import math
    metrics = tmp_path / "m.jsonl"
    tb = tmp_path / "tb"
    trainer = _run(tiny_gpt_args(tiny_corpus, tmp_path, "--train-iters", "150", "--log-interval", "50",
                                 "--eval-interval", "75", "--eval-iters", "2", "--lr", "3e-3",
                                 "--hidden-dropout", "0", "--attention-dropout", "0",
                                 "--metrics-file", str(metrics), "--tensorboard-dir", str(tb)))
    rows = read_metrics(metrics)
    valid = [r for r in rows if r["kind"] == "valid"]
    assert [r["iteration"] for r in valid] == [75, 150]
    assert any(r["kind"] == "test" for r in rows)
    train = [r for r in rows if r["kind"] == "train"]
    assert [r["iteration"] for r in train] == [50, 100, 150]
    for key in ("lr", "lm_loss", "grad_norm", "tokens_per_s", "tflops_per_rank", "mfu",
                "ms_per_iteration", "consumed_samples", "skipped_iterations"):
        assert key in train[-1], key
    assert valid[-1]["lm_loss"] < math.log(tiny_corpus["vocab_size"]) - 0.75
    assert train[-1]["lm_loss"] < train[0]["lm_loss"]
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(tb))
    assert trainer.state.consumed_train_samples == 600


def _cli(argv, tmp_path):
    """`python pretrain_gpt2.py argv` (the first command of the test below; the others run
    `_forked`)."""
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_gpt2.py"), *argv],
                          capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)


def _forked(argv, tmp_path):
    """`_cli` in a child forked from a process that has imported the trainer (run_main): the
    same exit code and output without an interpreter start-up."""
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    code, out, err = run_main(argv, str(tmp_path), env)
    return subprocess.CompletedProcess(argv, code, out, err)


def test_cli_errors_exit_nonzero_with_clear_messages(tiny_corpus, tmp_path):
    """Config errors, a shape mismatch against a checkpoint and a damaged tracker exit 2."""
    base = ["--train-iters", "2", "--log-interval", "1", "--eval-iters", "0"]
    bad = _cli(tiny_gpt_args(tiny_corpus, tmp_path, *base, "--global-batch-size", "3"), tmp_path)
    assert bad.returncode == 2, bad.stderr
    assert "global" in bad.stderr and "3" in bad.stderr and "Traceback" not in bad.stderr

    ck = tmp_path / "ck"
    ok = _forked(tiny_gpt_args(tiny_corpus, tmp_path, *base, "--save", str(ck)), tmp_path)
    assert ok.returncode == 0, ok.stderr
    wide = tiny_gpt_args(tiny_corpus, tmp_path, *base, "--load", str(ck))
    wide[wide.index("--hidden-size") + 1] = "128"
    mismatch = _forked(wide, tmp_path)
    assert mismatch.returncode == 2 and "hidden_size" in mismatch.stderr, mismatch.stderr

    (ck / "latest_checkpointed_iteration.txt").write_text("abc")
    garbled = _forked(tiny_gpt_args(tiny_corpus, tmp_path, *base, "--load", str(ck)), tmp_path)
    assert garbled.returncode == 2 and "latest_checkpointed_iteration.txt" in garbled.stderr

    empty = tmp_path / "empty"
    empty.mkdir()  # an empty --load is a mistyped path, unless it is also --save (resume-or-start)
    typo = _forked(tiny_gpt_args(tiny_corpus, tmp_path, *base, "--load", str(empty)), tmp_path)
    assert typo.returncode == 2 and "holds no checkpoint" in typo.stderr, typo.stderr
    fresh = _forked(tiny_gpt_args(tiny_corpus, tmp_path, *base, "--load", str(empty), "--save",
                                  str(empty)), tmp_path)
    assert fresh.returncode == 0 and "starting from iteration 0" in fresh.stdout


def test_finetune_loads_weights_and_restarts_iteration(tiny_corpus, tmp_path):
    """--finetune takes the weights but starts at iteration 0 with fresh consumed samples."""
    import torch
    ck = tmp_path / "ck"
    base = ["--log-interval", "1", "--eval-iters", "0"]
    first = _run(tiny_gpt_args(tiny_corpus, tmp_path, "--train-iters", "3", *base, "--save", str(ck)))
    saved = {k: v.clone() for k, v in first.engine.module.state_dict().items()}
    tuned = _run(tiny_gpt_args(tiny_corpus, tmp_path, "--train-iters", "1", *base, "--load", str(ck),
                               "--finetune", "--lr", "0", "--min-lr", "0",
                               "--lr-warmup-iters", "0"))
    assert tuned.state.iteration == 1 and tuned.state.consumed_train_samples == 4
    for k, v in tuned.engine.module.state_dict().items():
        assert torch.equal(v, saved[k]), k  # lr 0: weights are exactly the loaded ones


def test_release_checkpoint_loads_weights_at_iteration_zero(tiny_corpus, tmp_path):
    """A `release` tracker and directory (Megatron's published-weights layout) load as weights."""
    import torch
    ck = tmp_path / "ck"
    base = ["--log-interval", "1", "--eval-iters", "0", "--lr-warmup-iters", "0"]
    first = _run(tiny_gpt_args(tiny_corpus, tmp_path, "--train-iters", "2", *base, "--save", str(ck)))
    saved = {k: v.clone() for k, v in first.engine.module.state_dict().items()}
    (ck / "iter_0000002").rename(ck / "release")
    (ck / "latest_checkpointed_iteration.txt").write_text("release")
    again = _run(tiny_gpt_args(tiny_corpus, tmp_path, "--train-iters", "1", *base, "--load", str(ck),
                               "--lr", "0", "--min-lr", "0"))
    assert again.state.iteration == 1
    for k, v in again.engine.module.state_dict().items():
        assert torch.equal(v, saved[k]), k


def test_no_load_optim_keeps_the_lr_schedule_position(tiny_corpus, tmp_path):
    """--no-load-optim: weights and data position load, Adam starts fresh, the LR continues."""
    common = ["--train-iters", "8", "--log-interval", "1", "--eval-iters", "0",
              "--hidden-dropout", "0", "--attention-dropout", "0"]
    straight = tmp_path / "straight.jsonl"
    _run(tiny_gpt_args(tiny_corpus, tmp_path, *common, "--metrics-file", str(straight)))
    ck, resumed = tmp_path / "ck", tmp_path / "resumed.jsonl"
    _run(tiny_gpt_args(tiny_corpus, tmp_path, *common, "--save", str(ck), "--exit-interval", "4"))
    _run(tiny_gpt_args(tiny_corpus, tmp_path, *common, "--load", str(ck), "--no-load-optim",
                       "--metrics-file", str(resumed)))
    want = {r["iteration"]: r for r in read_metrics(straight) if r["kind"] == "train"}
    got = {r["iteration"]: r for r in read_metrics(resumed) if r["kind"] == "train"}
    assert sorted(got) == [5, 6, 7, 8]
    for it in got:
        assert got[it]["lr"] == want[it]["lr"], it
    assert got[5]["lm_loss"] == want[5]["lm_loss"]  # same weights, same batch
    assert got[6]["lm_loss"] != want[6]["lm_loss"]  # the update used a fresh Adam state


def test_exit_duration_rotation_and_relaunching_a_finished_run(tiny_corpus, tmp_path):
    base = ["--log-interval", "1", "--eval-iters", "0"]
    timed = tmp_path / "timed"
    t = _run(tiny_gpt_args(tiny_corpus, tmp_path, "--train-iters", "20", *base, "--save", str(timed),
                           "--exit-duration-in-mins", "1e-9"))
    assert t.state.iteration == 1  # over the time budget after the first iteration: save, exit
    assert (timed / "latest_checkpointed_iteration.txt").read_text().strip() == "1"

    ck = tmp_path / "ck"
    args = tiny_gpt_args(tiny_corpus, tmp_path, "--train-iters", "5", *base, "--save", str(ck),
                         "--load", str(ck), "--save-interval", "1", "--keep-last-n-checkpoints", "2")
    _run(args)
    assert sorted(p.name for p in ck.iterdir() if p.name.startswith("iter_")) == [
        "iter_0000004", "iter_0000005"]
    before = (ck / "iter_0000005" / "mp_rank_00" / "model_optim_rng.pt").stat().st_mtime_ns
    again = _cli(args, tmp_path)  # e.g. a job requeued after it finished
    assert again.returncode == 0 and "nothing to train" in again.stdout, again.stderr[-2000:]
    assert (ck / "iter_0000005" / "mp_rank_00" / "model_optim_rng.pt").stat().st_mtime_ns == before


def test_extending_a_run_needs_an_explicit_lr_schedule_choice(tiny_corpus, tmp_path):
    """A longer --train-iters changes the decay horizon: resuming stops with a message naming
    both flags; --override-opt_param-scheduler decays over the new horizon, while
    --use-checkpoint-opt_param-scheduler keeps the saved one (already at min-lr)."""
    import math
    base = ["--log-interval", "1", "--eval-iters", "0", "--lr-warmup-iters", "0",
            "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine"]
    ck = tmp_path / "ck"
    _run(tiny_gpt_args(tiny_corpus, tmp_path, "--train-iters", "4", *base, "--save", str(ck)))
    longer = tiny_gpt_args(tiny_corpus, tmp_path, "--train-iters", "8", *base, "--load", str(ck))
    refused = _cli(longer, tmp_path)
    assert refused.returncode == 2 and "--override-opt_param-scheduler" in refused.stderr
    curves = {}
    for flag in ("--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler"):
        metrics = tmp_path / f"{flag}.jsonl"
        _run(longer + [flag, "--metrics-file", str(metrics)])
        curves[flag] = {r["iteration"]: r["lr"] for r in read_metrics(metrics) if r["kind"] == "train"}
    cosine = lambda it: 1e-4 + 0.5 * (1e-3 - 1e-4) * (1 + math.cos(math.pi * it / 8))  # noqa: E731
    for it in (5, 6, 7):  # the LR the update of iteration `it` used: schedule step it - 1
        assert abs(curves["--override-opt_param-scheduler"][it] - cosine(it - 1)) < 1e-12
        assert curves["--use-checkpoint-opt_param-scheduler"][it] == 1e-4
