"""--mock-data: the synthetic dataset, NullTokenizer, the flags' rules and the --dry-run report."""
import numpy as np
import pytest
import torch

import arguments
from app.data import NullTokenizer, build_mock_datasets, build_tokenizer
from app.data.mock_dataset import MockDocuments

TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
        "--global-batch-size", "4", "--train-iters", "5", "--eval-interval", "2",
        "--eval-iters", "1", "--distributed-backend", "gloo"]


def test_mock_documents_are_megatrons():
    # Megatron's MockGPTLowLevelDataset: 100,000 lengths from default_rng(0) in [1, 4096),
    # document of length L = 1 .. L - 1 modulo the vocabulary, then the end of document
    docs = MockDocuments(vocab_size=10, eod=9)
    assert len(docs) == 100_000 and docs.sizes.dtype == np.int32
    np.testing.assert_array_equal(
        docs.sizes, np.random.default_rng(0).integers(1, 4096, 100_000, dtype=np.int32))
    length = int(docs.sizes[0])
    whole = docs.read(0, 0, length)
    assert whole[-1] == 9 and whole.dtype == np.int64
    np.testing.assert_array_equal(whole[:12], [1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1, 2])
    np.testing.assert_array_equal(docs.read(0, 5, 8), whole[5:8])


def test_samples_are_consecutive_document_tokens_and_depend_on_seed():
    train, _, test = build_mock_datasets((12, 0, 3), 31, 97, seed=7)
    sample = train[0]["text"]
    assert sample.dtype == np.int64 and sample.shape == (32,)
    # inside a document each id is the previous one + 1 modulo 97, or the end of document (96)
    step = (sample[1:] - sample[:-1]) % 97
    assert np.all((step == 1) | (sample[1:] == 96) | (sample[:-1] == 96))
    other_seed = build_mock_datasets((12, 0, 0), 31, 97, seed=8)[0]
    assert not np.array_equal(sample, other_seed[0]["text"])
    assert not np.array_equal(sample, test[0]["text"])
    with pytest.raises(IndexError, match="out of range"):
        train[len(train)]


def test_a_dataloader_worker_serves_the_same_samples():
    data = build_mock_datasets((8, 0, 0), 15, 64, seed=3)[0]
    loader = torch.utils.data.DataLoader(data, batch_size=4, num_workers=1)
    got = torch.cat([batch["text"] for batch, _ in zip(loader, range(2))])
    want = np.stack([data[i]["text"] for i in range(8)])
    np.testing.assert_array_equal(got.numpy(), want)


def test_build_mock_datasets_sizes_each_split_and_skips_empty_ones():
    train, valid, test = build_mock_datasets((12, 0, 3), 16, 100, seed=5)
    assert valid is None and (train.split, test.split) == ("train", "test")
    assert (train.num_samples, test.num_samples) == (12, 3) and len(train) >= 12
    # Megatron's thirds of the documents, whatever --split says
    assert (train.documents, test.documents) == ((0, 33333), (66667, 100000))
    with pytest.raises(ValueError, match="vocab_size must be positive"):
        MockDocuments(0, 0)


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
    assert ("--mock-data: 20 train samples of 17 token ids from Megatron's mock documents "
            "[0, 33333) (1 epoch(s), ids counting up modulo 100) in the order of seed 1234; its "
            "indices take 0.13 MiB of host memory when the run builds them; no data files "
            "read") in text
    assert "12 valid samples" in text and "4 test samples" in text


def test_mock_order_record_refuses_the_old_mock_order_and_sees_epochs():
    from app.training.pretrain import mock_order_record
    from app.training.checkpointing.data_order import order_changes
    cfg = arguments.config_from_argv(TINY + ["--mock-data", "--vocab-size", "100"], 1, 100)
    record = mock_order_record(cfg, build_mock_datasets((20, 12, 4), 16, 100, seed=1234))
    part = record["splits"]["train"]["parts"][0]
    assert (part["documents"], part["epochs"], part["separate_last_epoch"]) == ([0, 33333], 1,
                                                                                False)
    assert part["tokens"] == int(MockDocuments(100, 99).sizes[:33333].sum())
    old = {"mock_data": True, "seed": 1234, "seq_length": 16, "splits": {}}  # before version 2
    changes, _ = order_changes(old, record, {"train": 8})
    assert len(changes) == 1 and "data-order rules, version 1 -> 2" in changes[0]
    # more samples than one epoch of the train third holds: another order
    many = mock_order_record(cfg, build_mock_datasets((part["tokens"] // 16 + 1, 0, 0), 16, 100,
                                                      seed=1234))
    changes, _ = order_changes(record, many, {"train": 8})
    assert any("epochs 1 -> 2" in c for c in changes), changes
