"""Training-loop stall per checkpoint save: synchronous vs --async-save, GPT-2 small shape.

    python bench/bench_async_save.py [--saves 5] [--num-layers 12] [--dir /tmp]

The 124M model (12 layers, hidden 768, 12 heads, vocab 50257 padded to 50304, 1024 positions,
fp32, AdamW) built through the real engine (tests.harness.synthetic), trained one step so the
optimizer's moments exist (at sequence length 128: the state saved does not depend on it, only
the step's time does), then saved `--saves` times each way through engine.save_checkpoint, the
call the training loop makes. The stall is the time that call blocks the training thread:
synchronous, the whole save (state dict, torch.save, SHA-256 sidecar, fsync, tracker);
asynchronous, the state dict, its copy to host memory and the hand-off to the writing thread.
The first asynchronous save allocates the host buffers (page faults: several times the copy);
later ones reuse them (app.checkpoint.snapshot.HostBuffers), so the ratio uses saves 2..N.
One training step runs before each pair of saves, so the state changes in place between them.
The background write that follows is timed too (until every file is durable and committed).
Goal: the asynchronous stall at most 10% of the synchronous save.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from typing import Dict, List

import torch

RAW_VOCAB = 50257


def model_argv(layers: int) -> List[str]:
    return ["--num-layers", str(layers), "--hidden-size", "768", "--num-attention-heads", "12",
            "--seq-length", "128", "--max-position-embeddings", "1024",
            "--make-vocab-size-divisible-by", "128", "--hidden-dropout", "0",
            "--attention-dropout", "0", "--micro-batch-size", "1", "--global-batch-size", "1",
            "--lr", "1e-4", "--lr-decay-style", "constant", "--distributed-backend", "gloo",
            "--train-iters", "1000"]


def measure(layers: int, saves: int, directory: str) -> Dict[str, List[float]]:
    """{"sync": stalls, "async": stalls, "background": write times} in seconds."""
    import arguments
    from tests.harness.synthetic import build_synthetic_run

    cfg = arguments.config_from_argv(model_argv(layers), 1, RAW_VOCAB)
    run = build_synthetic_run(cfg, saves + 2)
    engine = run["engine"]
    run["trainer"].train_step(run["iterator"])  # AdamW's moments exist from here on
    params = sum(p.numel() for p in run["model"].parameters())
    print(f"model: {layers} layers, {params / 1e6:.1f} M parameters; state saved "
          f"{sum(engine.state_bytes().values()) / 2**30:.2f} GiB held (weights, grads, AdamW)")
    client = {"iteration": 1, "consumed_train_samples": 1, "consumed_valid_samples": 0}
    out: Dict[str, List[float]] = {"sync": [], "async": [], "background": []}
    for i in range(saves):
        run["trainer"].train_step(run["iterator"])  # the weights and moments change in place
        for mode in ("sync", "async"):
            save_dir = os.path.join(directory, mode)
            start = time.perf_counter()
            engine.save_checkpoint(save_dir, i + 1, client, asynchronous=mode == "async")
            out[mode].append(time.perf_counter() - start)
            if mode == "async":
                while engine.finish_save(blocking=False) is None:  # the loop's per-iteration check
                    time.sleep(0.01)
                out["background"].append(time.perf_counter() - start)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--saves", type=int, default=5)
    p.add_argument("--num-layers", type=int, default=12)
    p.add_argument("--dir", default=tempfile.gettempdir(), help="where the checkpoints go")
    a = p.parse_args()
    load = os.getloadavg()
    print(f"machine: {os.cpu_count()} CPUs, load average {load[0]:.2f} {load[1]:.2f} "
          f"{load[2]:.2f} (1/5/15 min) at start; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    directory = tempfile.mkdtemp(prefix="bench_async_save_", dir=a.dir)
    try:
        got = measure(a.num_layers, a.saves, directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    sync = statistics.median(got["sync"])
    stall = statistics.median(got["async"][1:] or got["async"])  # the first allocates buffers
    print("seconds per save   " + "  ".join(f"#{i + 1:<6}" for i in range(a.saves)) + "  median")
    for name in ("sync", "async", "background"):
        label = {"sync": "sync save (stall)", "async": "async stall",
                 "background": "async until durable"}[name]
        print(f"{label:<19}" + "  ".join(f"{t:7.3f}" for t in got[name])
              + f"  {statistics.median(got[name]):7.3f}")
    print(f"async stall (median of saves 2..{a.saves}: the first allocates the host buffers, "
          f"{got['async'][0]:.3f} s) / sync save (median) = {stall:.3f} / {sync:.3f} = "
          f"{stall / sync:.3f} (goal <= 0.10); load average at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
