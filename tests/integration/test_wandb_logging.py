"""Weights & Biases logging, offline: the run files hold the metrics file's numbers under the
tags TensorBoard gets (Megatron-LM's: 'lm loss', 'learning-rate', ...; app.training.telemetry.
scalars), and the run configuration; with two ranks only the last one logs."""
import glob
import json
import os
import struct

import pytest

from tests.harness.corpus import read_metrics, tiny_gpt_args
from tests.harness.launch import torchrun

wandb = pytest.importorskip("wandb", reason="wandb is optional and not installed: pip install wandb")

TRAIN = ["--train-iters", "4", "--log-interval", "1", "--eval-interval", "2", "--eval-iters", "1",
         "--hidden-dropout", "0", "--attention-dropout", "0"]
_BLOCK, _HEADER = 32768, 7  # the .wandb transaction log: 32 KiB blocks, 7-byte record headers


def _records(path):
    """The protobuf records of a .wandb file (W&B's LevelDB-style log: a ':W&B' header, then
    records of (crc32, length, type) split across 32 KiB blocks), parsed with wandb's own
    Record message."""
    from wandb.proto import wandb_internal_pb2
    with open(path, "rb") as f:
        data = f.read()
    ident, magic, _version = struct.unpack("<4sHB", data[:_HEADER])
    assert (ident, magic) == (b":W&B", 0xBEE1), f"{path} is not a W&B transaction log"
    position, pending = _HEADER, b""
    while position + _HEADER <= len(data):
        room = _BLOCK - position % _BLOCK
        _crc, length, kind = struct.unpack("<IHB", data[position:position + _HEADER])
        if room < _HEADER or (length, kind) == (0, 0):  # the rest of the block is padding
            position += room
            continue
        pending += data[position + _HEADER:position + _HEADER + length]
        position += _HEADER + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record
            pending = b""


def read_offline_run(save_dir):
    """(run name, config {key: value}, {step: {tag: value}}) of the one offline run in save_dir."""
    runs = glob.glob(os.path.join(save_dir, "wandb", "offline-run-*", "run-*.wandb"))
    assert len(runs) == 1, runs
    name, config, history = None, {}, {}
    for record in _records(runs[0]):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            name = record.run.display_name or name
            config.update({i.key: json.loads(i.value_json) for i in record.run.config.update})
        elif kind == "config":
            config.update({i.key: json.loads(i.value_json) for i in record.config.update})
        elif kind == "history":
            row = history.setdefault(record.history.step.num, {})
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                     for i in record.history.item}  # "train/lm_loss" is a nested key
            row.update({k: v for k, v in items.items() if not k.startswith("_")})
    return name, config, history


TAGS = {"train": {"lm loss": "lm_loss", "learning-rate": "lr", "grad-norm": "grad_norm",
                  "batch-size": "global_batch_size", "samples vs steps": "consumed_samples",
                  "tokens-per-second": "tokens_per_s", "mfu": "mfu"},
        "valid": {"lm loss validation": "lm_loss"}, "test": {"lm loss validation": "lm_loss"}}
"""Megatron's tag -> the metrics file's key, by row kind (every iteration is logged here); the
test set's loss is written under the validation tag, after the last validation, as Megatron's
evaluate_and_print_results does."""


def _expected(metrics_file):
    """{iteration: {tag: value}}: the metrics file's numbers under Megatron's tags."""
    want = {}
    for row in read_metrics(metrics_file):
        for tag, key in TAGS.get(row["kind"], {}).items():
            if isinstance(row.get(key), (int, float)):
                want.setdefault(row["iteration"], {})[tag] = float(row[key])
    return want


def test_offline_run_holds_the_scalars_and_the_config(tiny_corpus, tmp_path, monkeypatch):
    from pretrain_gpt2 import run as pretrain
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    pretrain(tiny_gpt_args(tiny_corpus, tmp_path, *TRAIN, "--metrics-file",
                           str(tmp_path / "m.jsonl"), "--wandb-project", "gpt2-tests",
                           "--wandb-exp-name", "tiny", "--wandb-save-dir", str(tmp_path / "wb")))
    wandb.teardown()  # the run is finished; its files are complete once W&B's service stops
    name, config, history = read_offline_run(tmp_path / "wb")
    assert name == "tiny"
    assert config["model"]["hidden_size"] == 64 and config["training"]["train_iters"] == 4
    assert config["wandb"]["project"] == "gpt2-tests"
    want = _expected(tmp_path / "m.jsonl")
    for tag in (*TAGS["train"], *TAGS["valid"]):
        assert any(tag in row for row in want.values()), f"the run logged no {tag}"
    assert sorted(history) == sorted(want)
    for iteration, row in want.items():
        got = {tag: history[iteration].get(tag) for tag in row}
        assert got == pytest.approx(row, rel=1e-6), iteration


def test_only_the_last_rank_logs(tiny_corpus, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    torchrun(2, tiny_gpt_args(tiny_corpus, tmp_path, *TRAIN, "--pipeline-model-parallel-size", "2",
                              "--metrics-file", str(tmp_path / "m.jsonl"), "--wandb-project",
                              "gpt2-tests", "--wandb-exp-name", "pp2", "--save",
                              str(tmp_path / "ck"), "--save-interval", "100"), tmp_path)
    _, config, history = read_offline_run(tmp_path / "ck" / "wandb")  # default: {--save}/wandb
    assert config["parallel"]["pipeline_model_parallel_size"] == 2
    want = _expected(tmp_path / "m.jsonl")
    assert want and sorted(history) == sorted(want)
    assert history[4]["lm loss"] == pytest.approx(want[4]["lm loss"], rel=1e-6)
