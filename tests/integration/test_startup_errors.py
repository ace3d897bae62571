"""Bad inputs found at start-up: exit code 2 and one line naming the flag or file and the fix,
never a traceback; and the quickstart banner names the sizes that train."""
import os
import shutil
import stat
import subprocess
import sys

import numpy as np

import pretrain_gpt2
from app.data import MMapIndexedDatasetBuilder
from tests.harness.corpus import tiny_gpt_args

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASE = ["--train-iters", "2", "--eval-iters", "0", "--log-interval", "1"]


def fails(capsys, argv):
    """The one error line of a run that must stop at start-up with exit code 2."""
    code = pretrain_gpt2.main(argv)
    err = capsys.readouterr().err
    assert code == 2, err[-2000:]
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err[-2000:]
    return lines[0]


def test_deepspeed_run_loading_a_native_checkpoint(tiny_corpus, tmp_path, capsys):
    ck = tmp_path / "ck"
    pretrain_gpt2.run(tiny_gpt_args(tiny_corpus, tmp_path, *BASE, "--save", str(ck)))
    line = fails(capsys, tiny_gpt_args(
        tiny_corpus, tmp_path, *BASE, "--train-iters", "3", "--load", str(ck), "--deepspeed",
        "--deepspeed_config", os.path.join(ROOT, "ds_configs", "zero2.json")))
    assert str(ck / "iter_0000002") in line and "Megatron-layout" in line
    assert "without --deepspeed" in line


def test_split_or_dataset_without_training_documents(tiny_corpus, tmp_path, capsys):
    line = fails(capsys, tiny_gpt_args(tiny_corpus, tmp_path, *BASE, "--split", "0,1,0"))
    assert "--split 0,1,0 leaves no training documents" in line
    empty = str(tmp_path / "empty_text_document")
    MMapIndexedDatasetBuilder(empty + ".bin", np.uint16).finalize(empty + ".idx")
    argv = tiny_gpt_args(tiny_corpus, tmp_path, *BASE)
    argv[argv.index("--data-path") + 1] = empty
    line = fails(capsys, argv)
    assert f"{empty}.bin holds no documents" in line


def test_token_ids_beyond_the_vocabulary_stop_the_run_at_start(tiny_corpus, tmp_path, capsys):
    from app.data.tokenizer import train_gpt2_bpe
    vocab, merges = train_gpt2_bpe(["x = 1\n"] * 20, 300, str(tmp_path / "small"))
    argv = tiny_gpt_args(tiny_corpus, tmp_path, *BASE)
    argv[argv.index("--vocab-file") + 1], argv[argv.index("--merge-file") + 1] = vocab, merges
    line = fails(capsys, argv)
    assert tiny_corpus["prefix"] + ".bin" in line and "in document" in line


def test_empty_or_garbage_vocab_and_empty_merges(tiny_corpus, tmp_path, capsys):
    for name, text in (("empty.json", ""), ("garbage.json", "<html>")):
        (tmp_path / name).write_text(text)
        argv = tiny_gpt_args(tiny_corpus, tmp_path, *BASE)
        argv[argv.index("--vocab-file") + 1] = str(tmp_path / name)
        line = fails(capsys, argv)
        assert f"--vocab-file '{tmp_path / name}' is not valid JSON" in line
    (tmp_path / "merges.txt").write_text("")
    argv = tiny_gpt_args(tiny_corpus, tmp_path, *BASE)
    argv[argv.index("--merge-file") + 1] = str(tmp_path / "merges.txt")
    assert "holds no merges" in fails(capsys, argv)


def test_model_summary_names_the_flags_gpt2_args_builds():
    env = dict(os.environ, NUM_LAYERS="6", HIDDEN="128", HEADS="8", SEQ="64", MICRO_BATCH="4")
    out = subprocess.run(["bash", "-c", "source scripts/lib/gpt2_args.sh && gpt2_args 8 ck && "
                          "model_summary && echo \"${GPT2_ARGS[*]}\""], cwd=ROOT, env=env,
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[0] == "6 layers, hidden 128, heads 8, seq 64, micro-batch 4, global batch 8"
    assert "--num-layers 6 --hidden-size 128 --num-attention-heads 8 --seq-length 64" in out[1]


QUICKSTART_ENV = ("VENV_BIN", "PYTHON", "DATA", "VOCAB", "MERGES", "CHECKPOINT_PATH", "LOAD_PATH",
                  "MICRO_BATCH", "GLOBAL_BATCH", "TRAIN_ITERS", "NUM_GPUS", "DS_CONFIG",
                  "PRECISION", "DATA_DIR", "RUN_DIR", "CKPT", "QUICKSTART_FRESH")
"""Settings of the scripts that the test's own environment must not leak into them."""


def _executable(path, text):
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def test_quickstart_banner_names_the_sizes_its_launch_trains(tmp_path):
    """scripts/quickstart.sh in a copy of the scripts, with the environment set-up stubbed, the
    data steps already done and `deepspeed` replaced by a recorder of its arguments that stops
    the script: the "== 4/5 training GPT-2 (...)" banner names the model and batch sizes of the
    flags that ds_pretrain_gpt2.sh hands to pretrain_gpt2.py, also when the sizes come from
    the environment."""
    root = tmp_path / "repo"
    (root / "scripts" / "lib").mkdir(parents=True)
    for name in ("quickstart.sh", "ds_pretrain_gpt2.sh", os.path.join("lib", "gpt2_args.sh")):
        shutil.copy(os.path.join(ROOT, "scripts", name), root / "scripts" / name)
    (root / "scripts" / "setup_env.sh").write_text("true\n")
    bin_dir = root / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    _executable(bin_dir / "python", f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    _executable(bin_dir / "deepspeed", '#!/bin/sh\nprintf "%s\\n" "$@" > "$ARGS_FILE"\nexit 1\n')
    (root / "data" / "tokenizer").mkdir(parents=True)
    for name in ("stdlib.jsonl", "tokenizer/merges.txt", "stdlib_content_document.idx"):
        (root / "data" / name).write_text("done\n")  # steps 1-3 run only without these
    args_file = tmp_path / "launch_args.txt"
    env = {k: v for k, v in os.environ.items() if k not in QUICKSTART_ENV}
    env.update(ARGS_FILE=str(args_file), NUM_LAYERS="6", HIDDEN="128", HEADS="8", SEQ="64")
    out = subprocess.run(["bash", str(root / "scripts" / "quickstart.sh")], env=env,
                         capture_output=True, text=True, timeout=300)
    banner = [line for line in out.stdout.splitlines() if line.startswith("== 4/5")]
    assert len(banner) == 1 and args_file.exists(), out.stdout + out.stderr
    argv = args_file.read_text().splitlines()

    def flag(name):
        return argv[argv.index(name) + 1]

    trained = (f"{flag('--num-layers')} layers, hidden {flag('--hidden-size')}, heads "
               f"{flag('--num-attention-heads')}, seq {flag('--seq-length')}, micro-batch "
               f"{flag('--micro-batch-size')}, global batch {flag('--global-batch-size')}")
    assert trained == "6 layers, hidden 128, heads 8, seq 64, micro-batch 4, global batch 8"
    assert banner[0].startswith(f"== 4/5 training GPT-2 ({trained}) for ")
