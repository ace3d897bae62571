"""Megatron-LM's own GPT launch scripts as test fixtures: which launches, how each is run with a
recording `torchrun`, and the recorded fixtures (tests/data/megatron_scripts/<name>.json, written
by tests/data/megatron_scripts/record.py from a Megatron-LM tree).

A launch is a script of Megatron-LM's examples/ run exactly as a user runs it (`bash SCRIPT
ARGS` with its environment), except that `torchrun` is tests/harness/children/torchrun_recorder.py,
which records the arguments instead of starting ranks. Paths the launch takes are placeholders
(`{ckpt}`, `{data}`, ...) made absolute under one base directory when it runs and turned back into
placeholders in the fixture, so fixtures do not depend on the machine.

The modelopt configurations (examples/post_training/modelopt/conf/<Org>/<Model>.sh) reach
pretrain_gpt.py only through examples/post_training/modelopt/train.sh; they are launched as a
pretraining run (MLM_DATA_ARGS with --data-path instead of train.sh's SFT default), and the
flags that exist only with NVIDIA Model Optimizer installed (train.sh's --modelopt-enabled and
--export-te-mcore-model, post-training features) are dropped from the argv that is compared.
"""
import json
import os
import shutil
import stat
import subprocess
import sys
from typing import Dict, List, NamedTuple, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HERE = os.path.join(ROOT, "tests", "data", "megatron_scripts")
"""Where record.py writes the fixtures."""
RECORDER = os.path.join(ROOT, "tests", "harness", "children", "torchrun_recorder.py")

PLACEHOLDERS = {"{ckpt}": "checkpoints/run", "{tb}": "tensorboard/run",
                "{vocab}": "gpt2-vocab.json", "{merges}": "gpt2-merges.txt",
                "{data}": "data/corpus_text_document", "{hf_tokenizer}": "hf_tokenizer",
                "{sp_model}": "sentencepiece/tokenizer.model", "{cwd}": "cwd"}
"""Placeholder -> its path under the base directory of one launch."""


class Launch(NamedTuple):
    """One launch: a script of Megatron-LM's tree, its arguments and environment."""

    script: str
    args: Tuple[str, ...] = ()
    env: Tuple[Tuple[str, str], ...] = ()
    conf: Optional[str] = None
    """The modelopt configuration it runs (<Org>/<Model>), if any."""


MODELOPT_PRETRAINING = (
    ("MLM_SKIP_INSTALL", "1"), ("MLM_MODEL_CKPT", "{ckpt}"), ("HF_MODEL_CKPT", "{hf_tokenizer}"),
    ("MLM_DATA_ARGS", "--train-samples 128000 --lr-decay-samples 128000 --lr-warmup-samples 0 "
                      "--data-path {data} --split 99,1,0"))
"""train.sh's environment for a pretraining run of a conf: no pip install, the checkpoint
directory, the tokenizer (HF_MODEL_CKPT makes TOKENIZER_MODEL the same path) and pretraining
data instead of the SFT default."""

MODELOPT_CONFS = ("Qwen/Qwen2.5-0.5B-Instruct", "Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen3-0.6B",
                  "Qwen/Qwen3-8B", "Qwen/Qwen3-30B-A3B", "Qwen/Qwen3-235B-A22B",
                  "meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Llama-3.2-1B-Instruct",
                  "nvidia/Nemotron-Mini-4B-Instruct")
"""The GPT-family dense and MoE configurations (not hybrid Mamba, not MLA, not multimodal)."""


def _conf_name(conf: str) -> str:
    return "modelopt_" + conf.split("/")[1].lower().replace("-", "_").replace(".", "_")


LAUNCHES: Dict[str, Launch] = {
    "gpt3_175b": Launch("examples/gpt3/train_gpt3_175b_distributed.sh",
                        ("{ckpt}", "{tb}", "{vocab}", "{merges}", "{data}")),
    "llama3_8b_fp8": Launch("examples/llama/train_llama3_8b_h100_fp8.sh", ("{ckpt}", "{tb}")),
    "llama3_8b_fp8_hf": Launch("examples/llama/train_llama3_8b_h100_fp8.sh",
                               ("{ckpt}", "{tb}", "{hf_tokenizer}", "{data}")),
    "mixtral_8x7b": Launch("examples/mixtral/train_mixtral_8x7b_distributed.sh",
                           ("{ckpt}", "{sp_model}", "{data}")),
    **{_conf_name(conf): Launch("examples/post_training/modelopt/train.sh", (conf,),
                                MODELOPT_PRETRAINING, conf) for conf in MODELOPT_CONFS},
}
"""Every launch the compatibility suite holds, by fixture name."""


def paths(base: str) -> Dict[str, str]:
    """{placeholder: absolute path under `base`}."""
    return {key: os.path.join(base, rel) for key, rel in PLACEHOLDERS.items()}


def fill(text: str, where: Dict[str, str]) -> str:
    """`text` with every placeholder replaced by its path."""
    for key, value in where.items():
        text = text.replace(key, value)
    return text


def unfill(text: str, where: Dict[str, str]) -> str:
    """`text` with every path (longest first) replaced by its placeholder."""
    for key, value in sorted(where.items(), key=lambda kv: -len(kv[1])):
        text = text.replace(value, key)
    return text


