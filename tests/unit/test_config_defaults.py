"""A flag left out of the command line gives its config field the dataclass's default.

The flag -> field mapping is the real conversion: a command line with only the required
--train-iters goes through `arguments.config_from_argv`, and every field of every sub-config is
compared with the same dataclass built from its own defaults (its required fields, which have
no default, copied over). The exceptions are the fields the builder derives, listed with why.
"""
import dataclasses

import pytest

import arguments
from app.config import OptimizerConfig, RunConfig

RAW_VOCAB = 50257

DERIVED = {
    ("optimizer", "lr_decay_iters"): "--lr-decay-iters defaults to --train-iters",
    ("precision", "source"): "the builder records where the precision came from",
    ("parallel", "distributed_backend"): "--distributed-backend defaults to nccl with CUDA",
    ("run", "raw_vocab_size"): "the tokenizer's vocabulary size, passed to the builder",
}
"""(sub-config, field) -> why the built value is not the dataclass default."""


def _required(config):
    """The fields of `config` without a default, with its values."""
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}


def _defaults(built):
    """{sub-config name: (built sub-config, the same dataclass with its defaults)}."""
    subs = {f.name: getattr(built, f.name) for f in dataclasses.fields(built)
            if dataclasses.is_dataclass(getattr(built, f.name))}
    pairs = {name: (sub, type(sub)(**_required(sub))) for name, sub in subs.items()}
    plain = RunConfig(**{name: default for name, (_, default) in pairs.items()})
    pairs["run"] = (built, plain)
    return pairs


@pytest.fixture(scope="module")
def built():
    return arguments.config_from_argv(["--train-iters", "10"], 1, RAW_VOCAB)


def test_every_sub_config_is_compared(built):
    assert set(_defaults(built)) == {"model", "parallel", "optimizer", "precision", "data",
                                     "training", "checkpoint", "deepspeed", "kernels", "rollback",
                                     "wandb", "run"}


def test_flag_defaults_equal_the_dataclass_defaults(built):
    mismatches = []
    for name, (sub, default) in _defaults(built).items():
        for f in dataclasses.fields(sub):
            got, want = getattr(sub, f.name), getattr(default, f.name)
            if dataclasses.is_dataclass(got) or (name, f.name) in DERIVED:
                continue
            if got != want:
                mismatches.append(f"{name}.{f.name}: flag default {got!r}, dataclass {want!r}")
    assert not mismatches, "\n".join(mismatches)


def test_derived_fields_hold_what_the_builder_derives(built):
    assert built.optimizer.lr_decay_iters == built.training.train_iters == 10
    assert built.precision.source == "fp32 (no --fp16/--bf16)"
    assert built.parallel.distributed_backend in ("gloo", "nccl")
    assert built.raw_vocab_size == RAW_VOCAB


def test_lr_decay_style_defaults_to_megatrons_linear(built):
    assert built.optimizer.lr_decay_style == OptimizerConfig().lr_decay_style == "linear"
