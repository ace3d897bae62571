#!/usr/bin/env python
"""Benchmark tools/preprocess_data.py on the standard-library corpus against a plain reference loop.

    python bench/bench_preprocess.py [--max-bytes N] [--vocab-size 50257] [--workers 1 2]

Builds the stdlib corpus and a byte-level BPE in a temporary directory, runs the tool (as a
subprocess, wall time including start-up) with each --workers value, and runs in this process a
reference: a plain loop over the same lines with the `tokenizers` GPT-2 (byte-level BPE)
tokenizer, appending EOD, and writing the tokens with numpy.tofile. Both sides run the Rust
tokenizer single-threaded (TOKENIZERS_PARALLELISM=false), so per-worker figures compare per core.
Prints docs/s, MB/s and tokens/s, the ratios to the reference, and whether our .bin equals the
reference token stream byte for byte.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

os.environ["TOKENIZERS_PARALLELISM"] = "false"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import numpy as np

# this checkout's `app`, whether or not the project is pip-installed
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from app.data.tokenizer import train_gpt2_bpe
from tools.build_stdlib_corpus import build_corpus


def reference_loop(corpus: str, vocab: str, merges: str, out_path: str, batch: int = 64):
    """(seconds, CPU seconds, docs, input bytes, tokens): json.loads + encode_batch + EOD + uint16 tofile."""
    from tokenizers import ByteLevelBPETokenizer

    tok = ByteLevelBPETokenizer(vocab, merges)
    eod = tok.token_to_id("<|endoftext|>")
    docs = nbytes = ntokens = 0
    t0, cpu0 = time.perf_counter(), time.process_time()
    with open(corpus, "rb") as f, open(out_path, "wb") as out:
        lines = []
        for line in f:
            lines.append(line)
            if len(lines) == batch:
                d, b, n = _reference_batch(tok, lines, eod, out)
                docs, nbytes, ntokens, lines = docs + d, nbytes + b, ntokens + n, []
        d, b, n = _reference_batch(tok, lines, eod, out)
    return (time.perf_counter() - t0, time.process_time() - cpu0, docs + d, nbytes + b,
            ntokens + n)


def _reference_batch(tok, lines, eod, out):
    texts = [json.loads(line)["content"] for line in lines]
    ntokens = 0
    for enc in tok.encode_batch(texts):
        if enc.ids:
            ids = np.array(enc.ids + [eod], dtype=np.uint16)
            ids.tofile(out)
            ntokens += ids.size
    return len(texts), sum(len(x) for x in lines), ntokens


def run_tool(corpus, vocab, merges, prefix, workers):
    cmd = [sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"), "--input", corpus,
           "--output-prefix", prefix, "--json-keys", "content", "--vocab-file", vocab,
           "--merge-file", merges, "--append-eod", "--workers", str(workers),
           "--log-interval", "100000000"]
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stderr=subprocess.DEVNULL)
    seconds = time.perf_counter() - t0
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    return seconds, (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime)


def rates(seconds, docs, nbytes, ntokens):
    return docs / seconds, nbytes / seconds / 1e6, ntokens / seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    p.add_argument("--max-bytes", type=int, default=None)
    p.add_argument("--vocab-size", type=int, default=50257)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        import sysconfig
        corpus = os.path.join(tmp, "stdlib.jsonl")
        counts = build_corpus(sysconfig.get_paths()["stdlib"], corpus, args.max_bytes)
        t0 = time.perf_counter()
        with open(corpus, encoding="utf-8") as f:
            texts = [json.loads(line)["content"] for line in f]
        vocab, merges = train_gpt2_bpe(texts, args.vocab_size, os.path.join(tmp, "tok"))
        print(f"corpus: {counts['files']} files, {os.path.getsize(corpus) / 1e6:.1f} MB jsonl; "
              f"BPE vocab {args.vocab_size} trained in {time.perf_counter() - t0:.1f} s")
        ref_bin = os.path.join(tmp, "reference.bin")
        t_ref, cpu_ref, docs, nbytes, ntokens = reference_loop(corpus, vocab, merges, ref_bin)
        ref = rates(t_ref, docs, nbytes, ntokens)
        print(f"{'run':<13}{'wall s':>7}{'docs/s':>8}{'MB/s':>7}{'tokens/s':>10}{'vs ref':>7}"
              f"{'MB/s/worker':>12}{'CPU s':>7}{'Mtok/CPU-s':>11}  identical")
        print(f"{'reference':<13}{t_ref:7.2f}{ref[0]:8.1f}{ref[1]:7.2f}{ref[2]:10,.0f}{1:7.2f}"
              f"{ref[1]:12.2f}{cpu_ref:7.1f}{ntokens / cpu_ref / 1e6:11.3f}  -")
        reference_bytes = open(ref_bin, "rb").read()
        for workers in args.workers:
            prefix = os.path.join(tmp, f"w{workers}")
            seconds, cpu = run_tool(corpus, vocab, merges, prefix, workers)
            ours = rates(seconds, docs, nbytes, ntokens)
            same = open(prefix + "_content_document.bin", "rb").read() == reference_bytes
            print(f"{f'ours -w {workers}':<13}{seconds:7.2f}{ours[0]:8.1f}{ours[1]:7.2f}"
                  f"{ours[2]:10,.0f}{t_ref / seconds:7.2f}{ours[1] / workers:12.2f}{cpu:7.1f}"
                  f"{ntokens / cpu / 1e6:11.3f}  {same}")
        print(f"load average during the run: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores "
              f"(CPU seconds are the load-independent figure; the tool's include start-up)")
        print("anchors: ~1 MB/s and ~460 docs/s per worker (Python BPE, BigScience PR #18); "
              "~0.85 M tokens/s per core (HF tokenizers, marin #2829)")


if __name__ == "__main__":
    main()
