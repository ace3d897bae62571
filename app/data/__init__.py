"""Data pipeline: GPT-2 BPE tokenizer, Megatron mmap indexed dataset, GPT datasets with cached
sample indices, blending, synthetic data (--mock-data), the pretraining sampler and batch
construction (see docs/data.md).

Public names are imported lazily (PEP 562), so that tools which only need the tokenizer or the
indexed dataset (tools/preprocess_data.py and its workers) do not pay for importing torch.
This package never imports torch.distributed; rank coordination comes in through the
`is_builder` / `barrier` arguments of `build_datasets`.
"""
import importlib
from typing import Any

_EXPORTS = {
    "get_batch": "batch", "get_ltor_masks_and_position_ids": "batch",
    "BlendableDataset": "blendable_dataset",
    "GPTDataset": "gpt_dataset", "build_train_valid_test_datasets": "gpt_dataset",
    "build_datasets": "gpt_dataset", "plan_datasets": "plan", "order_record": "plan",
    "DatasetFormatError": "indexed_dataset", "MMapIndexedDataset": "indexed_dataset",
    "MMapIndexedDatasetBuilder": "indexed_dataset", "best_fitting_dtype": "indexed_dataset",
    "MegatronPretrainingSampler": "samplers",
    "GPT2BPETokenizer": "tokenizer", "NullTokenizer": "tokenizer",
    "build_tokenizer": "tokenizer", "MockGPTDataset": "mock_dataset",
    "build_mock_datasets": "mock_dataset",
    "pad_vocab_size": "tokenizer", "train_gpt2_bpe": "tokenizer",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'app.data' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"app.data.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + __all__)
