"""The exported Hugging Face directory describes itself: README.md names the architecture, the
training data, the tokens seen (consumed samples x sequence length), the iterations, the final
validation loss from the run's metrics file (or says it is unknown), and its example code runs."""
import re
import sys

import pytest

from tests.harness.tools import run_tool
from tests.harness.corpus import read_metrics, tiny_gpt_args
from tests.harness.launch import run

transformers = pytest.importorskip("transformers")

TRAIN = ["--train-iters", "8", "--log-interval", "4", "--eval-interval", "4", "--eval-iters", "1",
         "--lr", "3e-3", "--save-interval", "1000"]


def _export(ck, out, corpus, *extra):
    run_tool("convert_checkpoint", ["--input-format", "megatron", "--output-format", "hf",
                                    "--load", str(ck), "--save", str(out), "--vocab-file",
                                    corpus["vocab"], "--merge-file", corpus["merges"], *extra])
    return (out / "README.md").read_text(encoding="utf-8")


def test_model_card_describes_the_run_and_its_example_runs(tiny_corpus, tmp_path):
    from pretrain_gpt2 import run as pretrain
    metrics = tmp_path / "metrics.jsonl"
    pretrain(tiny_gpt_args(tiny_corpus, tmp_path, *TRAIN, "--save", str(tmp_path / "ck"),
                           "--metrics-file", str(metrics)))
    card = _export(tmp_path / "ck", tmp_path / "hf", tiny_corpus, "--metrics-file", str(metrics))
    for row in ("| layers | 2 |", "| hidden size | 64 |", "| attention heads | 4 |",
                "| context (positions) | 32 |", "| vocabulary | 512 |", "| iterations | 8 |",
                "| global batch size | 4 |",
                f"| training data (--data-path) | `{tiny_corpus['prefix']}` |",
                "| tokens seen | 1,024 (32 samples x 32 tokens) |"):
        assert row in card, row
    valid = [r for r in read_metrics(metrics) if r["kind"] == "valid"]
    assert f"| final validation loss | {valid[-1]['lm_loss']:.4f} " in card
    assert f"at iteration {valid[-1]['iteration']}, from metrics.jsonl |" in card
    model = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf"))
    parameters = sum(p.numel() for p in model.parameters())
    assert f"| parameters | {parameters:,} " in card
    snippet = re.search(r"```python\n(from transformers import pipeline.*?)```", card, re.S).group(1)
    assert str(tmp_path / "hf") in snippet
    done = run([sys.executable, "-c", snippet], tmp_path)
    assert done.stdout.startswith("def main(") and len(done.stdout.strip()) > len("def main(")

    card = _export(tmp_path / "ck", tmp_path / "hf_plain", tiny_corpus)
    assert "| final validation loss | unknown (pass the run's --metrics-file" in card


def test_metrics_file_problems_are_named(tmp_path):
    from app.checkpoint.hf.model_card import final_validation_loss
    with pytest.raises(FileNotFoundError, match="--metrics-file"):
        final_validation_loss(str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"kind": "train", "iteration": 1}\nnot json\n')
    with pytest.raises(ValueError, match="line 2 is not JSON"):
        final_validation_loss(str(bad))
    bad.write_text('{"kind": "train", "iteration": 1, "lm_loss": 2.0}\n')
    assert final_validation_loss(str(bad)) is None
