"""GPT dataset: sample index semantics, epochs, shuffles, split, blending, cache reuse, vocab check."""
import os

import numpy as np
import pytest

import app.data.gpt_dataset as gpt_dataset
import app.data.index_builder as index_builder
from app.data import build_train_valid_test_datasets
from app.data.index_builder import (blend_indices, build_indices, compute_num_epochs,
                                    split_document_ranges)
from tests.harness.datasets import write_dataset


@pytest.fixture
def lengths():
    return np.random.default_rng(0).integers(1, 40, size=200)


def reference_stream(doc_lengths, doc_order, first_token=0):
    """The split's tokens concatenated in doc-index order (written independently of our code)."""
    starts = np.concatenate([[0], np.cumsum(doc_lengths)[:-1]]) + first_token
    return np.concatenate([np.arange(starts[d], starts[d] + doc_lengths[d]) for d in doc_order])


def test_samples_cover_the_split_in_order_overlapping_by_one(tmp_path, lengths):
    prefix = write_dataset(str(tmp_path / "d"), lengths)
    seq, n = 16, 700  # 700 samples need several epochs of ~4000 tokens
    train, valid, test = build_train_valid_test_datasets([prefix], "100,0,0", (n, 0, 0), seq, 7)
    assert valid is None and test is None
    epochs = compute_num_epochs(int(lengths.sum()), seq, n)
    assert epochs == 3 and (epochs - 1) * lengths.sum() < n * seq + 1
    doc_idx = np.asarray(train.doc_idx)
    # every document appears once per epoch (Megatron shuffles the epochs as one array)
    assert np.bincount(doc_idx, minlength=200).tolist() == [epochs] * 200
    stream = reference_stream(lengths, doc_idx)
    assert len(train) == (stream.size - 1) // seq >= n
    by_sample = np.empty((len(train), seq + 1), dtype=np.int64)
    for i in range(len(train)):
        item = train[i]["text"]
        assert item.dtype == np.int64 and item.shape == (seq + 1,)
        by_sample[int(train.shuffle_idx[i])] = item
    for j in range(len(train)):
        assert np.array_equal(by_sample[j], stream[j * seq:j * seq + seq + 1])
    assert sorted(np.asarray(train.shuffle_idx).tolist()) == list(range(len(train)))


def test_deterministic_given_seed_and_different_across_seeds(tmp_path, lengths):
    prefix = write_dataset(str(tmp_path / "d"), lengths)
    build = lambda seed, cache: build_train_valid_test_datasets(  # noqa: E731
        [prefix], "1,0,0", (300, 0, 0), 16, seed, cache_path=str(tmp_path / cache))[0]
    a, b, c = build(1, "c1"), build(1, "c2"), build(2, "c3")
    for kind in ("doc_idx", "sample_idx", "shuffle_idx"):
        assert np.array_equal(getattr(a, kind), getattr(b, kind))
    assert not np.array_equal(a.doc_idx, c.doc_idx)
    assert not np.array_equal(a.shuffle_idx, c.shuffle_idx)
    assert [a[i]["text"].tolist() for i in range(5)] == [b[i]["text"].tolist() for i in range(5)]


def test_cache_is_reused_and_keyed_on_every_parameter(tmp_path, lengths, monkeypatch):
    prefix = write_dataset(str(tmp_path / "d"), lengths)
    cache = str(tmp_path / "cache")
    args = dict(data_path=[prefix], split="90,10,0", num_samples=(100, 10, 0), seq_length=16,
                seed=3, cache_path=cache)
    first = build_train_valid_test_datasets(**args)
    files = sorted(os.listdir(cache))
    assert len([f for f in files if f.endswith(".npy")]) == 6

    def fail(*a, **k):
        raise AssertionError("indices rebuilt although cached")

    monkeypatch.setattr(index_builder, "build_indices", fail)
    barriers = []
    again = build_train_valid_test_datasets(**args, is_builder=False,
                                            barrier=lambda: barriers.append(1))
    assert barriers == [1, 1]  # one barrier per dataset built
    assert np.array_equal(first[0].shuffle_idx, again[0].shuffle_idx)
    assert sorted(os.listdir(cache)) == files
    for change in (dict(seed=4), dict(seq_length=8), dict(num_samples=(101, 10, 0)),
                   dict(split="80,20,0")):
        with pytest.raises(AssertionError, match="rebuilt"):
            build_train_valid_test_datasets(**{**args, **change})


def test_non_builder_without_cache_fails_clearly(tmp_path, lengths):
    prefix = write_dataset(str(tmp_path / "d"), lengths)
    with pytest.raises(FileNotFoundError, match="data-cache-path"):
        build_train_valid_test_datasets([prefix], "1,0,0", (10, 0, 0), 16, 1,
                                        cache_path=str(tmp_path / "empty"), is_builder=False)


def test_split_uses_disjoint_document_ranges(tmp_path):
    assert split_document_ranges(1000, "969,30,1") == ((0, 969), (969, 999), (999, 1000))
    assert split_document_ranges(10, "50,50,0") == ((0, 5), (5, 10), None)
    doc_lengths = np.full(100, 10)
    prefix = write_dataset(str(tmp_path / "d"), doc_lengths)
    train, valid, test = build_train_valid_test_datasets([prefix], "80,15,5", (150, 20, 7), 8, 1)
    for ds, (lo, hi) in ((train, (0, 800)), (valid, (800, 950)), (test, (950, 1000))):
        tokens = np.concatenate([ds[i]["text"] for i in range(len(ds))])
        assert tokens.min() >= lo and tokens.max() < hi
        assert np.unique(tokens).size == hi - lo  # 2 epochs: every token of the split is used


