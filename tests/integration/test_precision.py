"""Native fp16/bf16 end to end on the tiny corpus (one process): bit-exact resume including the
loss scale, checkpoints that Megatron's tools read with fp32 main weights inside, loading across
precisions, and a diverged run that stops with exit code 3 and no checkpoint of its NaN state."""
import os

import pytest
import torch

from tests.harness.distributed import run_main
from tests.harness.corpus import read_metrics, tiny_gpt_args
from tests.harness.checkpoints import megatron_reader

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
COMMON = ["--log-interval", "1", "--eval-iters", "0", "--hidden-dropout", "0.1",
          "--attention-dropout", "0.1"]
# fp16 starts at 2^12 with a window of 3 so that the scale moves (grows) within 16 iterations
HALF = {"fp16": ["--fp16", "--initial-loss-scale", "4096", "--loss-scale-window", "3"],
        "bf16": ["--bf16"]}


def _run(argv):
    from pretrain_gpt2 import run
    return run(argv)


def _train_rows(path):
    return {r["iteration"]: (r["lm_loss"], r["grad_norm"], r.get("loss_scale"))
            for r in read_metrics(path) if r["kind"] == "train"}


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_half_precision_resume_is_bit_exact(tiny_corpus, tmp_path, precision):
    """16 iterations straight == 8, exit with a checkpoint, resume for 8: losses, grad norms and
    loss scales identical, dropout on."""
    args = ["--train-iters", "16", *COMMON, *HALF[precision]]
    straight = tmp_path / "straight.jsonl"
    _run(tiny_gpt_args(tiny_corpus, tmp_path, *args, "--metrics-file", str(straight)))
    ck, first, second = tmp_path / "ck", tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    _run(tiny_gpt_args(tiny_corpus, tmp_path, *args, "--save", str(ck), "--exit-interval", "8",
                       "--metrics-file", str(first)))
    _run(tiny_gpt_args(tiny_corpus, tmp_path, *args, "--load", str(ck), "--metrics-file",
                       str(second)))
    want, got = _train_rows(straight), {**_train_rows(first), **_train_rows(second)}
    assert sorted(got) == list(range(1, 17))
    for it in range(1, 17):
        assert got[it] == want[it], f"iteration {it}: resumed {got[it]} != straight {want[it]}"
    if precision == "fp16":
        scales = [want[it][2] for it in range(1, 17)]
        assert scales[0] == 4096.0 and max(scales) > 4096.0  # grew after clean windows
    else:
        assert all(want[it][2] is None for it in want)


def test_fp16_checkpoint_reads_as_megatron_and_holds_fp32_main_weights(tiny_corpus, tmp_path):
    from app.checkpoint.legacy import per_rank as ckpt
    ck = tmp_path / "ck"
    trainer = _run(tiny_gpt_args(tiny_corpus, tmp_path, "--train-iters", "3", *COMMON,
                                 *HALF["fp16"], "--save", str(ck)))
    r = megatron_reader(str(ck))  # written from Megatron's documented structure, not our code
    assert r["word"].dtype == torch.float16 and r["args"].fp16 and r["iteration"] == 3
    assert r["args"].params_dtype == torch.float16
    assert set(r["optimizer"]) >= {"optimizer", "grad_scaler", "fp32_from_fp16_params"}
    assert r["optimizer"]["grad_scaler"]["scale"].item() == trainer.engine.loss_scale
    state, _ = ckpt.load_checkpoint_dict(str(ck))
    main = ckpt.fp32_main_weights(state)
    wrapper = trainer.engine.optimizer
    live = {n: wrapper.main_of[id(p)] for n, p in wrapper.named_params}
    assert sorted(main) == sorted(live)
    for name, value in main.items():
        assert value.dtype == torch.float32 and torch.equal(value, live[name]), name
        assert torch.equal(value.half(), dict(trainer.engine.module.named_parameters())[name])


