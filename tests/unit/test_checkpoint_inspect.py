"""Checkpoint layouts read from file names, and the messages that refuse an unloadable one.

The directories are laid out by hand from the two formats' documented names (Megatron-LM's
mp_rank_XX[_YYY]/model_optim_rng.pt; DeepSpeed's mp_rank_XX_model_states.pt and
[bf16_]zero_pp_rank_D_mp_rank_XX_optim_states.pt), so the reader is checked against the
formats, not against our writers.
"""
import os

import pytest

from app.checkpoint.legacy import per_rank as ckpt
from app.checkpoint import names
from app.checkpoint.saved_layout import (DEEPSPEED, TORCH, check_loadable,
                                             inspect_directory, loadable_problem)


def touch(path):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    open(path, "wb").close()


def megatron_dir(root, tp, pp, skip=()):
    iter_dir = os.path.join(root, "iter_0000010")
    for t in range(tp):
        for p in range(pp):
            name = f"mp_rank_{t:02d}" if pp == 1 else f"mp_rank_{t:02d}_{p:03d}"
            if (t, p) not in skip:
                touch(os.path.join(iter_dir, name, "model_optim_rng.pt"))
            else:
                os.makedirs(os.path.join(iter_dir, name), exist_ok=True)
    names.write_tracker(root, 10)
    return iter_dir


def deepspeed_dir(root, tp, dp, prefix=""):
    iter_dir = os.path.join(root, "iter_0000010")
    for t in range(tp):
        touch(os.path.join(iter_dir, f"mp_rank_{t:02d}_model_states.pt"))
        for d in range(dp):
            touch(os.path.join(iter_dir, f"{prefix}zero_pp_rank_{d}_mp_rank_{t:02d}_optim_states.pt"))
    names.write_tracker(root, 10)
    return iter_dir


def problem(layout, root, deepspeed, tp=1, pp=1, dp=1, load_optimizer=True):
    return loadable_problem(layout, root, deepspeed=deepspeed, tensor_model_parallel_size=tp,
                            pipeline_model_parallel_size=pp, data_parallel_size=dp,
                            load_optimizer=load_optimizer)


def test_layouts_are_read_from_the_names(tmp_path):
    meg = inspect_directory(megatron_dir(str(tmp_path / "m"), tp=2, pp=3))
    assert (meg.format, meg.tensor_model_parallel_size, meg.pipeline_model_parallel_size,
            meg.data_parallel_size, len(meg.model_files), meg.missing) == (TORCH, 2, 3, None, 6, [])
    ds = inspect_directory(deepspeed_dir(str(tmp_path / "d"), tp=2, dp=4, prefix="bf16_"))
    assert (ds.format, ds.tensor_model_parallel_size, ds.data_parallel_size,
            len(ds.model_files), len(ds.optimizer_files), ds.missing) == (DEEPSPEED, 2, 4, 2, 8, [])
    assert inspect_directory(str(tmp_path / "nothing")) is None


def test_a_missing_rank_file_makes_the_checkpoint_incomplete(tmp_path):
    root = str(tmp_path)
    layout = inspect_directory(megatron_dir(root, tp=2, pp=2, skip={(1, 1)}))
    assert layout.missing == [os.path.join(layout.directory, "mp_rank_01_001", "model_optim_rng.pt")]
    message = problem(layout, root, deepspeed=False, tp=2, pp=2)
    assert "incomplete" in message and "mp_rank_01_001" in message
    assert names.TRACKER_FILENAME in message


def test_native_checkpoint_under_deepspeed_and_back(tmp_path):
    """A DeepSpeed run loading a native checkpoint (and a native run loading a DeepSpeed one)
    is refused with a message naming the format and the fix, not a bare AssertionError."""
    meg_root, ds_root = str(tmp_path / "m"), str(tmp_path / "d")
    meg = inspect_directory(megatron_dir(meg_root, tp=1, pp=1))
    message = problem(meg, meg_root, deepspeed=True)
    assert "Megatron-layout" in message and "without --deepspeed" in message
    assert problem(meg, meg_root, deepspeed=False) is None
    ds = inspect_directory(deepspeed_dir(ds_root, tp=1, dp=1))
    message = problem(ds, ds_root, deepspeed=False)
    assert "written by DeepSpeed" in message and "--input-format deepspeed" in message
    assert problem(ds, ds_root, deepspeed=True) is None


