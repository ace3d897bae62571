"""How the old-checkpoint fixtures in this folder are made and their losses recorded (run by hand;
no test runs it). tests/integration/test_old_checkpoints.py checks that today's code resumes each
one exactly as its writer did.

    data/vocab.json, data/merges.txt     GPT-2 BPE of 320 entries (tools/train_tokenizer.py)
    data/corpus_text_document.bin/.idx   60 documents of English-like text drawn from a word
                                         list (tools/preprocess_data.py; how, in this script as
                                         it was: git show 541016c:<this file>)
    <set>/<checkpoint>/                  the checkpoint of iteration 2 of a 4-iteration run of
                                         commands.json's command line, written by the set's
                                         writer (commands.json "sets": a release, or the code
                                         at a commit); a "converted" one by the writer's
                                         tools/convert_checkpoint.py from another of the set
    expected.json                        per set, per environment (tests/harness/numerics.py),
                                         the train rows of iterations 3 and 4 the writer logged

The writer's code runs from a checkout of its commit, through its public command line only
(pretrain_gpt2.py and tools/*.py as subprocesses), so this script does not depend on what that
code looked like inside. Run it from the repository root (the data files are never rewritten:
every set trains on the same bytes):

    git worktree add --detach /tmp/writer <commit>; ln -s $PWD/.venv /tmp/writer/.venv
    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python tests/data/old_checkpoints/make_fixtures.py \
        --writer /tmp/writer --set <set> [--record-only]

Without --record-only it writes the set's checkpoints (a new set: add it to commands.json first;
the compatibility set gains one per release) and records the rows the writer's uninterrupted
runs logged. With --record-only it writes nothing but expected.json: the writer's code resumes
each committed checkpoint of the set on this machine and its rows are recorded under this
machine's environment key, so that the test compares bit for bit here too (on the CI machine:
run it there for every set and commit expected.json). Either way the rows of other
environments stay as they are.

The v0.2.0 set was written by 3e2756e on the CI machine (recorded under its key of the older
format, "torch 2.13.0+cpu, cpu AVX512"); its rows on the development machines come from
--record-only with 3e2756e. The d8367dc set was written (and recorded) on the AVX2 development
machine; its deepspeed_zero1_torch_dist is deepspeed_zero1 converted by d8367dc's converter
(DeepSpeed writes only its own format). The AVX-512 development machine's rows of both sets come
from --record-only with each set's commit (2026-12-07); its v0.2.0 rows equal the CI machine's.
"""
import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, ROOT)
from tests.harness.numerics import this_environment  # noqa: E402

KEYS = ("lm_loss", "grad_norm", "loss_scale", "lr", "skipped_iterations")
ITERATIONS = 4


def load(name):
    with open(os.path.join(HERE, name)) as f:
        return json.load(f)


def command(name, work):
    """pretrain_gpt2.py's arguments for checkpoint `name` (a converted one: its source's, on the
    native path)."""
    spec = load("commands.json")
    source = spec["converted"].get(name, {}).get("source")
    args = spec["common"] + spec["checkpoints"][source or name]
    if source and "--deepspeed" in args:
        at = args.index("--deepspeed")
        args = args[:at] + args[at + 3:]  # --deepspeed --deepspeed_config <json>
    return [a.replace("{fixtures}", HERE).replace("{work}", work) for a in args]


def call(writer, script, *argv):
    """Run the writer's `script` with this Python from its checkout; stop on failure."""
    env = dict(os.environ, PYTHONPATH=writer, OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, os.path.join(writer, script), *argv], check=True,
                   cwd=writer, env=env)


def train_rows(metrics_file):
    """{iteration: the KEYS of its train row} of a --metrics-file."""
    with open(metrics_file) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return {r["iteration"]: {k: r[k] for k in KEYS if k in r} for r in rows
            if r["kind"] == "train"}


def write_checkpoint(writer, set_name, name, work):
    """The set's checkpoint `name`: written at iteration 2 of a run interrupted there; returns
    the rows of iterations 3 and 4 of the same run uninterrupted."""
    spec = load("commands.json")
    folder = os.path.join(HERE, set_name, name)
    shutil.rmtree(folder, ignore_errors=True)
    converted = spec["converted"].get(name)
    if converted:
        call(writer, "tools/convert_checkpoint.py", *converted["arguments"], "--load",
             os.path.join(HERE, set_name, converted["source"]), "--save", folder)
        return None  # the source's rows
    straight, first = os.path.join(work, name + ".jsonl"), os.path.join(work, name + "_2.jsonl")
    call(writer, "pretrain_gpt2.py", *command(name, work), "--metrics-file", straight)
    call(writer, "pretrain_gpt2.py", *command(name, work), "--save", folder,
         "--exit-interval", str(spec["saved_iteration"]), "--metrics-file", first)
    want, got = train_rows(straight), train_rows(first)
    assert sorted(want) == [1, 2, 3, 4] and sorted(got) == [1, 2], (want, got)
    assert all(want[i] == got[i] for i in (1, 2)), (want, got)
    for script in glob.glob(os.path.join(folder, "zero_to_*.py")):  # DeepSpeed's copies
        os.remove(script)
    return {str(i): want[i] for i in (3, 4)}


def resumed_rows(writer, set_name, name, work):
    """The rows of iterations 3 and 4 that the writer's code logs resuming the committed
    checkpoint `name` of the set on this machine."""
    copy, metrics = os.path.join(work, name), os.path.join(work, name + ".jsonl")
    shutil.copytree(os.path.join(HERE, set_name, name), copy)
    call(writer, "pretrain_gpt2.py", *command(name, work), "--load", copy, "--metrics-file",
         metrics)
    rows = train_rows(metrics)
    assert sorted(rows) == [3, 4], rows
    return {str(i): rows[i] for i in (3, 4)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--writer", required=True, help="a checkout of the set's commit")
    parser.add_argument("--set", required=True, help="a set of commands.json")
    parser.add_argument("--record-only", action="store_true",
                        help="write no checkpoint: record what the writer logs resuming them here")
    args = parser.parse_args(argv)
    spec = load("commands.json")["sets"][args.set]
    rows, how = {}, ("the writer resuming each checkpoint here" if args.record_only else
                     "the writer's uninterrupted runs")
    with tempfile.TemporaryDirectory() as work:
        for name in spec["checkpoints"]:
            if args.record_only:
                rows[name] = resumed_rows(args.writer, args.set, name, work)
            else:
                rows[name] = write_checkpoint(args.writer, args.set, name, work)
    for name, converted in load("commands.json")["converted"].items():
        if name in rows and rows[name] is None:
            rows[name] = rows[converted["source"]]
    expected = load("expected.json")
    recorded = expected["sets"].setdefault(args.set, {})
    recorded[this_environment(threads=1)] = {"how": f"{how} ({spec['commit']})", "rows": rows}
    with open(os.path.join(HERE, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1)
        f.write("\n")
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
