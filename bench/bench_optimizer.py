#!/usr/bin/env python
"""AdamW against Muon on the standard-library corpus: tokens to reach AdamW's best validation loss.

    python bench/bench_optimizer.py [--iters 80] [--adam-lrs 1e-3 2e-3 4e-3 8e-3] \\
        [--muon-lrs 2e-3 4e-3 8e-3] [--work-dir ~/.cache/app_bench/optimizer] \\
        [--output bench_optimizer.jsonl] [--plot docs/optimizer_muon.png]

The quickstart-size GPT-2 (4 layers, hidden 256, 4 heads, sequence 256, vocabulary 8192,
dropout 0, fp32; global batch 32 = 8192 tokens per step, so that Newton-Schulz, a per-step
cost, weighs as it would at a realistic batch) trains through `pretrain_gpt2.py` (one
subprocess per run, 2 threads) on the stdlib corpus (built, tokenised and preprocessed once
into --work-dir), for each optimizer and
each learning rate of its sweep: the same tokens in the same order (same seed), the same cosine
schedule (warmup 10 %, down to lr / 10), validation every --eval-interval iterations. Muon is
Megatron's (`--optimizer muon`, spectral scale, quintic coefficients, AdamW for the embeddings,
biases and LayerNorms) with Newton-Schulz in fp32 (`--muon-fp32-matmul-prec high`: on this
CPU bf16 matmuls are slower than fp32 ones).

Target: AdamW's best final validation loss over its sweep. For every run: its final validation
loss, the tokens it needs to reach the target (linear interpolation between evaluations; None
if it never does), and its wall time per step (median of the logged intervals, evaluation
excluded, the first interval left out as warm-up). The runs follow one another, so on a shared
machine their step times also measure the load of the moment; the step-time ratio is therefore
measured apart, in this process: the two optimizers' runs (synthetic tokens, same shapes) take
steps alternately, AdamW, Muon, AdamW, ..., and the fastest step of each is compared (other
jobs only ever add time; the medians are printed too). Printed: each
optimizer's best run, the token ratio Muon / AdamW (goal <= 0.75) and the step-time ratio
(goal <= 1.10), with the machine's load average before and after.

Output: each run's --metrics-file (`<work-dir>/runs/<name>.jsonl`, which tools/plot_metrics.py
plots), one summary line per run plus the verdict in --output (JSONL), and with --plot a PNG of
the validation curves of every run against tokens.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import time
from typing import Dict, List, Optional, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MODEL = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4",
         "--seq-length", "256", "--max-position-embeddings", "256",
         "--hidden-dropout", "0", "--attention-dropout", "0"]
SEQ = 256
MUON = ["--optimizer", "muon", "--muon-fp32-matmul-prec", "high"]


def prepare_data(work_dir: str, max_bytes: int, vocab_size: int) -> Dict[str, str]:
    """The stdlib corpus, its BPE tokenizer and the preprocessed dataset under `work_dir`
    (built once; an existing dataset is reused)."""
    from tools import preprocess_data, train_tokenizer
    from tools.build_stdlib_corpus import build_corpus
    paths = {"corpus": os.path.join(work_dir, "stdlib.jsonl"),
             "vocab": os.path.join(work_dir, "tokenizer", "vocab.json"),
             "merges": os.path.join(work_dir, "tokenizer", "merges.txt"),
             "prefix": os.path.join(work_dir, "stdlib_content_document")}
    os.makedirs(work_dir, exist_ok=True)
    if not os.path.exists(paths["corpus"]):
        build_corpus(sysconfig.get_paths()["stdlib"], paths["corpus"], max_bytes)
    if not os.path.exists(paths["merges"]):
        train_tokenizer.main(["--input", paths["corpus"], "--json-keys", "content",
                              "--vocab-size", str(vocab_size),
                              "--output-dir", os.path.dirname(paths["vocab"])])
    if not os.path.exists(paths["prefix"] + ".idx"):
        preprocess_data.main(["--input", paths["corpus"], "--json-keys", "content",
                              "--output-prefix", os.path.join(work_dir, "stdlib"),
                              "--tokenizer-type", "GPT2BPETokenizer",
                              "--vocab-file", paths["vocab"], "--merge-file", paths["merges"],
                              "--append-eod", "--workers", "1"])
    return paths


def run_argv(a: argparse.Namespace, data: Dict[str, str], lr: float, metrics: str) -> List[str]:
    """pretrain_gpt2.py's command line for one run of the sweep."""
    return [*MODEL, "--micro-batch-size", str(a.micro_batch_size),
            "--global-batch-size", str(a.global_batch_size), "--train-iters", str(a.iters),
            "--lr", f"{lr:g}", "--min-lr", f"{lr / 10:g}", "--lr-decay-style", "cosine",
            "--lr-warmup-iters", str(max(1, a.iters // 10)), "--weight-decay", "0.1",
            "--clip-grad", "1.0", "--seed", "1234", "--split", "95,5,0",
            "--data-path", data["prefix"], "--vocab-file", data["vocab"],
            "--merge-file", data["merges"], "--num-workers", "0",
            "--log-interval", str(a.log_interval), "--eval-interval", str(a.eval_interval),
            "--eval-iters", str(a.eval_iters), "--metrics-file", metrics,
            "--distributed-backend", "gloo"]


def train(a: argparse.Namespace, data: Dict[str, str], name: str, lr: float,
          extra: Sequence[str]) -> str:
    """Run pretrain_gpt2.py once; the path of its metrics file."""
    metrics = os.path.join(a.work_dir, "runs", f"{name}.jsonl")
    os.makedirs(os.path.dirname(metrics), exist_ok=True)
    if os.path.exists(metrics):
        os.remove(metrics)
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), PYTHONPATH=ROOT)
    start = time.time()
    subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_gpt2.py"),
                    *run_argv(a, data, lr, metrics), *extra], check=True, env=env,
                   stdout=subprocess.DEVNULL if a.quiet else None)
    print(f"[bench] {name}: {time.time() - start:.0f} s", flush=True)
    return metrics


