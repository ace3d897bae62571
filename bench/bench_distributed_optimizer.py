"""Per-rank state bytes and step time at DP=2: plain AdamW vs --use-distributed-optimizer.

    python bench/bench_distributed_optimizer.py [--steps 4] [--warmup 2] [--dp 2]

The bench_parallel model (L=6, h=384, seq=256, vocab 50304, micro-batch 8, global batch 16,
dropout 0) trained through the real engine on DP gloo ranks, in fp32 and in bf16, without and
with the distributed optimizer (and with both overlaps). Bytes are measured from the tensors each
rank holds after the first steps (app.training.engines.base state_bytes): weights, gradients (the
full gradient buffer, which the distributed optimizer keeps as Megatron's does), optimizer
states (AdamW's moments, plus the fp32 main weights of a bf16 run). The goal is optimizer
bytes / DP; weights and gradients are not sharded (ZeRO-1).
"""
from __future__ import annotations

import argparse
import os
import sys

from bench_parallel import run

# this checkout's `app`, whether or not the project is pip-installed
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DISTRIBUTED = ["--use-distributed-optimizer"]
OVERLAP = DISTRIBUTED + ["--overlap-grad-reduce", "--overlap-param-gather"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--dp", type=int, default=2, help="data-parallel ranks")
    a = p.parse_args()
    rows = [("fp32 AdamW", []), ("fp32 distributed", DISTRIBUTED),
            ("fp32 distributed + overlaps", OVERLAP),
            ("bf16 AdamW", ["--bf16"]), ("bf16 distributed", ["--bf16"] + DISTRIBUTED)]
    print(f"DP={a.dp}, per rank (MiB)  {'params':>8}{'grads':>8}{'optimizer':>11}"
          f"{'optim vs plain':>16}{'ms/step':>9}{'step vs plain':>15}")
    plain = {}
    for name, extra in rows:
        r = run(a.dp, extra, a.steps, a.warmup, 1)
        b = r["state_bytes"]
        key = name.split()[0]
        plain.setdefault(key, (b["optimizer"], r["step_s"]))
        base_opt, base_step = plain[key]
        print(f"{name:<28}{b['params'] / 2**20:>8.1f}{b['grads'] / 2**20:>8.1f}"
              f"{b['optimizer'] / 2**20:>11.1f}{b['optimizer'] / base_opt:>15.3f}x"
              f"{r['step_s'] * 1e3:>9.0f}{r['step_s'] / base_step:>14.2f}x")
    print(f"goal: optimizer bytes x 1/{a.dp} = {1 / a.dp:.3f}x (fp32: AdamW's 8 bytes/param; "
          "bf16: 8 + 4 bytes/param of moments and fp32 main weights)")


if __name__ == "__main__":
    main()
