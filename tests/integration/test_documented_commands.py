"""Every command in README.md and docs/*.md runs as written, against what the quickstart made.

Each fenced block of those files says what it is: an info string (```text for output and
listings, ```bash for commands) and, for a shell block, a marker on the line above it:

    <!-- doc-test: run -->             run as written
    <!-- doc-test: dry-run -->         training commands: run as written plus --dry-run; a
                                       launcher prefix (torchrun --nproc-per-node 8, deepspeed
                                       --num_gpus 8) becomes --dry-run-world-size 8
    <!-- doc-test: skip (why) -->      not run: it needs a GPU, the network, a cluster, ...

A block without them fails `test_every_block_is_classified`, naming the file and line. The
runnable blocks of one document run in order in one bash session (a variable one block sets,
the next can use), with `set -e`, in a sandbox of its own: symlinks to this checkout's files,
and the quickstart's outputs at the paths it writes them (data/ copied; checkpoints/quickstart
and runs/quickstart hard-linked, so a file a document adds or replaces stays in its sandbox).
Two documents run at a time; a failure names the file and line of the block, the commands it
ran and the tail of their output. The
quickstart itself (scripts/quickstart.sh) runs once per session, made small through its
environment knobs (a 1 MB corpus, vocabulary 512, 20 iterations; the model keeps its shape,
so the documents' flags fit its checkpoint), with the Hugging Face Hub unreachable
(HF_HUB_OFFLINE=1, HF_DATASETS_OFFLINE=1): this is also the quickstart's end-to-end test.
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

from tests.integration.launch_utils import LAUNCH_VARIABLES, ROOT

DOCUMENTS = ["README.md"] + sorted(os.path.join("docs", name)
                                   for name in os.listdir(os.path.join(ROOT, "docs"))
                                   if name.endswith(".md"))
SHELLS = ("bash", "sh", "shell", "console")
KINDS = ("run", "dry-run", "skip")
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*(\S*)")
MARKER = re.compile(r"^\s*<!--\s*doc-test:\s*([\w-]+)\s*(?:\((.*)\))?\s*-->\s*$")
TRAINING = re.compile(r"^(\s*)(.*?)\bpretrain_gpt2\.py\b(.*)$")
SANDBOX_OUTPUTS = ("data", "checkpoints", "runs", "exports")
BLOCK_BANNER = "@@ doc-test block "
QUICKSTART_KNOBS = {"CORPUS_BYTES": "1000000", "VOCAB_SIZE": "512", "TRAIN_ITERS": "20",
                    "EVAL_INTERVAL": "10", "EVAL_ITERS": "2", "SAVE_INTERVAL": "20",
                    "LOG_INTERVAL": "10", "QUICKSTART_CHECK_LOSS": "0", "SAMPLE_SEED": "1"}
"""A quickstart made small (scripts/quickstart.sh documents each knob); 20 iterations cannot
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


def parse_document(document: str) -> Tuple[List[Block], List[str]]:
    """The fenced blocks of `document` (a path relative to the checkout) and the problems with
    their classification, each naming the file and line."""
    lines = open(os.path.join(ROOT, document), encoding="utf-8").read().split("\n")
    blocks, problems, i = [], [], 0
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
        end = next((j for j in range(i + 1, len(lines))
                    if lines[j].strip().startswith(fence[0] * len(fence))
                    and not lines[j].strip().strip(fence[0])), len(lines))
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
        return [f"{block.where}: a dry-run block with no pretrain_gpt2.py command: mark it run"]
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
    """`text` with each pretrain_gpt2.py command run by `python` with --dry-run added (and
    --dry-run-world-size for the ranks its launcher would start); other lines as written."""
    out = []
    for line in _logical_lines(text):
        match = TRAINING.match(line)
        if not match or line.lstrip().startswith("#"):
            out.append(line)
            continue
        indent, launcher, args = match.groups()
        args = re.sub(r"\s+#.*$", "", args)  # a trailing comment
        world = launcher_world_size(launcher)
        extra = f" --dry-run-world-size {world}" if world and world > 1 else ""
        out.append(f"{indent}python pretrain_gpt2.py{args} --dry-run{extra}")
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


def _environment() -> Dict[str, str]:
    """A user's shell: this virtualenv first on PATH, nothing of this test process's launch
    or import settings, one thread, and no Hugging Face Hub."""
    e = {k: v for k, v in os.environ.items() if k not in (*LAUNCH_VARIABLES, "PYTHONPATH")}
    e.update(PATH=os.path.dirname(sys.executable) + os.pathsep + e.get("PATH", ""),
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
    shutil.copytree(made / "data", os.path.join(path, "data"))
    for folder in ("checkpoints", "runs"):
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


def _run_document(document: str, quickstart, work) -> Optional[str]:
    """Run the runnable blocks of `document` in one bash session in a fresh sandbox under
    `work`; None when every command succeeded, else what failed: the file and line of the
    block, the commands it ran and the tail of their output."""
    blocks = _runnable(document)
    os.makedirs(work)
    sandbox = _sandbox(quickstart, os.path.join(work, "sandbox"))
    script = os.path.join(work, "session.sh")
    with open(script, "w", encoding="utf-8") as f:
        f.write(_session_script(blocks))
    proc = subprocess.run(["bash", script], cwd=sandbox, env=_environment(),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=900)
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
    time (each is a chain of short processes: two keep both cores busy)."""
    selected = [d for d in RUNNABLE
                if any(f"test_documented_commands_run[{d}]" in item.nodeid
                       for item in request.session.items)]
    work = tmp_path_factory.mktemp("documents")
    with ThreadPoolExecutor(max_workers=2) as pool:
        yield {d: pool.submit(_run_document, d, quickstart, str(work / d.replace("/", "_")))
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