def tokens_to_reach(curve: List[Tuple[int, float]], target: float) -> Optional[float]:
    """Tokens at which the validation curve [(tokens, loss)] first reaches `target`, linearly
    interpolated between evaluations; None when it never does."""
    previous = None
    for tokens, loss in curve:
        if loss <= target:
            if previous is None:
                return float(tokens)
            t0, l0 = previous
            return t0 + (tokens - t0) * (l0 - target) / (l0 - loss)
        previous = (tokens, loss)
    return None


def summarize(metrics: str, tokens_per_iteration: int) -> Dict[str, object]:
    """Validation curve (tokens, loss), final validation loss and median ms per step."""
    from tools.plot_metrics import read_rows
    rows = read_rows(metrics)
    valid = [(r["iteration"] * tokens_per_iteration, r["lm_loss"]) for r in rows
             if r.get("kind") == "valid" and r.get("lm_loss") is not None]
    steps = [r["ms_per_iteration"] for r in rows
             if r.get("kind") == "train" and r.get("ms_per_iteration") is not None]
    return {"valid_curve": valid, "final_valid_loss": valid[-1][1],
            "ms_per_step": statistics.median(steps[1:] or steps)}


def interleaved_step_ms(a: argparse.Namespace, rounds: int) -> Dict[str, Dict[str, float]]:
    """{adam, muon: {min, median}} ms per training step, the two optimizers' steps taken
    alternately in this process (synthetic tokens; the model, batch and threads of the runs)."""
    import torch

    import arguments
    from app.launch.distributed import keep_freed_memory
    from tests.harness.synthetic import build_synthetic_run
    keep_freed_memory()  # as pretrain_gpt2.py does
    torch.set_num_threads(a.threads)
    base = [*MODEL, "--micro-batch-size", str(a.micro_batch_size), "--global-batch-size",
            str(a.global_batch_size), "--train-iters", "1000", "--lr", "1e-3",
            "--num-workers", "0"]
    runs = {name: build_synthetic_run(arguments.config_from_argv(base + extra, 1, a.vocab_size),
                                      a.global_batch_size * (rounds + 2))
            for name, extra in (("adam", []), ("muon", MUON))}
    times: Dict[str, List[float]] = {name: [] for name in runs}
    for i in range(rounds + 2):
        for name, run in runs.items():
            start = time.perf_counter()
            run["trainer"].train_step(run["iterator"])
            if i >= 2:  # two warm-up steps each
                times[name].append(time.perf_counter() - start)
    return {name: {"min": 1e3 * min(t), "median": 1e3 * statistics.median(t)}
            for name, t in times.items()}


