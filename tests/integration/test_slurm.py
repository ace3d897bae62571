"""Slurm, for real: Debian's slurm-wlm with munge, one controller and two nodes, node1 and node2,
each a test host (network namespace) with its own slurmd and 2 CPUs (tests.harness.slurm).

The batch scripts are submitted with `sbatch` from the checkout, as a user would, and must:
- train on one node and across the two hosts, with `srun` starting one task per rank (ranks
  from SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID), one torchrun per node, or
  `deepspeed --launcher slurm`, giving the losses and grad norms of the same run (forked ranks)
  on one host (native DP 2, DeepSpeed ZeRO-2 TP 2);
- resume exactly: a `scontrol requeue` mid-run (SIGTERM: the ranks save, the job is requeued)
  and a USR1 (what `#SBATCH --signal=USR1@N` sends before the time limit: the ranks save and
  exit 0, and the script requeues the job) both end with the final weights of an uninterrupted
  run, bit for bit, and the log naming the job and its restart count.
The misuse of srun (torchrun in every task, a task count the layout cannot use, a WORLD_SIZE
exported against Slurm's) stops every task with one line naming the fix, writing nothing.
"""
import os
import subprocess
import sys
import time

import pytest
import torch

from app.checkpoint.files import safe_torch_load
from tests.harness import netns, slurm
from tests.harness.distributed import run_pretrain
from tests.harness.netns import HostsUnavailable, TestHosts
from tests.harness.slurm import SlurmCluster
from tests.harness.corpus import read_metrics
from tests.harness.launch import ROOT, env, train_curve
from tests.harness.checkpoints import tensors

NATIVE = os.path.join(ROOT, "scripts", "sbatch_pretrain_gpt2.sh")
DEEPSPEED = os.path.join(ROOT, "scripts", "sbatch_ds_zero2_pretrain_gpt2_model_parallel.sh")
ITERS = 50  # long enough to interrupt a run after its iteration 3
SHORT = 6
ONE_NODE = ["--nodes=1", "--nodelist=node1", "--ntasks-per-node=2"]
TWO_HOSTS = ["--nodes=2", "--ntasks-per-node=1"]


@pytest.fixture(scope="module")
def cluster():
    """The two-node cluster for the whole module; skipped, with the reason, where Slurm is not
    installed or test hosts cannot be made. Every daemon is stopped by pid, whatever happens."""
    reason = slurm.unavailable_reason() or netns.unavailable_reason()
    if reason:
        pytest.skip(f"no Slurm test cluster here: {reason}")
    hosts = TestHosts(2)
    try:
        hosts.__enter__()
    except HostsUnavailable as exc:
        pytest.skip(f"no Slurm test cluster here: test hosts cannot be made: {exc}")
    try:
        with SlurmCluster(hosts) as made:
            yield made
    finally:
        hosts.close()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("slurm")


def job_env():
    """What jobs and srun get: the tests' launch environment without an outer Slurm job's."""
    return {k: v for k, v in env().items() if not k.startswith("SLURM_")}


def script_env(corpus, workdir, run, iters, **extra):
    """The variables of scripts/lib/gpt2_args.sh for a tiny model in `workdir/run`."""
    e = job_env()
    e.update(PYTHON=sys.executable, VENV_BIN=os.path.dirname(sys.executable), NUM_LAYERS="2",
             HIDDEN="64", HEADS="4", SEQ="32", MICRO_BATCH="2", TRAIN_ITERS=str(iters),
             LOG_INTERVAL="1", EVAL_ITERS="0", SAVE_INTERVAL="1000", DATA=corpus["prefix"],
             VOCAB=corpus["vocab"], MERGES=corpus["merges"],
             CHECKPOINT_PATH=str(workdir / run / "ck"), **extra)
    return e


def extra_args(workdir, run):
    return ["--data-cache-path", str(workdir / "cache"), "--num-workers", "0",
            "--make-vocab-size-divisible-by", "64", "--distributed-backend", "gloo",
            "--metrics-file", str(workdir / run / "metrics.jsonl")]


