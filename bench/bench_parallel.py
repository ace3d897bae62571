"""Throughput of the bench config across parallel layouts and ZeRO stages, side by side.

    python bench/bench_parallel.py --suite layouts   # one process vs DP=2, TP=2, PP=2 (native)
    python bench/bench_parallel.py --suite zero      # DP=2: native DDP, ZeRO-1, ZeRO-2 (DeepSpeed)

Every configuration trains the same model (L=6, h=384, heads=6, seq=256, vocab 50304, fp32,
dropout 0, AdamW) on the same global batch (16 sequences = 2 micro-batches of 8 per
data-parallel replica... or per rank) through the real engine and Trainer.train_step, on
synthetic tokens. On a 2-core machine the ranks share the cores, so read the ratios (what the
communication and the bookkeeping cost), not a speed-up. The zero suite also prints each
rank's parameter / gradient / optimizer-state bytes, measured from the tensors, beside the
ZeRO paper's model.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Dict, List

# this checkout's `app`, whether or not the project is pip-installed
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import numpy as np
import torch

RAW_VOCAB = 50257
MODEL = ["--num-layers", "6", "--hidden-size", "384", "--num-attention-heads", "6",
         "--seq-length", "256", "--max-position-embeddings", "256",
         "--make-vocab-size-divisible-by", "64", "--hidden-dropout", "0", "--attention-dropout", "0",
         "--micro-batch-size", "8", "--global-batch-size", "16", "--lr", "1e-4",
         "--lr-decay-style", "constant", "--distributed-backend", "gloo", "--train-iters", "1000"]


def measure(argv: List[str], steps: int, warmup: int, threads: int) -> Dict[str, Any]:
    """On every rank: build the run from `argv`, time `steps` train steps after `warmup`."""
    import torch.distributed as dist

    import arguments
    from tests.harness.synthetic import build_synthetic_run
    from app.training.telemetry.flops import cached_cpu_peak, model_flops_per_token
    from app.utils.dtypes import torch_dtype
    from common import keep_freed_memory

    keep_freed_memory()
    torch.set_num_threads(threads)
    global_batch = int(argv[argv.index("--global-batch-size") + 1])
    world = dist.get_world_size() if dist.is_initialized() else 1
    cfg = arguments.config_from_argv(argv, world, RAW_VOCAB)
    run_ = build_synthetic_run(cfg, global_batch * (steps + warmup))
    cfg, ps, model, engine = run_["cfg"], run_["ps"], run_["model"], run_["engine"]
    trainer, iterator, t = run_["trainer"], run_["iterator"], run_["cfg"].training
    times = []
    for _ in range(warmup + steps):
        start = time.perf_counter()
        trainer.train_step(iterator)
        times.append(time.perf_counter() - start)
    step = float(np.median(times[warmup:]))
    tokens_per_s = t.global_batch_size * cfg.model.seq_length / step
    peak, _ = cached_cpu_peak(torch_dtype(cfg.model.params_dtype), threads)
    mfu = tokens_per_s * model_flops_per_token(cfg.model) / ps.world_size / peak
    return {"rank": ps.rank, "step_s": step, "padded_vocab": cfg.model.padded_vocab_size,
            "tokens_per_s": tokens_per_s, "mfu": mfu,
            "state_bytes": engine.state_bytes(),
            "num_params": sum(p.numel() for p in model.parameters())}


def run(ranks: int, extra: List[str], steps: int, warmup: int, threads: int) -> Dict[str, Any]:
    argv = MODEL + extra
    if ranks == 1:
        return measure(argv, steps, warmup, threads)
    from tests.harness.distributed import run_distributed
    results = run_distributed(measure, ranks, argv, steps, warmup, threads, timeout=3600)
    slowest = max(results, key=lambda r: r["step_s"])
    return {**slowest, "per_rank": results}


def suite_layouts(steps: int, warmup: int) -> None:
    rows = [("1 process, 1 thread", 1, [], 1), ("1 process, 2 threads", 1, [], 2),
            ("DP=2 (2 ranks x 1 thread)", 2, [], 1),
            ("TP=2", 2, ["--tensor-model-parallel-size", "2"], 1),
            ("PP=2", 2, ["--pipeline-model-parallel-size", "2"], 1)]
    base = None
    print(f"{'layout':<28}{'ms/step':>10}{'tokens/s':>10}{'MFU':>8}{'vs 1 proc x 2 threads':>24}")
    results = []
    for name, ranks, extra, threads in rows:
        r = run(ranks, extra, steps, warmup, threads)
        results.append((name, r))
        if threads == 2:
            base = r["tokens_per_s"]
    for name, r in results:
        print(f"{name:<28}{r['step_s'] * 1e3:>10.0f}{r['tokens_per_s']:>10.0f}"
              f"{100 * r['mfu']:>7.1f}%{r['tokens_per_s'] / base:>23.2f}x")


def suite_zero(steps: int, warmup: int) -> None:
    ds = lambda name: ["--deepspeed", "--deepspeed_config",  # noqa: E731
                       os.path.join(ROOT, "ds_configs", f"{name}.json")]
    rows = [("native DDP", []), ("ZeRO-1", ds("zero1")), ("ZeRO-2", ds("zero2")),
            ("ZeRO-2 bf16", ds("zero2") + ["--bf16"])]
    print(f"{'DP=2':<12}{'tokens/s':>10}{'MFU':>7}{'params MiB':>12}{'grads MiB':>11}"
          f"{'optim MiB':>11}{'bytes/param (p+g+o)':>22}")
    base = None
    for name, extra in rows:
        r = run(2, extra, steps, warmup, 1)
        b, n = r["state_bytes"], r["num_params"]
        base = base or r["tokens_per_s"]
        per = (b["params"] + b["grads"] + b["optimizer"]) / n
        print(f"{name:<12}{r['tokens_per_s']:>10.0f}{100 * r['mfu']:>6.1f}%{b['params'] / 2**20:>12.1f}"
              f"{b['grads'] / 2**20:>11.1f}{b['optimizer'] / 2**20:>11.1f}{per:>22.2f}"
              f"   ({r['tokens_per_s'] / base:.2f}x native)")
    dp = 2
    print(f"model, fp32 Adam (peak gradients): DDP 4+4+8 = 16; ZeRO-1 4+4+12/{dp} = "
          f"{8 + 12 / dp:.0f}; ZeRO-2 4+4/{dp}+12/{dp} = {4 + 16 / dp:.0f} bytes/param "
          "(ZeRO's fp32 master copy counts as optimizer state; ZeRO-1 holds full gradients only "
          "while accumulating several micro-batches, and this config has one per step)")
    print(f"ZeRO paper, mixed-precision Adam: stage 1 2+2+12/{dp} = {4 + 12 / dp:.0f}, stage 2 "
          f"2+(2+12)/{dp} = {2 + 14 / dp:.0f} bytes/param (the bf16 row)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--suite", choices=["layouts", "zero", "all"], default="all")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    a = p.parse_args()
    if a.suite in ("layouts", "all"):
        suite_layouts(a.steps, a.warmup)
    if a.suite in ("zero", "all"):
        suite_zero(a.steps, a.warmup)


if __name__ == "__main__":
    main()
