"""app.data.legacy_order reads the sample order of this trainer before 0.5.0 exactly as that code
built it, and a resume chooses it only for the checkpoints of that code.

The reference is the code itself: tests/data/legacy_order/samples.json holds the first train
and valid samples that the code of d8367dc (the last with that order) built from the datasets
of tests/data/legacy_order/data, and its data-order record (tests/data/legacy_order/record.py),
for a dataset of
documents with two sequences each over several epochs with the last shuffled apart, a blend of
three weighted datasets, and a blend of nine (weights summed in Python, not numpy's pairwise
sum)."""
import argparse
import json
import os

import pytest

from app.checkpoint.model_args import ARGS_BEFORE_0_4, checkpoint_writer, writer_record
from app.config import DataConfig
from app.data.gpt_dataset import build_datasets
from app.data.legacy_order import LEGACY_ORDER, sample_order
from app.data.plan import ORDER_VERSION, order_record, plan_datasets
from app.training.checkpointing.data_order import ALLOW_FLAG, resume_order
from tests.harness.launch import ROOT

HERE = os.path.join(ROOT, "tests", "data", "legacy_order")
with open(os.path.join(HERE, "samples.json")) as f:
    RECORDED = json.load(f)["cases"]
CASES = {name: case["arguments"] for name, case in RECORDED.items()}


def _datasets(case, order, cache):
    data = [w if w[0].isdigit() else os.path.join(HERE, "data", w) for w in case["data"]]
    blends = DataConfig(data_path=data, split=case["split"]).blends
    plan = plan_datasets(blends, case["split"], case["num_samples"], case["seq_length"],
                         order=order)
    return plan, build_datasets(plan, case["seed"], cache_path=cache)


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_samples_are_those_the_code_before_megatron_cores_order_built(name, tmp_path):
    plan, (train, valid, _) = _datasets(CASES[name], LEGACY_ORDER, str(tmp_path))
    for split, dataset in (("train", train), ("valid", valid)):
        want = RECORDED[name][split]
        assert [dataset[i]["text"].tolist() for i in range(len(want))] == want, (name, split)
    record = order_record(plan, CASES[name]["seed"])  # what its checkpoints recorded
    for split in record["splits"].values():
        for part in split["parts"]:
            part["prefix"] = os.path.basename(part["prefix"])
    assert {k: v for k, v in record.items() if k not in ("source", "order")} == \
        RECORDED[name]["record"]
    _, (megatron_train, _, _) = _datasets(CASES[name], sample_order(2), str(tmp_path))
    assert [megatron_train[i]["text"].tolist() for i in range(12)] != RECORDED[name]["train"]


def _args(**fields):
    return argparse.Namespace(**fields)


def test_the_writer_is_recorded_or_recognised_by_the_marks_of_its_args():
    ours_old = _args(**{name: 0 for name in ARGS_BEFORE_0_4})
    assert checkpoint_writer(ours_old).before == "0.4.0"  # 0.1.0 to 0.3.0
    assert checkpoint_writer(_args(num_layers=2, data_order=None, split="1")).before == "0.5.0"
    assert checkpoint_writer(_args(num_layers=2, data_order=None, norm_epsilon=1e-5)
                             ).before == "0.6.0"
    megatron = _args(num_layers=2, rank=0, save="s", load=None)  # Megatron-LM's parse_args
    assert not checkpoint_writer(megatron).ours and not checkpoint_writer(None).ours
    recorded = checkpoint_writer(_args(rank=0, writer=writer_record()))
    assert recorded.ours and recorded.version == writer_record()["version"]
    assert checkpoint_writer(None, writer_record()).version == writer_record()["version"]
    assert "0.1.0 to 0.3.0" in checkpoint_writer(ours_old).describe()


def test_a_converted_checkpoint_keeps_its_writers_marks():
    """The converter copies the source's args and sets its layout fields: a checkpoint of
    0.1.0-0.3.0 converted today is still theirs (and resumes in their order)."""
    import torch
    from app.checkpoint.param_layout import target_args
    old = os.path.join(os.path.dirname(__file__), "..", "data", "old_checkpoints", "v0.2.0",
                       "native_fp32", "iter_0000002", "mp_rank_00", "model_optim_rng.pt")
    source = torch.load(old, map_location="cpu", weights_only=False)  # what 0.2.0 wrote
    assert checkpoint_writer(source["args"]).before == "0.4.0"
    converted = target_args(argparse.Namespace(args=source["args"]), 2, 1, torch.float32, 320, 2)
    assert checkpoint_writer(converted).before == "0.4.0"


def test_a_resume_reads_the_order_its_checkpoint_names_and_only_the_flag_switches():
    old_writer = checkpoint_writer(_args(**{name: 0 for name in ARGS_BEFORE_0_4}))
    other = checkpoint_writer(_args(rank=0))
    mine = checkpoint_writer(_args(writer=writer_record()))
    assert resume_order(None, old_writer, False)[0] == 1  # 0.2.0: no record, its order
    assert resume_order({"version": 1}, mine, False)[0] == 1
    assert resume_order({"version": 2}, old_writer, False)[0] == 2
    assert resume_order(None, other, False)[0] == ORDER_VERSION == 2  # Megatron-LM's
    version, why = resume_order({"version": 1}, mine, True)
    assert version == 2 and ALLOW_FLAG in why
    version, why = resume_order(None, old_writer, False)
    assert "this trainer's order before 0.5.0" in why and ALLOW_FLAG in why
    assert resume_order({"version": 3}, mine, False)[0] == 3
    with pytest.raises(ValueError, match="newer release"):
        sample_order(3)