def test_megatron_layout_change_names_the_converter(tmp_path):
    root = str(tmp_path)
    layout = inspect_directory(megatron_dir(root, tp=2, pp=1))
    message = problem(layout, root, deepspeed=False, tp=1, pp=2)
    assert "tensor-parallel size 2 and pipeline-parallel size 1; this run uses 1 and 2" in message
    assert ("tools/convert_checkpoint.py --input-format torch --output-format torch "
            f"--load {root}") in message
    assert "--target-tensor-model-parallel-size 1 --target-pipeline-model-parallel-size 2" in message


def test_deepspeed_dp2_to_tp2_names_the_tensor_parallel_change(tmp_path):
    """DP2 -> TP2 under DeepSpeed is refused naming the tensor-parallel change, not with
    DeepSpeed's 'DP world size' error."""
    root = str(tmp_path)
    layout = inspect_directory(deepspeed_dir(root, tp=1, dp=2))
    message = problem(layout, root, deepspeed=True, tp=2, dp=1)
    assert "tensor-parallel size 1" in message and "this run uses 2" in message
    assert "DeepSpeed cannot change the tensor-parallel size" in message
    assert "--tensor-model-parallel-size 1" in message and "DP world size" not in message
    only_dp = problem(layout, root, deepspeed=True, tp=1, dp=4)
    assert "over 2 data-parallel ranks, and this run has 4" in only_dp and "--no-load-optim" in only_dp
    assert problem(layout, root, deepspeed=True, tp=1, dp=4, load_optimizer=False) is None
    with pytest.raises(ckpt.CheckpointError, match="DeepSpeed cannot change"):
        check_loadable(root, 10, deepspeed=True, tensor_model_parallel_size=2,
                       pipeline_model_parallel_size=1, data_parallel_size=1, load_optimizer=True)


def test_universal_tag_is_read_from_latest_universal_or_refused_with_the_command(tmp_path):
    from app.checkpoint.saved_layout import universal_tag
    with pytest.raises(ckpt.CheckpointError) as exc:
        universal_tag(str(tmp_path))
    assert f"{tmp_path}/latest_universal does not exist" in str(exc.value)
    assert "deepspeed.checkpoint.ds_to_universal --input_folder" in str(exc.value)
    (tmp_path / "latest_universal").write_text("iter_0000006_universal\n")
    assert universal_tag(str(tmp_path)) == "iter_0000006_universal"


def zero3_dir(root, tp, dp, skip=()):
    """DeepSpeed's ZeRO-3 names: a module file and an optimizer file per (dp, tp) rank."""
    iter_dir = os.path.join(root, "iter_0000010")
    for t in range(tp):
        for d in range(dp):
            for kind in ("model", "optim"):
                if (d, t, kind) not in skip:
                    touch(os.path.join(iter_dir, f"zero_pp_rank_{d}_mp_rank_{t:02d}_{kind}_states.pt"))
    names.write_tracker(root, 10)
    return iter_dir


def test_zero3_layout_and_the_stage_refusals(tmp_path):
    from app.checkpoint.saved_layout import stage_problem
    z3 = inspect_directory(zero3_dir(str(tmp_path / "z3"), tp=2, dp=3))
    assert (z3.format, z3.tensor_model_parallel_size, z3.data_parallel_size, z3.partitioned_weights,
            len(z3.model_files), len(z3.optimizer_files), z3.missing) == (DEEPSPEED, 2, 3, True, 6, 6, [])
    assert os.path.basename(z3.model_files[0]) == "zero_pp_rank_0_mp_rank_00_model_states.pt"
    lost = inspect_directory(zero3_dir(str(tmp_path / "lost"), tp=1, dp=2, skip={(1, 0, "model")}))
    assert [os.path.basename(p) for p in lost.missing] == ["zero_pp_rank_1_mp_rank_00_model_states.pt"]
    z2 = inspect_directory(deepspeed_dir(str(tmp_path / "z2"), tp=1, dp=2))
    assert not z2.partitioned_weights
    assert "saved at ZeRO stage 3" in stage_problem(z3, False, load_optimizer=False)
    assert stage_problem(z3, True, load_optimizer=True) is None
    assert "--no-load-optim" in stage_problem(z2, True, load_optimizer=True)
    assert stage_problem(z2, True, load_optimizer=False) is None  # a ZeRO-3 run reads its weights
    assert stage_problem(z2, False, load_optimizer=True) is None