def gpt2_args(e, global_batch):
    """The flags the scripts build from `e` (scripts/lib/gpt2_args.sh)."""
    out = subprocess.run(["bash", "-c", 'source scripts/lib/gpt2_args.sh && gpt2_args "$0" "$1" '
                          '&& printf "%s\\n" "${GPT2_ARGS[@]}"', str(global_batch),
                          e["CHECKPOINT_PATH"]], cwd=ROOT, env=e, capture_output=True,
                         text=True, check=True)
    return out.stdout.splitlines()


DS_FLAGS = ["--model-parallel-size", "2", "--pipeline-model-parallel-size", "1",
            "--checkpoint-activations", "--deepspeed-activation-checkpointing", "--deepspeed",
            "--deepspeed_config", os.path.join(ROOT, "ds_configs", "zero2.json")]
"""What the DeepSpeed batch script adds on a CPU cluster (MP_SIZE 2, fp32)."""


@pytest.fixture(scope="module")
def native_reference(tiny_corpus, workdir):
    """The native DP 2 run of the native script's flags on two forked ranks (run_pretrain; the
    reference's launcher does not matter), uninterrupted: its curve and its checkpoint of the
    last iteration."""
    e = script_env(tiny_corpus, workdir, "native_ref", ITERS)
    run_pretrain(2, gpt2_args(e, 4) + extra_args(workdir, "native_ref"))
    return workdir / "native_ref"


@pytest.fixture(scope="module")
def deepspeed_reference(tiny_corpus, workdir):
    """The DeepSpeed ZeRO-2 TP 2 run of the DeepSpeed script's flags on two forked ranks."""
    e = script_env(tiny_corpus, workdir, "ds_ref", SHORT)
    run_pretrain(2, gpt2_args(e, 2) + DS_FLAGS + extra_args(workdir, "ds_ref"))
    return train_curve(workdir / "ds_ref" / "metrics.jsonl")


def submit(cluster, script, e, workdir, run, options, *more):
    """sbatch `script` from the checkout with the run's output in workdir/run/job.out."""
    os.makedirs(workdir / run, exist_ok=True)
    return cluster.sbatch([*options, f"--output={workdir / run / 'job.out'}", script,
                           *extra_args(workdir, run), *more], env=e, cwd=ROOT)


def job_log(workdir, run):
    with open(workdir / run / "job.out", errors="replace") as f:
        return f.read()


def finished(cluster, job, workdir, run, restarts=0):
    """Wait for `job`; it must have completed with exit code 0."""
    fields = cluster.wait(job, restarts=restarts)
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", \
        f"{fields}\n{job_log(workdir, run)[-5000:]}\n{cluster.logs()}"
    return job_log(workdir, run)


