"""tools/prepare_cache.py builds a run's sample indices from the run's own flags, without a
process group; the run with the same flags then builds and writes nothing and says where it
loaded them from. The world size it is told sets the sample counts."""
import os
import shutil

import pytest

import app.data.gpt_dataset as gpt_dataset
import app.data.index_cache as index_cache
import pretrain_gpt2
from tests.harness.corpus import tiny_gpt_args
from tools import prepare_cache


def snapshot(*folders):
    return {os.path.join(root, f): (os.stat(os.path.join(root, f)).st_mtime_ns,
                                    os.stat(os.path.join(root, f)).st_size)
            for folder in folders for root, _, files in os.walk(folder) for f in files}


def flags(corpus, tmp, *extra):
    """The tiny run over a per-split blend of two datasets in tmp/data, caches in tmp/cache."""
    data = tmp / "data"
    data.mkdir(exist_ok=True)
    for name in ("a", "b"):
        for ext in (".bin", ".idx"):
            shutil.copy(corpus["prefix"] + ext, data / (name + ext))
    argv = tiny_gpt_args(corpus, tmp, "--train-iters", "3", "--eval-iters", "1",
                         "--eval-interval", "2", "--log-interval", "1", *extra)
    i = argv.index("--data-path")
    argv[i:i + 2] = ["--train-data-path", "0.6", str(data / "a"), "0.4", str(data / "b"),
                     "--valid-data-path", str(data / "b")]
    i = argv.index("--split")
    return argv[:i] + argv[i + 2:]


def test_a_prepared_cache_is_loaded_and_nothing_is_written(tiny_corpus, tmp_path, capsys,
                                                          caplog, monkeypatch):
    argv = flags(tiny_corpus, tmp_path)
    assert prepare_cache.main(argv) == 0
    out = capsys.readouterr().out
    assert "4 index set(s) built, 0 already there" in out  # a, b, their blend; valid b
    # 3 iterations x 4 = 12 samples, blended by Megatron's rule: ceil(7.2) + ceil(4.8) = 13
    assert "train: 13 samples, a blend of 2 dataset(s) by weight" in out
    before = snapshot(tmp_path / "data", tmp_path / "cache")

    def no_write(*args, **kwargs):
        raise AssertionError("the run wrote a cache file")

    monkeypatch.setattr(index_cache, "atomic_write", no_write)
    monkeypatch.setattr(gpt_dataset, "atomic_write", no_write)
    with caplog.at_level("INFO"):
        trainer = pretrain_gpt2.run(argv)
    assert trainer.state.iteration == 3
    assert (f"sample indices: 4 of 4 index sets loaded from the cache in {tmp_path / 'cache'}, "
            "0 built") in caplog.text
    assert snapshot(tmp_path / "data", tmp_path / "cache") == before
    assert prepare_cache.main(argv) == 0  # again: everything is there already
    assert "0 index set(s) built, 4 already there" in capsys.readouterr().out


def test_the_world_size_sets_the_sample_counts(tiny_corpus, tmp_path, capsys):
    argv = flags(tiny_corpus, tmp_path)
    i = argv.index("--global-batch-size")  # it defaults to micro-batch 2 x data-parallel size
    argv = argv[:i] + argv[i + 2:]
    assert prepare_cache.main(argv + ["--prepare-cache-world-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "world size 2: tensor 1 x pipeline 1 x data 2" in out
    assert "train: 13 samples" in out  # 3 iterations x (2 x 2) = 12: ceil(7.2) + ceil(4.8)
    assert prepare_cache.main(argv + ["--prepare-cache-world-size", "1"]) == 0
    assert "train: 7 samples" in capsys.readouterr().out  # 6: ceil(3.6) + ceil(2.4)


def test_bad_flags_exit_2_with_one_line(tiny_corpus, tmp_path, capsys):
    argv = flags(tiny_corpus, tmp_path, "--prepare-cache-world-size", "0")
    assert prepare_cache.main(argv) == 2
    assert "--prepare-cache-world-size must be positive" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        pretrain_gpt2.main(flags(tiny_corpus, tmp_path, "--prepare-cache-world-size", "2"))