def _torchrun_shim(bin_dir: str) -> None:
    path = os.path.join(bin_dir, "torchrun")
    with open(path, "w") as f:
        f.write(f"#!/bin/sh\nexec {sys.executable} {RECORDER} \"$@\"\n")
    os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def run_launch(tree: str, launch: Launch, base: str) -> dict:
    """Run `launch`'s script from Megatron-LM `tree` with bash, `torchrun` recording, in the
    directory {cwd} (holding an empty pretrain_gpt.py, which the llama script requires there);
    its own environment only (no RANK, SLURM_* or WANDB_* of the caller). Returns
    {"torchrun": argv, "env": launch environment, "output": the script's output}, paths as
    placeholders."""
    where = paths(base)
    bin_dir = os.path.join(base, "bin")
    for folder in (bin_dir, where["{cwd}"]):
        os.makedirs(folder, exist_ok=True)
    open(os.path.join(where["{cwd}"], "pretrain_gpt.py"), "w").close()
    _torchrun_shim(bin_dir)
    record = os.path.join(base, "torchrun.json")
    env = {"PATH": bin_dir + os.pathsep + "/usr/bin:/bin", "HOME": base, "LANG": "C.UTF-8",
           "TORCHRUN_RECORD": record, **{k: fill(v, where) for k, v in launch.env}}
    proc = subprocess.run(["bash", os.path.join(tree, launch.script),
                           *(fill(a, where) for a in launch.args)],
                          cwd=where["{cwd}"], env=env, capture_output=True, text=True,
                          timeout=120)
    if not os.path.exists(record):
        raise RuntimeError(f"{launch.script} exited {proc.returncode} without calling torchrun:"
                           f"\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    with open(record) as f:
        got = json.load(f)
    tree_root = os.path.abspath(tree)
    argv = [unfill(a, where).replace(tree_root + os.sep, "{megatron}/") for a in got["argv"]]
    return {"torchrun": argv,
            "env": {k: unfill(v, where) for k, v in got["env"].items()},
            "output": proc.stdout + proc.stderr}


def split_torchrun(argv: List[str]) -> Tuple[int, str, List[str]]:
    """(world size, entry script, its flags) of a torchrun command line: --nproc_per_node x
    --nnodes (the N of N or M:N)."""
    nproc, nnodes, i = 1, 1, 0
    while i < len(argv) and argv[i].startswith("-"):
        key, eq, value = argv[i].partition("=")
        if not eq:
            i += 1
            value = argv[i]
        key = key.lstrip("-").replace("-", "_")
        if key == "nproc_per_node":
            nproc = int(value)
        elif key == "nnodes":
            nnodes = int(value.split(":")[-1])
        i += 1
    return nproc * nnodes, argv[i], list(argv[i + 1:])


def names() -> List[str]:
    """The recorded launches, in LAUNCHES order."""
    return [n for n in LAUNCHES if os.path.exists(os.path.join(HERE, f"{n}.json"))]


def fixture(name: str) -> dict:
    """The recorded fixture of launch `name` (record.py's fields)."""
    with open(os.path.join(HERE, f"{name}.json")) as f:
        return json.load(f)


def copy_tree_parts(mirror: str, commit: str, dest: str) -> None:
    """`git archive` of examples/, megatron/ and pretrain_gpt.py at `commit` into `dest`."""
    archive = subprocess.Popen(["git", "-C", mirror, "archive", commit, "examples", "megatron",
                                "pretrain_gpt.py"], stdout=subprocess.PIPE)
    subprocess.run(["tar", "-x", "-C", dest], stdin=archive.stdout, check=True)
    if archive.wait():
        shutil.rmtree(dest, ignore_errors=True)
        raise RuntimeError(f"git archive {commit} of {mirror} failed")


# ---------------------------------------------------------------------------- CI assets

def make_assets(tokenizer_type: str, where: Dict[str, str], texts: List[str]) -> None:
    """The files a launch names, made here for its --tokenizer-type: the tokenizer
    ({hf_tokenizer}: a byte-level BPE in a Hugging Face directory; {sp_model}: a SentencePiece
    BPE model; {vocab}/{merges}: a GPT-2 BPE) and {data}, `texts` preprocessed with that
    tokenizer (one document per ~2 KB, end-of-document appended). NullTokenizer needs none."""
    import numpy as np

    from app.data import build_tokenizer
    from tests.harness.corpus import write_documents
    from tests.harness.tokenizers import train_hf_tokenizer
    if tokenizer_type == "NullTokenizer":
        return
    for key in ("{data}", "{sp_model}", "{vocab}"):
        os.makedirs(os.path.dirname(where[key]), exist_ok=True)
    files = {"vocab_file": None, "merge_file": None, "tokenizer_model": None}
    if tokenizer_type == "HuggingFaceTokenizer":
        files["tokenizer_model"] = train_hf_tokenizer(where["{hf_tokenizer}"])
    elif "SentencePiece" in tokenizer_type or tokenizer_type == "Llama2Tokenizer":
        files["tokenizer_model"] = train_sentencepiece(where["{sp_model}"], texts)
    else:
        from app.data.tokenizer import train_gpt2_bpe
        files["vocab_file"], files["merge_file"] = train_gpt2_bpe(
            texts, 512, os.path.dirname(where["{vocab}"]))
    tok = build_tokenizer(tokenizer_type, files["vocab_file"], files["merge_file"], None,
                          files["tokenizer_model"])
    write_documents(where["{data}"], texts, tok, np.int32)


def train_sentencepiece(path: str, texts: List[str], vocab_size: int = 512) -> str:
    """A SentencePiece BPE model at `path` (the .model file) trained on `texts`."""
    import io

    import sentencepiece
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(line for t in texts for line in t.splitlines() if line.strip()),
        model_writer=model, vocab_size=vocab_size, model_type="bpe", byte_fallback=True,
        minloglevel=2)
    with open(path, "wb") as f:
        f.write(model.getvalue())
    return path
