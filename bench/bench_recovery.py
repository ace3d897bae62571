"""What one failure costs: iterations redone and seconds from the fault to the next training step.

    python bench/bench_recovery.py [--fault-at 8] [--train-iters 12] [--save-interval 5]
                                   [--cases persistent,local,local_inprocess,...]
    python bench/bench_recovery.py --snapshot-cost 12     # what a snapshot costs, GPT-2 small

The same DP 2 run (torchrun, gloo, a small GPT-2 on --mock-data) fails once: rank 1 raises an
error (or SIGKILLs itself) in the forward pass of iteration --fault-at (the fault-injection
point `faults.TRAINING_LOSS`, armed by this script running as the worker), on the first
attempt only. Cases, each with persistent checkpoints every --save-interval iterations:

- persistent: restart by the launcher (torchrun --max-restarts 1) from the newest persistent
  checkpoint;
- local: the same, plus local checkpoints every 2 iterations (--non-persistent-save-interval 2
  --non-persistent-ckpt-type local), which the restart resumes from;
- local_inprocess: local checkpoints and --inprocess-restart with no memory snapshot
  (--inprocess-snapshot-interval 0): the processes stay, the group is rebuilt and the newest
  local checkpoint is loaded;
- memory_inprocess: --inprocess-restart from the in-memory snapshot of every iteration;
- killed_inprocess: --inprocess-restart, but rank 1 SIGKILLs itself instead of raising: what
  in-process restart cannot recover, left to the launcher's restart (from --save).

A case whose flags this checkout does not have (local checkpoints, from branch w5-local-ckpt)
is skipped with a message. Measured from the metrics file (one train record per iteration,
with its wall time and duration) and the time the worker wrote when it raised: iterations
redone = the last iteration completed before the fault minus the one training resumed from;
seconds = the start of the first training step after the fault (its record's time less its
duration) minus the time of the fault. Results are printed as a table and written as JSON;
--keep keeps each case's directory with the job's output (output.txt), to see which
checkpoint a restart took.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

GLOBAL_BATCH = 4
CASES = ("persistent", "local", "local_inprocess", "memory_inprocess", "killed_inprocess")
LOCAL_FLAG = "--non-persistent-save-interval"


def model_argv(train_iters: int) -> List[str]:
    """A small GPT-2 (4 layers, hidden 256, sequence 128) on mock data, DP 2, dropout on."""
    return ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4",
            "--seq-length", "128", "--max-position-embeddings", "128",
            "--micro-batch-size", "2", "--global-batch-size", str(GLOBAL_BATCH),
            "--train-iters", str(train_iters), "--lr", "1e-4", "--lr-decay-style", "constant",
            "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "4095",
            "--distributed-backend", "gloo", "--log-interval", "1", "--eval-iters", "0",
            "--num-workers", "0", "--distributed-timeout-minutes", "2", "--seed", "1234"]


def case_argv(case: str, tmp: str, save_interval: int) -> List[str]:
    """The flags of `case` on top of model_argv, in directories under `tmp`."""
    save = os.path.join(tmp, "save")
    argv = ["--save", save, "--load", save, "--save-interval", str(save_interval),
            "--metrics-file", os.path.join(tmp, "metrics.jsonl")]
    if case in ("local", "local_inprocess"):
        argv += [LOCAL_FLAG, "2", "--non-persistent-ckpt-type", "local",
                 "--non-persistent-local-ckpt-dir", os.path.join(tmp, "local")]
    if case == "local_inprocess":
        argv += ["--inprocess-restart", "--inprocess-snapshot-interval", "0"]
    if case in ("memory_inprocess", "killed_inprocess"):
        argv += ["--inprocess-restart"]
    return argv


def has_flag(flag: str) -> bool:
    """Whether pretrain_gpt2.py of this checkout accepts `flag`."""
    import arguments

    return any(flag in action.option_strings for action in arguments.build_parser()._actions)


def run_case(case: str, fault_at: int, train_iters: int, save_interval: int,
             tmp: str) -> Dict[str, float]:
    """One run of `case` with its fault; {redone, seconds, wall_s, step_s}."""
    fault_file = os.path.join(tmp, "fault.json")
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               FAULT_AT=str(fault_at), FAULT_FILE=fault_file,
               FAULT_KIND="kill" if case == "killed_inprocess" else "raise")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           "--max-restarts", "1", os.path.abspath(__file__), "--worker",
           *model_argv(train_iters), *case_argv(case, tmp, save_interval)]
    start = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    wall = time.time() - start
    with open(os.path.join(tmp, "output.txt"), "w") as f:
        f.write(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"{case}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n"
                           f"{proc.stderr[-3000:]}")
    with open(fault_file) as f:
        fault = json.load(f)
    rows = [json.loads(line) for line in open(os.path.join(tmp, "metrics.jsonl"))
            if line.strip()]
    train = [r for r in rows if r["kind"] == "train"]
    after = [r for r in train if r["time"] > fault["time"]]
    first = after[0]
    step_s = first["ms_per_iteration"] / 1e3
    before = [r["ms_per_iteration"] / 1e3 for r in train if r["time"] < fault["time"]]
    return {"redone": fault["completed"] - (first["iteration"] - 1),
            "seconds": first["time"] - step_s - fault["time"], "wall_s": wall,
            "step_s": sorted(before)[len(before) // 2] if before else float("nan")}


def snapshot_cost(layers: int, snapshots: int) -> Dict[str, float]:
    """Seconds per in-memory snapshot (what --inprocess-restart adds to every
    --inprocess-snapshot-interval-th iteration) against one training step, for GPT-2 small's
    shape with `layers` layers (bench_async_save's model) on the CPU; the first two snapshots
    allocate host memory, later ones reuse the oldest's."""
    import arguments
    from app.config import InProcessRestartConfig
    from app.training.resilience.inprocess import InProcessRestart
    from app.training.state import RunState
    from bench.bench_async_save import RAW_VOCAB, model_argv as gpt2_small_argv
    from tests.harness.synthetic import build_synthetic_run

    cfg = arguments.config_from_argv(gpt2_small_argv(layers), 1, RAW_VOCAB)
    run = build_synthetic_run(cfg, snapshots + 2)
    restart = InProcessRestart(InProcessRestartConfig(enabled=True), 1.0)
    state, takes, steps = RunState(), [], []
    for _ in range(snapshots):
        start = time.perf_counter()
        run["trainer"].train_step(run["iterator"])
        steps.append(time.perf_counter() - start)
        state.iteration += 1
        start = time.perf_counter()
        restart.after_iteration(run["engine"], state)
        takes.append(time.perf_counter() - start)
    held = sum(run["engine"].state_bytes()[k] for k in ("params", "optimizer"))
    return {"snapshot_s": statistics.median(takes[2:] or takes),
            "first_snapshot_s": takes[0], "step_s": statistics.median(steps),
            "gib": held / 2**30}


def worker() -> int:
    """Under torchrun: pretrain_gpt2 with the fault armed (rank 1, iteration $FAULT_AT, first
    attempt, once per process)."""
    import torch.distributed as dist

    import pretrain_gpt2
    from app.utils import faults

    fault_at, fired = int(os.environ["FAULT_AT"]), []

    def handler(first_sample, loss):
        iteration = first_sample // GLOBAL_BATCH + 1
        if (iteration == fault_at and dist.get_rank() == 1 and not fired
                and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"):
            fired.append(1)
            with open(os.environ["FAULT_FILE"], "w") as f:
                json.dump({"time": time.time(), "completed": iteration - 1}, f)
            if os.environ.get("FAULT_KIND") == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"bench_recovery: injected fault in iteration {iteration}")
        return loss

    faults.arm(faults.TRAINING_LOSS, handler)
    argv = sys.argv[sys.argv.index("--worker") + 1:]
    return pretrain_gpt2.main(argv)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fault-at", type=int, default=8)
    parser.add_argument("--train-iters", type=int, default=12)
    parser.add_argument("--save-interval", type=int, default=5)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--json", default=None, help="write the results here too")
    parser.add_argument("--keep", action="store_true",
                        help="keep each case's directory (its output.txt, metrics, checkpoints)")
    parser.add_argument("--snapshot-cost", type=int, default=0, metavar="LAYERS",
                        help="instead: time the in-memory snapshot of GPT-2 small's shape "
                             "with this many layers against a training step, and exit")
    args = parser.parse_args()
    if args.snapshot_cost:
        cost = snapshot_cost(args.snapshot_cost, 6)
        print(f"GPT-2 small shape, {args.snapshot_cost} layers ({cost['gib']:.2f} GiB of weights "
              f"and optimizer states): snapshot {cost['snapshot_s']:.3f} s (the first "
              f"{cost['first_snapshot_s']:.3f} s), training step (sequence 128, batch 1) "
              f"{cost['step_s']:.3f} s")
        return
    local_ok = has_flag(LOCAL_FLAG)
    results: Dict[str, Optional[Dict[str, float]]] = {}
    for case in args.cases.split(","):
        if case not in CASES:
            raise SystemExit(f"unknown case {case!r}; the cases are {', '.join(CASES)}")
        if case.startswith("local") and not local_ok:
            print(f"{case}: skipped: this checkout has no local checkpoints ({LOCAL_FLAG}, "
                  "branch w5-local-ckpt); merge it and run again", flush=True)
            results[case] = None
            continue
        tmp = tempfile.mkdtemp(prefix=f"bench_recovery_{case}_")
        try:
            results[case] = run_case(case, args.fault_at, args.train_iters,
                                     args.save_interval, tmp)
        finally:
            if args.keep:
                print(f"{case}: kept {tmp}", flush=True)
            else:
                shutil.rmtree(tmp, ignore_errors=True)
        r = results[case]
        print(f"{case}: {r['redone']} completed iteration(s) redone, {r['seconds']:.2f} s from "
              f"the fault to the next training step (step {r['step_s']:.2f} s; run "
              f"{r['wall_s']:.0f} s)", flush=True)
    print(f"\nfault in iteration {args.fault_at} (rank 1 raises; killed_inprocess: is killed), "
          f"persistent saves every "
          f"{args.save_interval} iterations, DP 2 on CPU (gloo)")
    print("| case | completed iterations redone | s from the fault to the next step |")
    print("| --- | --- | --- |")
    for case, r in results.items():
        print(f"| {case} | " + ("skipped | skipped |" if r is None else
                                f"{r['redone']} | {r['seconds']:.2f} |"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    if "--worker" in sys.argv:
        sys.exit(worker())
    main()
