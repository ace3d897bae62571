"""Every command in README.md and docs/*.md runs as written, against what the quickstart made.

Each fenced block of those files says what it is: an info string (```text for output and
listings, ```bash for commands) and, for a shell block, a marker on the line above it:

    <!-- doc-test: run -->             run as written
    <!-- doc-test: dry-run -->         training commands: run as written plus --dry-run; a
                                       launcher prefix (torchrun --nproc-per-node 8, deepspeed
                                       --num_gpus 8) becomes --dry-run-world-size 8
    <!-- doc-test: skip (why) -->      not run: it needs a GPU, the network, a cluster, ...

A block without them fails `test_every_block_is_classified`, naming the file and line; so
does an indented code block (four spaces after a paragraph, which markdown shows as code but no
marker can classify): commands and output are fenced. The runnable blocks of one document
run in order in one bash session (a variable one block sets, the next can use), with `set -e`,
in a sandbox of its own: symlinks to this checkout's files, and the quickstart's outputs at the
paths it writes them (data/, checkpoints/quickstart and runs/quickstart in folders of their
own holding hard links to its files, so a file a document adds or replaces stays in its
sandbox). Two documents run at a time; a failure names the file and line of the block, the
commands it ran and the tail of their output. The quickstart itself (scripts/quickstart.sh)
runs once per session, made small through its environment knobs (vocabulary 512, 10
iterations; the model keeps its shape, so the documents' flags fit its checkpoint, and the
corpus its size, so the documents' resumes to 1000 iterations stay within one epoch of the
training and validation data and keep the data order), with the Hugging Face Hub unreachable
(HF_HUB_OFFLINE=1, HF_DATASETS_OFFLINE=1): this is also the quickstart's end-to-end test.
The documents' `python` commands (a script, -m or -c) run in children forked from the
session's forkserver with the same arguments, directory, environment and output
(tests/harness/forked_python.py), not in new interpreters that import torch again.
"""
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import pytest

from tests.harness.forked_python import ForkedPython
from tests.harness.launch import LAUNCH_VARIABLES, ROOT

DOCUMENTS = ["README.md"] + sorted(os.path.join("docs", name)
                                   for name in os.listdir(os.path.join(ROOT, "docs"))
                                   if name.endswith(".md"))
SHELLS = ("bash", "sh", "shell", "console")
KINDS = ("run", "dry-run", "skip")
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*(\S*)")
MARKER = re.compile(r"^\s*<!--\s*doc-test:\s*([\w-]+)\s*(?:\((.*)\))?\s*-->\s*$")
TRAINING = re.compile(r"^(\s*)(.*?)\b(pretrain_gpt2?\.py)\b(.*)$")
"""A training command: pretrain_gpt2.py, or pretrain_gpt.py (Megatron-LM's name, the same
trainer)."""
SANDBOX_OUTPUTS = ("data", "checkpoints", "runs", "exports")
BLOCK_BANNER = "@@ doc-test block "
QUICKSTART_KNOBS = {"VOCAB_SIZE": "512", "TRAIN_ITERS": "10",
                    "EVAL_INTERVAL": "5", "EVAL_ITERS": "2", "SAVE_INTERVAL": "10",
                    "LOG_INTERVAL": "5", "QUICKSTART_CHECK_LOSS": "0", "SAMPLE_SEED": "1"}
"""A quickstart made small (scripts/quickstart.sh documents each knob); 10 iterations cannot
bring the loss 2 nats below ln(512), so its check is turned off, explicitly."""


@dataclass
class Block:
    """One fenced block of a document."""

    document: str
    line: int
    """1-based line of the opening fence."""
    language: str
    text: str
    kind: Optional[str] = None
    """The doc-test marker above it: run, dry-run or skip (None: no marker)."""
    reason: str = ""

    @property
    def where(self) -> str:
        return f"{self.document}:{self.line}"


LIST_ITEM = re.compile(r"^\s*(?:[-*+]|\d+[.)])(?:\s|$)")