LR0 = ["--lr", "0", "--min-lr", "0", "--override-opt_param-scheduler"]  # weights must not move


def test_loading_across_precisions(tiny_corpus, tmp_path, caplog):
    """fp32 -> bf16 (full resume and --finetune) and fp16 -> fp32: the most exact fp32 weights
    are used and the conversion is logged."""
    import logging
    fp32_ck, fp16_ck = tmp_path / "fp32", tmp_path / "fp16"
    base = ["--train-iters", "2", "--log-interval", "1", "--eval-iters", "0"]
    src = _run(tiny_gpt_args(tiny_corpus, tmp_path, *base, "--save", str(fp32_ck)))
    fp32_weights = {n: p.detach().clone() for n, p in src.engine.module.named_parameters()}
    with caplog.at_level(logging.INFO, logger="app"):
        bf16 = _run(tiny_gpt_args(tiny_corpus, tmp_path, *base, "--train-iters", "3", "--bf16",
                                  "--load", str(fp32_ck), *LR0))
    assert any("converted checkpoint" in r.getMessage() for r in caplog.records)
    wrapper = bf16.engine.optimizer
    for name, p in wrapper.named_params:  # lr 0: main weights are the checkpoint's fp32 values
        assert torch.equal(wrapper.main_of[id(p)], fp32_weights[name]), name
        assert torch.equal(p, fp32_weights[name].bfloat16()), name
    assert bf16.state.iteration == 3 and len(wrapper.inner.state) > 0  # Adam moments loaded
    tuned = _run(tiny_gpt_args(tiny_corpus, tmp_path, *base, "--bf16", "--load", str(fp32_ck),
                               "--finetune", "--lr", "0", "--min-lr", "0"))
    assert tuned.state.iteration == 2
    half = _run(tiny_gpt_args(tiny_corpus, tmp_path, *base, *HALF["fp16"], "--save", str(fp16_ck)))
    mains = {n: half.engine.optimizer.main_of[id(p)].detach().clone()
             for n, p in half.engine.optimizer.named_params}
    back = _run(tiny_gpt_args(tiny_corpus, tmp_path, *base, "--train-iters", "3", "--load",
                              str(fp16_ck), *LR0))
    for name, p in back.engine.module.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p, mains[name]), name


def test_diverged_run_stops_with_exit_3_and_no_checkpoint_of_its_nan_state(tiny_corpus, tmp_path):
    ck = tmp_path / "ck"
    args = tiny_gpt_args(tiny_corpus, tmp_path, "--train-iters", "40", "--log-interval", "1",
                         "--eval-iters", "0", "--lr", "1e6", "--lr-warmup-iters", "0",
                         "--save", str(ck), "--save-interval", "1",
                         "--max-consecutive-skipped-iterations", "3",
                         "--metrics-file", str(tmp_path / "m.jsonl"))
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    code, _, err = run_main(args, str(tmp_path), env)  # as `python pretrain_gpt2.py args`
    assert code == 3, err[-3000:]
    assert "3 consecutive iterations with non-finite" in err
    import re
    stopped = int(re.search(r"iteration (\d+): 3 consecutive", err).group(1))
    rows = [r for r in read_metrics(tmp_path / "m.jsonl") if r["kind"] == "train"]
    assert rows[-1]["iteration"] == stopped - 1  # the stopping iteration logs nothing more
    assert sum(r["skipped_iterations"] for r in rows) == 2 and rows[-1]["lm_loss"] is None
    latest = int((ck / "latest_checkpointed_iteration.txt").read_text())
    assert latest == stopped - 3  # the last iteration before the non-finite run of 3
    from app.checkpoint.legacy import per_rank as ckpt
    state, _ = ckpt.load_checkpoint_dict(str(ck))
    weights = ckpt.from_megatron_model(state["model"])
    assert all(torch.isfinite(v).all() for v in weights.values())
