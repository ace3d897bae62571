"""Pipeline bubble: measured idle time per stage, 1F1B vs interleaved 1F1B, same PP and M.

    python bench/bench_pipeline.py [--pp 2] [--micro-batches 4] [--hidden 512] [--seq 256]

One spawn of PP gloo ranks (one thread each) builds three runs of the same model (L=8, heads=8,
h and seq from the flags, vocab 512 so that the head does not unbalance the last stage,
micro-batch 4, fp32, dropout 0) through app.training.run: plain 1F1B, and interleaved with V=2 and V=4 model
chunks per stage (--num-layers-per-virtual-pipeline-stage = L / PP / V, where it divides). The
runs take turns, one iteration each, so machine noise hits them alike. Each iteration runs the real schedule with the engine's backward; the time a
stage spends in its own work (drawing the micro-batch, forward, backward) is measured around
those calls, and

    bubble fraction of a stage = (schedule wall time - its work time) / schedule wall time

is the share of the iteration the stage waited for (or exchanged with) its neighbours. The
model of a perfectly balanced pipeline says (PP - 1) / (V x M + PP - 1). The ratio
interleaved / 1F1B of the mean measured fraction is the figure to read; on a machine with fewer
cores than ranks the stages also wait for a core, which shows up as idle time too.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any, Dict, List

# this checkout's `app`, whether or not the project is pip-installed
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

NUM_LAYERS = 8
MODEL = ["--num-layers", str(NUM_LAYERS), "--num-attention-heads", "8",
         "--make-vocab-size-divisible-by", "64", "--hidden-dropout", "0",
         "--attention-dropout", "0", "--micro-batch-size", "4", "--lr", "1e-4",
         "--lr-decay-style", "constant", "--distributed-backend", "gloo", "--train-iters", "1000"]
RAW_VOCAB = 512  # a small head, so the stages are balanced and idle time is the bubble


class _Clock:
    """Adds up the seconds spent inside wrapped calls."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        return timed


def _iteration(run: Dict[str, Any]) -> Dict[str, float]:
    """One training iteration through the schedule; (wall, work) seconds of the schedule."""
    from app.pipeline import get_forward_backward_func
    from app.training.loss import masked_mean_loss
    cfg, ps, engine, trainer = run["cfg"], run["ps"], run["engine"], run["trainer"]
    model, clock = engine.module, _Clock()

    def forward_step(batch):
        return model(batch["tokens"], batch["position_ids"], batch["attention_mask"],
                     labels=batch["labels"]), batch["loss_mask"]

    engine.train()
    engine.zero_grad()
    schedule = get_forward_backward_func(ps)
    start = time.perf_counter()
    schedule(forward_step_func=clock.wrap(forward_step),
             batch_func=clock.wrap(lambda: trainer.batches.next(run["iterator"])), model=model,
             num_microbatches=trainer.num_micro, loss_func=masked_mean_loss,
             backward_func=clock.wrap(engine.backward),
             output_backward_func=clock.wrap(engine.backward_output), parallel_state=ps,
             tensor_shape=(cfg.training.micro_batch_size, cfg.model.seq_length,
                           cfg.model.hidden_size))
    wall = time.perf_counter() - start
    engine.step()
    return {"wall": wall, "work": clock.seconds}


def _shape(hidden: int, seq: int) -> List[str]:
    return ["--hidden-size", str(hidden), "--seq-length", str(seq),
            "--max-position-embeddings", str(seq)]


def measure(configs: Dict[str, List[str]], steps: int, warmup: int) -> Dict[str, Any]:
    """On every rank: build every config's run, then let them take turns for the iterations."""
    import torch
    import torch.distributed as dist

    import arguments
    from tests.harness.synthetic import build_synthetic_run

    torch.set_num_threads(1)
    runs = {}
    for name, argv in configs.items():
        cfg = arguments.config_from_argv(MODEL + argv, dist.get_world_size(), RAW_VOCAB)
        runs[name] = build_synthetic_run(cfg, cfg.training.global_batch_size * (steps + warmup))
    samples: Dict[str, List[Dict[str, float]]] = {name: [] for name in configs}
    for step in range(warmup + steps):
        for name, run in runs.items():
            dist.barrier()
            result = _iteration(run)
            if step >= warmup:
                samples[name].append(result)
    out = {}
    for name, rows in samples.items():
        wall = statistics.median(r["wall"] for r in rows)
        bubble = statistics.median((r["wall"] - r["work"]) / r["wall"] for r in rows)
        out[name] = {"wall": wall, "bubble": bubble,
                     "chunks": runs[name]["cfg"].virtual_pipeline_model_parallel_size}
    return {"stage": runs[next(iter(runs))]["ps"].pipeline_model_parallel_rank, "results": out}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pp", type=int, default=2, help="pipeline stages (= ranks)")
    p.add_argument("--micro-batches", type=int, default=4, help="M, a multiple of --pp")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    a = p.parse_args()
    from tests.harness.distributed import run_distributed
    from common import format_table

    per_stage = NUM_LAYERS // a.pp
    shared = _shape(a.hidden, a.seq) + ["--pipeline-model-parallel-size", str(a.pp),
              "--global-batch-size", str(4 * a.micro_batches)]
    configs = {"1F1B": shared}
    for chunks in (2, 4):
        if per_stage % chunks == 0:
            configs[f"interleaved V={chunks}"] = shared + [
                "--num-layers-per-virtual-pipeline-stage", str(per_stage // chunks)]
    results = run_distributed(measure, a.pp, configs, a.steps, a.warmup, timeout=3600)
    results.sort(key=lambda r: r["stage"])
    base = {r["stage"]: r["results"]["1F1B"]["bubble"] for r in results}
    rows = []
    for name in configs:
        first = results[0]["results"][name]
        model = (a.pp - 1) / (first["chunks"] * a.micro_batches + a.pp - 1)
        fractions = [r["results"][name]["bubble"] for r in results]
        ratio = statistics.fmean(fractions) / statistics.fmean(base.values())
        rows.append([name, f"{first['wall'] * 1e3:.0f}",
                     " / ".join(f"{f:.3f}" for f in fractions),
                     f"{statistics.fmean(fractions):.3f}", f"{model:.3f}", f"{ratio:.2f}"])
    print(f"PP={a.pp}, M={a.micro_batches} micro-batches of 4 x {a.seq} tokens, L={NUM_LAYERS}, "
          f"h={a.hidden}; median of {a.steps} iterations after {a.warmup}")
    print(format_table(["schedule", "ms/iter (stage 0)", "bubble per stage", "mean",
                        "model (PP-1)/(VM+PP-1)", "vs 1F1B"], rows))


if __name__ == "__main__":
    main()
