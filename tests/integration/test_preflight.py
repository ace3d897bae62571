"""`pretrain_gpt2.py --dry-run` (and tools/preflight.py): one report, exit 0 on a good
configuration, exit 2 naming the flag or file on each kind of bad input, nothing trained."""
import json
import os
import shutil

import pytest

import pretrain_gpt2
from app.data import MMapIndexedDataset
from tests.harness.corpus import tiny_gpt_args

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GOOD = ["--train-iters", "20", "--eval-interval", "10", "--eval-iters", "2", "--log-interval", "5"]


def dry_run(capsys, corpus, tmp, *extra, tool=False):
    """(exit code, report text) of a dry run of the tiny configuration plus `extra`."""
    argv = tiny_gpt_args(corpus, tmp, *GOOD, *extra)
    if tool:
        from tools import preflight
        code = preflight.main(argv)
    else:
        code = pretrain_gpt2.main(argv + ["--dry-run"])
    return code, capsys.readouterr().out


def errors(report):
    return [line.strip()[len("ERROR"):].strip() for line in report.splitlines()
            if line.strip().startswith("ERROR")]


@pytest.fixture(scope="module")
def saved_checkpoint(tiny_corpus, tmp_path_factory):
    """A real one-iteration native checkpoint of the tiny configuration."""
    tmp = tmp_path_factory.mktemp("preflight_ck")
    ck = tmp / "ck"
    pretrain_gpt2.run(tiny_gpt_args(tiny_corpus, tmp, "--train-iters", "20", "--eval-iters", "0",
                                    "--exit-interval", "1", "--save", str(ck)))
    return ck


def test_good_configuration_passes_and_trains_nothing(tiny_corpus, tmp_path, capsys,
                                                      saved_checkpoint):
    ck = tmp_path / "ck"
    shutil.copytree(saved_checkpoint, ck)
    before = sorted(os.listdir(ck))
    code, report = dry_run(capsys, tiny_corpus, tmp_path, "--load", str(ck), "--save", str(ck),
                           "--metrics-file", str(tmp_path / "m.jsonl"))
    assert code == 0, report
    assert "preflight passed: 0 error(s)" in report
    for section in ("[tokenizer]", "[configuration]", "[data]", "[checkpoint]",
                    "[memory (per rank)]"):
        assert section in report
    documents = MMapIndexedDataset(tiny_corpus["prefix"]).num_documents
    assert f"{documents:,} documents" in report
    assert "20 iterations = 80 samples" in report and "train documents [0," in report
    assert "--load" in report and "iteration 1" in report and "19 iteration(s) left" in report
    assert "match their SHA-256 sidecars" in report
    assert sorted(os.listdir(ck)) == before and not (tmp_path / "m.jsonl").exists()


def test_tools_preflight_and_planning_for_another_world(tiny_corpus, tmp_path, capsys):
    code, report = dry_run(capsys, tiny_corpus, tmp_path, "--dry-run-world-size", "4",
                           "--tensor-model-parallel-size", "2", tool=True)
    assert code == 0, report
    assert "world size 4 = tensor 2 x pipeline 1 x data 2" in report
    code, report = dry_run(capsys, tiny_corpus, tmp_path, "--dry-run-world-size", "3",
                           "--tensor-model-parallel-size", "2", tool=True)
    assert code == 2 and "world size (3) is not divisible" in " ".join(errors(report))


def test_moe_dry_run_counts_experts_per_rank_and_active_flops(tiny_corpus, tmp_path, capsys):
    """The MoE line: the expert grid, total and active parameters (the model's own count and
    its k of E experts), this rank's routed experts and the active FLOPs; a bad EP is refused."""
    import arguments
    from app.model import GPT2Model
    from app.training.telemetry.flops import model_flops_per_token
    moe = ["--num-experts", "4", "--moe-router-topk", "2", "--disable-bias-linear",
           "--moe-ffn-hidden-size", "32", "--expert-model-parallel-size", "2",
           "--global-batch-size", "8"]
    code, report = dry_run(capsys, tiny_corpus, tmp_path, "--dry-run-world-size", "4", *moe)
    assert code == 0, report
    cfg = arguments.config_from_argv(tiny_gpt_args(tiny_corpus, tmp_path, *GOOD, *moe), 4, 512)
    model = GPT2Model(cfg.model)
    total = sum(p.numel() for p in model.parameters())
    experts = {n: p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n}
    idle = sum(experts.values()) // 2  # each token uses 2 of the 4 experts
    assert (f"expert grid expert-tensor 1 x expert 2 x expert-data 2 x pipeline 1; parameters "
            f"{total:,} in all, {total - idle:,} active per token; routed experts per rank "
            f"{sum(experts.values()) // 2:,} of its {total - sum(experts.values()) // 2:,}"
            in report), report
    assert f"{model_flops_per_token(cfg.model) / 1e6:,.2f} MFLOP (active" in report
    code, report = dry_run(capsys, tiny_corpus, tmp_path, "--dry-run-world-size", "4", *moe,
                           "--expert-model-parallel-size", "3")
    assert code == 2 and "Number of experts should be a multiple" in " ".join(errors(report))


