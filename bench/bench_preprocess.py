#!/usr/bin/env python
"""Benchmark tools/preprocess_data.py against Megatron-LM's preprocess_data_fast.py (gigatoken)
and, optionally, its classic tools/preprocess_data.py, whole process, on a >= 100 MB corpus.

    python bench/bench_preprocess.py [--megabytes 105] [--workers 2] [--repeats 3] \\
        [--megatron-dir DIR --megatron-path DEPS] [--classic] [--reference]

The corpus is Python source, one file per JSON line ({"content": ...}): the standard library,
then the .py files of a few installed packages until --megabytes; files whose text is empty or
holds the literal `<|endoftext|>` are left out, because the three tools treat those
differently (docs/data.md), so that their outputs can be compared byte for byte. A GPT-2-format
BPE of --vocab-size is trained on its first --train-megabytes.

Each tool runs as a subprocess with --workers (Megatron's fast tool: RAYON_NUM_THREADS) cores,
the runs interleaved --repeats times; the table gives the median wall time, CPU seconds
(user + system, every thread), MB/s, our speed-up, and whether the .bin/.idx equal ours byte for
byte. Wall times share the machine with whatever else runs (the load average is printed); CPU
seconds do not depend on it.

Megatron-LM (--megatron-dir, a checkout, e.g. from github.com/NVIDIA/Megatron-LM) runs from a
temporary folder holding a `gpt2` tokenizer folder made of the trained files, so that its
GPT2BPETokenizer (Hugging Face AutoTokenizer "gpt2") loads offline; --megatron-path is put on its
PYTHONPATH for the packages it needs beyond this environment (gigatoken, awkward, triton). On
Python < 3.12 a sitecustomize in that folder supplies `typing.override`, which Megatron imports.
--reference adds a plain in-process loop over `tokenizers` (json.loads + encode_batch + EOD).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from typing import Dict, List, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, ROOT)
from app.data.tokenizer import EOD_TOKEN, train_gpt2_bpe  # noqa: E402
from tools.build_stdlib_corpus import stdlib_python_files  # noqa: E402

PACKAGES = ("torch", "transformers", "deepspeed", "numpy", "pandas", "scipy", "pyarrow")
SHIM = ("import typing\nimport typing_extensions\nif not hasattr(typing, 'override'):\n"
        "    typing.override = typing_extensions.override\n")


def build_corpus(path: str, megabytes: float) -> Dict[str, int]:
    """Write the corpus (module docstring); counts of files kept and left out."""
    site = sysconfig.get_paths()["purelib"]
    roots = [sysconfig.get_paths()["stdlib"]] + [os.path.join(site, p) for p in PACKAGES]
    counts = {"files": 0, "bytes": 0, "empty": 0, "eod_literal": 0}
    with open(path, "w", encoding="utf-8") as out:
        for root in roots:
            for rel in stdlib_python_files(root) if os.path.isdir(root) else ():
                if counts["bytes"] >= megabytes * 1e6:
                    return counts
                try:
                    with open(os.path.join(root, rel), "rb") as f:
                        text = f.read().decode("utf-8")
                except (OSError, UnicodeDecodeError):
                    continue
                if not text or EOD_TOKEN in text:
                    counts["empty" if not text else "eod_literal"] += 1
                    continue
                line = json.dumps({"content": text}) + "\n"
                out.write(line)
                counts["files"] += 1
                counts["bytes"] += len(line.encode("utf-8"))
    return counts


def timed(cmd: List[str], env: Dict[str, str], cwd: str) -> Tuple[float, float]:
    """(wall seconds, CPU seconds of the child and its threads) of one subprocess."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    done = subprocess.run(cmd, env=env, cwd=cwd, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - t0
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd[:3])} failed:\n{done.stderr[-3000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)


def commands(args, corpus: str, vocab: str, merges: str, tmp: str) -> Dict[str, tuple]:
    """{name: (command, environment, cwd, output prefix)} of every tool to run."""
    env = dict(os.environ)
    env.pop("RAYON_NUM_THREADS", None)
    common = ["--input", corpus, "--json-keys", "content", "--vocab-file", vocab,
              "--merge-file", merges, "--append-eod"]
    out = {"ours": ([sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"), *common,
                     "--workers", str(args.workers), "--log-interval", "1000000000",
                     "--output-prefix", os.path.join(tmp, "ours")], env, tmp,
                    os.path.join(tmp, "ours"))}
    if not args.megatron_dir:
        return out
    run_dir = os.path.join(tmp, "megatron_run")
    os.makedirs(os.path.join(run_dir, "gpt2"), exist_ok=True)
    for name in (vocab, merges):
        shutil.copy(name, os.path.join(run_dir, "gpt2"))
    with open(os.path.join(run_dir, "gpt2", "config.json"), "w") as f:
        json.dump({"model_type": "gpt2"}, f)
    with open(os.path.join(run_dir, "gpt2", "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "GPT2Tokenizer", "eos_token": EOD_TOKEN,
                   "bos_token": EOD_TOKEN, "unk_token": EOD_TOKEN}, f)
    paths = [args.megatron_dir] + ([args.megatron_path] if args.megatron_path else [])
    if sys.version_info < (3, 12):
        with open(os.path.join(run_dir, "sitecustomize.py"), "w") as f:
            f.write(SHIM)
        paths.insert(0, run_dir)
    menv = dict(env, HF_HUB_OFFLINE="1", RAYON_NUM_THREADS=str(args.workers),
                PYTHONPATH=os.pathsep.join(paths))
    tools = os.path.join(args.megatron_dir, "tools")
    megatron = common + ["--tokenizer-type", "GPT2BPETokenizer"]
    prefix = os.path.join(tmp, "megatron_fast")
    out["megatron fast"] = ([sys.executable, os.path.join(tools, "preprocess_data_fast.py"),
                             *megatron, "--use-gigatoken", "--output-prefix", prefix], menv,
                            run_dir, prefix)
    if args.classic:
        prefix = os.path.join(tmp, "megatron_classic")
        out["megatron classic"] = ([sys.executable, os.path.join(tools, "preprocess_data.py"),
                                    *megatron, "--workers", str(args.workers),
                                    "--output-prefix", prefix], menv, run_dir, prefix)
    return out


def same_files(prefix: str, reference: str) -> bool:
    name = "_content_document"
    return all(open(prefix + name + ext, "rb").read() == open(reference + name + ext, "rb").read()
               for ext in (".bin", ".idx"))


def reference_loop(corpus: str, vocab: str, merges: str) -> Tuple[float, float]:
    """(wall, CPU) of json.loads + `tokenizers` encode_batch + EOD in this process."""
    import numpy as np
    from tokenizers import ByteLevelBPETokenizer

    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    tok = ByteLevelBPETokenizer(vocab, merges)
    eod = tok.token_to_id(EOD_TOKEN)
    t0, cpu0 = time.perf_counter(), time.process_time()
    with open(corpus, "rb") as f:
        lines = f.readlines()
    for start in range(0, len(lines), 64):
        texts = [json.loads(line)["content"] for line in lines[start:start + 64]]
        for enc in tok.encode_batch(texts):
            np.array(enc.ids + [eod], dtype=np.uint16)
    return time.perf_counter() - t0, time.process_time() - cpu0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--megabytes", type=float, default=105.0)
    p.add_argument("--vocab-size", type=int, default=50257)
    p.add_argument("--train-megabytes", type=float, default=4.0)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--megatron-dir", default=None, help="a Megatron-LM checkout")
    p.add_argument("--megatron-path", default=None,
                   help="PYTHONPATH entry with the packages Megatron-LM needs beyond ours")
    p.add_argument("--classic", action="store_true",
                   help="also run Megatron-LM's classic tools/preprocess_data.py (slow)")
    p.add_argument("--reference", action="store_true",
                   help="also time a plain `tokenizers` loop in this process")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        corpus = os.path.join(tmp, "corpus.jsonl")
        counts = build_corpus(corpus, args.megabytes)
        size = os.path.getsize(corpus)
        with open(corpus, encoding="utf-8") as f:
            sample, total = [], 0
            for line in f:
                sample.append(json.loads(line)["content"])
                total += len(line)
                if total >= args.train_megabytes * 1e6:
                    break
        t0 = time.perf_counter()
        vocab, merges = train_gpt2_bpe(sample, args.vocab_size, os.path.join(tmp, "tok"))
        print(f"corpus: {counts['files']} files, {size / 1e6:.1f} MB jsonl ({counts['empty']} "
              f"empty and {counts['eod_literal']} with a literal {EOD_TOKEN} left out); BPE vocab "
              f"{args.vocab_size} trained on {total / 1e6:.1f} MB in {time.perf_counter() - t0:.1f} s")
        runs = commands(args, corpus, vocab, merges, tmp)
        times: Dict[str, List[Tuple[float, float]]] = {name: [] for name in runs}
        for repeat in range(args.repeats):
            for name, (cmd, env, cwd, _) in runs.items():
                if name == "megatron classic" and repeat:
                    continue
                times[name].append(timed(cmd, env, cwd))
        ours_wall = statistics.median(w for w, _ in times["ours"])
        print(f"{'tool':<18}{'wall s':>8}{'CPU s':>8}{'MB/s':>8}{'ours x':>8}  identical to ours")
        for name, (_, _, _, prefix) in runs.items():
            wall = statistics.median(w for w, _ in times[name])
            cpu = statistics.median(c for _, c in times[name])
            same = "-" if name == "ours" else str(same_files(prefix, runs["ours"][3]))
            print(f"{name:<18}{wall:8.2f}{cpu:8.2f}{size / 1e6 / wall:8.1f}"
                  f"{wall / ours_wall:8.2f}  {same}")
        if args.reference:
            wall, cpu = reference_loop(corpus, vocab, merges)
            print(f"{'tokenizers loop':<18}{wall:8.2f}{cpu:8.2f}{size / 1e6 / wall:8.1f}"
                  f"{wall / ours_wall:8.2f}  (in process, no output)")
        print(f"workers {args.workers}, median of {args.repeats} interleaved runs (classic: one); "
              f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
