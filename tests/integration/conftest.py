"""Fixtures for end-to-end runs (the helpers behind them live in tests/harness/corpus.py)."""
import pytest

from tests.harness.corpus import make_tiny_corpus, run_zero2_dp2


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory):
    """dict(prefix, vocab, merges, vocab_size): ~40 stdlib files, BPE vocab 512, one doc per ~2 KB."""
    return make_tiny_corpus(str(tmp_path_factory.mktemp("tiny_corpus")))


@pytest.fixture(scope="session")
def zero2_dp2_run(tiny_corpus, tmp_path_factory):
    """A DeepSpeed ZeRO-2 run on two ranks: checkpoints of iterations 3 and 6 in `ck/`, losses in
    `straight.jsonl`; shared by the conversion and reshape tests."""
    tmp = tmp_path_factory.mktemp("zero2_dp2")
    run_zero2_dp2(tiny_corpus, tmp)
    return tmp
