"""How the old-checkpoint fixtures in this folder were made (kept as a record; no test runs it).

The committed files were written by the code at commit 3e2756e, so that
tests/integration/test_old_checkpoints.py can check that later code still resumes them:

    data/vocab.json, data/merges.txt       GPT-2 BPE of 320 entries (tools/train_tokenizer.py)
    data/corpus_text_document.bin/.idx     corpus_lines(), 60 documents (tools/preprocess_data.py)
    native_fp32/, native_fp16/, deepspeed_zero1/
                                           the checkpoint of iteration 2 of each configuration
                                           of commands.json (a 4-iteration run exited at 2)
    expected.json                          per configuration, the train rows of iterations 3 and
                                           4 of the uninterrupted 4-iteration run, exact floats
                                           as its --metrics-file wrote them

Only the public command line is used (tools/*.py and pretrain_gpt2.py, as subprocesses), so this
script does not depend on where modules live. corpus_lines() is 15 KB of English-like text drawn
from a fixed word list by a linear congruential generator: the same bytes on every machine. Run
from the repository root; it rewrites everything above (byte for byte the same files, at 3e2756e
on the machine that made them: torch 2.13.0+cpu, AVX512):

    OMP_NUM_THREADS=1 PYTHONPATH=. python tests/data/old_checkpoints/make_fixtures.py
"""
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
WORDS = ("the a model layer weight token data loss step rank batch grows falls trains reads "
         "writes saves loads small large fast slow every each one two three four of to in on "
         "with and but then after before while gradient optimizer checkpoint sequence window "
         "attention head embedding vocabulary learning rate schedule warmup decay").split()


def corpus_lines(documents: int = 60):
    """One JSON line {"text": ...} per document: 3..8 sentences of 4..11 words each."""
    state = 2024

    def draw(n):
        nonlocal state
        state = (1103515245 * state + 12345) % 2 ** 31
        return (state >> 8) % n

    for _ in range(documents):
        sentences = []
        for _ in range(3 + draw(6)):
            words = [WORDS[draw(len(WORDS))] for _ in range(4 + draw(8))]
            sentences.append(" ".join(words).capitalize() + ".")
        yield json.dumps({"text": " ".join(sentences)})


def command(name, work):
    """pretrain_gpt2.py's arguments for configuration `name` of commands.json."""
    with open(os.path.join(HERE, "commands.json")) as f:
        spec = json.load(f)
    args = spec["common"] + spec["checkpoints"][name]
    return [a.replace("{fixtures}", HERE).replace("{work}", work) for a in args]


def call(*argv):
    """Run a repository script with this Python; stop on failure."""
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, *argv], check=True, cwd=ROOT, env=env)


def train_rows(metrics_file):
    """{iteration: row} of the train rows of a --metrics-file."""
    with open(metrics_file) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return {r["iteration"]: r for r in rows if r["kind"] == "train"}


def make_data(work):
    data = os.path.join(HERE, "data")
    shutil.rmtree(data, ignore_errors=True)
    corpus = os.path.join(work, "corpus.jsonl")
    with open(corpus, "w") as f:
        f.write("\n".join(corpus_lines()) + "\n")
    call(os.path.join(ROOT, "tools", "train_tokenizer.py"), "--input", corpus,
         "--vocab-size", "320", "--output-dir", data)
    call(os.path.join(ROOT, "tools", "preprocess_data.py"), "--input", corpus,
         "--output-prefix", os.path.join(data, "corpus"), "--vocab-file",
         os.path.join(data, "vocab.json"), "--merge-file", os.path.join(data, "merges.txt"),
         "--append-eod", "--workers", "1")


def make_checkpoint(name, work):
    """Train `name` 4 iterations straight, then again exiting with a checkpoint at iteration 2;
    returns the straight run's rows of iterations 3 and 4."""
    ck = os.path.join(HERE, name)
    shutil.rmtree(ck, ignore_errors=True)
    straight, first = os.path.join(work, name + ".jsonl"), os.path.join(work, name + "_2.jsonl")
    call(os.path.join(ROOT, "pretrain_gpt2.py"), *command(name, work), "--metrics-file", straight)
    call(os.path.join(ROOT, "pretrain_gpt2.py"), *command(name, work), "--save", ck,
         "--exit-interval", "2", "--metrics-file", first)
    want, got = train_rows(straight), train_rows(first)
    keys = ("lm_loss", "grad_norm", "loss_scale", "lr", "skipped_iterations")
    numbers = {i: {k: row[k] for k in keys if k in row} for i, row in want.items()}
    assert sorted(want) == [1, 2, 3, 4] and sorted(got) == [1, 2], (want, got)
    assert all(numbers[i] == {k: got[i][k] for k in numbers[i]} for i in (1, 2)), (want, got)
    # DeepSpeed copies its conversion scripts into the checkpoint: not needed to resume
    for script in glob.glob(os.path.join(ck, "zero_to_*.py")):
        os.remove(script)
    return {str(i): numbers[i] for i in (3, 4)}


def main():
    with tempfile.TemporaryDirectory() as work:
        make_data(work)
        with open(os.path.join(HERE, "commands.json")) as f:
            names = list(json.load(f)["checkpoints"])
        expected = {"environment": f"torch {torch.__version__}, cpu "
                                   f"{torch.backends.cpu.get_cpu_capability()}",
                    "checkpoints": {name: make_checkpoint(name, work) for name in names}}
    with open(os.path.join(HERE, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1)
        f.write("\n")
    print(json.dumps(expected, indent=1))


if __name__ == "__main__":
    main()
