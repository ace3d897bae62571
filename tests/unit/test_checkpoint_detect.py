"""The converter tells a checkpoint's format from its files: real checkpoints of each kind (the
legacy Megatron and DeepSpeed ZeRO-1 fixtures that earlier code wrote, a Megatron TP2 x PP2
written by the converter, a Hugging Face directory that transformers reads, a DeepSpeed
checkpoint under DeepSpeed's own `global_step` tag) are recognised and converted without
--input-format; a contradicting --input-format is refused with the fix and writes nothing."""
import os
import shutil

import pytest
import torch

from app.checkpoint import CheckpointError
from app.checkpoint.convert import ConvertOptions, read_checkpoint
from app.checkpoint.formats import detect_format
from tools import convert_checkpoint

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "data", "old_checkpoints", "v0.2.0")
MEGATRON_FIXTURE = os.path.join(FIXTURES, "native_fp32")
DEEPSPEED_FIXTURE = os.path.join(FIXTURES, "deepspeed_zero1")


def _weights(load, **options):
    return read_checkpoint(ConvertOptions(load=str(load), print_checkpoint_structure=True,
                                          **options)).weights


def test_fixtures_of_earlier_code_are_recognised():
    assert detect_format(MEGATRON_FIXTURE) == "torch"
    assert detect_format(os.path.join(FIXTURES, "native_fp16"), 2) == "torch"
    assert detect_format(DEEPSPEED_FIXTURE) == "deepspeed"


def test_every_output_of_the_converter_is_recognised_and_read_back(tmp_path):
    """Megatron TP2 x PP2 (mp_rank_XX_YYY folders) and a Hugging Face directory, both written
    from the legacy fixture without --input-format, are detected and hold its weights."""
    assert convert_checkpoint.main(["--load", MEGATRON_FIXTURE, "--save", str(tmp_path / "tp2pp2"),
                                    "--target-tensor-model-parallel-size", "2",
                                    "--target-pipeline-model-parallel-size", "2"]) == 0
    assert os.path.isdir(tmp_path / "tp2pp2" / "release" / "mp_rank_01_001")
    assert convert_checkpoint.main(["--load", str(tmp_path / "tp2pp2"), "--output-format", "hf",
                                    "--save", str(tmp_path / "hf")]) == 0
    assert detect_format(str(tmp_path / "tp2pp2")) == "torch"
    assert detect_format(str(tmp_path / "hf")) == "hf"
    transformers = pytest.importorskip("transformers")
    hf = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf"))
    original = _weights(MEGATRON_FIXTURE)
    wte = hf.transformer.wte.weight.detach()  # the reference reader: transformers itself
    embeddings = original["language_model.embedding.word_embeddings.weight"]
    assert torch.equal(wte, embeddings[:wte.shape[0]])
    back = _weights(tmp_path / "hf")
    assert torch.equal(back["language_model.embedding.word_embeddings.weight"][:wte.shape[0]], wte)


def test_deepspeed_checkpoint_under_deepspeeds_own_tag(tmp_path):
    """DeepSpeed's default tag (global_stepN, named by `latest`, no Megatron tracker) reads the
    same weights as the fixture it was copied from."""
    ds = tmp_path / "ds"
    shutil.copytree(os.path.join(DEEPSPEED_FIXTURE, "iter_0000002"), ds / "global_step2")
    (ds / "latest").write_text("global_step2")
    assert detect_format(str(ds)) == "deepspeed"
    got, want = _weights(ds), _weights(DEEPSPEED_FIXTURE)
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_a_contradicting_input_format_is_refused_and_writes_nothing(tmp_path, capsys):
    for load, wrong, found in ((DEEPSPEED_FIXTURE, "megatron", "deepspeed"),  # an alias of torch
                               (DEEPSPEED_FIXTURE, "torch", "deepspeed"),
                               (MEGATRON_FIXTURE, "deepspeed", "torch")):
        save = tmp_path / f"out_{wrong}"
        assert convert_checkpoint.main(["--input-format", wrong, "--load", load,
                                        "--save", str(save)]) == 2
        message = capsys.readouterr().err
        assert f"--input-format {wrong}, but --load {load} holds a {found} checkpoint" in message
        assert f"pass --input-format {found}" in message and "drop --input-format" in message
        assert not save.exists()
    assert convert_checkpoint.main(["--input-format", "deepspeed", "--load", DEEPSPEED_FIXTURE,
                                    "--save", str(tmp_path / "agreed")]) == 0


def test_what_is_not_a_checkpoint_is_named(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(CheckpointError, match=r"no latest_checkpointed_iteration.txt .* no "
                                              r"'latest' .* no config.json .*holds: notes.txt"):
        detect_format(str(tmp_path))
    (tmp_path / "iter_0000005").mkdir()
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("5")
    with pytest.raises(CheckpointError, match=r"iter_0000005 holds neither .*holds: nothing"):
        detect_format(str(tmp_path))
    with pytest.raises(CheckpointError, match=r"--iteration 7: .*\(iterations present: \[5\]\)"):
        detect_format(str(tmp_path), 7)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        detect_format(str(tmp_path / "missing"))
