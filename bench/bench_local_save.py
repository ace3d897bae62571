"""Training time lost per local checkpoint (--non-persistent-ckpt-type local) against a persistent
save (--save, synchronous and --async-save), GPT-2 small shape, one rank.

    python bench/bench_local_save.py [--saves 5] [--num-layers 12] [--dir /tmp]

The model and state of bench/bench_async_save.py (124M parameters, fp32, AdamW after one
step, built through the real engine), saved `--saves` times each way, with one training step
before each round so the state changes in place:

- persistent, synchronous: engine.save_checkpoint (the whole save blocks training);
- persistent, --async-save: engine.save_checkpoint(asynchronous=True), the host copy blocks;
- local: LocalCheckpoints.save_checkpoint (app.training.checkpointing.local), the call
  the loop makes every --non-persistent-save-interval: the state dict and its host copy block,
  the serialization, the files, their checksums and the commit run in the background.

The stall is what the call blocks the training thread; "until durable" is until the background
save is committed. The first asynchronous and local saves allocate their host buffers, so the
ratios use saves 2..N.

With `--replication-layers L` (0: skipped) a second measurement runs two gloo ranks (DP 2) of an
L-layer model: the local save's stall without and with --replication (J 1, K 2: each rank's
background writer serializes its state and exchanges it with the other), rank 0's figures.
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
from bench_async_save import RAW_VOCAB, model_argv  # noqa: E402  (bench/ is this folder)

MODES = ("persistent sync", "persistent async", "local")


def measure(layers: int, saves: int, directory: str) -> Dict[str, List[float]]:
    """{mode: stalls} and {mode + " durable": seconds until committed}, plus "step"."""
    import arguments
    from app.config.checkpoint import CheckpointConfig
    from app.training.checkpointing.local import LocalCheckpoints
    from tests.harness.synthetic import build_synthetic_run

    cfg = arguments.config_from_argv(model_argv(layers), 1, RAW_VOCAB)
    run = build_synthetic_run(cfg, saves + 2)
    engine = run["engine"]
    run["trainer"].train_step(run["iterator"])  # AdamW's moments exist from here on
    local_dir = os.path.join(directory, "local")
    local = LocalCheckpoints(CheckpointConfig(non_persistent_ckpt_type="local",
                                              non_persistent_local_ckpt_dir=local_dir),
                             engine, 0, 1, torch.device("cpu"))
    savers = {"persistent sync": (engine, os.path.join(directory, "sync"), False),
              "persistent async": (engine, os.path.join(directory, "async"), True),
              "local": (local, local.folder, True)}
    out: Dict[str, List[float]] = {k: [] for k in (*MODES, "persistent async durable",
                                                   "local durable", "step")}
    for i in range(saves):
        start = time.perf_counter()
        run["trainer"].train_step(run["iterator"])
        out["step"].append(time.perf_counter() - start)
        client = {"iteration": i + 1, "consumed_train_samples": i + 1,
                  "consumed_valid_samples": 0}
        for mode in MODES:
            saver, save_dir, background = savers[mode]
            start = time.perf_counter()
            saver.save_checkpoint(save_dir, i + 1, client, asynchronous=background)
            out[mode].append(time.perf_counter() - start)
            if background:
                while saver.finish_save(blocking=False) is None:  # the loop's check
                    time.sleep(0.01)
                out[f"{mode} durable"].append(time.perf_counter() - start)
    return out


def measure_replication(argv: List[str], saves: int, directory: str) -> Dict[str, List[float]]:
    """One rank of the two-rank measurement: {"local": stalls, "local + replica": stalls}."""
    import arguments
    import torch.distributed as dist

    from app.config.checkpoint import CheckpointConfig
    from app.training.checkpointing.local import LocalCheckpoints
    from tests.harness.synthetic import build_synthetic_run

    cfg = arguments.config_from_argv(argv, 2, RAW_VOCAB)
    run = build_synthetic_run(cfg, 2 * (saves + 2))
    engine, rank = run["engine"], dist.get_rank()
    run["trainer"].train_step(run["iterator"])
    savers = {name: LocalCheckpoints(CheckpointConfig(
        non_persistent_ckpt_type="local", replication=replicas,
        replication_jump=1 if replicas else None,
        non_persistent_local_ckpt_dir=os.path.join(directory, name.replace(" ", "_"))),
        engine, rank, 2, torch.device("cpu"))
        for name, replicas in (("local", False), ("local + replica", True))}
    out: Dict[str, List[float]] = {name: [] for name in savers}
    for i in range(saves):
        run["trainer"].train_step(run["iterator"])
        for name, saver in savers.items():
            dist.barrier()
            start = time.perf_counter()
            saver.save_checkpoint(saver.folder, i + 1, {"iteration": i + 1},
                                  asynchronous=True)
            out[name].append(time.perf_counter() - start)
            saver.finish_save(blocking=True)
    return out


def report_replication(layers: int, saves: int, directory: str) -> None:
    """Run `measure_replication` on two gloo ranks and print rank 0's stalls and the ratio."""
    from tests.harness.distributed import run_distributed
    argv = model_argv(layers)
    argv[argv.index("--global-batch-size") + 1] = "2"
    got = run_distributed(measure_replication, 2, argv, saves, directory, timeout=3600)[0]
    print(f"two ranks (DP 2), {layers} layers: local save stall, seconds")
    for name, values in got.items():
        print(f"{name:<26}" + "  ".join(f"{t:7.3f}" for t in values)
              + f"  {statistics.median(values):7.3f}")
    plain, replicated = (statistics.median(got[n][1:] or got[n]) for n in got)
    print(f"with --replication the stall is {replicated:.3f} s = {replicated / plain:.2f} x the "
          f"local save's without ({plain:.3f} s; medians of saves 2..{saves})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--saves", type=int, default=5)
    p.add_argument("--num-layers", type=int, default=12)
    p.add_argument("--dir", default=tempfile.gettempdir(), help="where the checkpoints go")
    p.add_argument("--replication-layers", type=int, default=2,
                   help="layers of the two-rank --replication measurement (0: skip it)")
    a = p.parse_args()
    load = os.getloadavg()
    print(f"machine: {os.cpu_count()} CPUs, load average {load[0]:.2f} {load[1]:.2f} "
          f"{load[2]:.2f} (1/5/15 min) at start; torch {torch.__version__}")
    directory = tempfile.mkdtemp(prefix="bench_local_save_", dir=a.dir)
    try:
        got = measure(a.num_layers, a.saves, directory)
        if a.replication_layers:
            report_replication(a.replication_layers, a.saves, directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    print("seconds per save          " + "  ".join(f"#{i + 1:<6}" for i in range(a.saves))
          + "  median")
    for name, values in got.items():
        print(f"{name:<26}" + "  ".join(f"{t:7.3f}" for t in values)
              + f"  {statistics.median(values):7.3f}")
    later = {m: statistics.median(got[m][1:] or got[m]) for m in MODES}  # #1 allocates buffers
    step = statistics.median(got["step"])
    print(f"local stall (median of saves 2..{a.saves}) {later['local']:.3f} s = "
          f"{later['local'] / later['persistent sync']:.3f} x a synchronous persistent save "
          f"({later['persistent sync']:.3f} s), {later['local'] / later['persistent async']:.2f}"
          f" x an --async-save stall ({later['persistent async']:.3f} s), "
          f"{later['local'] / step:.2f} x a training step ({step:.3f} s); load average at end "
          f"{os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
