"""DeepSpeed checkpoints resumed at another data- or tensor-parallel size: through DeepSpeed's
universal checkpoint (ds_to_universal.py, then --universal-checkpoint) at DP2 -> DP1 and
DP1 -> TP2, and through tools/convert_checkpoint.py (ZeRO shards with Adam state -> a Megatron
checkpoint resumed on the native path). Each resumed run continues with the losses of the run
that was not interrupted. The runs train through pretrain_gpt2 in forked ranks
(tests.harness.distributed.run_pretrain); DeepSpeed's converter runs as a command, ours
in-process (its main())."""
import os
import sys

from tests.harness.distributed import run_pretrain
from tests.harness.tools import run_tool
from tests.harness.corpus import ZERO2_DP2_ARGS, tiny_gpt_args
from tests.harness.launch import ROOT, assert_close_curves, run, train_curve

ZERO2 = ["--deepspeed", "--deepspeed_config", os.path.join(ROOT, "ds_configs", "zero2.json")]
COMMON = ZERO2_DP2_ARGS


def _to_universal(ck, iteration=3):
    tag = f"iter_{iteration:07d}"
    run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
         str(ck / tag), "--output_folder", str(ck / f"{tag}_universal"),
         "--num_extract_workers", "1", "--num_merge_workers", "1"], ck)
    assert (ck / "latest_universal").read_text().strip() == f"{tag}_universal"


def _later(curve, after=3):
    return {k: v for k, v in curve.items() if k > after}


def test_universal_checkpoint_dp2_to_dp1(tiny_corpus, zero2_dp2_run):
    tmp = zero2_dp2_run
    _to_universal(tmp / "ck")
    resumed = tmp / "dp1.jsonl"
    run_pretrain(1, tiny_gpt_args(tiny_corpus, tmp, *COMMON, *ZERO2, "--load", str(tmp / "ck"),
                                  "--universal-checkpoint", "--metrics-file", str(resumed)))
    assert_close_curves(train_curve(resumed), _later(train_curve(tmp / "straight.jsonl")),
                        rel=1e-5, what="universal DP2 -> DP1")


def test_converter_dp2_zero2_to_native_with_adam_state(tiny_corpus, zero2_dp2_run):
    """ZeRO-2 shards of two DP ranks -> a Megatron checkpoint with the merged Adam moments ->
    the native path resumes it in one process."""
    from pretrain_gpt2 import run as pretrain
    tmp = zero2_dp2_run
    run_tool("convert_checkpoint", ["--input-format", "deepspeed", "--output-format", "megatron",
                                    "--load", str(tmp / "ck"), "--save", str(tmp / "megatron"),
                                    "--iteration", "3", "--include-optimizer"])
    assert (tmp / "megatron" / "latest_checkpointed_iteration.txt").read_text() == "3"
    resumed = tmp / "native.jsonl"
    pretrain(tiny_gpt_args(tiny_corpus, tmp, *COMMON, "--load", str(tmp / "megatron"),
                           "--metrics-file", str(resumed)))
    assert_close_curves(train_curve(resumed), _later(train_curve(tmp / "straight.jsonl")),
                        rel=1e-5, what="converted ZeRO-2 DP2 -> native DP1")


def test_universal_checkpoint_dp1_to_tp2(tiny_corpus, tmp_path):
    run_pretrain(1, tiny_gpt_args(tiny_corpus, tmp_path, *COMMON, *ZERO2, "--save",
                                  str(tmp_path / "ck"), "--metrics-file",
                                  str(tmp_path / "dp1.jsonl")))
    _to_universal(tmp_path / "ck")
    resumed = tmp_path / "tp2.jsonl"
    run_pretrain(2, tiny_gpt_args(tiny_corpus, tmp_path, *COMMON, *ZERO2, "--load",
                                  str(tmp_path / "ck"), "--universal-checkpoint",
                                  "--tensor-model-parallel-size", "2", "--metrics-file",
                                  str(resumed)))
    assert_close_curves(train_curve(resumed), _later(train_curve(tmp_path / "dp1.jsonl")),
                        rel=1e-5, what="universal DP1 -> TP2")
