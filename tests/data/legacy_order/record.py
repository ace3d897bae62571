"""Records samples.json: the samples the code of commit d8367dc (the last with this trainer's own
data order, read today by app.data.legacy_order) builds for a few data layouts, so that
tests/unit/test_data_legacy_order.py can check the reader against that code itself. Run with a
checkout of d8367dc first on the path, from this repository's root:

    git worktree add --detach /tmp/old d8367dc; ln -s $PWD/.venv /tmp/old/.venv
    PYTHONPATH=/tmp/old .venv/bin/python tests/data/legacy_order/record.py

It writes the three small datasets every case reads into data/ (`write_all`; the test reads
these files), then builds each case (`build_train_valid_test_datasets`' arguments) and keeps the
first samples of train and valid as token lists, the case's data-order record
(`order_record`, folders left out of its prefixes) and the case's arguments.
"""
import json
import os
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
CASES = {
    # several epochs, the last shuffled apart; a split of documents with two sequences each
    "one_dataset_epochs": dict(data=["a"], split="90,10,0", num_samples=(70, 12, 0),
                               seq_length=9, seed=1234),
    # a blend of three weighted datasets with --split 969,30,1
    "blend": dict(data=["0.5", "a", "0.3", "b", "0.2", "c"], split="969,30,1",
                  num_samples=(40, 6, 2), seq_length=7, seed=7),
    # nine datasets: weights summed in Python, not pairwise
    "blend_of_nine": dict(data=[w for i in range(9) for w in (str(0.1 + 0.07 * i), "abc"[i % 3])],
                          split="80,20,0", num_samples=(30, 4, 0), seq_length=5, seed=3),
}
SAMPLES = 12


def write(prefix, documents, sentences, first):
    """`documents` documents of `sentences` sequences each, lengths from an LCG, token values
    counting up from `first` (so a sample's tokens say where it came from)."""
    from app.data import MMapIndexedDatasetBuilder
    builder = MMapIndexedDatasetBuilder(prefix + ".bin", np.int32)
    state, token = 99 + first, first
    for _ in range(documents):
        for _ in range(sentences):
            state = (1103515245 * state + 12345) % 2 ** 31
            length = 3 + (state >> 8) % 11
            builder.add_item(np.arange(token, token + length))
            token += length
        builder.end_document()
    builder.finalize(prefix + ".idx")


def write_all(directory):
    """The three datasets every case reads: a (documents of two sequences), b, c."""
    write(os.path.join(directory, "a"), 23, 2, 0)
    write(os.path.join(directory, "b"), 17, 1, 10 ** 6)
    write(os.path.join(directory, "c"), 31, 1, 2 * 10 ** 6)


def record(data, case):
    """The code's data-order record of `case`, with the prefixes' folders left out."""
    from app.config import DataConfig
    from app.data.plan import order_record, plan_datasets
    blends = DataConfig(data_path=data, split=case["split"]).blends
    rec = order_record(plan_datasets(blends, case["split"], case["num_samples"],
                                     case["seq_length"]), case["seed"])
    for split in rec["splits"].values():
        for part in split["parts"]:
            part["prefix"] = os.path.basename(part["prefix"])
    del rec["source"]
    return rec


def main():
    import app
    from app.data import build_train_valid_test_datasets
    print("recording with", app.__file__, file=sys.stderr)
    out = {}
    data_dir = os.path.join(HERE, "data")
    os.makedirs(data_dir, exist_ok=True)
    write_all(data_dir)
    with tempfile.TemporaryDirectory() as directory:
        for name, case in CASES.items():
            data = [w if w[0].isdigit() else os.path.join(data_dir, w) for w in case["data"]]
            train, valid, _ = build_train_valid_test_datasets(
                data, case["split"], case["num_samples"], case["seq_length"], case["seed"],
                cache_path=os.path.join(directory, name))
            out[name] = {split: [ds[i]["text"].tolist() for i in range(min(SAMPLES, len(ds)))]
                         for split, ds in (("train", train), ("valid", valid)) if ds is not None}
            out[name]["record"] = record(data, case)
            out[name]["arguments"] = case
    with open(os.path.join(HERE, "samples.json"), "w") as f:
        json.dump({"_doc": "written by record.py with the code of d8367dc", "cases": out}, f)
        f.write("\n")
    print({k: {s: len(v) for s, v in c.items()} for k, c in out.items()})


if __name__ == "__main__":
    main()
