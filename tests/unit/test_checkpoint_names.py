"""Checkpoint names and pointer files, checked against the formats' documented spellings
(Megatron-LM: iter_XXXXXXX/mp_rank_XX[_YYY]/model_optim_rng.pt and the tracker; DeepSpeed:
mp_rank_XX_model_states.pt, ZeRO-3's zero_pp_rank_D_mp_rank_XX_model_states.pt,
[bf16_]zero_pp_rank_D_mp_rank_XX_optim_states.pt and `latest`)."""
import os
import subprocess
import sys

import pytest

from app.checkpoint import CheckpointError, names

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_iteration_tags_and_directories():
    assert names.iteration_tag(10) == "iter_0000010"
    assert names.iteration_tag(12345678) == "iter_12345678"
    assert names.iteration_tag("release") == "release"
    assert names.checkpoint_dir("/ck", 3) == "/ck/iter_0000003"
    assert names.checkpoint_dir("/ck", "release") == "/ck/release"
    assert names.tag_iteration("iter_0000010") == 10
    assert names.tag_iteration("iter_12345678") == 12345678
    for other in ("iter_10", "iter_0000010_universal", "release", "latest", "iter_000001x"):
        assert names.tag_iteration(other) is None, other


def test_megatron_rank_folders_are_named_and_parsed():
    assert names.rank_dir_name(3, 0, 1) == "mp_rank_03"
    assert names.rank_dir_name(1, 2, 4) == "mp_rank_01_002"
    assert names.checkpoint_path("/ck", 7, tp_rank=1, pp_rank=2, pp_size=4) == \
        "/ck/iter_0000007/mp_rank_01_002/model_optim_rng.pt"
    # Megatron's get_checkpoint_name with expert parallelism: the EP rank last, when EP > 1
    assert names.rank_dir_name(1, 0, 1, ep_rank=3, ep_size=4) == "mp_rank_01_003"
    assert names.rank_dir_name(1, 2, 4, ep_rank=3, ep_size=4) == "mp_rank_01_002_003"
    assert names.checkpoint_path("/ck", 7, tp_rank=1, pp_rank=2, pp_size=4, ep_rank=1,
                                 ep_size=2) == \
        "/ck/iter_0000007/mp_rank_01_002_001/model_optim_rng.pt"
    assert names.parse_rank_dir("mp_rank_03") == (3,)
    assert names.parse_rank_dir("mp_rank_01_002") == (1, 2)
    assert names.parse_rank_dir("mp_rank_01_002_003") == (1, 2, 3)
    assert names.parse_rank_dir("mp_rank_100_1000") == (100, 1000)  # wider than the padding
    for other in ("mp_rank_00_model_states.pt", "mp_rank_0", "mp_rank_00_01", "mp_rank_00_",
                  "mp_rank_00_000_000_000",
                  "zero_pp_rank_0_mp_rank_00_optim_states.pt", "mp_rank_00.sha256"):
        assert names.parse_rank_dir(other) is None, other


def test_deepspeed_file_names_plain_and_bf16():
    assert names.deepspeed_model_file(1) == "mp_rank_01_model_states.pt"
    assert names.deepspeed_optim_file(3, 1) == "zero_pp_rank_3_mp_rank_01_optim_states.pt"
    assert names.deepspeed_optim_file(12, 0, bf16=True) == \
        "bf16_zero_pp_rank_12_mp_rank_00_optim_states.pt"
    assert names.parse_deepspeed_model_file("mp_rank_01_model_states.pt") == 1
    assert names.parse_deepspeed_model_file("mp_rank_123_model_states.pt") == 123
    assert names.deepspeed_model_file(1, dp_rank=3) == "zero_pp_rank_3_mp_rank_01_model_states.pt"
    assert names.parse_deepspeed_model_file("zero_pp_rank_3_mp_rank_01_model_states.pt") == 1
    assert names.parse_zero3_model_file("zero_pp_rank_3_mp_rank_01_model_states.pt") == (3, 1)
    assert names.parse_zero3_model_file("mp_rank_01_model_states.pt") is None
    assert names.parse_zero3_model_file("zero_pp_rank_3_mp_rank_01_optim_states.pt") is None
    assert names.parse_deepspeed_optim_file("zero_pp_rank_3_mp_rank_01_optim_states.pt") == \
        (3, 1, False)
    assert names.parse_deepspeed_optim_file("bf16_zero_pp_rank_12_mp_rank_00_optim_states.pt") == \
        (12, 0, True)
    for other in (".mp_rank_00_model_states.pt.sha256", "mp_rank_00", "mp_rank_0_model_states.pt",
                  "layer_01-model_00-model_states.pt",
                  "fp16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
                  "zero_pp_rank_0_mp_rank_00_optim_states.pt.tmp.1"):
        assert names.parse_deepspeed_model_file(other) is None, other
        assert names.parse_deepspeed_optim_file(other) is None, other


def test_tracker_round_trip_and_on_disk_text(tmp_path):
    s = str(tmp_path)
    assert names.read_tracker(s) is None and names.read_tracker_text(s) is None
    os.makedirs(os.path.join(s, "iter_0000020"))
    names.write_tracker(s, 20)
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_bytes() == b"20"
    assert names.read_tracker(s) == 20 and names.read_tracker_text(s) == "20"
    os.makedirs(os.path.join(s, "release"))
    names.write_tracker(s, "release")
    assert names.read_tracker(s) == "release"
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("30\n")
    with pytest.raises(CheckpointError, match="names iteration 30, but .* does not exist"):
        names.read_tracker(s)
    assert names.list_checkpoint_iterations(s) == [20]


def test_deepspeed_latest_round_trip_and_on_disk_text(tmp_path):
    s = str(tmp_path)
    assert names.read_latest_tag(s) is None
    names.write_latest_tag(s, "iter_0000004")
    assert (tmp_path / "latest").read_bytes() == b"iter_0000004"  # DeepSpeed's: no newline
    assert names.read_latest_tag(s) == "iter_0000004"
    (tmp_path / "latest_universal").write_text("iter_0000004_universal\n")  # ds_to_universal.py
    assert names.read_latest_tag(s, names.LATEST_UNIVERSAL_FILENAME) == "iter_0000004_universal"


def test_names_import_without_torch():
    """Tools that only list or name checkpoints must not pay for (or need) torch."""
    code = "import sys, app.checkpoint.names; sys.exit('torch' in sys.modules)"
    env = dict(os.environ, PYTHONPATH=ROOT)
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env).returncode == 0