def _fence_end(lines: List[str], i: int, fence: str) -> int:
    """The index of the line closing the fence `fence` opened at line i (len(lines) if none)."""
    return next((j for j in range(i + 1, len(lines))
                 if lines[j].strip().startswith(fence[0] * len(fence))
                 and not lines[j].strip().strip(fence[0])), len(lines))


def _indented(line: str) -> bool:
    return line.startswith(("    ", "\t"))


def indented_code_lines(lines: List[str]) -> List[int]:
    """0-based indices of the first lines of indented code blocks outside fenced blocks and
    lists: a non-blank line indented four spaces (or a tab), after a blank line, whose previous
    non-blank line closes a paragraph (or a heading, table, fence, ...) that is neither indented
    (by any amount) nor part of a list item. Indented text under a list item, or after another
    indented line, continues the list; a paragraph's lines run back to the previous blank line,
    so a list item continued lazily (without indentation) still counts as the list."""
    found, i = [], 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if opening:
            i = _fence_end(lines, i, opening.group(2)) + 1
            continue
        if _indented(lines[i]) and lines[i].strip() and i > 0 and not lines[i - 1].strip():
            previous = max((j for j in range(i) if lines[j].strip()), default=None)
            if previous is not None and not lines[previous][:1].isspace():
                start = previous
                while start > 0 and lines[start - 1].strip():
                    start -= 1
                if not any(LIST_ITEM.match(line) for line in lines[start:previous + 1]):
                    found.append(i)
                    while i + 1 < len(lines) and (_indented(lines[i + 1]) or not lines[i + 1].strip()):
                        i += 1  # the rest of this block
        i += 1
    return found


def parse_document(document: str) -> Tuple[List[Block], List[str]]:
    """The fenced blocks of `document` (a path relative to the checkout) and the problems with
    their classification and with indented code blocks, each naming the file and line."""
    lines = open(os.path.join(ROOT, document), encoding="utf-8").read().split("\n")
    blocks, i = [], 0
    problems = [f"{document}:{k + 1}: an indented code block: fence it, ```bash with a doc-test "
                "marker above it for commands, ```text for output, formulas and listings"
                for k in indented_code_lines(lines)]
    while i < len(lines):
        marker = MARKER.match(lines[i])
        if marker:
            following = next((line for line in lines[i + 1:] if line.strip()), "")
            if not FENCE.match(following):
                problems.append(f"{document}:{i + 1}: a doc-test marker with no fenced block under it")
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        indent, fence, language = opening.groups()
        end = _fence_end(lines, i, fence)
        body = [line[len(indent):] if line.startswith(indent) else line.lstrip()
                for line in lines[i + 1:end]]
        above = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        found = MARKER.match(above)
        block = Block(document, i + 1, language, "\n".join(body) + "\n",
                      found.group(1) if found else None, (found.group(2) or "") if found else "")
        blocks.append(block)
        problems += _classification_problems(block)
        i = end + 1
    return blocks, problems


def _classification_problems(block: Block) -> List[str]:
    """What is wrong with how `block` is labelled and marked (empty when nothing is)."""
    markers = "<!-- doc-test: run -->, <!-- doc-test: dry-run --> or <!-- doc-test: skip (why) -->"
    if not block.language:
        return [f"{block.where}: a fenced block without a language: write ```text for output "
                f"or listings, or ```bash with one of {markers} on the line above for commands"]
    if block.language not in SHELLS:
        return [f"{block.where}: a doc-test marker on a ```{block.language} block: only shell "
                "blocks are run"] if block.kind else []
    if block.kind is None:
        return [f"{block.where}: ```{block.language} block without a doc-test marker: put "
                f"{markers} on the line above it"]
    if block.kind not in KINDS:
        return [f"{block.where}: unknown doc-test marker {block.kind!r}: use run, dry-run or skip"]
    if block.kind == "skip" and not block.reason.strip():
        return [f"{block.where}: <!-- doc-test: skip --> needs its reason: "
                "<!-- doc-test: skip (needs a GPU) -->"]
    if block.kind == "dry-run" and not any(TRAINING.match(line) for line in _logical_lines(block.text)):
        return [f"{block.where}: a dry-run block with no pretrain_gpt(2).py command: mark it run"]
    return []


