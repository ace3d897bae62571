"""The trainer's command line in tests: a base run, its RunConfig, an expected refusal."""
import pathlib

import pytest

import arguments
from app.config import RunConfig


DS_JSON = str(pathlib.Path(__file__).resolve().parents[2] / "ds_configs" / "zero1.json")


BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--max-position-embeddings", "64", "--train-iters", "100",
        "--micro-batch-size", "2", "--distributed-backend", "gloo"]


def build(extra, world_size=1, raw_vocab=100, padded_vocab=128) -> RunConfig:
    args = arguments.parse_args(BASE + list(extra))
    return arguments.build_run_config(args, world_size, raw_vocab, padded_vocab)


def expect_error(extra, *fragments, world_size=1, padded_vocab=128):
    with pytest.raises(ValueError) as info:
        build(extra, world_size=world_size, padded_vocab=padded_vocab)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return message
