"""Checkpoint save and load time per rank: --ckpt-format torch (Megatron's legacy files) against
torch_dist (each rank writes its own shards), on two ranks at DP2 and at TP2.

    python bench/bench_torch_dist.py [--num-layers 6] [--repeats 3] [--dir /tmp]

A GPT-2 small-width model (hidden 768, 12 heads, vocab 50304, 1024 positions, fp32 AdamW,
`--num-layers` layers) is built on two gloo ranks by the real engine, trained one step (AdamW's
moments exist), then saved and loaded `--repeats` times in each format through
engine.save_checkpoint / engine.load_checkpoint, the calls training makes. Per rank it reports:
the whole save (the call returns on every rank together, after the commit), the rank's own
write step (its files written, fsynced and checksummed) with the bytes it wrote, and the whole
load. The legacy format writes one file per model-parallel rank, so at DP2 data-parallel rank 0
writes everything while rank 1 waits; torch_dist spreads the replicas over the ranks. Medians
of the repeats; the machine's load is printed, since other work on it moves every number.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Dict, List

import torch

sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

RAW_VOCAB = 50257
LAYOUTS = {"DP2": [], "TP2": ["--tensor-model-parallel-size", "2"]}
FORMATS = ("torch", "torch_dist")


def model_argv(layers: int) -> List[str]:
    return ["--num-layers", str(layers), "--hidden-size", "768", "--num-attention-heads", "12",
            "--seq-length", "128", "--max-position-embeddings", "1024",
            "--make-vocab-size-divisible-by", "128", "--hidden-dropout", "0",
            "--attention-dropout", "0", "--micro-batch-size", "1", "--global-batch-size", "2",
            "--lr", "1e-4", "--lr-decay-style", "constant", "--distributed-backend", "gloo",
            "--train-iters", "1000"]


def _timed_writes(record: Dict[str, float]) -> None:
    """Time this rank's write step of either format (and count its bytes) by wrapping the one
    function each format writes its files with."""
    from app.checkpoint.legacy import per_rank as megatron
    from app.checkpoint.torch_dist import dcp_files

    legacy, sharded = megatron.write_checked_file, dcp_files.write_rank_files

    def legacy_write(path, write, *args, **kwargs):
        start = time.perf_counter()
        legacy(path, write, *args, **kwargs)
        record["write"] += time.perf_counter() - start
        record["bytes"] += os.path.getsize(path)

    def sharded_write(directory, rank, entries, *args, **kwargs):
        start = time.perf_counter()
        result = sharded(directory, rank, entries, *args, **kwargs)
        record["write"] += time.perf_counter() - start
        record["bytes"] += sum(os.path.getsize(os.path.join(directory, n)) for n in result.digests)
        return result

    megatron.write_checked_file, dcp_files.write_rank_files = legacy_write, sharded_write


def _rank_main(layers: int, repeats: int, directory: str, layout: List[str]) -> Dict[str, Dict]:
    """Every measurement of this rank: {format: {"save": [...], "write": [...], "bytes": n,
    "load": [...]}}."""
    import arguments
    from tests.harness.synthetic import build_synthetic_run
    import torch.distributed as dist

    record = {"write": 0.0, "bytes": 0}
    _timed_writes(record)
    out: Dict[str, Dict] = {}
    client = {"iteration": 1, "consumed_train_samples": 2, "consumed_valid_samples": 0}
    for fmt in FORMATS:
        cfg = arguments.config_from_argv(model_argv(layers) + layout + ["--ckpt-format", fmt],
                                         2, RAW_VOCAB)
        run = build_synthetic_run(cfg, 4)
        run["trainer"].train_step(run["iterator"])
        engine, times = run["engine"], {"save": [], "write": [], "load": [], "bytes": 0}
        for i in range(repeats):
            save_dir = os.path.join(directory, f"{fmt}_{i}")
            record.update(write=0.0, bytes=0)
            dist.barrier()
            start = time.perf_counter()
            engine.save_checkpoint(save_dir, 1, client)
            times["save"].append(time.perf_counter() - start)
            times["write"].append(record["write"])
            times["bytes"] = record["bytes"]
            dist.barrier()
            start = time.perf_counter()
            engine.load_checkpoint(save_dir)
            times["load"].append(time.perf_counter() - start)
            dist.barrier()
            if dist.get_rank() == 0:
                shutil.rmtree(save_dir, ignore_errors=True)
        out[fmt] = times
    return out


def main() -> None:
    from tests.harness.distributed import run_distributed

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-layers", type=int, default=6)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=tempfile.gettempdir(), help="where the checkpoints go")
    a = p.parse_args()
    load = os.getloadavg()
    print(f"machine: {os.cpu_count()} CPUs, load average {load[0]:.2f} {load[1]:.2f} "
          f"{load[2]:.2f} (1/5/15 min) at start; torch {torch.__version__}; "
          f"{a.num_layers} layers, hidden 768, fp32 AdamW, 2 ranks, {a.repeats} repeats")
    print(f"{'layout':6} {'format':10} {'rank':4} {'save s':>7} {'write s':>8} {'MiB':>7} "
          f"{'load s':>7}")
    for name, flags in LAYOUTS.items():
        directory = tempfile.mkdtemp(prefix="bench_torch_dist_", dir=a.dir)
        try:
            results = run_distributed(_rank_main, 2, a.num_layers, a.repeats, directory, flags,
                                      timeout=3600)
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        for fmt in FORMATS:
            for rank, per_rank in enumerate(results):
                t = per_rank[fmt]
                print(f"{name:6} {fmt:10} {rank:4} {statistics.median(t['save']):7.2f} "
                      f"{statistics.median(t['write']):8.2f} {t['bytes'] / 2**20:7.0f} "
                      f"{statistics.median(t['load']):7.2f}")


if __name__ == "__main__":
    main()
