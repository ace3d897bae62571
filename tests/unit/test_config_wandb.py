"""The --wandb-* flags: Megatron-LM's names, checked when the config is built, on every rank."""
import importlib.machinery
import os
import sys
import types

import pytest

import arguments
from app.config.wandb import WandbConfig

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--max-position-embeddings", "32", "--train-iters", "4",
        "--micro-batch-size", "2"]


def _installed():
    """A stand-in `wandb` module, so these checks run whether or not wandb is installed."""
    module = types.ModuleType("wandb")
    module.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    return module


def _config(*extra):
    return arguments.config_from_argv([*BASE, *extra], world_size=1, raw_vocab_size=512)


def test_off_by_default_and_save_dir_defaults_under_save(tmp_path, monkeypatch):
    assert not _config().wandb.enabled
    monkeypatch.setitem(sys.modules, "wandb", _installed())
    cfg = _config("--wandb-project", "p", "--wandb-exp-name", "e", "--save", str(tmp_path),
                  "--wandb-entity", "team")
    assert cfg.wandb == WandbConfig(project="p", exp_name="e", entity="team",
                                    save_dir=os.path.join(str(tmp_path), "wandb"))
    cfg = _config("--wandb-project", "p", "--wandb-exp-name", "e", "--wandb-save-dir", "w")
    assert cfg.wandb.save_dir == "w" and cfg.wandb.enabled


@pytest.mark.parametrize("extra, message", [
    (["--wandb-project", "p"], "needs --wandb-exp-name"),
    (["--wandb-exp-name", "e"], "--wandb-exp-name given without --wandb-project"),
    (["--wandb-save-dir", "d", "--wandb-entity", "t"],
     "--wandb-save-dir, --wandb-entity given without --wandb-project"),
])
def test_incomplete_flags_are_refused_by_name(extra, message, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", _installed())
    with pytest.raises(ValueError, match=message):
        _config(*extra)


def test_without_wandb_installed_the_flags_say_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # find_spec and import then fail
    with pytest.raises(ValueError, match="pip install wandb"):
        _config("--wandb-project", "p", "--wandb-exp-name", "e")
    assert not _config().wandb.enabled  # and runs without the flags are unaffected