def _logical_lines(text: str) -> List[str]:
    """The lines of a shell block with backslash continuations joined."""
    joined, pending = [], ""
    for line in text.split("\n"):
        part = line.strip() if pending else line.rstrip()
        if part.endswith("\\"):
            pending += part[:-1].rstrip() + " "
            continue
        joined.append(pending + part)
        pending = ""
    return joined


def launcher_world_size(launcher: str) -> Optional[int]:
    """Ranks a launcher prefix starts: torchrun's --nproc-per-node x --nnodes, deepspeed's
    --num_gpus x --num_nodes; None for a plain `python` (or an unknown count)."""
    words = shlex.split(launcher)
    values: Dict[str, str] = {}
    for k, word in enumerate(words):
        name, _, value = word.partition("=")
        values[name.replace("_", "-")] = value or (words[k + 1] if k + 1 < len(words) else "")
    per_node = values.get("--nproc-per-node") or values.get("--num-gpus")
    nodes = values.get("--nnodes") or values.get("--num-nodes") or "1"
    if not per_node or not per_node.isdigit() or not nodes.isdigit():
        return None
    return int(per_node) * int(nodes)


def dry_run_script(text: str) -> str:
    """`text` with each pretrain_gpt2.py / pretrain_gpt.py command run by `python` with
    --dry-run added (and --dry-run-world-size for the ranks its launcher would start); other
    lines as written."""
    out = []
    for line in _logical_lines(text):
        match = TRAINING.match(line)
        if not match or line.lstrip().startswith("#"):
            out.append(line)
            continue
        indent, launcher, script, args = match.groups()
        args = re.sub(r"\s+#.*$", "", args)  # a trailing comment
        world = launcher_world_size(launcher)
        extra = f" --dry-run-world-size {world}" if world and world > 1 else ""
        out.append(f"{indent}python {script}{args} --dry-run{extra}")
    return "\n".join(out)


def _all_blocks() -> Tuple[List[Block], List[str]]:
    blocks, problems = [], []
    for document in DOCUMENTS:
        found, wrong = parse_document(document)
        blocks += found
        problems += wrong
    return blocks, problems


def test_every_block_is_classified():
    _, problems = _all_blocks()
    assert not problems, ("fenced blocks in the documentation that say not what they are (see "
                          "tests/integration/test_documented_commands.py):\n" + "\n".join(problems))


@pytest.mark.parametrize("markdown,flagged", [
    # after a paragraph, a heading, a table or a closed fence: markdown shows code
    ("Run it:\n\n    python x.py\n    python y.py\n\nDone.", [3]),
    ("## Title\n\n    python x.py", [3]),
    ("| a | b |\n| --- | --- |\n\n    x = 1", [4]),
    ("```text\nout\n```\n\n\tpython x.py", [5]),
    ("- a list\n\nA paragraph ends it.\n\n    code", [5]),
    ("Para:\n\n    one\n\n    two\n\nText\n\n    three", [3, 9]),  # one block, then another
    # list continuations: under an item, after an indented paragraph, a lazy continuation
    ("- item\n\n    more of the item", []),
    ("1. step\n   text\n\n      python x.py", []),
    ("- item\n\n  its paragraph\n\n      code in the item", []),
    ("Intro:\n- item\ncontinued lazily\n\n    still the item", []),
    # not after a blank line (a paragraph's continuation), or inside a fence
    ("Text\n    continued", []),
    ("```bash\nx\n\n    y\n```", []),
    ("- item\n\n  ```bash\n  x\n\n      y\n  ```\n\n    after the fence", []),
])
def test_indented_code_blocks_are_found_outside_lists(markdown, flagged):
    """Hand-written markdown: the 1-based lines where an indented code block starts."""
    assert [k + 1 for k in indented_code_lines(markdown.split("\n"))] == flagged


