"""Data flags as Megatron-LM reads them (get_blend_from_list, get_blend_and_blend_per_split,
BlendedMegatronDatasetBuilder's sizes), against its documented formats and hand-computed
sample counts; and the sample order each equivalent command line gives."""
import json

import numpy as np
import pytest

from app.config import DataConfig
from app.config.blends import parse_blend
from app.data.gpt_dataset import build_datasets, build_train_valid_test_datasets
from app.data.plan import plan_datasets
from tests.harness.datasets import write_dataset


def blends_of(**flags):
    return DataConfig(**flags).blends


@pytest.mark.parametrize("words,prefixes,weights", [
    (["a"], ("a",), None),                                   # one prefix
    (["30", "a", "70", "b"], ("a", "b"), (0.3, 0.7)),        # weight/prefix pairs, normalised
    (["2", "a"], ("a",), (1.0,)),                            # one weighted prefix
    (["a", "b"], ("a", "b"), None),                          # prefixes: weighted by size
    (["a", "b", "c"], ("a", "b", "c"), None),
    ([" a ", "\tb"], ("a", "b"), None),                      # words are stripped
])
def test_blend_words_follow_megatrons_rules(words, prefixes, weights):
    blend = parse_blend(words, "--data-path")
    assert blend.prefixes == prefixes
    assert blend.weights == (None if weights is None else pytest.approx(weights))


@pytest.mark.parametrize("words,match", [
    ([], "is empty"),
    (["0.5", "a", "b", "c"], "mixes weight/prefix pairs"),
    (["0.5", "a", "0.5"], "weight/prefix pairs"),
    (["-1", "a", "2", "b"], "non-negative"),
    (["0", "a", "0", "b"], "positive sum"),
])
def test_bad_blends_are_refused_naming_the_flag(words, match):
    with pytest.raises(ValueError, match=match):
        parse_blend(words, "--train-data-path")


def test_data_args_path_is_data_path_read_from_a_file(tmp_path):
    path = tmp_path / "blend.txt"
    path.write_text("0.25 data/a\n  0.75\n data/b \n")
    from_file = blends_of(data_args_path=str(path))
    assert from_file.blend == blends_of(data_path=["0.25", "data/a", "0.75", "data/b"]).blend
    assert from_file.per_split is None and str(path) in from_file.source


def test_per_split_json_is_the_three_split_flags(tmp_path):
    path = tmp_path / "splits.json"
    path.write_text(json.dumps({"train": "0.3 data/a 0.7 data/b", "valid": ["data/c"],
                                "test": None}))
    from_json = blends_of(per_split_data_args_path=str(path))
    from_flags = blends_of(train_data_path=["0.3", "data/a", "0.7", "data/b"],
                           valid_data_path=["data/c"])
    assert from_json.per_split == from_flags.per_split
    assert from_json.per_split[2] is None and from_json.blend is None
    assert from_json.prefixes() == ["data/a", "data/b", "data/c"]


@pytest.mark.parametrize("flags,match", [
    (dict(data_path=["a"], train_data_path=["b"]), "given together"),
    (dict(data_path=["a"], data_args_path="f"), "given together"),
    (dict(train_data_path=["a"], per_split_data_args_path="f"), "given together"),
    (dict(valid_data_path=["a"]), "no training data"),
    (dict(train_data_path=["a"], split="90,10,0"), "--split 90,10,0 does not apply"),
    (dict(data_args_path="/nonexistent/blend.txt"), "/nonexistent/blend.txt: cannot read"),
])
def test_conflicting_or_missing_data_flags_are_refused(flags, match):
    with pytest.raises(ValueError, match=match):
        DataConfig(**flags)


@pytest.mark.parametrize("content,match", [
    ("not json", "not JSON"),
    ('{"train": "a", "validation": "b"}', "expected an object with the keys"),
    ('{"train": 3}', "expected a string or a list"),
])
def test_bad_per_split_json_names_the_file(tmp_path, content, match):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=match) as err:
        DataConfig(per_split_data_args_path=str(path))
    assert str(path) in str(err.value)


@pytest.fixture
def three(tmp_path):
    """Datasets a, b, c of 40 documents x 20 tokens (tokens tell the dataset apart)."""
    return [write_dataset(str(tmp_path / name), np.full(40, 20), first_token=10000 * k)
            for k, name in enumerate("abc")]


