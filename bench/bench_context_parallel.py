"""Long context: activation memory and throughput per rank at C = 1 against C = 2 (p2p, a2a).

    python bench/bench_context_parallel.py [--layers 2 --hidden 128 --heads 4 --seq 4096
                                            --steps 3 --warmup 1]

Every setting trains the same model (fp32, dropout 0, vocabulary 1024 so the logits do not hide
the layers, micro-batch 1, AdamW) on the same synthetic tokens through the real engine and
Trainer.train_step: C = 1 on one rank, C = 2 on two gloo ranks with --cp-comm-type p2p (the
ring) and a2a (Ulysses). Each setting runs in its own spawn, so a rank's figures are its own
process's. C = 1 runs twice: with the default attention (SDPA, whose CPU flash kernel keeps no
s x s tensor) and with --attention-backend local (q k^T, softmax, @ v: the s x s scores and
probabilities kept for backward), for what materialising the scores costs. The ring keeps no
score block either (it recomputes them in backward, as flash attention does), so every C = 2 row
is compared with the default C = 1 row ("vs C=1"). Per
rank, three figures:

- saved activations: the most bytes of tensors autograd keeps for backward at any moment of
  one train step (bench_memory.SavedActivationMeter: saved_tensors_hooks, each storage counted
  once, parameters excluded), measured on a step of its own after the timed ones;
- peak RSS growth: the process's maximum resident set (getrusage ru_maxrss) after the timed
  steps minus the same before the first step, with glibc told to keep freed memory
  (common.keep_freed_memory), so it is what the steps' transient tensors, activations,
  gradients and optimizer states added; it includes allocator slack and gloo buffers;
- tokens/s: global-batch tokens over the median step time (the slowest rank's).

The C = 2 ranks each run one thread, as the C = 1 rank does: on a machine with two free cores
the tokens/s ratio is the speed-up, on a loaded one it is what the ring costs as well.
"""
from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from typing import Any, Dict, List

# this checkout's `app`, whether or not the project is pip-installed
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np
import torch

RAW_VOCAB = 1000


def measure(argv: List[str], steps: int, warmup: int) -> Dict[str, Any]:
    """On every rank: build the run, time `warmup + steps` train steps, then one metered step."""
    import torch.distributed as dist

    import arguments
    from bench_memory import SavedActivationMeter
    from common import keep_freed_memory
    from tests.harness.synthetic import build_synthetic_run

    keep_freed_memory()
    torch.set_num_threads(1)
    world = dist.get_world_size() if dist.is_initialized() else 1
    cfg = arguments.config_from_argv(argv, world, RAW_VOCAB)
    run = build_synthetic_run(cfg, cfg.training.global_batch_size * (warmup + steps + 1))
    model, trainer, iterator = run["model"], run["trainer"], run["iterator"]
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    times = []
    for _ in range(warmup + steps):
        start = time.perf_counter()
        trainer.train_step(iterator)
        times.append(time.perf_counter() - start)
    rss_growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_before
    meter = SavedActivationMeter(list(model.parameters()))
    with meter.hooks():
        trainer.train_step(iterator)
    step = float(np.median(times[warmup:]))
    return {"step_s": step, "saved_peak": meter.peak, "rss_growth": rss_growth,
            "tokens_per_s": cfg.training.global_batch_size * cfg.model.seq_length / step}


def run_setting(ranks: int, argv: List[str], steps: int, warmup: int) -> List[Dict[str, Any]]:
    """measure() on `ranks` fresh gloo processes; one result per rank."""
    from tests.harness.distributed import run_distributed
    return run_distributed(measure, ranks, argv, steps, warmup, timeout=1800)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    a = p.parse_args()
    model = ["--num-layers", str(a.layers), "--hidden-size", str(a.hidden),
             "--num-attention-heads", str(a.heads), "--seq-length", str(a.seq),
             "--max-position-embeddings", str(a.seq), "--micro-batch-size", "1",
             "--global-batch-size", "1", "--make-vocab-size-divisible-by", "512",
             "--hidden-dropout", "0", "--attention-dropout", "0", "--lr", "1e-4",
             "--lr-decay-style", "constant", "--train-iters", "1000",
             "--distributed-backend", "gloo"]
    cp2 = ["--context-parallel-size", "2"]
    settings = [("C=1", 1, []),  # name, ranks, flags
                ("C=1 local", 1, ["--attention-backend", "local"]),
                ("C=2 p2p", 2, cp2 + ["--cp-comm-type", "p2p"]),
                ("C=2 a2a", 2, cp2 + ["--cp-comm-type", "a2a"])]
    started, load_before = time.perf_counter(), os.getloadavg()
    results = {name: run_setting(ranks, model + flags, a.steps, a.warmup)
               for name, ranks, flags in settings}
    mib = 2.0 ** 20
    base = results["C=1"][0]
    load = os.getloadavg()
    print(f"context parallelism, per rank: L={a.layers} h={a.hidden} heads={a.heads} "
          f"s={a.seq} micro-batch 1, fp32, dropout 0, vocab 1024, 1 thread per rank; "
          f"median of {a.steps} steps after {a.warmup}; torch {torch.__version__}")
    print(f"{'setting':<10}{'rank':>5}{'saved act MiB':>15}{'vs C=1':>8}"
          f"{'RSS growth MiB':>16}{'vs C=1':>8}{'tokens/s':>10}{'vs C=1':>8}")
    for name, _, _ in settings:
        tokens = min(r["tokens_per_s"] for r in results[name])  # the slowest rank's pace
        for rank, r in enumerate(results[name]):
            print(f"{name:<10}{rank:>5}{r['saved_peak'] / mib:>15.1f}"
                  f"{r['saved_peak'] / base['saved_peak']:>8.2f}{r['rss_growth'] / mib:>16.1f}"
                  f"{r['rss_growth'] / base['rss_growth']:>8.2f}{tokens:>10.0f}"
                  f"{tokens / base['tokens_per_s']:>8.2f}")
    print(f"load average (1, 5, 15 min) at the start: {load_before[0]:.2f} {load_before[1]:.2f} "
          f"{load_before[2]:.2f}, at the end: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} "
          f"({os.cpu_count()} cores); total {time.perf_counter() - started:.0f} s")

if __name__ == "__main__":
    main()
