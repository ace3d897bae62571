"""No silent change of data order on resume: the data-order record of a plan and the resume
check against hand-built records."""
import copy
import os
import shutil

import numpy as np
import pytest

from app.checkpoint import CheckpointError
from app.config import DataConfig
from app.data.plan import order_record, plan_datasets
from app.training.checkpointing.data_order import check_data_order, order_changes
from tests.harness.datasets import write_dataset

READ = {"train": 64, "valid": 8}


@pytest.fixture
def datasets(tmp_path):
    a = write_dataset(str(tmp_path / "a"), np.full(100, 33))  # 3,300 tokens
    b = write_dataset(str(tmp_path / "b"), np.full(50, 33), first_token=9000)
    return a, b


def record(data_path, split="9,1,0", samples=(200, 20, 0), seq=16, seed=5):
    plan = plan_datasets(DataConfig(data_path=list(data_path), split=split).blends, split,
                         samples, seq)
    return order_record(plan, seed)


def test_the_record_holds_what_decides_the_order(datasets):
    a, b = datasets
    rec = record(["0.5", a, "0.5", b])
    assert rec["seed"] == 5 and rec["seq_length"] == 16
    train = rec["splits"]["train"]
    assert train["samples"] == 200 and train["blended"]
    assert [p["prefix"] for p in train["parts"]] == [a, b]
    # a's train documents [0, 90): 2,970 tokens; 101 samples of 16 need 1 epoch
    assert train["parts"][0] == {"prefix": a, "weight": 0.5, "documents": [0, 90],
                                 "tokens": 2970, "epochs": 1, "separate_last_epoch": False}
    assert "test" not in rec["splits"]  # read from 0 at every evaluation: no order to keep


@pytest.mark.parametrize("change,named", [
    (dict(seed=6), "--seed 5 -> 6 (pass --seed 5 to keep it)"),
    (dict(seq=8), "--seq-length 16 -> 8 (pass --seq-length 16 to keep it)"),
    (dict(split="8,2,0"), "documents [0, 90] -> [0, 80]"),
    (dict(samples=(2000, 20, 0)), "epochs 1 -> "),
])
def test_changes_that_reorder_are_named(datasets, change, named):
    a, b = datasets
    changes, _ = order_changes(record(["0.5", a, "0.5", b]),
                               record(["0.5", a, "0.5", b], **change), READ)
    assert any(named in c for c in changes), changes


def test_other_weights_or_paths_are_named(datasets):
    a, b = datasets
    old = record(["0.5", a, "0.5", b])
    changes, _ = order_changes(old, record(["0.4", a, "0.6", b]), READ)
    assert any("weight 0.5 -> 0.4" in c and "blend weights" in c for c in changes)
    changes, _ = order_changes(old, record([a]), READ)
    assert changes and f"train data: {a} {b} -> {a}" in changes[0]


def test_the_same_files_read_from_another_folder_keep_the_order(datasets, tmp_path, monkeypatch):
    """A copy of the files elsewhere, or a relative path to them, is the same dataset; a dataset
    of the same name with other content is not."""
    a, b = datasets
    copies = tmp_path / "copies"
    copies.mkdir()
    for prefix in (a, b):
        for ext in (".bin", ".idx"):
            shutil.copy(prefix + ext, copies / (os.path.basename(prefix) + ext))
    old = record(["0.5", a, "0.5", b])
    monkeypatch.chdir(copies)
    changes, notes = order_changes(old, record(["0.5", "a", "0.5", "./b"]), READ)
    assert changes == [] and notes[0].startswith("train data read from a ./b, saved as ")
    write_dataset(str(copies / "a"), np.full(100, 34))  # a's name, other tokens
    changes, _ = order_changes(old, record(["0.5", "a", "0.5", "./b"]), READ)
    assert any("train data a: tokens 2970 -> 3060" in c for c in changes), changes
    changes, _ = order_changes(old, record(["0.5", b, "0.5", a]), READ)  # swapped
    assert changes and "train data: " in changes[0]


def test_more_samples_within_the_same_epochs_keep_the_order(datasets):
    a, _ = datasets
    changes, notes = order_changes(record([a], samples=(100, 20, 0)),
                                   record([a], samples=(150, 20, 0)), READ)
    assert changes == [] and "train samples 100 -> 150: the order of the samples is unchanged" \
        in notes[0]


def test_a_split_not_read_yet_has_no_order_to_keep(datasets):
    a, b = datasets
    old, new = record([a], split="9,1,0"), record([a], split="9,1,0", samples=(200, 2000, 0))
    assert order_changes(old, new, {"train": 64, "valid": 0})[0] == []
    assert order_changes(old, new, READ)[0]  # valid was read: its epochs changed


def test_refused_unless_allowed_and_older_checkpoints_are_noted(datasets):
    a, b = datasets
    old = record(["0.5", a, "0.5", b])
    new = copy.deepcopy(old)
    new["seed"] = 7
    with pytest.raises(CheckpointError, match=r"--seed 5 -> 7.*--allow-data-order-change"):
        check_data_order(old, new, "ck/iter_0000002", READ, allow_change=False)
    lines = check_data_order(old, new, "ck/iter_0000002", READ, allow_change=True)
    assert "--allow-data-order-change: the data order changes" in lines[0]
    assert check_data_order(old, copy.deepcopy(old), "x", READ, allow_change=False) == []
    assert "records no data order" in check_data_order(None, new, "x", READ, False)[0]


def test_a_record_of_the_order_before_megatron_cores_is_refused_with_the_way_on(datasets):
    """Version 1 records (this trainer's own shuffle) name other samples for the same counts:
    refused while a split has been read, with --allow-data-order-change as the way on."""
    a, _ = datasets
    current = record([a])
    assert current["version"] == 2
    old = dict(copy.deepcopy(current), version=1)
    old.pop("order")
    with pytest.raises(CheckpointError, match=r"version 1 -> 2.*Megatron Core's order.*"
                                              r"--allow-data-order-change"):
        check_data_order(old, current, "ck/iter_0000010", READ, allow_change=False)
    lines = check_data_order(old, current, "ck/iter_0000010", READ, allow_change=True)
    assert "version 1 -> 2" in lines[0]
    assert check_data_order(old, current, "ck", {"train": 0, "valid": 0}, False) == []
