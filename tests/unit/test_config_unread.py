"""Flags the run's path does not read are named, one warning each, with the path chosen and
what it reads instead; a run given only what it reads gets no warning."""
import json

import arguments
from app.config.unread import unread_flags

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--train-iters", "10", "--micro-batch-size", "2"]


def notes(*extra, world=1):
    return unread_flags(arguments.config_from_argv([*BASE, *extra], world, 100))


def test_a_run_given_only_what_it_reads_has_nothing_to_say(tmp_path):
    vocab, merges = tmp_path / "vocab.json", tmp_path / "merges.txt"
    assert notes("--vocab-file", str(vocab), "--merge-file", str(merges)) == []
    assert notes("--fp16", "--loss-scale", "128", "--hysteresis", "3") == []
    assert notes("--optimizer", "sgd", "--sgd-momentum", "0.5", "--use-distributed-optimizer",
                 "--ddp-bucket-size", "1000", world=2) == []
    assert notes("--mock-data", "--vocab-size", "100") == []


def test_tokenizer_files_the_type_does_not_read(tmp_path):
    hf = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(tmp_path)]
    vocab = tmp_path / "vocab.json"
    vocab.write_text("{}")
    got = notes(*hf, "--vocab-file", str(vocab), "--merge-file", str(tmp_path / "gone.txt"),
                "--vocab-size", "50")
    assert got == [
        f"--vocab-file {vocab} is not read: --tokenizer-type HuggingFaceTokenizer reads "
        "--tokenizer-model; drop --vocab-file, or choose the tokenizer type that reads it",
        f"--merge-file {tmp_path / 'gone.txt'} is not read: --tokenizer-type "
        "HuggingFaceTokenizer reads --tokenizer-model (and that file does not exist); drop "
        "--merge-file, or choose the tokenizer type that reads it",
        "--vocab-size 50 is not read: --tokenizer-type HuggingFaceTokenizer reads "
        "--tokenizer-model; drop --vocab-size, or choose the tokenizer type that reads it"]
    gpt2 = notes("--vocab-file", str(vocab), "--merge-file", str(vocab),
                 "--tokenizer-model", str(tmp_path))
    assert len(gpt2) == 1 and gpt2[0].startswith(
        f"--tokenizer-model {tmp_path} is not read: --tokenizer-type GPT2BPETokenizer reads "
        "--vocab-file and --merge-file")
    null = notes("--mock-data", "--vocab-size", "100", "--tokenizer-model", str(tmp_path))
    assert len(null) == 1 and "--tokenizer-type NullTokenizer reads --vocab-size" in null[0]


def test_loss_scale_flags_without_fp16_are_accepted_and_named(tmp_path):
    bf16 = notes("--bf16", "--loss-scale", "128", "--min-loss-scale", "2")
    assert bf16 == [f"{flag} is not read: bf16 weights need no loss scaling (the loss-scale "
                    "flags apply with --fp16 only); drop it"
                    for flag in ("--loss-scale", "--min-loss-scale")]
    assert notes("--hysteresis", "3")[0].startswith("--hysteresis is not read: fp32 weights")
    ds = tmp_path / "bf16.json"
    ds.write_text(json.dumps({"bf16": {"enabled": True}}))  # the precision from the JSON
    got = notes("--deepspeed", "--deepspeed_config", str(ds), "--loss-scale-window", "10")
    assert got == ["--loss-scale-window is not read: bf16 weights need no loss scaling (the "
                   "loss-scale flags apply with --fp16 only); drop it"]


def test_settings_of_an_unused_optimizer_or_engine(tmp_path):
    assert notes("--sgd-momentum", "0.5", "--muon-momentum", "0.9") == [
        "--muon-momentum is not read: --optimizer adam does not use it; drop it",
        "--sgd-momentum is not read: --optimizer adam does not use it; drop it"]
    assert notes("--optimizer", "sgd", "--adam-beta2", "0.95") == [
        "--adam-beta2 is not read: --optimizer sgd does not use it; drop it"]
    assert notes("--ddp-bucket-size", "1000") == [
        "--ddp-bucket-size 1000 is not read by the data-parallel all-reduce without "
        "--use-distributed-optimizer: only --use-distributed-optimizer buckets gradients by "
        "it; drop it"]
    ds = tmp_path / "ds.json"
    ds.write_text("{}")
    assert notes("--deepspeed_config", str(ds)) == [
        f"--deepspeed_config {ds} is not read: without --deepspeed the run takes the native "
        "path; add --deepspeed to train through DeepSpeed with it"]


def test_moe_flags_of_a_dense_model_and_megatrons_moe_fusions():
    assert notes("--num-experts", "4", "--disable-bias-linear", "--moe-router-topk", "1",
                 "--moe-router-pre-softmax", "--expert-tensor-parallel-size", "1") == []
    assert notes("--moe-router-topk", "4", "--expert-tensor-parallel-size", "1") == [
        f"{flag} is not read: without --num-experts the model is dense; drop it or add "
        "--num-experts" for flag in ("--moe-router-topk", "--expert-tensor-parallel-size")]
    assert notes("--num-experts", "4", "--disable-bias-linear", "--moe-permute-fusion") == [
        "--moe-permute-fusion is not read: the token permutation and the router run the same "
        "unfused PyTorch either way (accepted for Megatron's scripts)"]