def test_blend_indices_follow_weights():
    d, j = blend_indices(np.array([0.2, 0.5, 0.3]), 1000)
    for i in range(1, 1001):
        counts = np.bincount(d[:i], minlength=3)
        assert np.all(np.abs(counts - np.array([0.2, 0.5, 0.3]) * i) <= 1.0)
    for k in range(3):  # each dataset's samples are taken in order 0, 1, 2, ...
        assert j[d == k].tolist() == list(range(int((d == k).sum())))


def test_blended_datasets(tmp_path):
    a = write_dataset(str(tmp_path / "a"), np.full(50, 20))
    b = write_dataset(str(tmp_path / "b"), np.full(50, 20), first_token=10000)
    train, valid, _ = build_train_valid_test_datasets(
        ["0.25", a, "0.75", b], "9,1,0", (400, 40, 0), 8, 5, cache_path=str(tmp_path / "c"))
    assert len(train) == 400 and len(valid) == 40
    from_b = np.array([train[i]["text"][0] >= 10000 for i in range(400)])
    assert from_b.sum() == 300
    with pytest.raises(ValueError, match="weight/prefix pairs"):
        build_train_valid_test_datasets(["0.5", a, "0.5"], "1,0,0", (4, 0, 0), 8, 1)


def test_token_ids_not_below_vocab_size_fail_at_start(tmp_path, lengths):
    prefix = write_dataset(str(tmp_path / "d"), lengths)
    top = int(lengths.sum()) - 1
    build_train_valid_test_datasets([prefix], "1,0,0", (5, 0, 0), 16, 1, vocab_size=top + 1)
    with pytest.raises(ValueError, match=r"\[0, %d\].*re-run tools/preprocess_data.py" % top) as e:
        build_train_valid_test_datasets([prefix], "1,0,0", (5, 0, 0), 16, 1, vocab_size=top)
    assert prefix + ".bin" in str(e.value)


def test_token_id_error_names_the_first_offending_document(tmp_path, lengths):
    """Token value = its position in the file, so with vocabulary v the first offending token is
    the one at position v, in the document whose token range holds v (found here by a walk)."""
    prefix = write_dataset(str(tmp_path / "d"), lengths)
    vocab = int(lengths.sum()) // 3
    document, end = 0, int(lengths[0])
    while end <= vocab:
        document += 1
        end += int(lengths[document])
    with pytest.raises(ValueError, match=rf"first is id {vocab} in document {document} "
                                         rf"\(0-based, token {vocab} of the file\)"):
        build_train_valid_test_datasets([prefix], "1,0,0", (5, 0, 0), 16, 1, vocab_size=vocab,
                                        cache_path=str(tmp_path / "new" / "cache"))
    assert gpt_dataset.first_token_outside(gpt_dataset.MMapIndexedDataset(prefix),
                                           int(lengths.sum())) is None


def test_a_new_cache_path_caches_the_token_range_without_a_warning(tmp_path, lengths, caplog):
    """A --data-cache-path that does not exist yet is created and the token range cached
    there, without a 'could not cache token range' warning."""
    prefix = write_dataset(str(tmp_path / "d"), lengths)
    cache = tmp_path / "new" / "nested" / "cache"
    with caplog.at_level("WARNING"):
        build_train_valid_test_datasets([prefix], "1,0,0", (5, 0, 0), 16, 1,
                                        vocab_size=int(lengths.sum()), cache_path=str(cache))
    assert "could not cache" not in caplog.text
    assert len(list(cache.glob("d_*_token_range.json"))) == 1


def test_a_dataset_without_documents_is_an_error_naming_it(tmp_path):
    prefix = write_dataset(str(tmp_path / "empty"), [])
    with pytest.raises(ValueError, match=r"empty\.bin holds no documents.*preprocess_data"):
        build_train_valid_test_datasets([prefix], "1,0,0", (5, 0, 0), 16, 1)


def test_separate_last_epoch_shuffle():
    lengths = np.full(10, 11)  # 110 tokens per epoch: (110 - 1) // 10 = 10 samples per epoch
    # 12 samples need 2 epochs; the second supplies 2 < 80% of 10: it is shuffled apart
    _, sample_idx, shuffle_idx = build_indices(lengths, np.arange(10), num_samples=12,
                                               seq_length=10, seed=0)
    total = sample_idx.shape[0] - 1
    assert total == (2 * 110 - 1) // 10 == 21
    assert sorted(shuffle_idx[:10].tolist()) == list(range(10))
    assert sorted(shuffle_idx[10:].tolist()) == list(range(10, 21))
    # 19 samples: the second epoch supplies 9 >= 8, so all 21 samples are shuffled together
    _, _, mixed = build_indices(lengths, np.arange(10), num_samples=19, seq_length=10, seed=0)
    assert sorted(mixed.tolist()) == list(range(21)) and max(mixed[:10]) >= 10
