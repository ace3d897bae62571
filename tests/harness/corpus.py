"""A small real corpus for end-to-end runs: ~40 standard-library files, a byte-level BPE of 512
trained on them, their `.bin/.idx`, and the command line of a tiny GPT-2 run over it."""
import glob
import json
import os
import sysconfig
from typing import Dict, List

import numpy as np


def stdlib_texts(max_files: int = 40) -> List[str]:
    """The text of the first `max_files` standard-library modules (sorted by path) that decode."""
    paths = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))[:max_files]
    texts = []
    for path in paths:
        with open(path, "rb") as f:
            try:
                texts.append(f.read().decode("utf-8"))
            except UnicodeDecodeError:
                continue
    return texts


def make_tiny_corpus(root: str) -> Dict[str, object]:
    """dict(prefix, vocab, merges, vocab_size) under `root`: BPE vocab 512, each file cut into
    ~2 KB documents so the split has enough of them."""
    from app.data import build_tokenizer
    from app.data.tokenizer import train_gpt2_bpe

    texts = stdlib_texts()
    vocab, merges = train_gpt2_bpe(texts, 512, os.path.join(root, "tokenizer"))
    tok = build_tokenizer("GPT2BPETokenizer", vocab, merges)
    prefix = os.path.join(root, "stdlib_content_document")
    write_documents(prefix, texts, tok, np.uint16)
    return {"prefix": prefix, "vocab": vocab, "merges": merges, "vocab_size": tok.vocab_size}


def write_documents(prefix: str, texts: List[str], tokenizer, dtype) -> None:
    """`prefix`.bin/.idx of `texts` tokenized by `tokenizer`, each text cut into ~2 KB
    documents that end with the tokenizer's end-of-document id."""
    from app.data import MMapIndexedDatasetBuilder
    builder = MMapIndexedDatasetBuilder(prefix + ".bin", dtype)
    for text in texts:
        for start in range(0, len(text), 2048):
            ids = tokenizer.tokenize(text[start:start + 2048])
            if ids:
                builder.add_item(np.array(ids + [tokenizer.eod], dtype=dtype))
                builder.end_document()
    builder.finalize(prefix + ".idx")


def tiny_gpt_args(corpus, tmp, *extra) -> List[str]:
    """Command line of a tiny GPT-2 run (2 layers, h 64, seq 32) on the tiny corpus."""
    return [
        "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--max-position-embeddings", "32",
        "--micro-batch-size", "2", "--global-batch-size", "4",
        "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2",
        "--data-path", corpus["prefix"], "--vocab-file", corpus["vocab"],
        "--merge-file", corpus["merges"], "--split", "90,8,2",
        "--data-cache-path", str(tmp / "cache"), "--num-workers", "0",
        "--make-vocab-size-divisible-by", "64", "--seed", "1234",
        "--distributed-backend", "gloo", *extra,
    ]


def read_metrics(path) -> List[dict]:
    """The records of a --metrics-file (JSON lines)."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


ZERO2_DP2_ARGS = ["--train-iters", "6", "--log-interval", "1", "--eval-iters", "0",
                  "--hidden-dropout", "0", "--attention-dropout", "0", "--global-batch-size", "8",
                  "--micro-batch-size", "2", "--save-interval", "3"]


def run_zero2_dp2(corpus, tmp) -> None:
    """A DeepSpeed ZeRO-2 run on two ranks (ZERO2_DP2_ARGS): its checkpoints of iterations 3 and
    6 in `tmp/ck` and its losses in `tmp/straight.jsonl`."""
    from tests.harness.distributed import run_pretrain
    from tests.harness.launch import ROOT
    zero2 = os.path.join(ROOT, "ds_configs", "zero2.json")
    run_pretrain(2, tiny_gpt_args(corpus, tmp, *ZERO2_DP2_ARGS, "--deepspeed",
                                  "--deepspeed_config", zero2, "--save", str(tmp / "ck"),
                                  "--metrics-file", str(tmp / "straight.jsonl")))
