"""Data pipeline: GPT-2 BPE tokenizer, Megatron mmap indexed dataset, GPT datasets with cached
sample indices, blending, the pretraining sampler and batch construction (see docs/data.md).

This package never imports torch.distributed; rank coordination comes in through the
`is_builder` / `barrier` arguments of `build_train_valid_test_datasets`.
"""
from app.data.batch import get_batch, get_ltor_masks_and_position_ids
from app.data.blendable_dataset import BlendableDataset
from app.data.gpt_dataset import GPTDataset, build_train_valid_test_datasets, parse_data_path
from app.data.indexed_dataset import (DatasetFormatError, MMapIndexedDataset,
                                      MMapIndexedDatasetBuilder, best_fitting_dtype)
from app.data.samplers import MegatronPretrainingSampler
from app.data.tokenizer import (GPT2BPETokenizer, build_tokenizer, pad_vocab_size,
                                train_gpt2_bpe)

__all__ = [
    "BlendableDataset", "DatasetFormatError", "GPT2BPETokenizer", "GPTDataset",
    "MMapIndexedDataset", "MMapIndexedDatasetBuilder", "MegatronPretrainingSampler",
    "best_fitting_dtype", "build_tokenizer", "build_train_valid_test_datasets", "get_batch",
    "get_ltor_masks_and_position_ids", "pad_vocab_size", "parse_data_path", "train_gpt2_bpe",
]
