"""Our train/valid/test samples are Megatron Core's, token for token, in Megatron's order.

The reference is megatron-core 0.16.1 itself (installed in the venv; its dataset code and C++
helpers run on CPU): `BlendedMegatronDatasetBuilder` + `GPTDataset`, configured as Megatron-LM's
pretrain_gpt.py configures them (`core_gpt_dataset_config_from_args`: the blend(s) parsed by
`get_blend_from_list`, random_seed = --seed, --split, the default mid-level surplus), over
.bin/.idx files written by our writer. Ours is built from the same flags through the trainer's
own path (app.config.blends.resolve_blends -> app.data.plan -> app.data.gpt_dataset), and read
through the trainer's data iterator at DP1 and DP2 from a consumed-sample count, which must
give each rank Megatron's sampler slice: global batch i is samples [i * gbs, (i + 1) * gbs) and
rank r takes [r * mbs, (r + 1) * mbs) of each group of mbs * dp samples.
"""
import os
import types
import warnings

import numpy as np
import pytest

from app.config.blends import resolve_blends
from app.data import MMapIndexedDatasetBuilder
from app.data.gpt_dataset import build_datasets
from app.data.plan import plan_datasets
from app.training.data_loading import build_data_iterator

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    mcore_builder = pytest.importorskip("megatron.core.datasets.blended_megatron_dataset_builder")
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
    from megatron.core.datasets.utils import get_blend_from_list

SEED, SEQ, VOCAB = 1234, 16, 1000


class _Tokenizer:
    """The little of a tokenizer Megatron's GPT dataset reads (no pad token: it pads nothing)."""

    unique_identifiers = {"class": "TestTokenizer"}
    vocab_size = VOCAB
    eod = VOCAB - 1


def _write(path, num_docs, max_len, seed):
    """A dataset of random documents written by our writer; returns its prefix."""
    rng = np.random.default_rng(seed)
    builder = MMapIndexedDatasetBuilder(path + ".bin", np.uint16)
    for length in rng.integers(1, max_len, num_docs):
        builder.add_item(rng.integers(0, VOCAB - 1, length))
        builder.end_document()
    builder.finalize(path + ".idx")
    return path


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("megatron_order"))
    return {"a": _write(os.path.join(root, "a"), 300, 40, 1),
            "b": _write(os.path.join(root, "b"), 200, 60, 2),
            "tiny": _write(os.path.join(root, "tiny"), 3, 8, 3)}


