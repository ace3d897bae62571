"""The sample-index cache: an entry that does not match what the run needs is rebuilt by the
builder, or refused when it cannot be written; never used."""
import json

import numpy as np
import pytest

import app.data.index_cache as index_cache
from app.data.gpt_dataset import build_train_valid_test_datasets
from tests.harness.datasets import write_dataset


@pytest.fixture
def built(tmp_path):
    prefix = write_dataset(str(tmp_path / "d"), np.random.default_rng(0).integers(1, 40, 200))
    args = dict(data_path=[prefix], split="1,0,0", num_samples=(300, 0, 0), seq_length=16,
                seed=3, cache_path=str(tmp_path / "cache"))
    train = build_train_valid_test_datasets(**args)[0]
    return args, train, np.array(train.shuffle_idx)


def test_a_complete_matching_entry_is_loaded(built):
    args, _, _ = built
    again = build_train_valid_test_datasets(**args)[0]
    assert not again.built and again.cache.problem() is None


def test_a_tampered_description_is_rebuilt(built):
    args, train, shuffle = built
    desc = json.loads(open(train.description_file).read())
    desc["seed"] = 99
    open(train.description_file, "w").write(json.dumps(desc))
    assert "seed differ" in train.cache.problem()
    again = build_train_valid_test_datasets(**args)[0]
    assert again.built and np.array_equal(again.shuffle_idx, shuffle)


def test_an_array_of_the_wrong_length_is_rebuilt(built):
    args, train, shuffle = built
    np.save(train.cache_files["shuffle_idx"], shuffle[:-5])
    assert "records" in train.cache.problem()
    again = build_train_valid_test_datasets(**args)[0]
    assert again.built and np.array_equal(again.shuffle_idx, shuffle)


def test_a_wrong_entry_that_cannot_be_rewritten_is_refused(built, monkeypatch):
    args, train, shuffle = built
    np.save(train.cache_files["shuffle_idx"], shuffle[:-5])
    monkeypatch.setattr(index_cache.os, "access", lambda path, mode: False)
    with pytest.raises(PermissionError, match=r"holds \d+ rows.*not writable.*prepare_cache"):
        build_train_valid_test_datasets(**args)


def test_a_rank_that_does_not_build_refuses_a_missing_entry(built, tmp_path):
    args, _, _ = built
    with pytest.raises(FileNotFoundError, match="is missing.*prepare_cache"):
        build_train_valid_test_datasets(**{**args, "cache_path": str(tmp_path / "other")},
                                        is_builder=False)
