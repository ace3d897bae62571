"""examples/pretrain_llama.sh, made small through its environment: it trains its own Hugging
Face tokenizer on the corpus (a BOS before every document, its EOS at the end), tokenizes the
corpus with it, and hands the DeepSpeed launcher the Llama recipe with that tokenizer and no
GPT-2 files. The launcher is replaced by a recorder of its arguments (the launcher itself is
the quickstart's, run by test_documented_commands.py); the recorded pretrain_gpt2.py command
line then trains, as `python pretrain_gpt2.py ...` with OMP_NUM_THREADS unset, in one process
forked from the test session (run_main): it prints the intra-op threads it chose, and names
the GPT-2 flag added on the command line, which that tokenizer does not read."""
import json
import math
import os
import subprocess
import sys

from app.data import MMapIndexedDataset
from app.data.tokenizer import LLAMA_BOS, LLAMA_EOS
from app.launch.threads import choose_threads
from tests.harness.corpus import read_metrics, stdlib_texts
from tests.harness.distributed import run_main
from tests.harness.launch import LAUNCH_VARIABLES, ROOT

SMALL = {"NUM_LAYERS": "2", "HIDDEN": "64", "HEADS": "4", "KV_GROUPS": "2", "SEQ": "32",
         "TRAIN_ITERS": "2", "EVAL_INTERVAL": "2", "EVAL_ITERS": "1", "SAVE_INTERVAL": "2",
         "LOG_INTERVAL": "1", "MICRO_BATCH": "2", "GLOBAL_BATCH": "4", "NUM_GPUS": "2",
         "VOCAB_SIZE": "512"}
RECORDER = '#!/bin/sh\nprintf "%s\\n" "$@" > "$ARGS_FILE"\n'
PYTHON = f'#!/bin/sh\nexec "{sys.executable}" "$@"\n'


def test_llama_example_trains_with_its_own_tokenizer(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    with open(corpus, "w") as f:
        for text in stdlib_texts(12):
            f.write(json.dumps({"content": text}) + "\n")
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}
    env.update(SMALL, CORPUS=str(corpus), LLAMA_DATA=str(tmp_path / "llama"),
               CHECKPOINT_PATH=str(tmp_path / "ck"), ARGS_FILE=str(tmp_path / "launch.txt"))
    (tmp_path / "bin").mkdir()
    for name, script in (("python", PYTHON), ("deepspeed", RECORDER)):
        (tmp_path / "bin" / name).write_text(script)
        (tmp_path / "bin" / name).chmod(0o755)
    proc = subprocess.run(["bash", os.path.join(ROOT, "examples", "pretrain_llama.sh"),
                           "--metrics-file", str(tmp_path / "metrics.jsonl"),
                           "--merge-file", str(tmp_path / "gone.txt")],
                          capture_output=True, text=True,
                          env={**env, "VENV_BIN": str(tmp_path / "bin")},
                          stdin=subprocess.DEVNULL, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    tokenizer = json.loads((tmp_path / "llama" / "tokenizer" / "tokenizer.json").read_text())
    ids = {t["content"]: t["id"] for t in tokenizer["added_tokens"]}
    data = MMapIndexedDataset(str(tmp_path / "llama" / "stdlib_content_document"))
    for document in (data[0], data[len(data) - 1]):  # as the tokenizer frames every document
        assert (int(document[0]), int(document[-1])) == (ids[LLAMA_BOS], ids[LLAMA_EOS])
    launched = (tmp_path / "launch.txt").read_text().splitlines()
    argv = launched[launched.index(os.path.join(ROOT, "pretrain_gpt2.py")) + 1:]
    assert argv[argv.index("--tokenizer-type") + 1] == "HuggingFaceTokenizer"
    assert argv[argv.index("--tokenizer-model") + 1] == str(tmp_path / "llama" / "tokenizer")
    assert "--vocab-file" not in argv and argv.count("--merge-file") == 1  # only the one added

    env.pop("OMP_NUM_THREADS", None)
    code, out, err = run_main(argv, str(tmp_path), env)
    assert code == 0, (out + err)[-5000:]
    train = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r["kind"] == "train"]
    assert [r["iteration"] for r in train] == [1, 2]
    assert all(math.isfinite(r["lm_loss"]) for r in train)
    assert f"> {choose_threads({}, 1).describe()}" in out + err
    assert (f"--merge-file {tmp_path / 'gone.txt'} is not read: --tokenizer-type "
            "HuggingFaceTokenizer reads --tokenizer-model (and that file does not exist)") \
        in out + err
