"""Through the real start-up: a resume that would change the order of the data it continues is
refused naming what changed, unless --allow-data-order-change; the same data described another
way (--data-args-path) and a longer run within the same epochs resume."""
import pytest

import pretrain_gpt2
from app.checkpoint import CheckpointError
from tests.harness.corpus import tiny_gpt_args

COMMON = ["--train-iters", "4", "--lr-decay-iters", "8", "--eval-iters", "1", "--eval-interval", "2", "--log-interval", "1",
          "--save-interval", "2"]


def test_resume_refuses_a_silent_change_of_data_order(tiny_corpus, tmp_path, caplog):
    ck = str(tmp_path / "ck")
    args = lambda *extra: tiny_gpt_args(tiny_corpus, tmp_path, *COMMON, *extra)  # noqa: E731
    pretrain_gpt2.run(args("--save", ck, "--exit-interval", "2"))

    with pytest.raises(CheckpointError, match=r"--seed 1234 -> 99.*--allow-data-order-change"):
        pretrain_gpt2.run(args("--load", ck, "--seed", "99"))
    with pytest.raises(CheckpointError, match=r"train data .*documents \[0, \d+\] -> \[0, \d+\] "
                                              r"\(--split"):
        pretrain_gpt2.run(args("--load", ck, "--split", "80,18,2"))

    words = tmp_path / "blend.txt"
    words.write_text(tiny_corpus["prefix"] + "\n")
    argv = args("--load", ck, "--train-iters", "6")
    argv[argv.index("--data-path"):argv.index("--data-path") + 2] = ["--data-args-path", str(words)]
    with caplog.at_level("INFO"):
        trainer = pretrain_gpt2.run(argv)  # the same data, more samples in the same epoch
    assert trainer.state.iteration == 6
    assert "train samples 16 -> 24: the order of the samples is unchanged" in caplog.text

    with caplog.at_level("INFO"):
        trainer = pretrain_gpt2.run(args("--load", ck, "--train-iters", "8", "--seed", "99",
                                         "--allow-data-order-change"))
    assert trainer.state.iteration == 8
    assert "--allow-data-order-change: the data order changes on resume: --seed 1234 -> 99" \
        in caplog.text