def test_launcher_prefixes_become_dry_run_world_sizes():
    """Hand-written expectations for the launchers the documents use."""
    assert dry_run_script('torchrun --nproc-per-node 8 --max-restarts 3 pretrain_gpt2.py "${A[@]}" '
                          '--x 1   # note') == \
        'python pretrain_gpt2.py "${A[@]}" --x 1 --dry-run --dry-run-world-size 8'
    assert dry_run_script("deepspeed --num_gpus 4 --num_nodes 2 pretrain_gpt2.py \\\n    --y") == \
        "python pretrain_gpt2.py --y --dry-run --dry-run-world-size 8"
    assert dry_run_script("source a.sh && f 8\ndeepspeed pretrain_gpt2.py --z\n") == \
        "source a.sh && f 8\npython pretrain_gpt2.py --z --dry-run\n"
    assert launcher_world_size("torchrun --nproc_per_node=2 --nnodes=2") == 4


# ---------------------------------------------------------------- running the documents

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _environment(forked: Optional[ForkedPython] = None) -> Dict[str, str]:
    """A user's shell: this virtualenv first on PATH (after `forked`'s python, when given),
    nothing of this test process's launch or import settings, one thread, and no Hugging Face
    Hub."""
    e = {k: v for k, v in os.environ.items() if k not in (*LAUNCH_VARIABLES, "PYTHONPATH")}
    path = os.path.dirname(sys.executable) + os.pathsep + e.get("PATH", "")
    e.update(PATH=forked.folder + os.pathsep + path if forked else path,
             OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1",
             HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
             PET_MASTER_PORT=str(_free_port()), MASTER_PORT=str(_free_port()))
    return e


def _tail(text: str, n: int = 4000) -> str:
    return text if len(text) <= n else "...\n" + text[-n:]


@pytest.fixture(scope="session")
def quickstart(tmp_path_factory):
    """scripts/quickstart.sh, made small, run once: {"root", "output"}, with data/,
    checkpoints/quickstart and runs/quickstart under root."""
    root = tmp_path_factory.mktemp("quickstart")
    env = {**_environment(), **QUICKSTART_KNOBS, "DATA_DIR": str(root / "data"),
           "RUN_DIR": str(root / "runs" / "quickstart"),
           "CKPT": str(root / "checkpoints" / "quickstart")}
    proc = subprocess.run(["bash", os.path.join(ROOT, "scripts", "quickstart.sh")], cwd=ROOT,
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=900)
    if proc.returncode != 0:
        pytest.fail(f"scripts/quickstart.sh with {QUICKSTART_KNOBS} exited {proc.returncode}:\n"
                    f"{_tail(proc.stdout)}")
    return {"root": root, "output": proc.stdout}


def _sandbox(quickstart, path) -> str:
    """A folder that looks like this checkout after the quickstart (see the module docstring)."""
    os.makedirs(path)
    for name in os.listdir(ROOT):
        if name not in (".git", *SANDBOX_OUTPUTS):
            os.symlink(os.path.join(ROOT, name), os.path.join(path, name))
    made = quickstart["root"]
    for folder in ("data", "checkpoints", "runs"):
        shutil.copytree(made / folder, os.path.join(path, folder), copy_function=os.link)
    return str(path)


def _session_script(blocks: List[Block]) -> str:
    """The runnable blocks of one document, in order, each announced by a banner line."""
    parts = ["set -eo pipefail"]
    for block in blocks:
        text = dry_run_script(block.text) if block.kind == "dry-run" else block.text
        parts += [f"echo '{BLOCK_BANNER}{block.where}'", text]
    return "\n".join(parts) + "\n"


def _runnable(document: str) -> List[Block]:
    blocks, _ = parse_document(document)
    return [b for b in blocks if b.kind in ("run", "dry-run") and b.language in SHELLS]


RUNNABLE = [d for d in DOCUMENTS if _runnable(d)]


