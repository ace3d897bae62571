"""examples/custom_loss.py end to end on the tiny corpus: it trains, its metrics reach the
metrics file and the log line, and its own bad flag exits 2 with the flag named."""
import importlib.util
import pathlib

from tests.harness.corpus import read_metrics, tiny_gpt_args

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_custom_loss_example_trains_and_logs_its_metrics(tiny_corpus, tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("custom_loss_example",
                                                  ROOT / "examples" / "custom_loss.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    metrics = tmp_path / "metrics.jsonl"
    argv = tiny_gpt_args(tiny_corpus, tmp_path, "--train-iters", "3", "--log-interval", "1",
                         "--eval-iters", "1", "--eval-interval", "3",
                         "--metrics-file", str(metrics))
    assert example.main(["--label-smoothing", "0.1", "--z-loss", "1e-3", *argv]) == 0
    train = [r for r in read_metrics(metrics) if r["kind"] == "train"]
    assert len(train) == 3
    for record in train:
        # loss = 0.9 CE + 0.1 smoothing term + 1e-3 z-loss > 0.9 CE, and the metrics are there
        assert record["z_loss"] > 0 and record["lm_loss"] > 0.9 * record["cross entropy"]
    out = capsys.readouterr()
    assert "cross entropy:" in out.out + out.err and "z_loss:" in out.out + out.err
    assert example.main(["--label-smoothing", "1.5", *argv]) == 2
    assert "--label-smoothing" in capsys.readouterr().err