def test_weighted_blend_sizes_are_megatrons(three):
    a, b, _ = three
    plan = plan_datasets(blends_of(data_path=["0.3", a, "0.7", b]), "1,0,0", (1000, 0, 0), 8)
    train = plan.splits[0]
    # mid-level: ceil(ceil(n w) x 1.005); top-level: sum of ceil(n w)
    assert [p.num_samples for p in train.parts] == [302, 704]
    assert train.size == 1000 and train.blended and not train.by_size
    plan = plan_datasets(blends_of(data_path=["1", a, "2", b]), "1,0,0", (10, 0, 0), 8)
    assert [p.num_samples for p in plan.splits[0].parts] == [5, 8]  # ceil(4.02), ceil(7.035)
    assert plan.splits[0].size == 4 + 7


def test_unweighted_blend_takes_one_epoch_of_each_weighted_by_size(tmp_path):
    a = write_dataset(str(tmp_path / "a"), np.full(30, 20))                   # 600 tokens
    b = write_dataset(str(tmp_path / "b"), np.full(10, 20), first_token=5000)  # 200 tokens
    plan = plan_datasets(blends_of(train_data_path=[a, b]), "", (1000, 0, 0), 8)
    train = plan.splits[0]
    assert [p.num_samples for p in train.parts] == [(600 - 1) // 8, (200 - 1) // 8]  # 74, 24
    assert train.by_size and train.size == min(1000, 74 + 24)
    assert train.blend_weights() == pytest.approx([74 / 98, 24 / 98])
    (ds, _, _) = build_datasets(plan, seed=3, cache_path=str(tmp_path / "c"))
    from_b = [int(ds[i]["text"][0] >= 5000) for i in range(len(ds))]
    assert sum(from_b) == 24  # every sample of each dataset, none repeated


def test_per_split_paths_use_each_dataset_whole(three):
    a, b, c = three
    plan = plan_datasets(blends_of(train_data_path=[a], valid_data_path=["1", b],
                                   test_data_path=[c]), "969,30,1", (50, 20, 10), 8)
    for split in plan.splits:  # a single prefix, weighted or not, is one dataset used whole
        assert not split.blended and split.parts[0].documents == (0, 40)
    assert [s.size for s in plan.splits] == [50, 20, 10]


def _items(ds):
    return [ds[i]["text"].tolist() for i in range(len(ds))]


def test_equivalent_command_lines_give_the_same_samples(three, tmp_path):
    """--train-data-path p reads what --data-path p --split 1,0,0 reads for training;
    --data-args-path and --per-split-data-args-path read what their flags read."""
    a, b, c = three
    seq, seed, cache = 8, 11, str(tmp_path / "cache")
    build = lambda cfg, n: build_datasets(  # noqa: E731
        plan_datasets(cfg.blends, cfg.split, n, seq), seed, cache)
    per_split = build(DataConfig(train_data_path=[a]), (120, 0, 0))[0]
    shared = build_train_valid_test_datasets([a], "1,0,0", (120, 0, 0), seq, seed, cache)[0]
    assert _items(per_split) == _items(shared)

    words = ["0.4", a, "0.6", b]
    (tmp_path / "blend.txt").write_text(" ".join(words))
    from_file = build(DataConfig(data_args_path=str(tmp_path / "blend.txt"), split="8,2,0"),
                      (100, 20, 0))
    from_flags = build(DataConfig(data_path=words, split="8,2,0"), (100, 20, 0))
    assert [_items(x) for x in from_file[:2]] == [_items(x) for x in from_flags[:2]]

    (tmp_path / "s.json").write_text(json.dumps({"train": words, "valid": c, "test": None}))
    from_json = build(DataConfig(per_split_data_args_path=str(tmp_path / "s.json")),
                      (100, 20, 0))
    from_split_flags = build(DataConfig(train_data_path=words, valid_data_path=[c]),
                             (100, 20, 0))
    assert [_items(x) for x in from_json[:2]] == [_items(x) for x in from_split_flags[:2]]
    assert from_json[2] is None


def test_a_blends_samples_are_each_datasets_own_in_order(three, tmp_path):
    """Sample i of a 0.25/0.75 blend is the next unread sample of the dataset it picks, and
    every prefix holds each dataset's share to within one sample."""
    a, b, _ = three
    blends = blends_of(data_path=["0.25", a, "0.75", b])
    train = build_datasets(plan_datasets(blends, "1,0,0", (200, 0, 0), 8), 5,
                           str(tmp_path / "c"))[0]
    parts = train.datasets
    taken = [0, 0]
    for i in range(len(train)):
        d = int(train[i]["text"][0] >= 10000)
        assert train[i]["text"].tolist() == parts[d][taken[d]]["text"].tolist()
        taken[d] += 1
        assert abs(taken[0] - 0.25 * (i + 1)) <= 1
    assert taken == [50, 150]
