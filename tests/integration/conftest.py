"""Fixtures for end-to-end runs: a small real corpus, a tokenizer trained on it, and its .bin/.idx."""
import glob
import os
import sysconfig

import numpy as np
import pytest


def _stdlib_texts(max_files: int = 40):
    paths = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))[:max_files]
    texts = []
    for path in paths:
        with open(path, "rb") as f:
            try:
                texts.append(f.read().decode("utf-8"))
            except UnicodeDecodeError:
                continue
    return texts


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory):
    """dict(prefix, vocab, merges, vocab_size): ~40 stdlib files, BPE vocab 512, one doc per file."""
    from app.data import MMapIndexedDatasetBuilder, build_tokenizer
    from app.data.tokenizer import train_gpt2_bpe

    root = tmp_path_factory.mktemp("tiny_corpus")
    texts = _stdlib_texts()
    vocab, merges = train_gpt2_bpe(texts, 512, str(root / "tokenizer"))
    tok = build_tokenizer("GPT2BPETokenizer", vocab, merges)
    prefix = str(root / "stdlib_content_document")
    builder = MMapIndexedDatasetBuilder(prefix + ".bin", np.uint16)
    for text in texts:
        # split each file into ~2 KB pieces so the split has enough documents
        for start in range(0, len(text), 2048):
            ids = tok.tokenize(text[start:start + 2048])
            if ids:
                builder.add_item(np.array(ids + [tok.eod], dtype=np.uint16))
                builder.end_document()
    builder.finalize(prefix + ".idx")
    return {"prefix": prefix, "vocab": vocab, "merges": merges, "vocab_size": tok.vocab_size}


def tiny_gpt_args(corpus, tmp, *extra):
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


def read_metrics(path):
    import json
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


ZERO2_DP2_ARGS = ["--train-iters", "6", "--log-interval", "1", "--eval-iters", "0",
                  "--hidden-dropout", "0", "--attention-dropout", "0", "--global-batch-size", "8",
                  "--micro-batch-size", "2", "--save-interval", "3"]


@pytest.fixture(scope="session")
def zero2_dp2_run(tiny_corpus, tmp_path_factory):
    """A DeepSpeed ZeRO-2 run on two ranks (ZERO2_DP2_ARGS): its checkpoints of iterations 3 and 6
    in `ck/` and its losses in `straight.jsonl`; shared by the conversion and reshape tests."""
    import os
    from tests.harness.distributed import run_pretrain
    from tests.integration.launch_utils import ROOT
    tmp = tmp_path_factory.mktemp("zero2_dp2")
    zero2 = os.path.join(ROOT, "ds_configs", "zero2.json")
    run_pretrain(2, tiny_gpt_args(tiny_corpus, tmp, *ZERO2_DP2_ARGS, "--deepspeed",
                                  "--deepspeed_config", zero2, "--save", str(tmp / "ck"),
                                  "--metrics-file", str(tmp / "straight.jsonl")))
    return tmp
