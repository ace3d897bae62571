"""Native fp32 / bf16 / fp16 and DeepSpeed bf16 (fp16 on a GPU) side by side, one process.

    python bench/bench_precision.py                      # CPU: the quickstart-size model
    python bench/bench_precision.py --preset gpt2-124m   # GPT-2 124M shape (meant for a GPU)

Every row trains the same model on the same synthetic tokens through the real engine and
Trainer.train_step and reports tokens/s (median step), MFU against the peak of that row's dtype
(app.training.telemetry.flops: the datasheet on GPUs, the cached measured matmul peak on CPUs), the
ratio to native fp32, and the per-rank state bytes per parameter (weights + gradients +
optimizer states, fp32 main weights counted as optimizer state) beside the mixed-precision
model: fp32 4 + 4 + 8 = 16; mixed 2 + 4 (fp32 gradients) + 4 (main weights) + 8 (Adam) = 18.
On a CPU, fp16 matmuls are emulated and slow: that row shows correctness, not speed.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any, Dict, List

import torch

# this checkout's `app`, whether or not the project is pip-installed
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import arguments
from app.training.telemetry.flops import model_flops_per_token, peak_flops
from app.utils.dtypes import torch_dtype
from tests.harness.synthetic import build_synthetic_run
from common import format_table, keep_freed_memory

ROOT_JSON = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                         "ds_configs", "zero1.json")
PRESETS = {
    "small": ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4",
              "--seq-length", "256", "--micro-batch-size", "4", "--global-batch-size", "8"],
    "gpt2-124m": ["--num-layers", "12", "--hidden-size", "768", "--num-attention-heads", "12",
                  "--seq-length", "1024", "--micro-batch-size", "8", "--global-batch-size", "8"],
}
RAW_VOCAB = {"small": 8192, "gpt2-124m": 50257}


def rows(cuda: bool, ds_json: str) -> List[tuple]:
    ds = ["--deepspeed", "--deepspeed_config", ds_json]
    # fp16 starts at a loss scale that fits the few steps timed here: from Megatron's 2^32 the
    # first steps overflow and are skipped, which would time (and size) no optimizer step
    fp16 = ["--fp16", "--initial-loss-scale", "4096"]
    out = [("native fp32", []), ("native bf16", ["--bf16"]), ("native fp16", fp16)]
    out.append(("DeepSpeed bf16 (ZeRO-1)", ["--bf16", *ds]))
    if cuda:
        out.append(("DeepSpeed fp16 (ZeRO-1)", [*fp16, *ds]))
    return out


def measure(argv: List[str], raw_vocab: int, steps: int, warmup: int,
            device: torch.device) -> Dict[str, Any]:
    cfg = arguments.config_from_argv(argv, 1, raw_vocab)
    run = build_synthetic_run(cfg, cfg.training.global_batch_size * (steps + warmup), device)
    times, skipped = [], 0
    for i in range(warmup + steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = run["trainer"].train_step(run["iterator"])
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        if i >= warmup and out.skipped:
            skipped += 1
    step = statistics.median(times[warmup:])
    tokens = cfg.training.global_batch_size * cfg.model.seq_length / step
    peak, _ = peak_flops(device, torch_dtype(cfg.model.params_dtype))
    n = sum(p.numel() for p in run["model"].parameters())
    b = run["engine"].state_bytes()
    return {"tokens_per_s": tokens, "mfu": tokens * model_flops_per_token(cfg.model) / peak,
            "bytes_per_param": (b["params"] + b["grads"] + b["optimizer"]) / n,
            "split": (b["params"] / n, b["grads"] / n, b["optimizer"] / n),
            "loss": out.loss, "skipped": skipped}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="small")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--deepspeed-config", default=ROOT_JSON)
    a = p.parse_args()
    keep_freed_memory()
    torch.set_num_threads(a.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    base = PRESETS[a.preset] + ["--train-iters", "1000", "--lr", "1e-4", "--hidden-dropout", "0",
                                "--attention-dropout", "0", "--lr-decay-style", "constant",
                                "--num-workers", "0"]
    results = []
    for name, extra in rows(device.type == "cuda", a.deepspeed_config):
        r = measure(base + extra, RAW_VOCAB[a.preset], a.steps, a.warmup, device)
        results.append((name, r))
        print(f"{name}: {r['tokens_per_s']:.0f} tokens/s", flush=True)
    fp32 = results[0][1]["tokens_per_s"]
    table = [[name, f"{r['tokens_per_s']:.0f}",
              f"{100 * r['mfu']:.1f}%" + (" (over the peak: that peak is wrong)" if r["mfu"] > 1 else ""),
              f"{r['tokens_per_s'] / fp32:.2f}x", f"{r['bytes_per_param']:.1f}",
              "{:.0f} + {:.0f} + {:.0f}".format(*r["split"]), str(r["skipped"])]
             for name, r in results]
    print(f"\n{a.preset} on {device.type} ({a.threads} threads), {a.steps} timed steps after "
          f"{a.warmup} warm-up; MFU against each dtype's own peak")
    print(format_table(["run", "tokens/s", "MFU", "vs native fp32", "bytes/param",
                        "weights + grads + optimizer", "skipped steps"], table))
    by_name = dict(results)
    native, ds = by_name["native bf16"], by_name["DeepSpeed bf16 (ZeRO-1)"]
    print(f"native bf16 / DeepSpeed bf16 tokens/s: {native['tokens_per_s'] / ds['tokens_per_s']:.2f}; "
          f"bf16 / fp32 (native): {native['tokens_per_s'] / fp32:.2f}")


if __name__ == "__main__":
    main()
