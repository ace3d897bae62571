"""tools/plot_metrics.py: runs overlaid in one PNG, absent metrics left out, bad input refused."""
import json

import pytest

from tests.harness.tools import load_tool


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _capture_figures(monkeypatch):
    """The figures the tool saves, kept for inspection after it closes them."""
    from matplotlib.figure import Figure
    saved, real_savefig = [], Figure.savefig

    def savefig(fig, *args, **kwargs):
        saved.append(fig)
        return real_savefig(fig, *args, **kwargs)
    monkeypatch.setattr(Figure, "savefig", savefig)
    return saved


def _lines(ax):
    """{legend label: (x, y)} of the lines drawn on `ax`."""
    return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata()))
            for line in ax.get_lines()}


def test_two_runs_overlaid_and_errors(tmp_path, capsys, monkeypatch):
    pytest.importorskip("matplotlib")
    tool = load_tool("plot_metrics")
    figures = _capture_figures(monkeypatch)
    train = [{"kind": "train", "iteration": i, "lm_loss": 9.0 - i, "lr": 1e-3, "grad_norm": 1.0,
              "tokens_per_s": 100.0, "mfu": 0.2} for i in (1, 2, 3)]
    a = _write(tmp_path / "a.jsonl", train + [{"kind": "valid", "iteration": 3, "lm_loss": 6.5}])
    b = _write(tmp_path / "b.jsonl", [dict(r, lm_loss=r["lm_loss"] + 0.1) for r in train])
    out = tmp_path / "plots" / "m.png"
    assert tool.main(["--metrics-file", a, "--metrics-file", b, "--label", "a", "--label", "b",
                      "--output", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (fig,) = figures
    drawn = [ax for ax in fig.axes if ax.axison]
    # one panel per metric present in some file: no loss scale in either
    assert [ax.get_title() for ax in drawn] == ["loss", "learning rate", "grad norm", "tokens/s",
                                                "MFU"]
    loss = _lines(drawn[0])
    assert loss.keys() == {"a train", "a valid", "b train"}
    assert loss["a train"] == ([1, 2, 3], [8.0, 7.0, 6.0])
    assert loss["a valid"] == ([3], [6.5])
    assert loss["b train"][0] == [1, 2, 3]
    assert loss["b train"][1] == pytest.approx([8.1, 7.1, 6.1])
    assert _lines(drawn[4]) == {"a": ([1, 2, 3], [0.2] * 3), "b": ([1, 2, 3], [0.2] * 3)}
    (tmp_path / "bad.jsonl").write_text('{"kind": "train"}\nnot json\n')
    assert tool.main(["--metrics-file", str(tmp_path / "bad.jsonl"), "--output", str(out)]) == 2
    assert "line 2" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stop:  # a missing file: a usage error naming it
        tool.main(["--metrics-file", str(tmp_path / "none.jsonl")])
    assert stop.value.code == 2 and "none.jsonl does not exist" in capsys.readouterr().err


def test_megatrons_tensorboard_scalars_beside_our_metrics(tmp_path, monkeypatch):
    """A Megatron-LM run's TensorBoard events (written by SummaryWriter under the tags Megatron's
    training_log and evaluation use) and our metrics file on one figure."""
    pytest.importorskip("matplotlib")
    from torch.utils.tensorboard import SummaryWriter
    tool = load_tool("plot_metrics")
    figures = _capture_figures(monkeypatch)
    board = tmp_path / "megatron" / "tensorboard"
    writer = SummaryWriter(str(board))
    for iteration, loss in ((4, 5.5), (5, 5.25), (6, 5.0)):
        writer.add_scalar("lm loss", loss, iteration)
        writer.add_scalar("lm loss vs samples", loss + 1, iteration * 4)
        writer.add_scalar("learning-rate", 1e-4 * iteration, iteration)
        writer.add_scalar("grad-norm", 2.0, iteration)
        writer.add_scalar("batch-size", 4, iteration)
    writer.add_scalar("lm loss validation", 5.125, 6)
    writer.close()
    ours = _write(tmp_path / "ours.jsonl", [{"kind": "train", "iteration": i, "lm_loss": 5.5,
                                             "lr": 0.0} for i in (4, 5, 6)])
    out = tmp_path / "both.png"
    assert tool.main(["--metrics-file", ours, "--tensorboard-dir", str(board), "--label", "ours",
                      "--label", "megatron", "--output", str(out)]) == 0
    (fig,) = figures
    drawn = [ax for ax in fig.axes if ax.axison]
    assert [ax.get_title() for ax in drawn] == ["loss", "learning rate", "grad norm"]
    loss = _lines(drawn[0])
    assert loss.keys() == {"ours train", "megatron train", "megatron valid"}
    assert loss["megatron train"] == ([4, 5, 6], [5.5, 5.25, 5.0])
    assert loss["megatron valid"] == ([6], [5.125])
    assert _lines(drawn[1])["megatron"][1] == pytest.approx([4e-4, 5e-4, 6e-4])
    with pytest.raises(SystemExit) as stop:
        tool.main(["--tensorboard-dir", str(tmp_path / "empty_dir_missing")])
    assert stop.value.code == 2
    other = tmp_path / "other"
    SummaryWriter(str(other)).close()
    assert tool.main(["--tensorboard-dir", str(other)]) == 2


def test_usage_errors_name_the_flags(tmp_path, capsys):
    """No run, or a --label count that does not match the runs: usage errors (exit 2)."""
    tool = load_tool("plot_metrics")
    ours = _write(tmp_path / "m.jsonl", [{"kind": "train", "iteration": 1, "lm_loss": 5.0}])
    for argv, said in (([], "give at least one --metrics-file or --tensorboard-dir"),
                       (["--metrics-file", ours, "--label", "a", "--label", "b"],
                        "2 --label for 1 runs")):
        with pytest.raises(SystemExit) as stop:
            tool.main(argv)
        assert stop.value.code == 2
        assert said in capsys.readouterr().err


def test_our_runs_tensorboard_reads_as_megatrons(tmp_path):
    """Our run's TensorBoard (MetricsWriter.scalars under Megatron's tags, plus our
    tokens-per-second and mfu) reads back as the metrics file's rows."""
    from app.training.telemetry.metrics import MetricsWriter
    tool = load_tool("plot_metrics")
    board = tmp_path / "tb"
    with MetricsWriter(str(board), None) as writer:
        for iteration in (1, 2):
            writer.scalars(iteration, {"lm loss": 6.0 - iteration, "learning-rate": 1e-3},
                           consumed_samples=4 * iteration)
            writer.scalars(iteration, {"tokens-per-second": 100.0 * iteration, "mfu": 0.25})
        writer.scalars(2, {"lm loss validation": 4.5}, consumed_samples=8)
    rows = tool.read_tensorboard(str(board))
    assert rows == [{"kind": "train", "iteration": 1, "lm_loss": 5.0, "lr": pytest.approx(1e-3),
                     "tokens_per_s": 100.0, "mfu": 0.25},
                    {"kind": "train", "iteration": 2, "lm_loss": 4.0, "lr": pytest.approx(1e-3),
                     "tokens_per_s": 200.0, "mfu": 0.25},
                    {"kind": "valid", "iteration": 2, "lm_loss": 4.5}]
