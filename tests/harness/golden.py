"""Golden loss curves: the first iterations of a few fixed configurations, stored per
environment and compared with, so that any change to the numerics (model, optimizer, data order,
RNG use, precision handling, a library upgrade) shows up as a failing test instead of a silent
drift.

Deterministic by construction: one torch thread, fixed seeds, no data-loader workers, a data
set written here from an integer formula (no tokenizer training, no random library), the CPU.
The values depend on the environment (torch, the processor's kernels, the thread count), so they
are stored under an environment key (tests.harness.numerics): compared bit for bit on a machine
whose key is recorded, within the tolerance of the run's precision on any other.

When a change of the numbers is intended, regenerate them on one machine and commit the JSON with
the change (`--write` drops every other environment's curves: they are stale after the change):

    OMP_NUM_THREADS=1 .venv/bin/python -m tests.harness.golden --write

To give another machine exact comparisons without changing the numerics (the CI machine, a
developer's), add its curves (`--add` refuses curves that disagree with the recorded ones beyond
the tolerance, which would mean the numerics changed):

    OMP_NUM_THREADS=1 .venv/bin/python -m tests.harness.golden --add
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
from typing import Dict, List

import numpy as np
import torch

from tests.harness import numerics

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GOLDEN_FILE = os.path.join(ROOT, "tests", "data", "golden_loss_curves.json")
ITERATIONS = 10
VOCAB = 257  # the 256 byte symbols and <|endoftext|>: no merges needed

COMMON = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
          "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2",
          "--global-batch-size", "4", "--train-iters", str(ITERATIONS), "--lr", "3e-3",
          "--min-lr", "3e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2",
          "--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--split", "90,10,0",
          "--eval-interval", "5", "--eval-iters", "1", "--log-interval", "1",
          "--num-workers", "0", "--make-vocab-size-divisible-by", "64", "--seed", "1234",
          "--distributed-backend", "gloo"]

CONFIGS: Dict[str, List[str]] = {
    "native_fp32": [],
    "native_bf16": ["--bf16"],
    "native_fp32_recompute_reset_mask": ["--checkpoint-activations", "--reset-attention-mask",
                                         "--reset-position-ids", "--eod-mask-loss"],
    "deepspeed_zero2_fp32": ["--deepspeed", "--deepspeed_config",
                             os.path.join(ROOT, "ds_configs", "zero2.json")],
}


def environment() -> Dict[str, str]:
    """The fields of the environment key golden curves are stored under: this machine's, at the
    one thread `run_config` trains with."""
    return numerics.environment(threads=1)


def precision(name: str) -> str:
    """The precision configuration `name` trains in (its tolerance elsewhere)."""
    return numerics.precision_of(CONFIGS[name])


def disagreements(curves: Dict[str, Dict[str, List[float]]],
                  golden: Dict[str, Dict[str, Dict[str, List[float]]]]) -> List[str]:
    """Where `curves` (this machine's) differ from every recorded environment's beyond the
    tolerance of their precision (numerics.TOLERANCE): a change of the numerics, not of the
    machine."""
    problems = []
    for key, recorded in golden.items():
        for name, want in recorded.items():
            comparison = numerics.Comparison(numerics.TOLERANCE[precision(name)], "")
            for metric, values in want.items():
                got = curves.get(name, {}).get(metric, [])
                bad = [i for i, (a, b) in enumerate(zip(got, values))
                       if comparison.mismatch(a, b)] + ([] if len(got) == len(values) else [-1])
                if bad:
                    problems.append(f"{name} {metric} at {bad} against {key!r}")
    return problems


def write_tokenizer(directory: str) -> tuple:
    """vocab.json of the 256 byte-level symbols plus <|endoftext|> (id 256), an empty merges.txt."""
    from tokenizers import pre_tokenizers
    symbols = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {s: i for i, s in enumerate(symbols)}
    vocab["<|endoftext|>"] = len(vocab)
    vocab_file, merge_file = os.path.join(directory, "vocab.json"), os.path.join(directory, "merges.txt")
    with open(vocab_file, "w", encoding="utf-8") as f:
        json.dump(vocab, f)
    with open(merge_file, "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n")
    return vocab_file, merge_file


def write_data(prefix: str) -> str:
    """120 documents of 20..83 tokens from a linear congruential generator, each ending with
    the end-of-document id: the same bytes on every machine."""
    from app.data import MMapIndexedDatasetBuilder
    builder = MMapIndexedDatasetBuilder(prefix + ".bin", np.uint16)
    state = 12345
    for _ in range(120):
        state = (1103515245 * state + 12345) % 2 ** 31
        length = 20 + state % 64
        tokens = []
        for _ in range(length):
            state = (1103515245 * state + 12345) % 2 ** 31
            tokens.append((state >> 8) % (VOCAB - 1))
        builder.add_item(np.array(tokens + [VOCAB - 1], dtype=np.uint16))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix


def run_config(name: str, workdir: str) -> Dict[str, List[float]]:
    """Train configuration `name` in this process; its per-iteration train loss and gradient
    norm and its validation losses, read from the metrics file."""
    import pretrain_gpt2
    vocab_file, merge_file = write_tokenizer(workdir)
    prefix = write_data(os.path.join(workdir, "golden_text_document"))
    metrics = os.path.join(workdir, f"{name}.jsonl")
    argv = [*COMMON, *CONFIGS[name], "--data-path", prefix, "--vocab-file", vocab_file,
            "--merge-file", merge_file, "--data-cache-path", os.path.join(workdir, "cache"),
            "--metrics-file", metrics]
    threads, omp = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"  # the run sets its threads from it (app.launch.threads)
    try:
        pretrain_gpt2.run(argv)
    finally:
        torch.set_num_threads(threads)
        if omp is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = omp
    with open(metrics) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    train = [r for r in rows if r["kind"] == "train"]
    return {"lm_loss": [r["lm_loss"] for r in train],
            "grad_norm": [r["grad_norm"] for r in train],
            "valid_lm_loss": [r["lm_loss"] for r in rows if r["kind"] == "valid"]}


def load_golden() -> Dict[str, Dict[str, Dict[str, List[float]]]]:
    if not os.path.isfile(GOLDEN_FILE):
        return {}
    with open(GOLDEN_FILE) as f:
        return json.load(f)


def main(argv: List[str] = None) -> None:
    parser = argparse.ArgumentParser(description="print, rewrite or extend the golden loss curves")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true",
                      help=f"store this environment's curves in {GOLDEN_FILE} as the only ones "
                           "(after an intended change of the numerics)")
    mode.add_argument("--add", action="store_true",
                      help="add this environment's curves beside the recorded ones, if they "
                           "agree with them within the tolerance (a new machine)")
    args = parser.parse_args(argv)
    curves = {}
    for name in CONFIGS:
        with tempfile.TemporaryDirectory() as workdir:
            curves[name] = run_config(name, workdir)
        print(name, json.dumps(curves[name]))
    key = numerics.key_of(environment())
    golden = load_golden()
    if args.add:
        problems = disagreements(curves, golden)
        if problems:
            raise SystemExit("not added: these curves differ from the recorded ones beyond the "
                             "tolerance (the numerics changed: use --write): "
                             + "; ".join(problems))
        golden[key] = curves
    elif args.write:
        golden = {key: curves}
    if args.add or args.write:
        with open(GOLDEN_FILE, "w") as f:
            json.dump(golden, f, indent=1, sort_keys=True)
            f.write("\n")
        print(f"wrote {GOLDEN_FILE} for {key}")


if __name__ == "__main__":
    main()
