"""tools/plot_metrics.py: runs overlaid in one PNG, absent metrics left out, bad input refused."""
import json

import pytest

from app.testing.tools import load_tool


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_two_runs_overlaid_and_errors(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    tool = load_tool("plot_metrics")
    train = [{"kind": "train", "iteration": i, "lm_loss": 9.0 - i, "lr": 1e-3, "grad_norm": 1.0,
              "tokens_per_s": 100.0, "mfu": 0.2} for i in (1, 2, 3)]
    a = _write(tmp_path / "a.jsonl", train + [{"kind": "valid", "iteration": 3, "lm_loss": 6.5}])
    b = _write(tmp_path / "b.jsonl", [dict(r, lm_loss=r["lm_loss"] + 0.1) for r in train])
    out = tmp_path / "plots" / "m.png"
    assert tool.main(["--metrics-file", a, "--metrics-file", b, "--label", "a", "--label", "b",
                      "--output", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    runs = {"a": tool.read_rows(a), "b": tool.read_rows(b)}
    present = [k for k, _ in tool.PANELS if any(tool.series(r, "train", k)[0] for r in runs.values())]
    assert present == ["lm_loss", "lr", "grad_norm", "tokens_per_s", "mfu"]  # no loss_scale
    assert tool.series(runs["a"], "valid", "lm_loss") == ([3], [6.5])
    (tmp_path / "bad.jsonl").write_text('{"kind": "train"}\nnot json\n')
    assert tool.main(["--metrics-file", str(tmp_path / "bad.jsonl"), "--output", str(out)]) == 2
    assert "line 2" in capsys.readouterr().err
    assert tool.main(["--metrics-file", str(tmp_path / "none.jsonl")]) == 2