def wait_for_train_row(cluster, job, metrics, iteration, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if os.path.exists(metrics) and any(r["iteration"] >= iteration and r["kind"] == "train"
                                           for r in read_metrics(metrics)):
            return
        assert cluster.job(job)["JobState"] in ("PENDING", "RUNNING", "CONFIGURING"), \
            cluster.job(job)
        time.sleep(0.05)
    raise AssertionError(f"no iteration {iteration} in {metrics} after {timeout} s")


def restart_now(cluster, job):
    """Slurm holds a requeued batch job for two minutes (BeginTime), so that slurmd no longer
    refuses it as the job it killed: once it is pending again and its nodes are idle, wait
    2 s (slurmd compares the new credential's time with the kill's in whole seconds) and start
    it."""
    deadline = time.time() + 120
    while time.time() < deadline:
        fields = cluster.job(job)
        if (fields["JobState"] == "PENDING" and fields.get("Restarts") == "1"
                and cluster.nodes_idle()):
            time.sleep(2.0)
            cluster.run(["scontrol", "update", f"JobId={job}", "StartTime=now"])
            return
        time.sleep(0.1)
    raise AssertionError(f"job {job} was not requeued: {cluster.job(job)}")


def assert_same_final_weights(got_ck, want_ck):
    rel = os.path.join(f"iter_{ITERS:07d}", "mp_rank_00", "model_optim_rng.pt")
    got, want = tensors(safe_torch_load(str(got_ck / rel))), tensors(
        safe_torch_load(str(want_ck / rel)))
    assert sorted(got) == sorted(want) and any(n.startswith("/model/") for n in want)
    for name in want:
        assert torch.equal(got[name], want[name]), f"{rel}: {name} differs"


def test_srun_one_task_per_rank_requeued_mid_run_resumes_exactly(cluster, tiny_corpus, workdir,
                                                                 native_reference):
    """Native script, one node, LAUNCHER=srun: `scontrol requeue` after iteration 3."""
    run = "requeue"
    e = script_env(tiny_corpus, workdir, run, ITERS)
    job = submit(cluster, NATIVE, e, workdir, run, ONE_NODE)
    wait_for_train_row(cluster, job, workdir / run / "metrics.jsonl", 3)
    cluster.run(["scontrol", "requeue", job])
    restart_now(cluster, job)
    log = finished(cluster, job, workdir, run, restarts=1)
    assert train_curve(workdir / run / "metrics.jsonl") == \
        train_curve(native_reference / "metrics.jsonl")
    assert_same_final_weights(workdir / run / "ck", native_reference / "ck")
    assert (f"> world: rank 0 of 2 (local rank 0 of 2) from Slurm: SLURM_PROCID, SLURM_NTASKS "
            f"(srun --ntasks), SLURM_LOCALID of Slurm job {job} step 0 on 1 node(s); master "
            f"node1:{15000 + int(job)}") in log, log[-3000:]
    assert f"Slurm job {job} step 0, restart 1 (SLURM_RESTART_COUNT) on 1 node(s)" in log
    assert "received SIGTERM" in log and "resuming at iteration" in log


def test_usr1_saves_exits_0_and_the_job_requeues_itself(cluster, tiny_corpus, workdir,
                                                         native_reference):
    """Native script, one node, LAUNCHER=torchrun (one per node): USR1 to every process of the
    step, as `--signal=USR1@N` sends it before the time limit."""
    run = "usr1"
    e = script_env(tiny_corpus, workdir, run, ITERS, LAUNCHER="torchrun")
    job = submit(cluster, NATIVE, e, workdir, run, ONE_NODE)
    wait_for_train_row(cluster, job, workdir / run / "metrics.jsonl", 3)
    cluster.run(["scancel", "--signal=USR1", job])
    restart_now(cluster, job)
    log = finished(cluster, job, workdir, run, restarts=1)
    assert train_curve(workdir / run / "metrics.jsonl") == \
        train_curve(native_reference / "metrics.jsonl")
    assert_same_final_weights(workdir / run / "ck", native_reference / "ck")
    assert "received SIGUSR1" in log and f"requeueing job {job}" in log, log[-3000:]
    assert f"torchrun (one per node, Slurm job {job} step 0, restart 1 (SLURM_RESTART_COUNT))" \
        in log, log[-3000:]


def test_native_script_across_two_hosts_with_torchrun_per_node(cluster, tiny_corpus, workdir,
                                                               native_reference):
    """Two hosts, one torchrun each (one rank per node); the job's time limit gives
    --exit-duration-in-mins (squeue's end time on this Slurm, 22.05)."""
    run = "hosts_torchrun"
    e = script_env(tiny_corpus, workdir, run, ITERS, LAUNCHER="torchrun")
    job = submit(cluster, NATIVE, e, workdir, run, [*TWO_HOSTS, "--time=30"])
    log = finished(cluster, job, workdir, run)
    assert train_curve(workdir / run / "metrics.jsonl") == \
        train_curve(native_reference / "metrics.jsonl")
    assert "> --exit-duration-in-mins " in log and "(from SLURM_JOB_END_TIME: " in log, log[-3000:]


def test_deepspeed_script_one_node_srun_and_two_hosts_deepspeed_launcher(
        cluster, tiny_corpus, workdir, deepspeed_reference):
    """The DeepSpeed ZeRO-2 model-parallel script (TP 2): srun tasks on one node, and
    `deepspeed --launcher slurm` across the two hosts (DeepSpeed's runner calls srun)."""
    for run, options, launcher in (("ds_one", ONE_NODE, "srun"),
                                   ("ds_hosts", TWO_HOSTS, "deepspeed")):
        e = script_env(tiny_corpus, workdir, run, SHORT, LAUNCHER=launcher)
        log = finished(cluster, submit(cluster, DEEPSPEED, e, workdir, run, options),
                       workdir, run)
        assert train_curve(workdir / run / "metrics.jsonl") == deepspeed_reference, run
        nodes = 2 if launcher == "deepspeed" else 1
        assert f"on {nodes} node(s); master node1:" in log, log[-3000:]


def srun(cluster, workdir, run, argv, *options):
    """`srun OPTIONS python pretrain_gpt2.py ARGV` on node1 (two tasks); its output."""
    return cluster.run(["srun", "--nodes=1", "--nodelist=node1", "--ntasks=2", *options,
                        *argv], env=job_env(), cwd=ROOT, check=False, timeout=180)


def test_misuse_stops_every_task_with_one_line_and_writes_nothing(cluster, tiny_corpus,
                                                                  workdir):
    base = gpt2_args(script_env(tiny_corpus, workdir, "misuse", SHORT), 4) + \
        extra_args(workdir, "misuse")
    script = [sys.executable, os.path.join(ROOT, "pretrain_gpt2.py")]
    torchrun_each = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                     "--nproc-per-node=1", os.path.join(ROOT, "pretrain_gpt2.py")]
    cases = [
        (torchrun_each + base, [], "torchrun is running inside each of the 2 Slurm tasks on "
                                   "node1 (SLURM_STEP_TASKS_PER_NODE)"),
        (script + base + ["--tensor-model-parallel-size", "4"], [],
         "launch a multiple of their product (the world size came from Slurm: SLURM_PROCID, "
         "SLURM_NTASKS (srun --ntasks)"),
        (script + base, ["--export=ALL,WORLD_SIZE=4"],
         "WORLD_SIZE=4 is exported but srun gives this task SLURM_NTASKS=2: unset RANK"),
    ]
    for argv, options, fix in cases:
        proc = srun(cluster, workdir, "misuse", argv, *options)
        errors = {line for line in (proc.stdout + proc.stderr).splitlines()
                  if line.startswith("error: ")}
        assert proc.returncode != 0 and len(errors) == 1, proc.stdout[-2000:] + proc.stderr
        assert fix in errors.pop(), proc.stderr[-2000:]
        assert "Traceback" not in proc.stdout + proc.stderr or "torchrun" in fix
        assert not os.path.exists(workdir / "misuse"), os.listdir(workdir / "misuse")


def test_dry_run_shows_the_world_read_from_slurm(cluster, tiny_corpus, workdir):
    argv = [sys.executable, os.path.join(ROOT, "pretrain_gpt2.py"), "--dry-run",
            *gpt2_args(script_env(tiny_corpus, workdir, "dry", SHORT), 2), "--tensor-model-"
            "parallel-size", "2", *extra_args(workdir, "dry")]
    proc = cluster.run(["srun", "--nodes=2", "--ntasks-per-node=1", *argv], env=job_env(),
                       cwd=ROOT, check=False, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "rank 0 of 2 (local rank 0 of 1) from Slurm: SLURM_PROCID, SLURM_NTASKS (srun " \
           "--ntasks), SLURM_LOCALID of Slurm job " in proc.stdout, proc.stdout[-3000:]
    assert "on 2 node(s); master node1:" in proc.stdout