def plot(results: List[Dict[str, object]], output: str) -> None:
    """Validation loss against tokens, every run, AdamW solid and Muon dashed."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for r in results:
        x, y = zip(*r["valid_curve"])
        style = "-" if r["optimizer"] == "adam" else "--"
        ax.plot([t / 1e6 for t in x], y, style, marker=".",
                label=f"{r['optimizer']} lr {r['lr']:g}")
    target = min(r["final_valid_loss"] for r in results if r["optimizer"] == "adam")
    ax.axhline(target, color="grey", lw=0.8)
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel("validation loss")
    lowest = min(loss for r in results for _, loss in r["valid_curve"])
    ax.set_ylim(lowest - 0.1, target + 1.5)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("AdamW vs Muon, GPT-2 4x256 on the stdlib corpus")
    fig.tight_layout()
    fig.savefig(output, dpi=110)
    print(f"[bench] plot: {output}")


def verdict(results: List[Dict[str, object]], step_ms: Dict[str, Dict[str, float]]
            ) -> Dict[str, object]:
    """Best run of each optimizer, the token ratio and the (interleaved) step-time ratio
    against the goals."""
    adam = [r for r in results if r["optimizer"] == "adam"]
    target = min(r["final_valid_loss"] for r in adam)
    for r in results:
        r["tokens_to_target"] = tokens_to_reach(r["valid_curve"], target)
    best_adam = min(adam, key=lambda r: r["final_valid_loss"])
    reached = [r for r in results if r["optimizer"] == "muon" and r["tokens_to_target"]]
    best_muon = (min(reached, key=lambda r: r["tokens_to_target"]) if reached else
                 min((r for r in results if r["optimizer"] == "muon"),
                     key=lambda r: r["final_valid_loss"]))
    tokens_ratio = (best_muon["tokens_to_target"] / best_adam["tokens_to_target"]
                    if best_muon["tokens_to_target"] else None)
    time_ratio = step_ms["muon"]["min"] / step_ms["adam"]["min"]
    return {"target_valid_loss": target, "adam_lr": best_adam["lr"], "muon_lr": best_muon["lr"],
            "adam_tokens": best_adam["tokens_to_target"],
            "muon_tokens": best_muon["tokens_to_target"],
            "tokens_ratio": tokens_ratio, "adam_ms_per_step": step_ms["adam"],
            "muon_ms_per_step": step_ms["muon"], "step_time_ratio": time_ratio,
            "tokens_goal_met": tokens_ratio is not None and tokens_ratio <= 0.75,
            "time_goal_met": time_ratio <= 1.10}


def get_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--iters", type=int, default=80)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--global-batch-size", type=int, default=32)
    p.add_argument("--adam-lrs", type=float, nargs="+", default=[1e-3, 2e-3, 4e-3, 8e-3])
    p.add_argument("--muon-lrs", type=float, nargs="+", default=[2e-3, 4e-3, 8e-3])
    p.add_argument("--eval-interval", type=int, default=8)
    p.add_argument("--eval-iters", type=int, default=4)
    p.add_argument("--log-interval", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--timing-rounds", type=int, default=8,
                   help="alternating AdamW / Muon steps timed for the step-time ratio")
    p.add_argument("--max-bytes", type=int, default=12_000_000, help="stdlib corpus size")
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--work-dir", default=os.path.expanduser("~/.cache/app_bench/optimizer"))
    p.add_argument("--output", default="bench_optimizer.jsonl")
    p.add_argument("--plot", default=None, help="PNG of the validation curves")
    p.add_argument("--quiet", action="store_true", help="hide the runs' own output")
    return p.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> Dict[str, object]:
    a = get_args(argv)
    load_before = os.getloadavg()
    data = prepare_data(a.work_dir, a.max_bytes, a.vocab_size)
    tokens_per_iteration = a.global_batch_size * SEQ
    results = []
    for optimizer, lrs, extra in (("adam", a.adam_lrs, []), ("muon", a.muon_lrs, MUON)):
        for lr in lrs:
            name = f"{optimizer}_lr{lr:g}"
            metrics = train(a, data, name, lr, extra)
            results.append({"kind": "run", "optimizer": optimizer, "lr": lr,
                            "metrics_file": metrics,
                            **summarize(metrics, tokens_per_iteration)})
    step_ms = interleaved_step_ms(a, a.timing_rounds)
    summary = {"kind": "verdict", **verdict(results, step_ms), "load_average_before": load_before,
               "load_average_after": os.getloadavg(), "iters": a.iters,
               "tokens_per_iteration": tokens_per_iteration, "threads": a.threads}
    with open(a.output, "w") as f:
        for record in results + [summary]:
            f.write(json.dumps(record) + "\n")
    for r in results:
        print(f"{r['optimizer']:5s} lr {r['lr']:<7g} final valid {r['final_valid_loss']:.4f}  "
              f"tokens to target {r['tokens_to_target'] or float('nan'):>10.0f}  "
              f"{r['ms_per_step']:.0f} ms/step")
    print(json.dumps(summary, indent=1))
    if a.plot:
        plot(results, a.plot)
    return summary


if __name__ == "__main__":
    main()