def test_vocabulary_too_small_for_the_data(tiny_corpus, tmp_path, capsys):
    from app.data.tokenizer import train_gpt2_bpe
    vocab, merges = train_gpt2_bpe(["def f(x):\n    return x + 1\n"] * 20, 300,
                                   str(tmp_path / "small_tok"))
    code, report = dry_run(capsys, tiny_corpus, tmp_path, "--vocab-file", vocab,
                           "--merge-file", merges)
    found = errors(report)
    assert code == 2 and len(found) == 1, report
    assert tiny_corpus["prefix"] + ".bin" in found[0] and "in document" in found[0]
    assert "re-run tools/preprocess_data.py" in found[0]


def test_checkpoints_of_another_layout_or_format(tiny_corpus, tmp_path, capsys, saved_checkpoint):
    ck = tmp_path / "ck"
    shutil.copytree(saved_checkpoint, ck)
    shutil.copytree(ck / "iter_0000001" / "mp_rank_00", ck / "iter_0000001" / "mp_rank_01")
    code, report = dry_run(capsys, tiny_corpus, tmp_path, "--load", str(ck))
    found = " ".join(errors(report))
    assert code == 2 and "saved with tensor-parallel size 2" in found, report
    assert "tools/convert_checkpoint.py --input-format torch" in found
    shutil.rmtree(ck / "iter_0000001" / "mp_rank_01")
    code, report = dry_run(capsys, tiny_corpus, tmp_path, "--load", str(ck), "--deepspeed",
                           "--deepspeed_config", os.path.join(ROOT, "ds_configs", "zero2.json"))
    assert code == 2 and "without --deepspeed" in " ".join(errors(report)), report
    data = ck / "iter_0000001" / "mp_rank_00" / "model_optim_rng.pt"
    blob = bytearray(data.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    data.write_bytes(bytes(blob))
    code, report = dry_run(capsys, tiny_corpus, tmp_path, "--load", str(ck))
    assert code == 2 and "is corrupt" in " ".join(errors(report)), report
    code, report = dry_run(capsys, tiny_corpus, tmp_path, "--load", str(tmp_path / "typo"))
    assert code == 2 and "typo does not exist" in " ".join(errors(report)), report


def test_batch_sizes_json_disagreement_and_memory(tiny_corpus, tmp_path, capsys):
    code, report = dry_run(capsys, tiny_corpus, tmp_path, "--global-batch-size", "6",
                           "--micro-batch-size", "4")
    assert code == 2 and "--global-batch-size (6) is not divisible by --micro-batch-size (4)" \
        in " ".join(errors(report)), report
    with open(os.path.join(ROOT, "ds_configs", "zero2.json")) as f:
        ds = json.load(f)
    ds["train_micro_batch_size_per_gpu"] = 8
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    code, report = dry_run(capsys, tiny_corpus, tmp_path, "--deepspeed", "--deepspeed_config",
                           str(path))
    found = " ".join(errors(report))
    assert code == 2 and "train_micro_batch_size_per_gpu" in found and "--micro-batch-size" in found
    code, report = dry_run(capsys, tiny_corpus, tmp_path, "--dry-run-device-memory", "0.0029")
    found = " ".join(errors(report))
    assert code == 2 and "exceeds 90% of 0.0029 GiB" in found, report
    assert "largest micro-batch that fits: 1" in found and "lower --micro-batch-size to 1" in found
    code, report = dry_run(capsys, tiny_corpus, tmp_path, "--dry-run-device-memory", "0.001")
    assert code == 2 and "the model states alone do not fit" in " ".join(errors(report)), report
    code, report = dry_run(capsys, tiny_corpus, tmp_path, "--dry-run-device-memory", "1")
    assert code == 0 and "fits 1 GiB (--dry-run-device-memory)" in report, report


def test_deepspeed_checkpoint_is_read_and_matched(tiny_corpus, tmp_path, capsys):
    ds = ["--deepspeed", "--deepspeed_config", os.path.join(ROOT, "ds_configs", "zero2.json")]
    ck = tmp_path / "ck"
    pretrain_gpt2.run(tiny_gpt_args(tiny_corpus, tmp_path, "--train-iters", "20", "--eval-iters",
                                    "0", "--exit-interval", "2", "--save", str(ck), *ds))
    code, report = dry_run(capsys, tiny_corpus, tmp_path, "--load", str(ck), *ds)
    assert code == 0, report
    assert "iteration 2, deepspeed layout, tensor-parallel size 1" in report
    assert "ZeRO partitions over 1 data-parallel ranks" in report
    assert "model shape matches" in report and "resumes at iteration 2" in report
    code, report = dry_run(capsys, tiny_corpus, tmp_path, "--load", str(ck))
    assert code == 2 and "written by DeepSpeed" in " ".join(errors(report)), report
    code, report = dry_run(capsys, tiny_corpus, tmp_path, "--load", str(ck), "--hidden-size", "32",
                           *ds)
    assert code == 2 and "hidden_size" in " ".join(errors(report)), report