def _run_document(document: str, quickstart, work, forked: ForkedPython) -> Optional[str]:
    """Run the runnable blocks of `document` in one bash session in a fresh sandbox under
    `work`, its `python` commands forked by `forked` (tests/harness/forked_python.py); None
    when every command succeeded, else what failed: the file and line of the block, the
    commands it ran and the tail of their output."""
    blocks = _runnable(document)
    os.makedirs(work)
    sandbox = _sandbox(quickstart, os.path.join(work, "sandbox"))
    script = os.path.join(work, "session.sh")
    with open(script, "w", encoding="utf-8") as f:
        f.write(_session_script(blocks))
    proc = subprocess.run(["bash", script], cwd=sandbox, env=_environment(forked),
                          stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=900)
    if proc.returncode == 0:
        return None
    ran = proc.stdout.split(BLOCK_BANNER)
    where = ran[-1].split("\n", 1)[0] if len(ran) > 1 else "(before the first block)"
    block = next((b for b in blocks if b.where == where), None)
    shown = (dry_run_script(block.text) if block and block.kind == "dry-run" else
             block.text if block else "")
    return (f"{where}: the block (<!-- doc-test: {block.kind if block else '?'} -->) exited "
            f"{proc.returncode}; it ran, in {sandbox}:\n{shown}\noutput (tail):\n"
            f"{_tail(ran[-1].split(chr(10), 1)[-1])}")


@pytest.fixture(scope="session")
def document_runs(quickstart, tmp_path_factory, request):
    """{document: future of `_run_document`} for the documents this session selected, two at a
    time (each is a chain of short processes: two keep both cores busy), their `python`
    commands forked from this session's forkserver instead of new interpreters."""
    selected = [d for d in RUNNABLE
                if any(f"test_documented_commands_run[{d}]" in item.nodeid
                       for item in request.session.items)]
    work = tmp_path_factory.mktemp("documents")
    with ForkedPython(work / "bin") as forked, ThreadPoolExecutor(max_workers=2) as pool:
        yield {d: pool.submit(_run_document, d, quickstart, str(work / d.replace("/", "_")),
                              forked)
               for d in selected}


@pytest.mark.parametrize("document", RUNNABLE)
def test_documented_commands_run(document, document_runs):
    failure = document_runs[document].result()
    if failure:
        pytest.fail(failure, pytrace=False)


# ---------------------------------------------------------------- the quickstart's own ends

def test_quickstart_ends_on_a_seeded_sample(quickstart):
    """The closing sample is drawn with temperature and top-p, and the same seed draws the same
    text again (in another process); another seed draws another text."""
    output = quickstart["output"]
    header = "sampled from the exported model by transformers (temperature 0.8, top-p 0.95, seed 1"
    assert header in output, _tail(output)
    printed = output.split(header, 1)[1].split("\n", 1)[1].split("\n\nlogs:", 1)[0]
    sys.path.insert(0, os.path.join(ROOT, "scripts", "lib"))
    try:
        import quickstart_report
    finally:
        sys.path.pop(0)
    hf = str(quickstart["root"] / "runs" / "quickstart" / "hf")
    again = quickstart_report.sample(hf, "def main(argv):\n    ", 1, 0.8, 0.95, 64)
    assert printed == "    " + again.replace("\n", "\n    ")
    assert quickstart_report.sample(hf, "def main(argv):\n    ", 2, 0.8, 0.95, 64) != again


def test_quickstart_loss_check_is_on_unless_turned_off(quickstart):
    """The small run's loss is not 2 nats below ln(vocab): the check fails it unless told not
    to check (QUICKSTART_CHECK_LOSS=0, which the fixture sets)."""
    metrics = str(quickstart["root"] / "runs" / "quickstart" / "metrics.jsonl")
    command = [sys.executable, os.path.join(ROOT, "scripts", "lib", "quickstart_report.py"),
               "loss", metrics, "--vocab-size", QUICKSTART_KNOBS["VOCAB_SIZE"]]
    checked = subprocess.run(command, capture_output=True, text=True)
    assert checked.returncode == 1 and "did not fall well below ln(vocab)" in checked.stderr
    assert subprocess.run(command + ["--no-check"], capture_output=True).returncode == 0
    assert "validation loss: " in quickstart["output"]