def _megatron(sizes, data_path=None, per_split=None, split="969,30,1"):
    """Megatron Core's (train, valid, test), as pretrain_gpt.py builds them."""
    config = GPTDatasetConfig(
        random_seed=SEED, sequence_length=SEQ,
        blend=None if data_path is None else get_blend_from_list(data_path),
        blend_per_split=None if per_split is None else [
            None if words is None else get_blend_from_list(words) for words in per_split],
        split=None if per_split is not None else split, tokenizer=_Tokenizer(),
        reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return mcore_builder.BlendedMegatronDatasetBuilder(
            GPTDataset, list(sizes), lambda: True, config).build()


def _ours(sizes, cache, data_path=None, per_split=None, split="969,30,1"):
    per_split = per_split or [None, None, None]
    blends = resolve_blends(data_path or [], None, [w or [] for w in per_split], None)
    return build_datasets(plan_datasets(blends, split, sizes, SEQ), SEED, cache_path=cache)


def _megatron_text(dataset, i):
    item = dataset[i]
    return np.concatenate([item["tokens"].numpy(), item["labels"].numpy()[-1:]])


def _check_split(ours, theirs, count):
    """The first `count` samples agree token for token."""
    assert len(ours) >= count and len(theirs) >= count
    for i in range(count):
        assert np.array_equal(ours[i]["text"], _megatron_text(theirs, i)), f"sample {i}"


def _rank_batches(dataset, consumed, mbs, dp, rank, count):
    """The samples of `count` micro-batches the trainer's iterator gives DP rank `rank`."""
    state = types.SimpleNamespace(tensor_model_parallel_rank=0, data_parallel_rank=rank,
                                  data_parallel_size=dp)
    iterator = build_data_iterator(dataset, consumed, mbs, state, num_workers=0)
    return [next(iterator)["text"].numpy() for _ in range(count)]


def _check_sampler(ours, theirs, consumed, gbs, mbs, dp):
    """At DP `dp`, from `consumed`, every rank's micro-batches of two global batches are
    Megatron's sampler slices of Megatron's samples."""
    micro_per_rank = gbs // (mbs * dp)
    for rank in range(dp):
        batches = _rank_batches(ours, consumed, mbs, dp, rank, 2 * micro_per_rank)
        for k, batch in enumerate(batches):
            first = consumed + k * mbs * dp + rank * mbs
            expected = np.stack([_megatron_text(theirs, first + j) for j in range(mbs)])
            assert np.array_equal(batch, expected), (rank, k)


@pytest.mark.parametrize("dp", [1, 2])
def test_one_dataset_over_several_epochs(corpora, tmp_path, dp):
    # train (276 documents, 353 samples an epoch): 3 epochs shuffled together; valid (18
    # documents, 21 samples an epoch): 10 epochs, the last shuffled apart; test: one epoch
    sizes = (1000, 200, 5)
    ours = _ours(sizes, str(tmp_path), data_path=[corpora["a"]], split="92,6,2")
    theirs = _megatron(sizes, data_path=[corpora["a"]], split="92,6,2")
    assert np.array_equal(ours[0].doc_idx, theirs[0].document_index)
    assert np.array_equal(ours[0].shuffle_idx, theirs[0].shuffle_index)
    for split in range(3):
        _check_split(ours[split], theirs[split], sizes[split])
    _check_sampler(ours[0], theirs[0], consumed=3 * 32, gbs=32, mbs=4, dp=dp)


@pytest.mark.parametrize("dp", [1, 2])
def test_weighted_blend_divided_by_split(corpora, tmp_path, dp):
    sizes, words = (1000, 96, 32), ["0.3", corpora["a"], "0.7", corpora["b"]]
    ours = _ours(sizes, str(tmp_path), data_path=words, split="90,8,2")
    theirs = _megatron(sizes, data_path=words, split="90,8,2")
    for split in range(3):
        assert len(ours[split]) == len(theirs[split])  # Megatron's sizes, surplus included
        assert np.array_equal(ours[split].dataset_index, theirs[split].dataset_index)
        assert [len(d) for d in ours[split].datasets] == [len(d) for d in theirs[split].datasets]
        _check_split(ours[split], theirs[split], sizes[split])
    _check_sampler(ours[0], theirs[0], consumed=5 * 16, gbs=16, mbs=2, dp=dp)


def test_per_split_blends(corpora, tmp_path):
    """Weighted, single and size-weighted blends, one per split, each dataset used whole."""
    per_split = [["2", corpora["a"], "1", corpora["b"]], [corpora["b"]],
                 [corpora["a"], corpora["b"]]]
    sizes = (900, 64, 5000)  # test: capped at one epoch of each dataset
    ours = _ours(sizes, str(tmp_path), per_split=per_split)
    theirs = _megatron(sizes, per_split=per_split)
    for split in range(3):
        assert len(ours[split]) == len(theirs[split])
        _check_split(ours[split], theirs[split], len(theirs[split]))
    _check_sampler(ours[0], theirs[0], consumed=8, gbs=8, mbs=2, dp=2)


@pytest.mark.parametrize("dp", [1, 2])
def test_dataset_smaller_than_one_global_batch(corpora, tmp_path, dp):
    sizes = (96, 0, 0)  # 3 documents of < 8 tokens: a few samples an epoch, many epochs
    ours = _ours(sizes, str(tmp_path), per_split=[[corpora["tiny"]], None, None])
    theirs = _megatron(sizes, per_split=[[corpora["tiny"]], None, None])
    assert ours[1] is None and ours[2] is None
    _check_split(ours[0], theirs[0], sizes[0])
    _check_sampler(ours[0], theirs[0], consumed=32, gbs=32, mbs=4, dp=dp)


def test_mock_data_is_megatrons_mock_dataset():
    """--mock-data: our train/valid/test samples are megatron-core's MockGPTDataset's (built by
    BlendedMegatronDatasetBuilder with no blend, so mock; documents past VOCAB tokens wrap)."""
    from app.data.mock_dataset import build_mock_datasets
    from megatron.core.datasets.gpt_dataset import MockGPTDataset
    sizes = (40, 12, 8)
    config = GPTDatasetConfig(
        random_seed=SEED, sequence_length=SEQ, blend=None, split="969,30,1",
        tokenizer=_Tokenizer(), reset_position_ids=False, reset_attention_mask=False,
        eod_mask_loss=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = mcore_builder.BlendedMegatronDatasetBuilder(
            MockGPTDataset, list(sizes), lambda: True, config).build()
    ours = build_mock_datasets(sizes, SEQ, VOCAB, SEED)
    for our, their, count in zip(ours, theirs, sizes):
        assert len(our) == len(their)
        _check_split(our, their, count)
    _check_sampler(ours[0], theirs[0], consumed=8, gbs=8, mbs=2, dp=2)
