"""The progress helper of the tools: rate and ETA as plain lines when not on a terminal."""
import io
import time

import torch

from app.checkpoint.state import Progress as ConvertProgress
from app.utils.progress import progress


def test_progress_reports_rate_and_eta_as_lines_when_not_a_terminal():
    out = io.StringIO()
    for _ in progress(range(4), desc="converting", stream=out, min_interval_s=0):
        time.sleep(0.01)
    with progress(total=4 << 20, desc="tokenizing", unit="B", stream=out,
                  min_interval_s=0) as bar:
        bar.update(1 << 20)
        bar.set_postfix_str("12 docs/s")
    lines = out.getvalue().splitlines()
    assert all("\r" not in line for line in lines)
    assert any(line.startswith("converting: 100% 4/4") and "ETA" in line and "it/s" in line
               for line in lines)
    assert any("tokenizing:  25%" in line and "B/s" in line and "12 docs/s" in line
               for line in lines)
    converted = io.StringIO()  # the converter's tensor counter is built on the same helper
    counter = ConvertProgress("writing", total=2, stream=converted)
    counter.add(torch.zeros(1 << 18))  # 1 MiB
    counter.add(torch.zeros(1 << 18))
    counter.report(final=True)
    last = converted.getvalue().splitlines()[-1]
    assert last.startswith("[convert] writing: 100% 2/2") and "ETA" in last, last
    assert "tensors/s, 2.0 MiB," in last and "MiB/s]" in last, last
