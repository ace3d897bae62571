"""Per-rank parameter, gradient and optimizer memory at ZeRO-1, 2 and 3 (DeepSpeed, DP 2),
measured from the tensors, beside --dry-run's estimate of the same run.

    python bench/bench_zero_memory.py [--layers 12 --hidden 768 --heads 12 --seq 128]

The default model is GPT-2 small's shape (12 layers, h 768, 12 heads, vocabulary 50304: 124M
parameters), fp32, AdamW, dropout 0, on 2 gloo ranks of this machine, one micro-batch of 1 x
seq tokens, two per rank per step (so ZeRO-1 holds whole gradients while it accumulates),
two steps; GPT-2 medium (--layers 24 --hidden 1024 --heads 16)
fits 24 GiB too but takes long on 2 shared cores. Rows: ds_configs/zero1.json, zero2.json,
zero3.json as shipped, zero3.json with stage3_max_reuse_distance and
stage3_prefetch_bucket_size 0 (each parameter released after its module), and
zero3_offload.json (parameters and optimizer on the host, DeepSpeedCPUAdam).

Measured (rank 0; rank 1 holds the same to a few KiB): `engine.state_bytes()` after the steps:
parameters (ZeRO-3: this rank's pieces plus what is gathered whole between iterations),
gradients (ZeRO-1/2: the peak of the iteration; ZeRO-3: the gradient pieces), optimizer states
(the fp32 master partition or pieces and AdamW's moments), and what ZeRO-3's offloads keep on
the host. At ZeRO-3 also "gathered": the most parameter bytes held whole at any moment that a
module's forward starts or the forward ends (forward pre-hooks on every module), during the
second step, the persistent parameters (counted with the parameters) aside. Estimated: app.training.planning.memory.estimate_memory (weights, gradients,
optimizer, gathered; its reduce buckets are listed apart and are not in the measured columns).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Any, Dict, List

# this checkout's `app`, whether or not the project is pip-installed
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RAW_VOCAB = 50257
MiB = 2 ** 20
ROWS = [("ZeRO-1", "zero1", {}), ("ZeRO-2", "zero2", {}), ("ZeRO-3", "zero3", {}),
        ("ZeRO-3 reuse 0", "zero3", {"stage3_max_reuse_distance": 0,
                                     "stage3_prefetch_bucket_size": 0}),
        ("ZeRO-3 offload", "zero3_offload", {})]


def model_argv(a: argparse.Namespace) -> List[str]:
    return ["--num-layers", str(a.layers), "--hidden-size", str(a.hidden),
            "--num-attention-heads", str(a.heads), "--seq-length", str(a.seq),
            "--max-position-embeddings", str(a.seq), "--make-vocab-size-divisible-by", "64",
            "--hidden-dropout", "0", "--attention-dropout", "0", "--micro-batch-size", "1",
            "--global-batch-size", "4", "--lr", "1e-4", "--lr-decay-style", "constant",
            "--distributed-backend", "gloo", "--train-iters", "100"]


class GatheredMeter:
    """The most bytes of whole (gathered) parameters, the persistent ones aside, seen at any
    module's forward start or at the end of the forward (forward hooks on every module)."""

    def __init__(self, model: Any) -> None:
        from app.training.engines.base import tensor_bytes
        self.params = [p for p in model.parameters() if not p.ds_persist]
        self.peak = 0
        self.size = lambda: sum(tensor_bytes(p.data) for p in self.params)  # noqa: E731
        for module in model.modules():
            module.register_forward_pre_hook(lambda *_: self.sample())
        model.register_forward_hook(lambda *_: self.sample())

    def sample(self) -> None:
        self.peak = max(self.peak, self.size())


def measure(argv: List[str], config: str, zero: Dict[str, Any], tmpdir: str) -> Dict[str, Any]:
    """On every rank: the run of `argv` with ds_configs/`config`.json (+ `zero`), two steps."""
    import torch
    import torch.distributed as dist

    import arguments
    from tests.harness.synthetic import build_synthetic_run
    from app.training.planning.memory import estimate_memory
    torch.set_num_threads(1)
    with open(os.path.join(ROOT, "ds_configs", f"{config}.json")) as f:
        ds = json.load(f)
    ds["zero_optimization"].update(zero)
    path = os.path.join(tmpdir, f"{config}_{len(zero)}.json")
    if dist.get_rank() == 0:
        with open(path, "w") as f:
            json.dump(ds, f)
    dist.barrier()
    cfg = arguments.config_from_argv(argv + ["--deepspeed", "--deepspeed_config", path],
                                     dist.get_world_size(), RAW_VOCAB)
    run = build_synthetic_run(cfg, 8)
    engine, trainer = run["engine"], run["trainer"]
    trainer.train_step(run["iterator"])
    meter = GatheredMeter(engine.ds.module) if engine.partitioned else None
    trainer.train_step(run["iterator"])
    est = estimate_memory(cfg, device_type="cpu")
    out = {"held": engine.state_bytes(), "gathered": meter.peak if meter else None,
           "estimate": {"params": est.weights, "grads": est.gradients,
                        "optimizer": est.optimizer, "buffers": est.buffers,
                        "gathered": est.gathered},
           "num_params": cfg.model.parameters_per_rank()}
    from app.mpu import random as mpu_random
    mpu_random.set_checkpoint_implementation(None)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--rows", nargs="*", default=[r[0] for r in ROWS],
                   help="which rows to run (names as printed)")
    a = p.parse_args()
    from tests.harness.distributed import run_distributed
    argv = model_argv(a)
    print(f"DP=2, fp32, AdamW; L={a.layers} h={a.hidden} heads={a.heads} seq={a.seq}; rank 0, "
          "MiB, measured / estimated")
    print(f"{'config':<16}{'params':>16}{'grads':>16}{'optimizer':>16}{'on host':>10}"
          f"{'gathered':>16}{'buckets (est)':>15}{'B/param':>9}")
    with tempfile.TemporaryDirectory() as tmpdir:
        for name, config, zero in ROWS:
            if name not in a.rows:
                continue
            r = run_distributed(measure, 2, argv, config, zero, tmpdir, timeout=7200)[0]
            held, est, n = r["held"], r["estimate"], r["num_params"]
            pair = lambda k: f"{held[k] / MiB:.0f} / {est[k] / MiB:.0f}"  # noqa: E731
            gathered = ("-" if r["gathered"] is None else
                        f"{r['gathered'] / MiB:.0f} / {est['gathered'] / MiB:.0f}")
            per = (held["params"] + held["grads"] + held["optimizer"]) / n
            print(f"{name:<16}{pair('params'):>16}{pair('grads'):>16}{pair('optimizer'):>16}"
                  f"{held.get('host', 0) / MiB:>10.0f}{gathered:>16}"
                  f"{est['buffers'] / MiB:>15.0f}{per:>9.2f}", flush=True)
    print("ZeRO paper, fp32 Adam per parameter: ZeRO-1 4 + 4 + 12/N_d, ZeRO-2 4 + (4 + 12)/N_d, "
          "ZeRO-3 (4 + 4 + 12)/N_d, with N_d = 2: 14, 12, 10 bytes (at ZeRO-3 plus the "
          "persistent parameters and what is gathered)")


if __name__ == "__main__":
    main()
