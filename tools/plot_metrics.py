"""Plot training metrics of our runs (--metrics-file JSONL) and Megatron-LM runs (their TensorBoard
event files) into one PNG.

    python tools/plot_metrics.py --metrics-file runs/a/metrics.jsonl [--metrics-file ...] \
        [--tensorboard-dir megatron_run/tensorboard ...] [--label a --label megatron] \
        --output runs/metrics.png

Panels over iterations: loss (train, and valid as markers), learning rate, gradient norm, loss
scale, tokens/s and MFU; a panel whose metric no run has is left out. Runs are overlaid, one
colour per run. TensorBoard scalars are read under the tags Megatron-LM's training_log and
evaluation write (megatron/training/training.py), which our runs write too: "lm loss",
"lm loss validation", "learning-rate", "grad-norm", "loss-scale" (the "... vs samples" copies
are not used), and our "tokens-per-second" and "mfu". --label names the runs in
order: the --metrics-file ones first, then the --tensorboard-dir ones. Prints the PNG's path.
"""
import json
import os
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional

# this checkout's `app`, whether or not the project is pip-installed
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from app.config.cli import parse_config  # noqa: E402
from app.config.options import PathOption, option  # noqa: E402

MEGATRON_TAGS = {"lm loss": ("train", "lm_loss"), "lm loss validation": ("valid", "lm_loss"),
                 "learning-rate": ("train", "lr"), "grad-norm": ("train", "grad_norm"),
                 "loss-scale": ("train", "loss_scale"),
                 "tokens-per-second": ("train", "tokens_per_s"), "mfu": ("train", "mfu")}
"""TensorBoard tag -> (row kind, our metrics key): Megatron-LM's tags, which our runs write too,
and the two our runs add (tokens-per-second, mfu; app.training.telemetry.scalars)."""

PANELS = (("lm_loss", "loss"), ("lr", "learning rate"), ("grad_norm", "grad norm"),
          ("loss_scale", "loss scale"), ("tokens_per_s", "tokens/s"), ("mfu", "MFU"))


@dataclass(kw_only=True)
class PlotOptions:
    """What to plot: our metrics files and Megatron-LM's TensorBoard runs, one curve each."""

    metrics_file: List[str] = option(
        "--metrics-file", nargs="+", action="extend", default_factory=list,
        path=PathOption("file", "a metrics JSONL that pretrain_gpt2.py --metrics-file wrote"),
        help="a metrics JSONL written by pretrain_gpt2.py --metrics-file (repeatable)")
    tensorboard_dir: List[str] = option(
        "--tensorboard-dir", nargs="+", action="extend", default_factory=list,
        path=PathOption("any", "a Megatron-LM run's --tensorboard-dir or one event file"),
        help="a Megatron-LM run's (or ours) --tensorboard-dir (or one event file; repeatable)")
    label: Optional[List[str]] = option(
        "--label", nargs="+", action="extend", default=None,
        help="legend label per run, --metrics-file ones first (default: the directory name)")
    output: str = option("--output", default="metrics.png", help="PNG to write")
    title: Optional[str] = option("--title", default=None)

    def __post_init__(self) -> None:
        runs = len(self.metrics_file) + len(self.tensorboard_dir)
        if not runs:
            raise ValueError("give at least one --metrics-file or --tensorboard-dir")
        if self.label is not None and len(self.label) != runs:
            raise ValueError(f"{len(self.label)} --label for {runs} runs (--metrics-file and "
                             "--tensorboard-dir)")


def get_args(argv: Optional[List[str]] = None) -> PlotOptions:
    """PlotOptions from the command line (exit status 2 on a bad one)."""
    return parse_config(PlotOptions, argv, __doc__.splitlines()[0])


def read_rows(path: str) -> List[Dict]:
    """The JSON objects of a metrics file; a malformed line is an error naming the line."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except ValueError as exc:
                    raise ValueError(f"{path} line {number} is not JSON: {exc}") from exc
    return rows


def read_tensorboard(path: str) -> List[Dict]:
    """Rows like a metrics file's ({kind, iteration, key: value}) from the Megatron-LM scalars
    (MEGATRON_TAGS) of the TensorBoard event files in directory `path` (or the file `path`);
    ValueError when it holds none of them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(path, size_guidance={"scalars": 0})
    events.Reload()
    rows: Dict = {}
    for tag in events.Tags().get("scalars", []):
        if tag in MEGATRON_TAGS:
            kind, key = MEGATRON_TAGS[tag]
            for event in events.Scalars(tag):
                row = rows.setdefault((kind, event.step),
                                      {"kind": kind, "iteration": event.step})
                row[key] = event.value
    if not rows:
        raise ValueError(f"--tensorboard-dir {path} holds none of Megatron-LM's scalars "
                         f"({', '.join(MEGATRON_TAGS)})")
    return [rows[k] for k in sorted(rows, key=lambda k: (k[1], k[0]))]


def series(rows: List[Dict], kind: str, key: str):
    """(iterations, values) of `key` in rows of `kind`, skipping rows without it."""
    points = [(r["iteration"], r[key]) for r in rows
              if r.get("kind") == kind and r.get(key) is not None and "iteration" in r]
    return [p[0] for p in points], [p[1] for p in points]


def plot(runs: Dict[str, List[Dict]], output: str, title: Optional[str] = None) -> str:
    """Write the PNG of `runs` ({label: rows}) to `output`; returns its path."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    present = [(key, name) for key, name in PANELS
               if any(series(rows, "train", key)[0] or series(rows, "valid", key)[0]
                      for rows in runs.values())]
    if not present:
        raise ValueError("no plottable metrics (lm_loss, lr, grad_norm, ...) in the given files")
    cols = 2 if len(present) > 1 else 1
    nrows = (len(present) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(6 * cols, 3.2 * nrows), squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (key, name) in zip(axes.flat, present):
        for i, (label, rows) in enumerate(runs.items()):
            colour = colours[i % len(colours)]
            x, y = series(rows, "train", key)
            if x:
                ax.plot(x, y, color=colour, label=f"{label} train" if key == "lm_loss" else label)
            if key == "lm_loss":
                vx, vy = series(rows, "valid", key)
                if vx:
                    ax.plot(vx, vy, "o--", color=colour, label=f"{label} valid")
        ax.set_title(name)
        ax.set_xlabel("iteration")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(present):]:
        ax.axis("off")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    fig.savefig(output, dpi=100)
    plt.close(fig)
    return output


def main(argv: Optional[List[str]] = None) -> int:
    a = get_args(argv)
    sources = [(p, read_rows) for p in a.metrics_file] + \
        [(p, read_tensorboard) for p in a.tensorboard_dir]
    labels = a.label or [os.path.basename(os.path.dirname(os.path.abspath(p))) or p
                         for p, _ in sources]
    try:
        runs = {}
        for label, (path, read) in zip(labels, sources):
            runs[label if label not in runs else f"{label} ({path})"] = read(path)
        print(plot(runs, a.output, a.title))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
