"""--mock-data: the synthetic dataset, NullTokenizer, the flags' rules and the --dry-run report."""
import numpy as np
import pytest
import torch

import arguments
from app.data import MockGPTDataset, NullTokenizer, build_mock_datasets, build_tokenizer

TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--train-iters", "5", "--eval-interval", "2",
        "--eval-iters", "1", "--distributed-backend", "gloo"]


def test_samples_depend_only_on_seed_split_and_index():
    a = MockGPTDataset(50, 31, 97, seed=7)
    b = MockGPTDataset(50, 31, 97, seed=7)
    backwards = [b[i]["text"] for i in reversed(range(50))][::-1]  # read in another order
    for i in range(50):
        sample = a[i]["text"]
        assert sample.dtype == np.int64 and sample.shape == (32,)
        np.testing.assert_array_equal(sample, backwards[i])
    other_seed = MockGPTDataset(50, 31, 97, seed=8)[3]["text"]
    valid = MockGPTDataset(50, 31, 97, seed=7, split="valid")[3]["text"]
    assert not np.array_equal(a[3]["text"], other_seed)
    assert not np.array_equal(a[3]["text"], valid)
    assert not np.array_equal(a[3]["text"], a[4]["text"])
    with pytest.raises(IndexError, match="out of range"):
        a[50]


def test_ids_are_uniform_over_the_whole_vocabulary():
    vocab = 50
    tokens = np.concatenate([s["text"] for s in MockGPTDataset(400, 99, vocab, seed=1)])
    assert tokens.min() == 0 and tokens.max() == vocab - 1
    counts = np.bincount(tokens, minlength=vocab)  # 40,000 draws, 800 expected per id
    chi2 = float(((counts - counts.mean()) ** 2 / counts.mean()).sum())
    assert chi2 < 100, chi2  # 49 degrees of freedom: p < 1e-4 above ~95


def test_a_dataloader_worker_serves_the_same_samples():
    data = MockGPTDataset(8, 15, 64, seed=3)
    loader = torch.utils.data.DataLoader(data, batch_size=4, num_workers=1)
    got = torch.cat([batch["text"] for batch in loader])
    want = np.stack([data[i]["text"] for i in range(8)])
    np.testing.assert_array_equal(got.numpy(), want)


def test_build_mock_datasets_sizes_each_split_and_skips_empty_ones():
    train, valid, test = build_mock_datasets((12, 0, 3), 16, 100, seed=5)
    assert (len(train), valid, len(test)) == (12, None, 3)
    assert (train.split, test.split) == ("train", "test")
    with pytest.raises(ValueError, match="vocab_size must be positive"):
        MockGPTDataset(4, 16, 0, seed=1)


def test_null_tokenizer_and_when_vocab_size_selects_it(tmp_path):
    tok = build_tokenizer("GPT2BPETokenizer", None, None, vocab_size=1000)
    assert isinstance(tok, NullTokenizer) and (tok.vocab_size, tok.eod) == (1000, 999)
    assert tok.tokenize("5 17\n2") == [5, 17, 2] and tok.detokenize([5, 17]) == "5 17"
    assert build_tokenizer("NullTokenizer", None, None, 300).eod == 299
    with pytest.raises(ValueError, match="NullTokenizer needs --vocab-size"):
        build_tokenizer("NullTokenizer", None, None)
    with pytest.raises(ValueError, match="drop --vocab-size, or drop --vocab-file"):
        build_tokenizer("GPT2BPETokenizer", str(tmp_path / "vocab.json"), None, vocab_size=10)
    with pytest.raises(ValueError, match="reads no --vocab-file"):
        build_tokenizer("NullTokenizer", str(tmp_path / "vocab.json"), None, vocab_size=10)


def test_mock_data_flags():
    cfg = arguments.config_from_argv(TINY + ["--mock-data", "--vocab-size", "100"], 1, 100)
    assert cfg.data.mock_data and cfg.data.vocab_size == 100 and cfg.data.data_path == []
    with pytest.raises(ValueError, match="two data sources; give one"):
        arguments.config_from_argv(TINY + ["--mock-data", "--data-path", "corpus"], 1, 100)
    with pytest.raises(ValueError, match="--vocab-size must be at least 2"):
        arguments.config_from_argv(TINY + ["--mock-data", "--vocab-size", "1"], 1, 100)


def test_dry_run_reports_the_mock_samples_and_no_file(capsys):
    from pretrain_gpt2 import run
    report = run(TINY + ["--mock-data", "--vocab-size", "100", "--dry-run"])
    text = report.render()
    assert not report.errors, text
    assert "NullTokenizer: vocabulary 100, end-of-document id 99" in text
    # 5 iterations x 4 samples; 2 evaluations (at 2 and 4) + the last x 1 batch of 4
    assert ("--mock-data: 20 train samples of 17 token ids drawn uniformly from [0, 100) by "
            "seed 1234; no data files read") in text
    assert "12 valid samples" in text and "4 test samples" in text
